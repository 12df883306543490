"""Chunked SSD prefill scan in Triton (twin of `ops/ssd.py: ssd_chunked_scan_ref`).

Three launches per call, over the reference's chunk layout (ops/ssd_layout.py, built on the host
once per forward pass and shared by the layers), with the kernels of ops/triton/ssd_scan_kernels.py:

    chunk states   (nc, H, P tiles)  state of every chunk from zero, and its total decay
    chunk pass     (n, H, P tiles)   sequential over a sequence's chunks: states entering each
                                     chunk (in place) and the final state into the slot
    outputs        (nc, H, P tiles x row blocks)  intra-chunk (quadratic) + carried-state + D x

and, when boundary states are asked for, the boundary walk of ops/triton/ssd_boundary.py.

All math is fp32; one (nc, H, P, N) fp32 buffer and one (nc, H) buffer are the only temporaries.
The defaults compile without register spills for sm_90 at the 8B shape (checked on the CPU with
triton.compile for target sm_90 with 16-byte aligned pointers and strides, as a launch specializes
them: affine kernels 134 / 135 registers per thread at 4 warps for states / outputs, 110 for the pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from replayssm.ops.ssd_layout import ChunkLayout, chunk_layout
from replayssm.ops.triton import ssd_scan_kernels as kern
from replayssm.ops.triton.rounding import device_seed, max_finite, tl_dtype
from replayssm.ops.triton.ssd_boundary import launch_boundaries


@dataclass(frozen=True)
class LaunchConfig:
    """Rows of the state tile over P, and warps per program (per kind of launch)."""

    block_p: int = 64  # chunk states (unless state_block_p) and outputs
    block_k: int = 32  # chunk positions per step of the products (unless state_block_k)
    num_warps: int = 4  # chunk states
    out_warps: int = 4  # outputs
    pass_block_p: int = 32
    pass_warps: int = 4
    rows: int = 32  # output rows per program (a multiple of block_k)
    nb: int = 32  # columns of N per step of the output products
    num_stages: int = 3  # software pipelining depth of the state and output kernels' loops
    pass_block_n: int = 0  # columns of N per pass program (0: all)
    state_block_p: int = 0  # chunk states' block_p (0: block_p)
    state_block_k: int = 16  # chunk states' block_k (0: block_k)


CONFIG = LaunchConfig()


@dataclass(frozen=True)
class _Shape:
    H: int
    P: int
    N: int
    HPG: int
    L: int
    block_l: int
    block_k: int
    block_p: int
    block_n: int


def _shape(x: Tensor, B: Tensor, L: int, config: LaunchConfig) -> _Shape:
    _, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    # tl.dot needs every dimension >= 16: smaller chunks, heads and states are padded and masked.
    block_l = max(16, triton.next_power_of_2(L))
    return _Shape(H, P, N, H // G, L, block_l, max(16, min(config.block_k, block_l)),
                  max(16, min(config.block_p, triton.next_power_of_2(P))), max(16, triton.next_power_of_2(N)))


def _tile(want: int, default: int, cap: int) -> int:
    """A tile size: `want` as a power of two in [16, cap], or `default` when want <= 0."""
    return default if want <= 0 else max(16, min(triton.next_power_of_2(want), cap))


def _dense(t: Tensor) -> Tensor:
    """Unit stride on the last dimension (the kernels index it densely)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def launch_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
                state: Tensor, lay: ChunkLayout, chunk_size: int, dt_softplus: bool, rand_seed: int | Tensor,
                config: LaunchConfig = CONFIG, y: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Outputs y (T, H, P) in x.dtype and the states entering each chunk (nc, H, P, N) fp32; writes the
    final states of the sequences with a slot."""
    x, B, C = _dense(x), _dense(B), _dense(C)
    sh = _shape(x, B, chunk_size, config)
    nc, n = lay.nc, lay.num_seqs
    assert state.is_contiguous(), "state pool must be contiguous (offsets are linear indices)"
    # At least one row: with no chunks the pass still takes (never read) fp32 buffers.
    s = torch.empty(max(nc, 1), sh.H, sh.P, sh.N, dtype=torch.float32, device=x.device)[:nc]
    sums = torch.empty(max(nc, 1), sh.H, dtype=torch.float32, device=x.device)
    y = torch.empty_like(x) if y is None else y
    strides = (x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1))
    # 16-bit inputs take two tf32 passes, fp32 three (ops/triton/ssd_scan_kernels.py).
    blocks = dict(P=sh.P, N=sh.N, BLOCK_K=sh.block_k, BLOCK_P=sh.block_p, BLOCK_N=sh.block_n,
                  DT_SOFTPLUS=bool(dt_softplus), F32_DOT=x.dtype == torch.float32, num_warps=config.num_warps,
                  num_stages=config.num_stages)
    tiles = triton.cdiv(sh.P, sh.block_p)
    if nc:
        st_p = _tile(config.state_block_p, sh.block_p, triton.next_power_of_2(sh.P))
        st_k = _tile(config.state_block_k, sh.block_k, sh.block_l)
        kern.chunk_state_kernel[(nc, sh.H, triton.cdiv(sh.P, st_p))](
            x, dt, A, B, dt_bias, lay.idx, lay.chunk_len, s, sums, *strides, sh.H, sh.HPG, sh.L,
            **(blocks | dict(BLOCK_P=st_p, BLOCK_K=st_k)),
        )
    if n:
        pass_p = _tile(config.pass_block_p, 32, triton.next_power_of_2(sh.P))
        pass_n = _tile(config.pass_block_n, sh.block_n, sh.block_n)
        sd = tl_dtype(state.dtype)
        kern.chunk_pass_kernel[(n, sh.H, triton.cdiv(sh.P, pass_p) * triton.cdiv(sh.N, pass_n))](
            s, sums, state, lay.chunk_offsets if nc else lay.seq_chunks, lay.seq_chunks,
            lay.init_slot, lay.final_slot, device_seed(rand_seed, state.device), sh.H,
            P=sh.P, N=sh.N, BLOCK_P=pass_p, BLOCK_N=pass_n, STATE_DTYPE=sd, MAXV=max_finite(sd),
            num_warps=config.pass_warps,
        )  # fmt: skip
    if nc:
        # Rows per output program: a power-of-two multiple of block_k within the padded chunk.
        rows = min(sh.block_l, max(sh.block_k, triton.next_power_of_2(config.rows)))
        kern.chunk_output_kernel[(nc, sh.H, tiles * (sh.block_l // rows))](
            x, dt, A, B, C, D, dt_bias, lay.idx, lay.chunk_len, lay.chunk_valid, s, y,
            *strides, C.stride(0), C.stride(1), y.stride(0), y.stride(1), sh.H, sh.HPG, sh.L,
            BLOCK_L=sh.block_l, NB=min(config.nb, sh.block_n),
            **(blocks | dict(BLOCK_I=rows, num_warps=config.out_warps)),
        )  # fmt: skip
    return y, s


def ssd_chunked_scan_triton(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    *,
    chunk_size: int = 64,
    dt_softplus: bool = True,
    rand_seed: Tensor | None = None,
    boundary_seq: Tensor | None = None,
    boundary_len: Tensor | None = None,
    boundary_dst: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`ssd_chunked_scan` in Triton (`ops.ssd.ssd_chunked_scan`; arguments validated by the public op).

    x (T, H, P); dt (T, H); B, C (T, G, N) in x.dtype; A, D, dt_bias (H,) fp32; state (S, H, P, N)
    fp32/fp16/bf16, final states written with the reference's stochastic rounding bits. Returns y
    (T, H, P) in x.dtype and the (m, H, P, N) fp32 boundary states (None when not asked, or when
    boundary_dst sends them into pool slots).
    """
    lay = chunk_layout(cu_seqlens, state_indices, has_initial_state, boundary_seq, boundary_len, chunk_size,
                       x.shape[0])
    y, s_in = launch_scan(x, dt, A, B, C, D, dt_bias, state, lay, chunk_size, dt_softplus, rand_seed)
    if boundary_seq is None:
        return y, None
    dst = None if boundary_dst is None else boundary_dst.long()
    return y, launch_boundaries(x, dt, A, B, dt_bias, state, lay, s_in, dt_softplus, dst=dst,
                                rand_seed=rand_seed)
