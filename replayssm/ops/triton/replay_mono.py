"""ReplaySSM forward step in one launch (route `Mono`), for small one-token steps (several tokens
take its tensor-core twin `MonoMMA`, replay_mono_mma.py).

The split routes cut a step into a weights launch, output launches and flush launches, which pays
at large batches (B·C once per group, the fold's registers kept out of the streaming programs) but
costs a launch latency each. Here one program per (row, head, P tile) does it all:

    1. B·C, the cumulative decays and the coefficients of `replay_step._weights_kernel`, for its
       own head only (B·C recomputed per head and P tile: ~QB (HB + QB) N products, small next
       to the tile's P N), a token at a time, before the tile is loaded (so B never shares the
       registers with the tile);
    2. y_t = e^{Λ_t} (S0 C_t) + Σ_j w_tj x_j + Σ_k w_tk x_k + D x_t, one reduction over N per
       token on the CUDA cores;
    3. appends: x rows (every program, its P tile), Δ (P tile 0), B (P tile 0 of the group's
       first head), never onto a history row;
    4. flush rows (h_c + Q > W): S0 <- e^{Λ_h} S0 + Σ_j f_j x_j B_jᵀ, one 3xTF32 tensor-core
       product per column chunk (~2^-21 relative error per product, as the other routes' folds),
       written with stochastic rounding for 16-bit pools.
"""

from __future__ import annotations

import triton
import triton.language as tl

from replayssm.ops.triton.replay_flush import fold_chunks
from replayssm.ops.triton.replay_stream import stream_supported
from replayssm.ops.triton.rounding import device_seed, load_seed_mix, max_finite, tl_dtype
from replayssm.ops.triton.ssu import softplus_dt


@triton.jit
def _ordered_row(idx_ptr, committed_ptr, window, Q: tl.constexpr, ORDER: tl.constexpr):
    """This program's row and whether it has work. With ORDER the grid spans 2b rows: the first half
    works the flush rows only and the second half the rest, so the flush rows' longer (folding)
    programs are dispatched first and the short ones fill in behind them, instead of a fold starting
    in the last wave."""
    k = tl.program_id(2)
    if not ORDER:
        return k, True
    b = tl.num_programs(2) // 2
    second = k >= b
    i = tl.where(second, k - b, k)
    s = tl.load(idx_ptr + i)
    flush = (s >= 0) & (tl.load(committed_ptr + tl.maximum(s, 0).to(tl.int64)) + Q > window)
    return i, flush != second


@triton.jit
def _row_head(idx_ptr, committed_ptr, ring_start_ptr, i, h, H, G):
    """Row i's slot s, whether it is a real row, s as int64 (padding rows read slot 0: outputs zeroed,
    nothing written), its committed history length and ring start; heads per group, h's group."""
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.where(valid, tl.load(committed_ptr + s64), 0)
    hpg = H // G
    return s, valid, s64, hc, tl.load(ring_start_ptr + s64), hpg, h // hpg


@triton.jit
def _decays(A_ptr, rdt_ptr, dt_ptr, dt_bias_ptr, hist, jm, new, tm, h, DT_SOFTPLUS: tl.constexpr):
    """A and Λ from the stored history Δ (offsets `hist`, mask jm) and the step's raw dt (offsets
    `new`, mask tm): (A, Δ_hist, cumulative Λ of the history, its total, Δ_new, cumulative Λ of the
    step's tokens after the history). Exponents are later clamped <= 0, as in the weights launch."""
    A = tl.load(A_ptr + h)
    dth = tl.load(rdt_ptr + hist, mask=jm, other=0.0)
    cumh = tl.cumsum(dth, axis=0) * A
    lam_h = tl.sum(dth, axis=0) * A
    dtn = tl.load(dt_ptr + new, mask=tm, other=0.0).to(tl.float32)
    dtn = tl.where(tm, softplus_dt(dtn, tl.load(dt_bias_ptr + h), DT_SOFTPLUS), 0.0)
    cumn = lam_h + tl.cumsum(dtn, axis=0) * A
    return A, dth, cumh, lam_h, dtn, cumn


@triton.jit
def _mono_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, rx_ptr, rB_ptr, rdt_ptr,
    ring_start_ptr, committed_ptr, idx_ptr, y_ptr, seed_ptr, window,
    sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, NS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr, ORDER: tl.constexpr,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    i, mine = _ordered_row(idx_ptr, committed_ptr, window, Q, ORDER)
    if not mine:
        return
    s, valid, s64, hc, o, hpg, g = _row_head(idx_ptr, committed_ptr, ring_start_ptr, i, h, H, G)
    NC: tl.constexpr = N // NS
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    ncol = tl.arange(0, NC)[:, None] * NS + tl.arange(0, NS)[None, :]
    tile = p[None, :, None] * N + ncol[:, None, :]
    sbase = (s64 * H + h) * (P * N)

    n = tl.arange(0, BLOCK_N)
    nm = n < N
    j = tl.arange(0, HB)
    jm = j < hc
    t = tl.arange(0, QB)
    tm = t < Q
    rows = (o + j) % R
    Brow0 = s64 * G * R + g * R
    xrow0 = s64 * H * R + h * R
    Bh = tl.load(rB_ptr + (Brow0 + rows)[:, None] * N + n[None, :], mask=jm[:, None] & nm[None, :],
                 other=0.0).to(tl.float32)  # (HB, BLOCK_N)
    tn = tm[:, None] & nm[None, :]
    Bn_raw = tl.load(B_ptr + i * sB_b + t[:, None] * sB_t + g * sB_g + n[None, :], mask=tn, other=0.0)
    Bn = Bn_raw.to(tl.float32)  # (QB, BLOCK_N)
    A, dth, cumh, lam_h, dtn, cumn = _decays(A_ptr, rdt_ptr, dt_ptr, dt_bias_ptr, xrow0 + rows, jm,
                                             i * sdt_b + t * sdt_t + h * sdt_h, tm, h, DT_SOFTPLUS)

    # Coefficients one token at a time, so no (tokens, history, N) product is ever live, and
    # before the tile is loaded, so B never shares the registers with it.
    wh = tl.zeros((QB, HB), dtype=tl.float32)
    wn = tl.zeros((QB, QB), dtype=tl.float32)
    for tt in tl.static_range(Q):
        Crow = tl.load(C_ptr + i * sC_b + tt * sC_t + g * sC_g + n, mask=nm, other=0.0).to(tl.float32)
        cum_t = tl.sum(tl.where(t == tt, cumn, 0.0))
        wht = dth * tl.exp(tl.minimum(cum_t - cumh, 0.0)) * tl.sum(Crow[None, :] * Bh, axis=1)
        wnt = dtn * tl.exp(tl.minimum(cum_t - cumn, 0.0)) * tl.sum(Crow[None, :] * Bn, axis=1)
        wnt = tl.where(t <= tt, wnt, 0.0)  # causal: token k <= t
        wh = tl.where((t == tt)[:, None], wht[None, :], wh)
        wn = tl.where((t == tt)[:, None], wnt[None, :], wn)

    S0 = tl.load(state_ptr + sbase + tile).to(tl.float32)  # (NC, BLOCK_P, NS), as `_piece`
    xh = tl.load(rx_ptr + (xrow0 + rows)[:, None] * P + p[None, :], mask=jm[:, None],
                 other=0.0).to(tl.float32)  # (HB, BLOCK_P)
    xrows = x_ptr + i * sx_b + t[:, None] * sx_t + h * sx_h + p[None, :]
    xn_raw = tl.load(xrows, mask=tm[:, None], other=0.0)
    xn = xn_raw.to(tl.float32)
    Dh = tl.load(D_ptr + h)
    for tt in tl.static_range(Q):
        sel = t == tt
        Ct = tl.load(C_ptr + i * sC_b + tt * sC_t + g * sC_g + ncol).to(tl.float32)
        yt = tl.exp(tl.sum(tl.where(sel, cumn, 0.0))) * tl.sum(tl.sum(S0 * Ct[:, None, :], axis=0), axis=1)
        wht = tl.sum(tl.where(sel[:, None], wh, 0.0), axis=0)
        wnt = tl.sum(tl.where(sel[:, None], wn, 0.0), axis=0)
        xt = tl.sum(tl.where(sel[:, None], xn, 0.0), axis=0)
        yt += tl.sum(wht[:, None] * xh, axis=0) + tl.sum(wnt[:, None] * xn, axis=0) + Dh * xt
        yt = tl.where(valid, yt, 0.0)
        tl.store(y_ptr + i * sy_b + tt * sy_t + h * sy_h + p, yt.to(y_ptr.dtype.element_ty))

    _appends(rx_ptr, rB_ptr, rdt_ptr, xn_raw, dtn, Bn_raw, s, o, hc, t, tm, p, n, nm, pid_p, h, hpg,
             xrow0, Brow0, P, N, R)
    if valid & (hc + Q > window):
        _fold(state_ptr, rx_ptr, rB_ptr, rdt_ptr, A, lam_h, o, hc, p, sbase, xrow0, Brow0, seed_mix,
              P, N, R, HB, NS, STATE_DTYPE, MAXV)


@triton.jit
def _appends(rx_ptr, rB_ptr, rdt_ptr, xn_raw, dtn, Bn_raw, s, o, hc, t, tm, p, n, nm, pid_p, h, hpg,
             xrow0, Brow0, P: tl.constexpr, N: tl.constexpr, R):
    """The step's ring appends after the history (never onto a history row): x rows (every program,
    its P tile), Δ (P tile 0), B (P tile 0 of the group's first head)."""
    # Validity and "which program" as tensors (a scalar bool in a mask trips the interpreter).
    kv = tm & ((t * 0 + s) >= 0)
    arow = (o + hc + t) % R
    tl.store(rx_ptr + (xrow0 + arow)[:, None] * P + p[None, :], xn_raw, mask=kv[:, None])
    kv0 = kv & ((t * 0 + pid_p) == 0)
    tl.store(rdt_ptr + xrow0 + arow, dtn, mask=kv0)
    kvg = kv0 & ((t * 0 + h % hpg) == 0)
    tl.store(rB_ptr + (Brow0 + arow)[:, None] * N + n[None, :], Bn_raw, mask=kvg[:, None] & nm[None, :])


@triton.jit
def _fold(state_ptr, rx_ptr, rB_ptr, rdt_ptr, A, lam_h, o, hc, p, sbase, xrow0, Brow0, seed_mix,
          P: tl.constexpr, N: tl.constexpr, R, HB: tl.constexpr, NS: tl.constexpr, STATE_DTYPE: tl.constexpr,
          MAXV: tl.constexpr):
    """A flush row's fold: S0 <- e^{Λ_h} S0 + Σ_j f_j x_j B_jᵀ, an NS-column chunk at a time as one
    (BLOCK_P, KB) x (KB, NS) 3xTF32 product onto the decayed chunk (as the lean fold-only launch), the
    chunk read again (an L2 hit): the whole-tile fold's registers would cut the occupancy of every
    program, flush or not."""
    KB: tl.constexpr = 16 if HB < 16 else HB
    jk = tl.arange(0, KB)
    jkm = jk < hc
    krows = (o + jk) % R
    dtk = tl.load(rdt_ptr + xrow0 + krows, mask=jkm, other=0.0)
    fk = dtk * tl.exp(tl.minimum(lam_h - tl.cumsum(dtk, axis=0) * A, 0.0))  # fold coefficients
    xf = tl.load(rx_ptr + (xrow0 + krows)[None, :] * P + p[:, None], mask=jkm[None, :],
                 other=0.0).to(tl.float32) * fk[None, :]  # (BLOCK_P, KB)
    FNS: tl.constexpr = 16 if NS > 16 else NS  # narrow chunks: few registers live in the fold
    fold_chunks(state_ptr, rB_ptr, xf, tl.exp(lam_h), krows, jkm, p, sbase, Brow0, seed_mix, N, FNS,
                STATE_DTYPE, MAXV)


def launch_mono(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                state_indices, window, dt_softplus, rand_seed, y, block_p: int, num_warps: int,
                order: bool = False) -> None:
    """One launch, grid (P / block_p, H, b) (2b with `order`: the flush rows' programs first,
    `_ordered_row`); needs whole tiles (`replay_stream.stream_supported`) of >= 16 rows (the fold's
    tensor-core product)."""
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G, R = B.shape[2], ring_x.shape[2]
    if not stream_supported(P, N, block_p) or block_p < 16:
        raise ValueError(f"route Mono needs block_p >= 16 dividing P and N a multiple of 32 (P={P}, N={N})")
    sdt = tl_dtype(state.dtype)
    _mono_kernel[(P // block_p, H, b * (1 + order))](
        x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed, state_indices, y,
        device_seed(rand_seed, state.device), int(window), *x.stride()[:3], *dt.stride(), *B.stride()[:3],
        *C.stride()[:3],
        *y.stride()[:3], H, G, R,
        Q=q, QB=triton.next_power_of_2(q), HB=triton.next_power_of_2(int(window)), P=P, N=N, BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(N), NS=min(N, 32), DT_SOFTPLUS=bool(dt_softplus), STATE_DTYPE=sdt,
        MAXV=max_finite(sdt), ORDER=bool(order), num_warps=num_warps,
    )
