"""ReplaySSM forward, commit and materialize in Triton (twins of `ops/replay.py`).

Forward, per program (P tile, head h, row i) with slot s, h_c = committed[s], o = ring_start[s]:

    history j < h_c at ring row (o + j) mod R      new token t < q at row (o + h_c + t) mod R
    Λ = A * cumsum([Δ_hist, Δ_new])                (fp32, recomputed every step, all <= 0)
    y_t = e^{Λ_t} (S0 C_t) + Σ_j Δ_j e^{Λ_t-Λ_j} (B_j·C_t) x_j + Σ_{k<=t} (same, new) + D x_t

Output-only route: reads S0, never writes it. Fold route (flush: h_c + q > W): S0 advanced
by the h_c history entries with the per-token recurrence in fp32 (bit-for-bit the baseline's
arithmetic), rounded and written. Appended rows never overlap history rows (h_c + q <= R), so
no program reads what another writes in the same launch. ROUTE selects one launch (fused) or
the split pair (output-only launch, then a fold-only launch that exits early on non-flush rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.rounding import max_finite, seed_mix, stochastic_round, tl_dtype
from replayssm.ops.triton.ssu import LaunchConfig, softplus_dt

ROUTE_FUSED = 0
ROUTE_OUTPUT = 1
ROUTE_FOLD = 2

# Chosen from the H200 sweep in benchmarks/bench_kernels.py (see benchmarks/NOTES-kernels.md).
CONFIG = LaunchConfig(block_p=32, num_warps=4)
SPLIT = False


@triton.jit
def _fold(S, rx_ptr, rB_ptr, rdt_ptr, xrow0, Brow0, dtrow0, o, count, A, R, p, n, pm, nm,
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
def _replay_fwd_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr,
    state_ptr, rx_ptr, rB_ptr, rdt_ptr, ring_start_ptr, committed_ptr, idx_ptr, y_ptr,
    seed_mix, window,
    sx_b, sx_t, sx_h,
    sdt_b, sdt_t, sdt_h,
    sB_b, sB_t, sB_g,
    sC_b, sC_t, sC_g,
    sy_b, sy_t, sy_h,
    H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    ROUTE: tl.constexpr, DT_SOFTPLUS: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    g = h // (H // G)
    hc = tl.where(valid, tl.load(committed_ptr + s64), 0)
    o = tl.load(ring_start_ptr + s64)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm = p < P
    nm = n < N
    # Validity as a tensor mask (a scalar bool in a mask trips the interpreter).
    pmv = pm & ((p * 0 + s) >= 0)
    tile = p[:, None] * N + n[None, :]
    tmask = pmv[:, None] & nm[None, :]
    A = tl.load(A_ptr + h)
    xrow0 = s64 * H * R + h * R  # ring_x / ring_dt row base of (s, h)
    Brow0 = s64 * G * R + g * R  # ring_B row base of (s, g)
    sbase = (s64 * H + h) * (P * N)

    if ROUTE != 2:
        Dh = tl.load(D_ptr + h)
        bias = tl.load(dt_bias_ptr + h)
        # History block (HB >= W rows, masked to j < h_c).
        j = tl.arange(0, HB)
        jm = (j < hc) & ((j * 0 + s) >= 0)
        rows = (o + j) % R
        dth = tl.load(rdt_ptr + xrow0 + rows, mask=jm, other=0.0)
        cumh = tl.cumsum(dth, axis=0) * A
        lam_h = tl.sum(dth, axis=0) * A
        Bh = tl.load(rB_ptr + (Brow0 + rows)[:, None] * N + n[None, :], mask=jm[:, None] & nm[None, :],
                     other=0.0).to(tl.float32)
        xh = tl.load(rx_ptr + (xrow0 + rows)[:, None] * P + p[None, :], mask=jm[:, None] & pm[None, :],
                     other=0.0).to(tl.float32)
        S0 = tl.load(state_ptr + sbase + tile, mask=tmask, other=0.0).to(tl.float32)
        # New-token block (QB >= q rows, masked to t < q).
        tq = tl.arange(0, QB)
        qm = tq < Q
        dtn = tl.load(dt_ptr + i * sdt_b + tq * sdt_t + h * sdt_h, mask=qm, other=0.0).to(tl.float32)
        dtn = tl.where(qm, softplus_dt(dtn, bias, DT_SOFTPLUS), 0.0)
        cumn = lam_h + tl.cumsum(dtn, axis=0) * A
        Bn_raw = tl.load(B_ptr + i * sB_b + tq[:, None] * sB_t + g * sB_g + n[None, :],
                         mask=qm[:, None] & nm[None, :], other=0.0)
        xn_raw = tl.load(x_ptr + i * sx_b + tq[:, None] * sx_t + h * sx_h + p[None, :],
                         mask=qm[:, None] & pm[None, :], other=0.0)
        Bn = Bn_raw.to(tl.float32)
        xn = xn_raw.to(tl.float32)
        for t in tl.static_range(Q):
            Ct = tl.load(C_ptr + i * sC_b + t * sC_t + g * sC_g + n, mask=nm, other=0.0).to(tl.float32)
            lam_t = tl.sum(tl.where(tq == t, cumn, 0.0), axis=0)
            yt = tl.exp(lam_t) * tl.sum(S0 * Ct[None, :], axis=1)
            # Exponents clamped at 0: masked entries must not overflow before being zeroed.
            wh = dth * tl.exp(tl.minimum(lam_t - cumh, 0.0)) * tl.sum(Bh * Ct[None, :], axis=1)
            yt += tl.sum(wh[:, None] * xh, axis=0)
            wn = dtn * tl.exp(tl.minimum(lam_t - cumn, 0.0)) * tl.sum(Bn * Ct[None, :], axis=1)
            wn = tl.where(tq <= t, wn, 0.0)
            yt += tl.sum(wn[:, None] * xn, axis=0)
            xt = tl.load(x_ptr + i * sx_b + t * sx_t + h * sx_h + p, mask=pm, other=0.0).to(tl.float32)
            yt = tl.where(valid, yt + Dh * xt, 0.0)
            tl.store(y_ptr + i * sy_b + t * sy_t + h * sy_h + p, yt.to(y_ptr.dtype.element_ty), mask=pm)
        # Append the q new entries after the history (never a history row).
        arow = (o + hc + tq) % R
        qmv = qm & ((tq * 0 + s) >= 0)
        tl.store(rx_ptr + (xrow0 + arow)[:, None] * P + p[None, :], xn_raw, mask=qmv[:, None] & pm[None, :])
        if pid_p == 0:
            tl.store(rdt_ptr + xrow0 + arow, dtn, mask=qmv)
            if h % (H // G) == 0:
                tl.store(rB_ptr + (Brow0 + arow)[:, None] * N + n[None, :], Bn_raw,
                         mask=qmv[:, None] & nm[None, :])
    if ROUTE != 1:
        if valid & (hc + Q > window):
            if ROUTE == 2:
                S0 = tl.load(state_ptr + sbase + tile, mask=tmask, other=0.0).to(tl.float32)
            S = _fold(S0, rx_ptr, rB_ptr, rdt_ptr, xrow0, Brow0, xrow0, o, hc, A, R, p, n, pm, nm, P, N, HB)
            val = stochastic_round(S, sbase + tile, seed_mix, STATE_DTYPE, MAXV)
            tl.store(state_ptr + sbase + tile, val, mask=tmask)


def launch_replay_forward(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                          state_indices, window, dt_softplus, rand_seed, out, config: LaunchConfig,
                          split: bool) -> torch.Tensor:
    """Launch the forward with an explicit tile config and route split (the benchmark sweeps both)."""
    S, H, P, N = state.shape
    b, q, _, _ = x.shape
    G = B.shape[2]
    R = ring_x.shape[2]
    assert state.is_contiguous() and ring_x.is_contiguous() and ring_B.is_contiguous()
    assert ring_dt.is_contiguous() and x.stride(3) == 1 and B.stride(3) == 1 and C.stride(3) == 1
    y = out if out is not None else torch.empty_like(x)
    if b == 0:
        return y
    block_p = min(config.block_p, triton.next_power_of_2(P))
    grid = (triton.cdiv(P, block_p), H, b)
    args = (
        x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed, state_indices, y,
        seed_mix(rand_seed), int(window),
        x.stride(0), x.stride(1), x.stride(2),
        dt.stride(0), dt.stride(1), dt.stride(2),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        y.stride(0), y.stride(1), y.stride(2),
        H, G, R,
    )
    meta = dict(
        Q=q, QB=max(triton.next_power_of_2(q), 2), HB=max(triton.next_power_of_2(int(window)), 2),
        P=P, N=N, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N), DT_SOFTPLUS=bool(dt_softplus),
        STATE_DTYPE=tl_dtype(state.dtype), MAXV=max_finite(tl_dtype(state.dtype)),
        num_warps=config.num_warps,
    )
    if split:
        _replay_fwd_kernel[grid](*args, ROUTE=ROUTE_OUTPUT, **meta)
        _replay_fwd_kernel[grid](*args, ROUTE=ROUTE_FOLD, **meta)
    else:
        _replay_fwd_kernel[grid](*args, ROUTE=ROUTE_FUSED, **meta)
    return y


def replay_forward_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    ring_x: torch.Tensor,
    ring_B: torch.Tensor,
    ring_dt: torch.Tensor,
    ring_start: torch.Tensor,
    committed: torch.Tensor,
    state_indices: torch.Tensor,
    window: int,
    *,
    dt_softplus: bool = True,
    rand_seed: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """ReplaySSM forward (API.md `replay_forward`); arguments validated by the public op.

    x (b,q,H,P); dt (b,q,H) raw; B, C (b,q,G,N); state (S,H,P,N), written only on flush rows;
    ring_x (S,H,R,P), ring_B (S,G,R,N), ring_dt (S,H,R) fp32: the q new entries are appended;
    ring_start, committed (S,) int32 read-only; state_indices (b,) int32, -1 = padding.
    Returns y (b,q,H,P) in x.dtype (zero rows for padding).
    """
    return launch_replay_forward(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start,
                                 committed, state_indices, window, dt_softplus, rand_seed, out, CONFIG, SPLIT)


@triton.jit
def _replay_commit_kernel(ring_start_ptr, committed_ptr, idx_ptr, acc_ptr, b, q, window, ring_rows,
                          HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(idx_ptr + i, mask=i < b, other=-1)
    m = s >= 0
    s = tl.maximum(s, 0)
    hc = tl.load(committed_ptr + s, mask=m, other=0)
    o = tl.load(ring_start_ptr + s, mask=m, other=0)
    a = tl.load(acc_ptr + i, mask=m, other=0)
    # Decided from the pre-commit cursor, exactly as the forward decided its flush.
    flushed = hc + q > window
    start = tl.where(flushed, o + hc, o)
    if HAS_ROWS:
        start = start % ring_rows
    tl.store(ring_start_ptr + s, start, mask=m)
    tl.store(committed_ptr + s, tl.where(flushed, a, hc + a), mask=m)


def replay_commit_triton(ring_start: torch.Tensor, committed: torch.Tensor, state_indices: torch.Tensor,
                         num_accepted: torch.Tensor, q: int, window: int, *,
                         ring_rows: int | None = None) -> None:
    """Cursor commit on device (API.md `replay_commit`); padding rows untouched, no host sync."""
    b = state_indices.shape[0]
    if b == 0:
        return
    block = 128
    _replay_commit_kernel[(triton.cdiv(b, block),)](
        ring_start, committed, state_indices, num_accepted, b, int(q), int(window),
        int(ring_rows) if ring_rows is not None else 1,
        HAS_ROWS=ring_rows is not None, BLOCK=block, num_warps=4,
    )


@triton.jit
def _replay_materialize_kernel(
    A_ptr, state_ptr, rx_ptr, rB_ptr, rdt_ptr, ring_start_ptr, src_ptr, n_ptr, dst_ptr,
    seed_mix, H, G, R,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, JB: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
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
    S = _fold(S, rx_ptr, rB_ptr, rdt_ptr, src64 * H * R + h * R, src64 * G * R + g * R, src64 * H * R + h * R,
              o, count, A, R, p, n, pm, nm, P, N, JB)
    base = (dst64 * H + h) * (P * N)
    val = stochastic_round(S, base + tile, seed_mix, STATE_DTYPE, MAXV)
    tl.store(state_ptr + base + tile, val, mask=tmask)


def replay_materialize_triton(A: torch.Tensor, state: torch.Tensor, ring_x: torch.Tensor,
                              ring_B: torch.Tensor, ring_dt: torch.Tensor, ring_start: torch.Tensor,
                              committed: torch.Tensor,
                              src_indices: torch.Tensor, num_entries: torch.Tensor, dst_indices: torch.Tensor,
                              *, rand_seed: int = 0) -> None:
    """state[dst] = state[src] advanced by its first n ring entries (API.md `replay_materialize`).

    Same fp32 per-token fold as the forward's flush; rows with src or dst = -1 are skipped.
    """
    S, H, P, N = state.shape
    m = src_indices.shape[0]
    if m == 0:
        return
    assert state.is_contiguous() and ring_x.is_contiguous() and ring_B.is_contiguous()
    block_p = min(CONFIG.block_p, triton.next_power_of_2(P))
    _replay_materialize_kernel[(triton.cdiv(P, block_p), H, m)](
        A, state, ring_x, ring_B, ring_dt, ring_start, src_indices, num_entries, dst_indices,
        seed_mix(rand_seed), H, ring_B.shape[1], ring_x.shape[2],
        P=P, N=N, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N),
        # n <= committed <= W < R bounds the unrolled fold.
        JB=triton.next_power_of_2(ring_x.shape[2]),
        STATE_DTYPE=tl_dtype(state.dtype), MAXV=max_finite(tl_dtype(state.dtype)),
        num_warps=CONFIG.num_warps,
    )
