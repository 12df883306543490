"""ReplaySSM state folds in Triton: the flush write of a forward step, and materialize.

Both advance a checkpoint S0 by the first `count` ring entries of its slot with the per-token
recurrence S <- exp(Δ A) S + Δ x Bᵀ in fp32 (the baseline's own arithmetic, so no tensor-core
rounding reaches a stored state), then round stochastically into the pool.
"""

from __future__ import annotations

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


@triton.jit
def fold(S, rx_ptr, rB_ptr, rdt_ptr, xrow0, Brow0, dtrow0, o, count, A, R, p, n, pm, nm,
          P: tl.constexpr, N: tl.constexpr, JB: tl.constexpr):
    # S <- S advanced by `count` (<= JB) ring entries from row o, token by token in fp32.
    # Unrolled with masked loads so every load can issue up front; a masked entry has
    # Δ = 0, x = 0, so its update S * exp(0) + 0 leaves S bit-exact.
    for j in tl.static_range(JB):
        r = (o + j) % R
        dj = tl.load(rdt_ptr + dtrow0 + r, mask=count > j, other=0.0)
        xj = tl.load(rx_ptr + (xrow0 + r) * P + p, mask=pm & ((p * 0 + j) < count), other=0.0)
        Bj = tl.load(rB_ptr + (Brow0 + r) * N + n, mask=nm & ((n * 0 + j) < count), other=0.0)
        xj = xj.to(tl.float32)
        Bj = Bj.to(tl.float32)
        S = S * tl.exp(dj * A) + (dj * xj)[:, None] * Bj[None, :]
    return S


@triton.jit
def replay_fold_kernel(
    state_ptr, rx_ptr, rB_ptr, rdt_ptr, A_ptr, ring_start_ptr, committed_ptr, idx_ptr,
    seed_ptr, window, H, G, R,
    Q: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    """Flush rows of a forward step (h + q > W): S0 <- S0 advanced by its h history entries.

    Grid (P tiles, H, b); rows that do not flush exit after reading their cursor. Reads only
    history rows, so it may run after the output launch appended the new entries.
    """
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    s = tl.load(idx_ptr + i)
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.load(committed_ptr + s64)
    if (s >= 0) & (hc + Q > window):
        o = tl.load(ring_start_ptr + s64)
        g = h // (H // G)
        p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        pm = p < P
        nm = n < N
        tile = p[:, None] * N + n[None, :]
        tmask = pm[:, None] & nm[None, :]
        sbase = (s64 * H + h) * (P * N)
        S = tl.load(state_ptr + sbase + tile, mask=tmask, other=0.0).to(tl.float32)
        A = tl.load(A_ptr + h)
        xrow0 = s64 * H * R + h * R
        S = fold(S, rx_ptr, rB_ptr, rdt_ptr, xrow0, s64 * G * R + g * R, xrow0, o, hc, A, R, p, n, pm, nm,
                 P, N, HB)
        val = stochastic_round_pairs(S, sbase + tile, seed_mix, STATE_DTYPE, MAXV, N)
        tl.store(state_ptr + sbase + tile, val, mask=tmask)


def launch_fold(state, ring_x, ring_B, ring_dt, A, ring_start, committed, state_indices, window, q, rand_seed,
                block_p: int, num_warps: int) -> None:
    """Fold-and-write every flushing row of a forward step (after its output launch)."""
    S, H, P, N = state.shape
    b = state_indices.shape[0]
    block_p = min(block_p, triton.next_power_of_2(P))
    replay_fold_kernel[(triton.cdiv(P, block_p), H, b)](
        state, ring_x, ring_B, ring_dt, A, ring_start, committed, state_indices,
        device_seed(rand_seed, state.device), int(window), H, ring_B.shape[1], ring_x.shape[2],
        Q=q, HB=triton.next_power_of_2(int(window)), P=P, N=N, BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(N), STATE_DTYPE=tl_dtype(state.dtype),
        MAXV=max_finite(tl_dtype(state.dtype)), num_warps=num_warps,
    )


@triton.jit
def _replay_materialize_kernel(
    A_ptr, state_ptr, rx_ptr, rB_ptr, rdt_ptr, ring_start_ptr, src_ptr, n_ptr, dst_ptr,
    seed_ptr, H, G, R,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, JB: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    src = tl.load(src_ptr + i)
    dst = tl.load(dst_ptr + i)
    ok = (src >= 0) & (dst >= 0)
    src64 = tl.maximum(src, 0).to(tl.int64)
    dst64 = tl.maximum(dst, 0).to(tl.int64)
    count = tl.where(ok, tl.load(n_ptr + i), 0)
    o = tl.load(ring_start_ptr + src64)
    g = h // (H // G)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm = p < P
    nm = n < N
    tile = p[:, None] * N + n[None, :]
    tmask = (pm & ((p * 0 + tl.where(ok, 1, 0)) > 0))[:, None] & nm[None, :]
    S = tl.load(state_ptr + (src64 * H + h) * (P * N) + tile, mask=tmask, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + h)
    S = fold(S, rx_ptr, rB_ptr, rdt_ptr, src64 * H * R + h * R, src64 * G * R + g * R, src64 * H * R + h * R,
             o, count, A, R, p, n, pm, nm, P, N, JB)
    base = (dst64 * H + h) * (P * N)
    val = stochastic_round_pairs(S, base + tile, seed_mix, STATE_DTYPE, MAXV, N)
    tl.store(state_ptr + base + tile, val, mask=tmask)


def replay_materialize_triton(A: torch.Tensor, state: torch.Tensor, ring_x: torch.Tensor,
                              ring_B: torch.Tensor, ring_dt: torch.Tensor, ring_start: torch.Tensor,
                              committed: torch.Tensor,
                              src_indices: torch.Tensor, num_entries: torch.Tensor, dst_indices: torch.Tensor,
                              *, rand_seed: int | torch.Tensor = 0) -> None:
    """state[dst] = state[src] advanced by its first n ring entries (`ops.replay.replay_materialize`).

    Same fp32 per-token fold as the forward's flush; rows with src or dst = -1 are skipped.
    """
    S, H, P, N = state.shape
    m = src_indices.shape[0]
    if m == 0:
        return
    assert state.is_contiguous() and ring_x.is_contiguous() and ring_B.is_contiguous()
    block_p = min(32, triton.next_power_of_2(P))
    _replay_materialize_kernel[(triton.cdiv(P, block_p), H, m)](
        A, state, ring_x, ring_B, ring_dt, ring_start, src_indices, num_entries, dst_indices,
        device_seed(rand_seed, state.device), H, ring_B.shape[1], ring_x.shape[2],
        P=P, N=N, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N),
        # n <= committed <= W < R bounds the unrolled fold.
        JB=triton.next_power_of_2(ring_x.shape[2]),
        STATE_DTYPE=tl_dtype(state.dtype), MAXV=max_finite(tl_dtype(state.dtype)),
        num_warps=4,
    )
