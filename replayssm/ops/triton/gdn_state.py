"""Baseline Gated DeltaNet state update in Triton (twin of `ops/gdn.py: gdn_state_update_ref`).

One program per (Dv tile, value head, row): grid (cdiv(Dv, BLOCK_V), Hv, b), so consecutive programs
walk one slot's (Hv, Dk, Dv) state contiguously. A program keeps its (Dk, BLOCK_V) state tile in fp32
registers across the q tokens and runs the per-token delta rule on it:

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q     (q, k L2-normalized in fp32)

Plain decode reads the tile once and writes it once; verify (`dst_indices`) reads it once and writes
the state after each token to its own slot. 16-bit pools round with `stochastic_round_pairs` (the
seed read on the device), so a write's bits depend only on (seed, destination element). A store
hashes the tile's int32 offsets within one (slot, head) state and adds the slot's part to the seed mix
once, so verify's q stores share one offset tile and do no per-element 64-bit work. The tile per
(state dtype, q > 1) is `CONFIGS`. The jitted helpers here are shared with the replay kernels
(`gdn_replay.py`).
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
    """Columns of the state tile over Dv (a power of two) and warps per program."""

    block_v: int = 32
    num_warps: int = 4


# The state update's tile per (state dtype, several tokens per row: verify, which writes the state after
# each token); `benchmarks/bench_gdn_kernels.py --sweep` times the candidates per (dtype, q).
CONFIGS = {
    # The H100 sweep (Qwen3.5-27B shape, batch 256; bench_gdn_kernels.py --sweep 32x4,64x4,64x8,128x8):
    # (Dk, 64) fp32 tiles at 4 warps read a slot's rows in 256-byte runs and keep 64 registers of state.
    (torch.float32, False): LaunchConfig(block_v=64, num_warps=4),  # 555 us against 588 at 32x4
    (torch.float32, True): LaunchConfig(block_v=64, num_warps=4),  # 1488 us against 1569 at 32x4
    # One 16-bit token: the smaller tile holds the rounding's temporaries beside the state.
    (torch.float16, False): LaunchConfig(block_v=32, num_warps=4),  # bf16's bytes and rounding work
    (torch.float16, True): LaunchConfig(block_v=64, num_warps=4),
    (torch.bfloat16, False): LaunchConfig(block_v=32, num_warps=4),  # 468 us against 518 at 64x4
    (torch.bfloat16, True): LaunchConfig(block_v=64, num_warps=4),  # 1804 us against 1853 at 32x4
}


@triton.jit
def unit_key(ptr, kk, km, scale):
    """The (BLOCK_K,) key at ptr, L2-normalized in fp32 and times `scale` (x rsqrt(|x|^2 + 1e-6), the eps
    of `ops/gdn.py: l2norm`)."""
    x = tl.load(ptr + kk, mask=km, other=0.0).to(tl.float32)
    return x * (tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6) * scale)


@triton.jit
def delta_step(S, kn, v, g, beta):
    """One token of the delta rule on a (BLOCK_K, BLOCK_V) fp32 tile: decay, then + k (beta (v - S^T k))^T."""
    S = S * tl.exp(g)
    delta = beta * (v - tl.sum(S * kn[:, None], axis=0))
    return S + kn[:, None] * delta[None, :]


@triton.jit
def store_state(state_ptr, S, slot, hv, Hv, kk, vv, tmask, seed_mix,
                DK: tl.constexpr, DV: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr):
    """state[slot, hv, kk, vv] = S (rounded stochastically into a 16-bit pool); nothing where slot < 0."""
    base = (tl.maximum(slot, 0).to(tl.int64) * Hv + hv) * (DK * DV)
    local = kk[:, None] * DV + vv[None, :]  # int32, the same for every slot: computed once per program
    if (DK * DV) % 2 == 0:
        # base is even, so element base + local hashes (base >> 1) + (local >> 1) with parity local & 1:
        # base >> 1 joins the seed mix (a scalar add mod 2^32) and the tile's work stays int32 and
        # shared by verify's q stores, with the bits of the pool-wide offsets.
        val = stochastic_round_pairs(S, local, seed_mix + (base >> 1).to(tl.uint32), STATE_DTYPE, MAXV, DV)
    else:
        val = stochastic_round_pairs(S, base + local, seed_mix, STATE_DTYPE, MAXV, DV)
    tl.store(state_ptr + base + local, val, mask=tmask & ((local * 0 + slot) >= 0))


@triton.jit
def load_state(state_ptr, slot, hv, Hv, kk, vv, tmask, DK: tl.constexpr, DV: tl.constexpr):
    """state[slot, hv, kk, vv] as fp32 (zeros where slot < 0)."""
    base = (tl.maximum(slot, 0).to(tl.int64) * Hv + hv) * (DK * DV)
    local = kk[:, None] * DV + vv[None, :]
    return tl.load(state_ptr + base + local, mask=tmask & ((local * 0 + slot) >= 0), other=0.0).to(tl.float32)


@triton.jit
def _state_update_kernel(
    state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, idx_ptr, dst_ptr, o_ptr, seed_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    sg_b, sg_t, sg_h, sb_b, sb_t, sb_h, so_b, so_t, so_h,
    Hv, RATIO, q_scale,
    Q: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_DST: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    hv = tl.program_id(1)
    i = tl.program_id(2).to(tl.int64)
    hk = hv // RATIO
    s = tl.load(idx_ptr + i)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    km = kk < DK
    vm = vv < DV
    tmask = km[:, None] & vm[None, :]
    S = load_state(state_ptr, s, hv, Hv, kk, vv, tmask, DK, DV)
    for t in tl.static_range(Q):
        kn = unit_key(k_ptr + i * sk_b + t * sk_t + hk * sk_h, kk, km, 1.0)
        qn = unit_key(q_ptr + i * sq_b + t * sq_t + hk * sq_h, kk, km, q_scale)
        v = tl.load(v_ptr + i * sv_b + t * sv_t + hv * sv_h + vv, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + i * sg_b + t * sg_t + hv * sg_h).to(tl.float32)
        beta = tl.load(beta_ptr + i * sb_b + t * sb_t + hv * sb_h).to(tl.float32)
        S = delta_step(S, kn, v, g, beta)
        o = tl.where(vv * 0 + s >= 0, tl.sum(S * qn[:, None], axis=0), 0.0)
        tl.store(o_ptr + i * so_b + t * so_t + hv * so_h + vv, o.to(o_ptr.dtype.element_ty), mask=vm)
        if HAS_DST:
            d = tl.where(s >= 0, tl.load(dst_ptr + i * Q + t), -1)
            store_state(state_ptr, S, d, hv, Hv, kk, vv, tmask, seed_mix, DK, DV, STATE_DTYPE, MAXV)
    if not HAS_DST:
        store_state(state_ptr, S, s, hv, Hv, kk, vv, tmask, seed_mix, DK, DV, STATE_DTYPE, MAXV)


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t with a contiguous last dim (the kernels index it with unit stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def launch_state_update(state, q, k, v, g, beta, state_indices, dst_indices, rand_seed, out,
                        config: LaunchConfig) -> torch.Tensor:
    """Launch the baseline kernel with an explicit tile config (the benchmark times it)."""
    _, Hv, Dk, Dv = state.shape
    b, n, Hk, _ = q.shape
    assert state.is_contiguous(), "state pool must be contiguous (offsets are linear indices)"
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    o = out if out is not None else torch.empty_like(v)
    assert o.stride(-1) == 1
    if b == 0:
        return o
    dst = dst_indices.contiguous() if dst_indices is not None else state_indices
    block_v = min(config.block_v, triton.next_power_of_2(Dv))
    grid = (triton.cdiv(Dv, block_v), Hv, b)
    sdt = tl_dtype(state.dtype)
    _state_update_kernel[grid](
        state, q, k, v, g, beta, state_indices, dst, o, device_seed(rand_seed, state.device),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), *o.stride()[:3],
        Hv, Hv // Hk, Dk**-0.5,
        Q=n, DK=Dk, DV=Dv, BLOCK_K=triton.next_power_of_2(Dk), BLOCK_V=block_v,
        HAS_DST=dst_indices is not None, STATE_DTYPE=sdt, MAXV=max_finite(sdt), num_warps=config.num_warps,
    )
    return o
