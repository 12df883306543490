"""ReplaySSM output-only route on the CUDA cores (the forward's path for q = 1).

The same closed form as `replay.py`'s tensor-core route, evaluated per token with element-wise
products and row reductions. On the H200 it is the faster of the two at q = 1 (one token: one
S0 C reduction) and the slower at q > 1, where the per-token cross-lane reductions dominate
(benchmarks/NOTES-kernels.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from replayssm.ops.triton.ssu import softplus_dt


@triton.jit
def replay_out_reduce_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr,
    state_ptr, rx_ptr, rB_ptr, rdt_ptr, ring_start_ptr, committed_ptr, idx_ptr, y_ptr,
    sx_b, sx_t, sx_h,
    sdt_b, sdt_t, sdt_h,
    sB_b, sB_t, sB_g,
    sC_b, sC_t, sC_g,
    sy_b, sy_t, sy_h,
    H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
):
    """Output-only route with CUDA-core products and reductions; grid (P tiles, H, b).

    Reads S0 and the history, appends x (every P tile), Δ and B (first tile; B from the first
    head of each group); never writes the state.
    """
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


def launch_out_reduce(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                      state_indices, window, dt_softplus, y, block_p: int, num_warps: int) -> None:
    """Outputs and appends of a forward step (the caller then launches the fold)."""
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    block_p = min(block_p, triton.next_power_of_2(P))
    replay_out_reduce_kernel[(triton.cdiv(P, block_p), H, b)](
        x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed, state_indices, y,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), dt.stride(2),
        B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
        y.stride(0), y.stride(1), y.stride(2), H, B.shape[2], ring_x.shape[2],
        Q=q, QB=max(triton.next_power_of_2(q), 2), HB=max(triton.next_power_of_2(int(window)), 2),
        P=P, N=N, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N), DT_SOFTPLUS=bool(dt_softplus),
        num_warps=num_warps,
    )
