"""Baseline selective state update in Triton (twin of `ops/ssu.py: selective_state_update_ref`).

Plain decode reads each (slot, head) state once and writes it once; verify (`dst_indices`)
reads it once and writes one state per token. Grid: (P tiles, H, b), so consecutive programs
walk one slot's (H, P, N) state contiguously. Each program keeps its (BLOCK_P, N) tile in
registers in fp32 across the q tokens; dt, A, D, dt_bias are per-head scalars.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.rounding import (
    device_seed,
    load_seed_mix,
    max_finite,
    stochastic_round_pairs,
    tl_dtype,
)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile rows over P and warps per program."""

    block_p: int = 32
    num_warps: int = 4


# The tile per state dtype (`benchmarks/bench_kernels.py --sweep-baseline` times the candidates):
CONFIGS = {
    torch.float32: LaunchConfig(block_p=64, num_warps=4),  # the fastest tile timed on the H200
    # 16-bit writes carry the rounding's temporaries beside the tile: the smaller tile wins the
    # H100 sweep (8B shape, b=256, q=1 and 4: 410 / 1599 us fp16 against 439 / 2207 at 64x4).
    torch.float16: LaunchConfig(block_p=32, num_warps=4),
    torch.bfloat16: LaunchConfig(block_p=32, num_warps=4),
}


@triton.jit
def softplus_dt(dt, bias, DT_SOFTPLUS: tl.constexpr):
    """Δ = softplus(dt + bias) with identity above 20 (or the biased value when off)."""
    v = dt + bias
    if DT_SOFTPLUS:
        v = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))
    return v


@triton.jit
def _ssu_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, idx_ptr, dst_ptr, y_ptr,
    seed_ptr,
    sx_b, sx_t, sx_h,
    sdt_b, sdt_t, sdt_h,
    sB_b, sB_t, sB_g,
    sC_b, sC_t, sC_g,
    sy_b, sy_t, sy_h,
    H, HPG,
    Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DST: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    g = h // HPG
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm = p < P
    nm = n < N
    tile = p[:, None] * N + n[None, :]
    # Validity broadcast as a tensor (a scalar bool in a mask trips the interpreter).
    tmask = (pm & ((p * 0 + s) >= 0))[:, None] & nm[None, :]

    A = tl.load(A_ptr + h)
    Dh = tl.load(D_ptr + h)
    bias = tl.load(dt_bias_ptr + h)
    S = tl.load(state_ptr + (s64 * H + h) * (P * N) + tile, mask=tmask, other=0.0).to(tl.float32)
    for t in tl.static_range(Q):
        xt = tl.load(x_ptr + i * sx_b + t * sx_t + h * sx_h + p, mask=pm, other=0.0).to(tl.float32)
        dt_raw = tl.load(dt_ptr + i * sdt_b + t * sdt_t + h * sdt_h).to(tl.float32)
        dt = softplus_dt(dt_raw, bias, DT_SOFTPLUS)
        Bt = tl.load(B_ptr + i * sB_b + t * sB_t + g * sB_g + n, mask=nm, other=0.0).to(tl.float32)
        Ct = tl.load(C_ptr + i * sC_b + t * sC_t + g * sC_g + n, mask=nm, other=0.0).to(tl.float32)
        S = S * tl.exp(dt * A) + (dt * xt)[:, None] * Bt[None, :]
        yt = tl.sum(S * Ct[None, :], axis=1) + Dh * xt
        yt = tl.where(valid, yt, 0.0)
        tl.store(y_ptr + i * sy_b + t * sy_t + h * sy_h + p, yt.to(y_ptr.dtype.element_ty), mask=pm)
        if HAS_DST:
            d = tl.load(dst_ptr + i * Q + t)
            base = (tl.maximum(d, 0).to(tl.int64) * H + h) * (P * N)
            val = stochastic_round_pairs(S, base + tile, seed_mix, STATE_DTYPE, MAXV, N)
            tl.store(state_ptr + base + tile, val, mask=tmask & ((tile * 0 + d) >= 0))
    if not HAS_DST:
        base = (s64 * H + h) * (P * N)
        val = stochastic_round_pairs(S, base + tile, seed_mix, STATE_DTYPE, MAXV, N)
        tl.store(state_ptr + base + tile, val, mask=tmask)


def launch_ssu(state, x, dt, A, B, C, D, dt_bias, state_indices, dst_indices, dt_softplus, rand_seed, out,
               config: LaunchConfig) -> torch.Tensor:
    """Launch the baseline kernel with an explicit tile config (the benchmark sweeps it)."""
    S, H, P, N = state.shape
    b, q, _, _ = x.shape
    G = B.shape[2]
    assert state.is_contiguous(), "state pool must be contiguous (offsets are linear indices)"
    assert x.stride(3) == 1 and B.stride(3) == 1 and C.stride(3) == 1
    y = out if out is not None else torch.empty_like(x)
    if b == 0:
        return y
    dst = dst_indices.contiguous() if dst_indices is not None else state_indices
    block_p = min(config.block_p, triton.next_power_of_2(P))
    grid = (triton.cdiv(P, block_p), H, b)
    _ssu_kernel[grid](
        state, x, dt, A, B, C, D, dt_bias, state_indices, dst, y,
        device_seed(rand_seed, state.device),
        x.stride(0), x.stride(1), x.stride(2),
        dt.stride(0), dt.stride(1), dt.stride(2),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        y.stride(0), y.stride(1), y.stride(2),
        H, H // G,
        Q=q, P=P, N=N, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N),
        HAS_DST=dst_indices is not None, DT_SOFTPLUS=bool(dt_softplus),
        STATE_DTYPE=tl_dtype(state.dtype), MAXV=max_finite(tl_dtype(state.dtype)),
        num_warps=config.num_warps,
    )
    return y


def selective_state_update_triton(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    dst_indices: torch.Tensor | None = None,
    dt_softplus: bool = True,
    rand_seed: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Baseline SSU (`ops.ssu.selective_state_update`); arguments validated by the public op.

    state (S,H,P,N) fp32/fp16/bf16, updated in place; x (b,q,H,P); dt (b,q,H); B, C (b,q,G,N);
    A, D, dt_bias (H,) fp32; state_indices (b,) int32 (-1 = padding, zero output);
    dst_indices (b,q) int32 or None. Returns y (b,q,H,P) in x.dtype.
    """
    return launch_ssu(state, x, dt, A, B, C, D, dt_bias, state_indices, dst_indices, dt_softplus, rand_seed,
                      out, CONFIGS[state.dtype])
