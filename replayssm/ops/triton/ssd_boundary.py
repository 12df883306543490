"""Boundary (prefix-checkpoint) states of the chunked SSD scan in Triton, after the scan's pass.

The exact fp32 state after the first boundary_len[j] tokens of sequence boundary_seq[j] is
S_t = exp(a_1 + .. + a_t) s_in[c] + Σ_{r<=t} exp(seg(t, r)) Δ_r x_r B_rᵀ for its last token at
position t of chunk c (s_in[c]: the state entering c, from the pass). One program per (walk item, head, P
tile) walks one chunk forward through its boundaries in position order, advancing a running state
from one boundary to the next,

    S_t = exp(a_{u+1} + .. + a_t) S_u + Σ_{u<r<=t} exp(seg(t, r)) Δ_r x_r B_rᵀ,

so every position of the chunk enters one product once, however many boundaries it holds
(recomputing each boundary from the chunk start cost ~8x the work at one checkpoint per 16 tokens
and 128-token chunks). The spans use the scan's precision rules (ops/triton/ssd_scan_kernels.py: sums of
same-sign a_k, 3xTF32-accurate products). A zero-length boundary is its sequence's initial state: position
-1 of its first chunk, or of the walk item of a sequence without chunks, which reads its slot.

The states go to an fp32 (m, H, P, N) buffer, or straight into pool slots `dst[j]` with the
stochastic rounding of `ops.common.store_states` (same random bits), which saves the buffer and
the gather-scatter of storing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayssm.ops.ssd_layout import ChunkLayout
from replayssm.ops.triton.rounding import device_seed, load_seed_mix, max_finite, stochastic_round, tl_dtype
from replayssm.ops.triton.ssd_scan_kernels import chunk_delta
from replayssm.ops.triton.tf32 import dot_split


@dataclass(frozen=True)
class BoundaryConfig:
    """State rows per program, chunk positions per product, warps."""

    block_p: int = 32
    block_k: int = 16
    num_warps: int = 4


BOUNDARY_CONFIG = BoundaryConfig()


@triton.jit
def advance(s, x_ptr, B_ptr, dt_ptr, sx_t, sB_t, sdt_t, start, n_live, A, bias, lo, t, x_off, b_off, dt_off,
            p, n, pm, nm, BLOCK_K: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """The state s after position lo - 1 of a chunk advanced to after position t (unchanged if t < lo):
    exp(a_lo + .. + a_t) s + Σ_{lo<=r<=t} exp(seg(t, r)) Δ_r x_r B_rᵀ, s (BLOCK_P, BLOCK_N) fp32.

    The span's decay is summed first so that the products accumulate into the decayed s itself (one
    accumulator live). Then the blocks are walked backwards from t, so seg(t, r) adds the masked sum
    inside r's block to the sums of the later blocks: same-sign terms, never a difference of prefix
    sums. Addresses are affine in the position (no index load before Δ, x, B). Products by
    `tf32.dot_split` (two TF32 passes with 16-bit B, three with fp32).
    """
    top = tl.maximum(t, 0) // BLOCK_K
    blocks = tl.where(t >= lo, top - lo // BLOCK_K + 1, 0)
    total = tl.sum(tl.zeros((BLOCK_K,), dtype=tl.float32), axis=0)
    for b in range(0, blocks):
        pos = (top - b) * BLOCK_K + tl.arange(0, BLOCK_K)
        use = (pos < n_live) & (pos <= t) & (pos >= lo)
        _, a = chunk_delta(dt_ptr, dt_off, sdt_t, start, pos, use, A, bias, DT_SOFTPLUS)
        total += tl.sum(a)
    s = tl.exp(total) * s
    tail = tl.sum(tl.zeros((BLOCK_K,), dtype=tl.float32), axis=0)  # Σ a_k over the blocks done so far
    for b in range(0, blocks):
        pos = (top - b) * BLOCK_K + tl.arange(0, BLOCK_K)
        use = (pos < n_live) & (pos <= t) & (pos >= lo)
        delta, a = chunk_delta(dt_ptr, dt_off, sdt_t, start, pos, use, A, bias, DT_SOFTPLUS)
        own = tl.sum(tl.where(pos[:, None] > pos[None, :], a[:, None], 0.0), axis=0)  # [k, r]: k > r
        rows = (start + pos)[:, None]
        xs = tl.load(x_ptr + x_off + rows * sx_t + p[None, :], mask=use[:, None] & pm[None, :], other=0.0)
        bs = tl.load(B_ptr + b_off + rows * sB_t + n[None, :], mask=use[:, None] & nm[None, :], other=0.0)
        xw = tl.trans(xs.to(tl.float32) * (tl.exp(own + tail) * delta)[:, None])
        s = dot_split(xw, bs.to(tl.float32), s, False, B_ptr.dtype.element_ty != tl.float32)
        tail += tl.sum(a)
    return s


@triton.jit
def boundary_walk_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, dt_bias_ptr, idx_ptr, len_ptr, s_ptr, state_ptr, init_ptr,
    w_chunk_ptr, w_rank_ptr, w_start_ptr, w_count_ptr, order_ptr, pos_ptr, dst_ptr, out_ptr, seed_ptr,
    sx_t, sx_h, sdt_t, sdt_h, sB_t, sB_g, H, HPG, L,
    P: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, TO_POOL: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    """Grid (walk items, H, P tiles): the states of an item's boundaries, in position order."""
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    w = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    tile = p[:, None] * N + n[None, :]
    tmask = pm[:, None] & nm[None, :]
    c = tl.load(w_chunk_ptr + w)
    if c >= 0:
        # .to: without chunks the launcher passes the pool as s_ptr (never read here; the type must match).
        s = tl.load(s_ptr + (c * H + h) * (P * N) + tile, mask=tmask, other=0.0).to(tl.float32)
    else:
        # No chunks: the pass left the slot holding the initial state exactly (a pool value rounds
        # to itself); no slot (-1) means zeros.
        islot = tl.load(init_ptr + tl.load(w_rank_ptr + w))
        ibase = (tl.maximum(islot, 0) * H + h) * (P * N)
        s = tl.load(state_ptr + ibase + tile, mask=tmask & ((tile * 0 + islot) >= 0), other=0.0)
        s = s.to(tl.float32)
    A, bias = tl.load(A_ptr + h), tl.load(dt_bias_ptr + h)
    x_off, b_off = h * sx_h, (h // HPG) * sB_g
    cc = tl.maximum(c, 0).to(tl.int64)
    start = tl.load(idx_ptr + cc * L)  # the chunk's first token (any valid token for chunk -1: unread)
    n_live = tl.load(len_ptr + cc)
    first = tl.load(w_start_ptr + w)
    done = tl.load(pos_ptr + first) * 0 - 1  # the running state is after position `done` (-1: none)
    for k in range(0, tl.load(w_count_ptr + w)):
        j = tl.load(order_ptr + first + k)
        t = tl.load(pos_ptr + first + k)
        s = advance(s, x_ptr, B_ptr, dt_ptr, sx_t, sB_t, sdt_t, start, n_live, A, bias, done + 1, t, x_off,
                    b_off, h * sdt_h, p, n, pm, nm, BLOCK_K, DT_SOFTPLUS)
        done = tl.maximum(done, t)
        if TO_POOL:
            base = (tl.load(dst_ptr + j) * H + h) * (P * N)
            tl.store(state_ptr + base + tile, stochastic_round(s, base + tile, seed_mix, STATE_DTYPE, MAXV),
                     mask=tmask)
        else:
            tl.store(out_ptr + (j.to(tl.int64) * H + h) * (P * N) + tile, s, mask=tmask)


def launch_boundaries(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, dt_bias: Tensor, state: Tensor,
                      lay: ChunkLayout, s_in: Tensor, dt_softplus: bool, *, dst: Tensor | None = None,
                      rand_seed: int | torch.Tensor = 0, config: BoundaryConfig = BOUNDARY_CONFIG,
                      out: Tensor | None = None) -> Tensor | None:
    """Boundary states after the scan (s_in (nc, H, P, N) fp32: the states entering each chunk).

    dst None: returns them as fp32 (m, H, P, N) (into `out` when given). dst (m,) int64 slots: writes
    them into state[dst] (stochastically rounded with rand_seed for 16-bit pools) and returns None.
    """
    x = x if x.stride(-1) == 1 else x.contiguous()
    B = B if B.stride(-1) == 1 else B.contiguous()
    _, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    m = lay.b_rank.shape[0]
    if dst is None and out is None:
        out = torch.empty(m, H, P, N, dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    assert state.is_contiguous(), "state pool must be contiguous (offsets are linear indices)"
    block_p = max(16, min(config.block_p, triton.next_power_of_2(P)))
    sd = tl_dtype(state.dtype)
    s_ptr = s_in if s_in.numel() else state  # no chunks: only zero-length boundaries, s_in never read
    idx, clen = (lay.idx, lay.chunk_len) if lay.nc else (lay.b_order, lay.b_order)  # read, never used
    grid = (lay.w_chunk.shape[0], H, triton.cdiv(P, block_p))
    boundary_walk_kernel[grid](
        x, dt, A, B, dt_bias, idx, clen, s_ptr, state, lay.init_slot,
        lay.w_chunk, lay.w_rank, lay.w_start, lay.w_count, lay.b_order, lay.b_pos,
        dst if dst is not None else lay.b_order, out if out is not None else state,
        device_seed(rand_seed, state.device),
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), H, H // G,
        lay.idx.shape[1],
        P=P, N=N, BLOCK_K=config.block_k, BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(N)),
        DT_SOFTPLUS=bool(dt_softplus), TO_POOL=dst is not None, STATE_DTYPE=sd, MAXV=max_finite(sd),
        num_warps=config.num_warps,
    )  # fmt: skip
    return out
