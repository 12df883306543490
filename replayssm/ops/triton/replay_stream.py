"""ReplaySSM forward step, row-streaming output launch (route "stream").

Same weights launch and arithmetic as `replay_step.py`; the output launch differs in shape. The
grid-per-tile launch gives every program one 16 KiB (P tile, head) piece of the state behind a
chain of dependent loads (slot index, then cursor, then ring rows), so each program waits out
two or three memory latencies for little data. Here one program takes ITEMS consecutive
(head, P tile) pieces of ONE row: the slot, cursor and flush decision are loaded once, the
pieces are contiguous in the slot's state, and the loop over them is software-pipelined
(`tl.range(num_stages=...)`), so the next piece's loads are in flight while this one reduces.
A row flushes as a whole, so flush rows take a separate (unpipelined) loop that folds each
piece in registers and writes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.replay_step import _weights_kernel
from replayssm.ops.triton.rounding import max_finite, seed_mix, stochastic_round, tl_dtype

FLUSH_PROGRAMS_PER_SM = 4


@triton.jit
def _piece(
    k, first, i, s64, valid, hc, o, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr, w_ptr, sc_ptr,
    seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, NS: tl.constexpr, FOLD: tl.constexpr, STATE_DTYPE: tl.constexpr,
    MAXV: tl.constexpr,
):
    # One (head, P tile) piece of row i: outputs of its Q tokens, x appended to the ring, and
    # (FOLD) the history folded into the tile and written back.
    NPT: tl.constexpr = P // BLOCK_P
    NC: tl.constexpr = N // NS
    w = first + k
    h = w // NPT
    p = (w % NPT) * BLOCK_P + tl.arange(0, BLOCK_P)
    g = h // (H // G)
    ncol = tl.arange(0, NC)[:, None] * NS + tl.arange(0, NS)[None, :]  # (NC, NS), as replay_step
    tile = p[None, :, None] * N + ncol[:, None, :]
    sbase = (s64 * H + h) * (P * N)
    S0 = tl.load(state_ptr + sbase + tile).to(tl.float32)  # padding rows read slot 0, zeroed below
    xrow0 = s64 * H * R + h * R
    j = tl.arange(0, HB)
    jm = j < hc
    xh = tl.load(rx_ptr + (xrow0 + (o + j) % R)[:, None] * P + p[None, :], mask=jm[:, None],
                 other=0.0).to(tl.float32)  # (HB, BLOCK_P)
    kk = tl.arange(0, QB)
    km = kk < Q
    xrows = x_ptr + i * sx_b + kk[:, None] * sx_t + h * sx_h + p[None, :]
    xn_raw = tl.load(xrows, mask=km[:, None], other=0.0)
    xn = xn_raw.to(tl.float32)
    JB: tl.constexpr = HB + QB
    wbase = (i.to(tl.int64) * H + h) * ((Q + 1) * JB)
    scbase = (i.to(tl.int64) * H + h) * (Q + 1)
    Dh = tl.load(D_ptr + h)
    for t in tl.static_range(Q):
        Ct = tl.load(C_ptr + i * sC_b + t * sC_t + g * sC_g + ncol).to(tl.float32)
        yt = tl.load(sc_ptr + scbase + t) * tl.sum(tl.sum(S0 * Ct[:, None, :], axis=0), axis=1)
        wh = tl.load(w_ptr + wbase + t * JB + j, mask=jm, other=0.0)
        wn = tl.load(w_ptr + wbase + t * JB + HB + kk, mask=km, other=0.0)
        yt += tl.sum(wh[:, None] * xh, axis=0) + tl.sum(wn[:, None] * xn, axis=0)
        xt = tl.load(x_ptr + i * sx_b + t * sx_t + h * sx_h + p).to(tl.float32)
        yt = tl.where(valid, yt + Dh * xt, 0.0)
        tl.store(y_ptr + i * sy_b + t * sy_t + h * sy_h + p, yt.to(y_ptr.dtype.element_ty))
    kv = km & ((kk * 0 + valid.to(tl.int32)) > 0)  # a scalar bool in a mask trips the interpreter
    tl.store(rx_ptr + (xrow0 + (o + hc + kk) % R)[:, None] * P + p[None, :], xn_raw, mask=kv[:, None])
    if FOLD:
        S = S0 * tl.load(sc_ptr + scbase + Q)
        Brow0 = s64 * G * R + g * R
        # Unrolled over the window with masked loads (f = 0 past h_c), so every load issues up
        # front instead of one L2 round trip per history entry.
        for jj in tl.static_range(HB):
            r = (o + jj) % R
            f = tl.load(w_ptr + wbase + Q * JB + jj, mask=jj < hc, other=0.0)
            xj = tl.load(rx_ptr + (xrow0 + r) * P + p, mask=(p * 0 + jj) < hc, other=0.0).to(tl.float32)
            Bj = tl.load(rB_ptr + (Brow0 + r) * N + ncol, mask=(ncol * 0 + jj) < hc, other=0.0).to(tl.float32)
            S += (f * xj)[None, :, None] * Bj[:, None, :]
        tl.store(state_ptr + sbase + tile, stochastic_round(S, sbase + tile, seed_mix, STATE_DTYPE, MAXV))


@triton.jit
def _piece_mma(
    k, first, i, s64, valid, hc, o, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr, w_ptr, sc_ptr,
    seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, NS: tl.constexpr, FOLD: tl.constexpr, STATE_DTYPE: tl.constexpr,
    MAXV: tl.constexpr,
):
    # `_piece` for several tokens: the Q reductions over N become tensor-core products of the
    # (BLOCK_P, NS) column chunks of the tile with C^T (tokens padded to TB >= 16 columns), chunk
    # by chunk so that no warp holds all of C^T. 16-bit C is exact in TF32, so an fp32 tile split
    # into hi + lo TF32 parts gives ~fp32 products (two MMAs); the fold stays plain fp32 on the
    # CUDA cores (no tensor-core rounding reaches a stored state).
    TB: tl.constexpr = 16 if QB < 16 else QB
    JB: tl.constexpr = HB + QB
    NPT: tl.constexpr = P // BLOCK_P
    w = first + k
    h = w // NPT
    p = (w % NPT) * BLOCK_P + tl.arange(0, BLOCK_P)
    g = h // (H // G)
    t = tl.arange(0, TB)
    tm = t < Q
    j = tl.arange(0, HB)
    jm = j < hc
    sbase = (s64 * H + h) * (P * N)
    wbase = (i.to(tl.int64) * H + h) * ((Q + 1) * JB)
    scbase = (i.to(tl.int64) * H + h) * (Q + 1)
    xrow0 = s64 * H * R + h * R
    xh = tl.load(rx_ptr + (xrow0 + (o + j) % R)[None, :] * P + p[:, None], mask=jm[None, :],
                 other=0.0).to(tl.float32)  # (BLOCK_P, HB)
    if FOLD:
        decay = tl.load(sc_ptr + scbase + Q)
        Brow0 = s64 * G * R + g * R
    acc = tl.zeros((BLOCK_P, TB), dtype=tl.float32)
    for c in tl.static_range(N // NS):
        n = c * NS + tl.arange(0, NS)
        tile = p[:, None] * N + n[None, :]
        S0 = tl.load(state_ptr + sbase + tile).to(tl.float32)  # padding rows read slot 0, zeroed below
        Ct = tl.load(C_ptr + i * sC_b + g * sC_g + t[None, :] * sC_t + n[:, None], mask=tm[None, :], other=0.)
        Ct = Ct.to(tl.float32)  # (NS, TB): C^T of this chunk
        if C_ptr.dtype.element_ty == tl.float32:
            acc = tl.dot(S0, Ct, acc, input_precision="tf32x3")
        elif state_ptr.dtype.element_ty == tl.float32:
            hi = (S0.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
            acc = tl.dot(hi, Ct, acc, input_precision="tf32")
            acc = tl.dot(S0 - hi, Ct, acc, input_precision="tf32")
        else:
            acc = tl.dot(S0, Ct, acc, input_precision="tf32")
        if FOLD:
            # Rank-one updates on the CUDA cores, as `_piece` (a dot here spills registers).
            S = S0 * decay
            for jj in tl.static_range(HB):
                r = (o + jj) % R
                f = tl.load(w_ptr + wbase + Q * JB + jj, mask=jj < hc, other=0.0)
                xj = tl.load(rx_ptr + (xrow0 + r) * P + p, mask=(p * 0 + jj) < hc, other=0.0).to(tl.float32)
                Bj = tl.load(rB_ptr + (Brow0 + r) * N + n, mask=(n * 0 + jj) < hc, other=0.0).to(tl.float32)
                S += (f * xj)[:, None] * Bj[None, :]
            tl.store(state_ptr + sbase + tile, stochastic_round(S, sbase + tile, seed_mix, STATE_DTYPE, MAXV))
    acc = acc * tl.load(sc_ptr + scbase + t, mask=tm, other=0.0)[None, :]
    wh = tl.load(w_ptr + wbase + t[None, :] * JB + j[:, None], mask=jm[:, None] & tm[None, :], other=0.0)
    acc = tl.dot(xh, wh, acc, input_precision="tf32x3")
    xrows = x_ptr + i * sx_b + t[None, :] * sx_t + h * sx_h + p[:, None]
    xn_raw = tl.load(xrows, mask=tm[None, :], other=0.0)
    xn = xn_raw.to(tl.float32)  # (BLOCK_P, TB): token k in column k
    wn = tl.load(w_ptr + wbase + t[None, :] * JB + HB + t[:, None], mask=tm[:, None] & tm[None, :], other=0.0)
    acc = tl.dot(xn, wn, acc, input_precision="tf32x3")
    acc = tl.where(valid, acc + tl.load(D_ptr + h) * xn, 0.0)
    tl.store(y_ptr + i * sy_b + t[None, :] * sy_t + h * sy_h + p[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=tm[None, :])
    tv = tm & ((t * 0 + valid.to(tl.int32)) > 0)  # a scalar bool in a mask trips the interpreter
    tl.store(rx_ptr + (xrow0 + (o + hc + t) % R)[None, :] * P + p[:, None], xn_raw, mask=tv[None, :])


@triton.jit
def _any_piece(
    k, first, i, s64, valid, hc, o, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr, w_ptr, sc_ptr,
    seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, NS: tl.constexpr, FOLD: tl.constexpr, MMA: tl.constexpr, STATE_DTYPE: tl.constexpr,
    MAXV: tl.constexpr,
):
    if MMA:
        _piece_mma(k, first, i, s64, valid, hc, o, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr,
                   w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
                   Q, QB, HB, P, N, BLOCK_P, NS, FOLD, STATE_DTYPE, MAXV)
    else:
        _piece(k, first, i, s64, valid, hc, o, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr,
               w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
               Q, QB, HB, P, N, BLOCK_P, NS, FOLD, STATE_DTYPE, MAXV)


@triton.jit
def _stream_kernel(
    x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, ring_start_ptr, committed_ptr, idx_ptr, y_ptr,
    w_ptr, sc_ptr, seed_mix, window, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, NS: tl.constexpr, ITEMS: tl.constexpr, STAGES: tl.constexpr,
    MODE: tl.constexpr, MMA: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    # MODE 0: every row, no fold; 1: non-flush rows only; 2: flush rows only, folded and written;
    # 3: every row, flush rows folded and written.
    # ITEMS divides H * (P / BLOCK_P), so every program stays inside one row.
    w0 = tl.program_id(0) * ITEMS
    per_row = H * (P // BLOCK_P)
    i = w0 // per_row
    first = w0 % per_row
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.where(valid, tl.load(committed_ptr + s64), 0)
    o = tl.load(ring_start_ptr + s64)
    flush = valid & (hc + Q > window)
    do_fold = flush & (MODE >= 2)
    do_plain = ((flush == 0) & (MODE != 2)) | (MODE == 0)
    if do_fold:
        for k in tl.range(0, ITEMS, num_stages=STAGES):
            _any_piece(k, first, i, s64, valid, hc, o, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr,
                       w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
                       Q, QB, HB, P, N, BLOCK_P, NS, True, MMA, STATE_DTYPE, MAXV)
    if do_plain:
        for k in tl.range(0, ITEMS, num_stages=STAGES):
            _any_piece(k, first, i, s64, valid, hc, o, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr,
                       w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
                       Q, QB, HB, P, N, BLOCK_P, NS, False, MMA, STATE_DTYPE, MAXV)


@triton.jit
def _flush_list_kernel(idx_ptr, committed_ptr, list_ptr, count_ptr, b, window, Q: tl.constexpr,
                       BLOCK: tl.constexpr):
    # One program: the rows that flush this step, in row order, and their count.
    base = 0
    for start in range(0, b, BLOCK):
        r = start + tl.arange(0, BLOCK)
        s = tl.load(idx_ptr + r, mask=r < b, other=-1)
        hc = tl.load(committed_ptr + tl.maximum(s, 0), mask=s >= 0, other=0)
        f = ((s >= 0) & (hc + Q > window)).to(tl.int32)
        tl.store(list_ptr + base + tl.cumsum(f, axis=0) - 1, r, mask=f > 0)
        base += tl.sum(f, axis=0)
    tl.store(count_ptr, base)


@triton.jit
def _flush_kernel(
    list_ptr, count_ptr, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, ring_start_ptr, committed_ptr,
    idx_ptr, y_ptr, w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, NS: tl.constexpr, MMA: tl.constexpr, STATE_DTYPE: tl.constexpr,
    MAXV: tl.constexpr,
):
    # Persistent over the pieces of the listed flush rows: a fixed, small grid whatever the batch,
    # so the fold's registers never throttle the launch of programs with nothing to do, and the
    # work of few flush rows still spreads over every SM.
    per_row = H * (P // BLOCK_P)
    for w in range(tl.program_id(0), tl.load(count_ptr) * per_row, tl.num_programs(0)):
        i = tl.load(list_ptr + w // per_row)
        s = tl.load(idx_ptr + i)
        s64 = s.to(tl.int64)
        hc = tl.load(committed_ptr + s64)
        o = tl.load(ring_start_ptr + s64)
        _any_piece(w % per_row, 0, i, s64, s >= 0, hc, o, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr,
                   y_ptr, w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h,
                   H, G, R, Q, QB, HB, P, N, BLOCK_P, NS, True, MMA, STATE_DTYPE, MAXV)


def stream_items(H: int, P: int, block_p: int, items: int) -> int:
    """Pieces per program: the largest power of two <= items that divides a row's piece count."""
    per_row = H * (P // block_p)
    k = 1
    while k * 2 <= items and per_row % (k * 2) == 0:
        k *= 2
    return k


def stream_supported(P: int, N: int, block_p: int) -> bool:
    """The streaming launch has no tail masks: whole tiles over P and N a multiple of 32 (or less)."""
    return P % block_p == 0 and (N <= 32 and N & (N - 1) == 0 or N % 32 == 0)


def launch_stream(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                  state_indices, window, dt_softplus, rand_seed, y, block_p: int, num_warps: int,
                  modes: tuple[int, ...] = (3,), items: int = 8, stages: int = 2) -> None:
    """Weights launch (`replay_step.py`), then one row-streaming output launch per mode.

    modes (3,): flush rows folded in the same launch; (1, 2): non-flush rows, then flush rows in
    their own launch (the fold's registers do not cut the occupancy of the common case); (1, 4):
    non-flush rows, then the flush rows listed on the device and folded by a persistent launch;
    (0,): no fold, the caller folds flush rows afterwards.
    """
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G, R = B.shape[2], ring_x.shape[2]
    assert stream_supported(P, N, block_p)
    QB, HB = triton.next_power_of_2(q), triton.next_power_of_2(int(window))
    w = torch.empty(b, H, q + 1, HB + QB, device=x.device, dtype=torch.float32)
    sc = torch.empty(b, H, q + 1, device=x.device, dtype=torch.float32)
    _weights_kernel[(b, G)](
        dt, A, B, C, dt_bias, ring_B, ring_dt, ring_start, committed, state_indices, w, sc,
        dt.stride(0), dt.stride(1), dt.stride(2), B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2), H, G, R,
        Q=q, QB=QB, HB=HB, HPB=triton.next_power_of_2(H // G), N=N, BLOCK_N=triton.next_power_of_2(N),
        DT_SOFTPLUS=bool(dt_softplus), num_warps=4,
    )
    k = stream_items(H, P, block_p, items)
    sdt = tl_dtype(state.dtype)
    common = (seed_mix(rand_seed), *x.stride()[:3], *C.stride()[:3], *y.stride()[:3], H, G, R)
    # Several tokens take the tensor-core piece (operands need >= 16 rows: BLOCK_P >= 16).
    meta = dict(Q=q, QB=QB, HB=HB, P=P, N=N, BLOCK_P=block_p, NS=min(N, 32), MMA=q > 1 and block_p >= 16,
                STATE_DTYPE=sdt, MAXV=max_finite(sdt), num_warps=num_warps)
    for mode in modes:
        if mode == 4:
            # Flush rows listed on the device, then folded by a persistent launch.
            rows = torch.empty(b, device=x.device, dtype=torch.int32)
            count = torch.empty(1, device=x.device, dtype=torch.int32)
            _flush_list_kernel[(1,)](state_indices, committed, rows, count, b, int(window), Q=q,
                                     BLOCK=min(1024, triton.next_power_of_2(b)), num_warps=4)
            programs = min(b * H * (P // block_p), flush_programs(x.device))
            _flush_kernel[(programs,)](rows, count, x, D, C, state, ring_x, ring_B, ring_start, committed,
                                       state_indices, y, w, sc, *common, **meta)
            continue
        _stream_kernel[(b * H * (P // block_p) // k,)](
            x, D, C, state, ring_x, ring_B, ring_start, committed, state_indices, y, w, sc,
            common[0], int(window), *common[1:], ITEMS=k, STAGES=stages, MODE=mode, **meta,
        )


def flush_programs(device: torch.device) -> int:
    """Programs of the persistent flush launch: a few per SM (4 on the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return FLUSH_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
