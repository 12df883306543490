"""ReplaySSM Gated DeltaNet decode and materialize in Triton (twins of `ops/gdn.py: *_ref`).

Both kernels run the sequential recurrence (`gdn_state.py: delta_step`) in fp32 registers, one program
per (Dv tile, value head, row), grid (cdiv(Dv, BLOCK_V), Hv, b), the (Dk, BLOCK_V) state tile loaded
once from the checkpoint. The reference solves the same tokens in the WY/UT form; the two agree to fp32
rounding (summation order), not bit for bit.

`gdn_replay_forward` for a row with h = committed[s] history entries and q new tokens:

    S = state[s]                                       read once
    for j < h:  S = step(S, ring entry (o + j) mod R)  history, no output
    if h + q > W:  state[s] = S                        flush: the history folded into the checkpoint
    for t < q:  S = step(S, token t); out[t] = S^T q_t; ring row (o + h + t) mod R = (k_t, v_t, g_t, beta_t)

The state after the new tokens is never stored: the ring keeps them and the next step replays them.
Appended rows never overlap history rows (h + q <= R), so no program reads a row another writes. The
k-head's ring_k row is written by the head's first value head (hv % (Hv / Hk) == 0) in its first Dv
tile, g and beta by each value head's first Dv tile.

Cost per row and value head: reads Dk Dv s of state and h (Dk + BLOCK_V-tiles of Dv) activations plus
8 bytes of g, beta per entry; about 5 Dk Dv FLOPs per history token and 7 Dk Dv per new token (decay,
S^T k, rank-1 update, output). At W = 16, q = 4 and Dk = Dv = 128 that is ~2 MFLOP against 64 KiB of
fp32 state per head: the work scales with h, while the bytes do not (the checkpoint is read once).

`gdn_replay_materialize`: S = state[src], the first n ring entries of src replayed, stored to dst.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.gdn_state import (
    LaunchConfig,
    delta_step,
    load_state,
    store_state,
    unit_key,
    unit_stride,
)
from replayssm.ops.triton.rounding import device_seed, load_seed_mix, max_finite, tl_dtype


@triton.jit
def _replay_entries(S, rk_ptr, rv_ptr, rg_ptr, rb_ptr, s, hk, hv, Hk, Hv, R, start, count, kk, km, vv, vm,
                    DK: tl.constexpr, DV: tl.constexpr):
    """S advanced by ring entries (start + j) mod R, j < count, of slot s (s >= 0)."""
    s64 = s.to(tl.int64)
    rk_row = (s64 * Hk + hk) * R
    rv_row = (s64 * Hv + hv) * R
    for j in range(0, count):
        r = (start + j) % R
        kn = unit_key(rk_ptr + (rk_row + r) * DK, kk, km, 1.0)
        v = tl.load(rv_ptr + (rv_row + r) * DV + vv, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(rg_ptr + rv_row + r)
        beta = tl.load(rb_ptr + rv_row + r)
        S = delta_step(S, kn, v, g, beta)
    return S


@triton.jit
def _replay_forward_kernel(
    state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, start_ptr, committed_ptr,
    idx_ptr, o_ptr, seed_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    sg_b, sg_t, sg_h, sb_b, sb_t, sb_h, so_b, so_t, so_h,
    Hk, Hv, RATIO, R, W, q_scale,
    Q: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    pid_v = tl.program_id(0)
    hv = tl.program_id(1)
    i = tl.program_id(2).to(tl.int64)
    hk = hv // RATIO
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s0 = tl.maximum(s, 0)
    h = tl.where(valid, tl.load(committed_ptr + s0), 0)
    start = tl.load(start_ptr + s0)
    kk = tl.arange(0, BLOCK_K)
    vv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    km = kk < DK
    vm = vv < DV
    tmask = km[:, None] & vm[None, :]

    S = load_state(state_ptr, s, hv, Hv, kk, vv, tmask, DK, DV)
    S = _replay_entries(S, rk_ptr, rv_ptr, rg_ptr, rb_ptr, s0, hk, hv, Hk, Hv, R, start, h, kk, km, vv, vm,
                        DK, DV)
    flush = tl.where(h + Q > W, s, -1)
    store_state(state_ptr, S, flush, hv, Hv, kk, vv, tmask, seed_mix, DK, DV, STATE_DTYPE, MAXV)

    s64 = s0.to(tl.int64)
    rk_row = (s64 * Hk + hk) * R
    rv_row = (s64 * Hv + hv) * R
    vm_ok = vm & ((vv * 0 + s) >= 0)
    k_writer = km & ((kk * 0 + s) >= 0) & ((kk * 0 + pid_v) == 0) & ((kk * 0 + hv % RATIO) == 0)
    for t in tl.static_range(Q):
        k_raw = tl.load(k_ptr + i * sk_b + t * sk_t + hk * sk_h + kk, mask=km, other=0.0)
        kn = unit_key(k_ptr + i * sk_b + t * sk_t + hk * sk_h, kk, km, 1.0)
        qn = unit_key(q_ptr + i * sq_b + t * sq_t + hk * sq_h, kk, km, q_scale)
        v_raw = tl.load(v_ptr + i * sv_b + t * sv_t + hv * sv_h + vv, mask=vm, other=0.0)
        g = tl.load(g_ptr + i * sg_b + t * sg_t + hv * sg_h).to(tl.float32)
        beta = tl.load(beta_ptr + i * sb_b + t * sb_t + hv * sb_h).to(tl.float32)
        S = delta_step(S, kn, v_raw.to(tl.float32), g, beta)
        o = tl.where(vm_ok, tl.sum(S * qn[:, None], axis=0), 0.0)
        tl.store(o_ptr + i * so_b + t * so_t + hv * so_h + vv, o.to(o_ptr.dtype.element_ty), mask=vm)

        r = (start + h + t) % R
        tl.store(rk_ptr + (rk_row + r) * DK + kk, k_raw.to(rk_ptr.dtype.element_ty), mask=k_writer)
        tl.store(rv_ptr + (rv_row + r) * DV + vv, v_raw.to(rv_ptr.dtype.element_ty), mask=vm_ok)
        # g and beta once per value head: the first Dv tile's program (a 1-element masked store).
        one = tl.arange(0, 1)
        gb_mask = (one * 0 + s >= 0) & (one * 0 + pid_v == 0)
        tl.store(rg_ptr + rv_row + r + one, g + tl.zeros((1,), tl.float32), mask=gb_mask)
        tl.store(rb_ptr + rv_row + r + one, beta + tl.zeros((1,), tl.float32), mask=gb_mask)


@triton.jit
def _materialize_kernel(
    state_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, start_ptr, src_ptr, num_ptr, dst_ptr, seed_ptr,
    Hk, Hv, RATIO, R,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    hv = tl.program_id(1)
    i = tl.program_id(2).to(tl.int64)
    src = tl.load(src_ptr + i)
    dst = tl.load(dst_ptr + i)
    valid = (src >= 0) & (dst >= 0)
    s0 = tl.maximum(src, 0)
    n = tl.where(valid, tl.load(num_ptr + i), 0)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    km = kk < DK
    vm = vv < DV
    tmask = km[:, None] & vm[None, :]
    S = load_state(state_ptr, tl.where(valid, src, -1), hv, Hv, kk, vv, tmask, DK, DV)
    S = _replay_entries(S, rk_ptr, rv_ptr, rg_ptr, rb_ptr, s0, hv // RATIO, hv, Hk, Hv, R,
                        tl.load(start_ptr + s0), n, kk, km, vv, vm, DK, DV)
    store_state(state_ptr, S, tl.where(valid, dst, -1), hv, Hv, kk, vv, tmask, seed_mix, DK, DV,
                STATE_DTYPE, MAXV)


def _check_pools(state, ring_k, ring_v, ring_g, ring_beta) -> None:
    for name, t in (("state", state), ("ring_k", ring_k), ("ring_v", ring_v), ("ring_g", ring_g),
                    ("ring_beta", ring_beta)):
        assert t.is_contiguous(), f"{name} must be contiguous (offsets are linear indices)"


def launch_replay_forward(q, k, v, g, beta, state, ring_k, ring_v, ring_g, ring_beta, ring_start, committed,
                          state_indices, window, rand_seed, out, config: LaunchConfig) -> torch.Tensor:
    """Launch the replay forward kernel with an explicit tile config (the benchmark times it)."""
    _check_pools(state, ring_k, ring_v, ring_g, ring_beta)
    _, Hv, Dk, Dv = state.shape
    b, n, Hk, _ = q.shape
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    o = out if out is not None else torch.empty_like(v)
    assert o.stride(-1) == 1
    if b == 0:
        return o
    block_v = min(config.block_v, triton.next_power_of_2(Dv))
    sdt = tl_dtype(state.dtype)
    _replay_forward_kernel[(triton.cdiv(Dv, block_v), Hv, b)](
        state, q, k, v, g, beta, ring_k, ring_v, ring_g, ring_beta, ring_start, committed, state_indices, o,
        device_seed(rand_seed, state.device),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), *o.stride()[:3],
        Hk, Hv, Hv // Hk, ring_k.shape[2], window, Dk**-0.5,
        Q=n, DK=Dk, DV=Dv, BLOCK_K=triton.next_power_of_2(Dk), BLOCK_V=block_v,
        STATE_DTYPE=sdt, MAXV=max_finite(sdt), num_warps=config.num_warps,
    )
    return o


def launch_materialize(state, ring_k, ring_v, ring_g, ring_beta, ring_start, src_indices, num_entries,
                       dst_indices, rand_seed, config: LaunchConfig) -> None:
    """Launch the materialize kernel with an explicit tile config."""
    _check_pools(state, ring_k, ring_v, ring_g, ring_beta)
    _, Hv, Dk, Dv = state.shape
    m = src_indices.shape[0]
    if m == 0:
        return
    block_v = min(config.block_v, triton.next_power_of_2(Dv))
    sdt = tl_dtype(state.dtype)
    _materialize_kernel[(triton.cdiv(Dv, block_v), Hv, m)](
        state, ring_k, ring_v, ring_g, ring_beta, ring_start, src_indices, num_entries, dst_indices,
        device_seed(rand_seed, state.device),
        ring_k.shape[1], Hv, Hv // ring_k.shape[1], ring_k.shape[2],
        DK=Dk, DV=Dv, BLOCK_K=triton.next_power_of_2(Dk), BLOCK_V=block_v,
        STATE_DTYPE=sdt, MAXV=max_finite(sdt), num_warps=config.num_warps,
    )
