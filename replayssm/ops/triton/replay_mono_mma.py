"""ReplaySSM forward step in one launch with tensor-core products (route `MonoMMA`), for small
verify steps.

Route `Mono` (replay_mono.py) works a token at a time on the CUDA cores, whose per-token reductions
over N cost many registers and shuffles at several tokens. Here the same program (row, head, P tile)
pads the step's tokens to QB >= 16 rows and forms everything as products:

    C·Bᵀ           (QB, N) x (N, HB)   and (QB, N) x (N, QB): the coefficient weights
                   w_tj = Δ_j e^{Λ_t - Λ_j} C_t·B_j (history j) and w_tk (this step's k <= t);
    y              e^{Λ_t} C S0ᵀ + w_h x_h + w_n x_n + D x_t;

the three products over N in one pass of NS-column chunks, the state tile never held whole, with
fp32 accuracy (`tf32.dot_split`: one TF32 pass for two 16-bit operands, two with one fp32), or one
pass each where y is 16-bit (`tf32.dot_out`: the products reach only y). Appends and the flush fold
are replay_mono.py's. With JOIN a flush row goes through `_joined_pass` instead: the fold first and
the outputs from the folded state, in one pass over the tile, JOIN_ROWS rows at a time. With SPLIT
(and ORDER, JOIN) a flush row's tile is worked by SPLIT programs of BLOCK_P / SPLIT rows each,
dispatched before the other rows' (`_split_row`): where the grid is about one wave the flush
programs end the step, and split they end it sooner.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.replay_mono import _appends, _decays, _fold, _ordered_row, _row_head
from replayssm.ops.triton.replay_stream import regs, stream_supported
from replayssm.ops.triton.rounding import device_seed, load_seed_mix, max_finite, stochastic_round, tl_dtype
from replayssm.ops.triton.tf32 import dot_out, dot_split

JOIN_ROWS = 32  # rows of a joined flush tile per pass of `_joined_pass`


@triton.jit
def _mono_mma_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, rx_ptr, rB_ptr, rdt_ptr,
    ring_start_ptr, committed_ptr, idx_ptr, y_ptr, seed_ptr, window,
    sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, NS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr, OUT16: tl.constexpr, ORDER: tl.constexpr,
    JOIN: tl.constexpr, FP: tl.constexpr, SPLIT: tl.constexpr,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    if SPLIT > 1:
        i, mine, part = _split_row(idx_ptr, committed_ptr, window, Q, SPLIT)
    else:
        i, mine = _ordered_row(idx_ptr, committed_ptr, window, Q, ORDER)
        part = 0
    if not mine:
        return
    s, valid, s64, hc, o, hpg, g = _row_head(idx_ptr, committed_ptr, ring_start_ptr, i, h, H, G)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    sbase = (s64 * H + h) * (P * N)
    X16: tl.constexpr = x_ptr.dtype.element_ty != tl.float32  # activations (and ring rows) 16-bit
    RING16: tl.constexpr = rB_ptr.dtype.element_ty != tl.float32

    n = tl.arange(0, BLOCK_N)
    nm = n < N
    j = tl.arange(0, HB)
    jm = j < hc
    t = tl.arange(0, QB)
    tm = t < Q
    rows = (o + j) % R
    Brow0 = s64 * G * R + g * R
    xrow0 = s64 * H * R + h * R
    A, dth, cumh, lam_h, dtn, cumn = _decays(A_ptr, rdt_ptr, dt_ptr, dt_bias_ptr, xrow0 + rows, jm,
                                             i * sdt_b + t * sdt_t + h * sdt_h, tm, h, DT_SOFTPLUS)

    flush = valid & (hc + Q > window)
    if flush & JOIN:
        FB: tl.constexpr = BLOCK_P // SPLIT  # each of a flush tile's SPLIT programs works FB of its rows
        _joined_pass(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, rx_ptr, rB_ptr,
                     rdt_ptr, y_ptr, seed_mix, i, h, g, hc, o, pid_p * BLOCK_P + part * FB, sbase, xrow0,
                     Brow0, R, sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g,
                     sy_b, sy_t, sy_h,
                     Q, QB, HB, P, N, FB, FP, NS, DT_SOFTPLUS, STATE_DTYPE, MAXV, OUT16)
        tma = tm & ((t * 0 + part) == 0) if SPLIT > 1 else tm  # the first of the SPLIT programs appends
        xn_raw = tl.load(x_ptr + i * sx_b + t[:, None] * sx_t + h * sx_h + p[None, :], mask=tma[:, None],
                         other=0.0)
    else:
        tma = tm
        # One pass over N in NS-column chunks (no (rows, N) tile live): C·B of the history and of this
        # step, and C S0ᵀ (the state tile read as (NS, BLOCK_P) pieces).
        cb_h = tl.zeros((QB, HB), dtype=tl.float32)
        cb_n = tl.zeros((QB, QB), dtype=tl.float32)
        acc = tl.zeros((QB, BLOCK_P), dtype=tl.float32)
        for c in range(N // NS):
            ncs = c * NS + tl.arange(0, NS)
            Cc = tl.load(C_ptr + i * sC_b + t[:, None] * sC_t + g * sC_g + ncs[None, :], mask=tm[:, None],
                         other=0.0).to(tl.float32)  # (QB, NS)
            Bhc = tl.load(rB_ptr + (Brow0 + rows)[None, :] * N + ncs[:, None], mask=jm[None, :],
                          other=0.0).to(tl.float32)  # (NS, HB)
            Bnc = tl.load(B_ptr + i * sB_b + t[None, :] * sB_t + g * sB_g + ncs[:, None], mask=tm[None, :],
                          other=0.0).to(tl.float32)  # (NS, QB)
            S0t = tl.load(state_ptr + sbase + p[None, :] * N + ncs[:, None]).to(tl.float32)  # (NS, BLOCK_P)
            cb_h = dot_out(Cc, Bhc, cb_h, X16, RING16, OUT16)
            cb_n = dot_out(Cc, Bnc, cb_n, X16, X16, OUT16)
            acc = dot_out(Cc, S0t, acc, X16, STATE_DTYPE != tl.float32, OUT16)
        # zero past hc: Δ = 0
        wh = dth[None, :] * tl.exp(tl.minimum(cumn[:, None] - cumh[None, :], 0.0)) * cb_h
        wn = dtn[None, :] * tl.exp(tl.minimum(cumn[:, None] - cumn[None, :], 0.0)) * cb_n
        wn = tl.where(t[:, None] >= t[None, :], wn, 0.0)  # causal: token k <= t
        acc = tl.exp(cumn)[:, None] * acc
        xh = tl.load(rx_ptr + (xrow0 + rows)[:, None] * P + p[None, :], mask=jm[:, None],
                     other=0.0).to(tl.float32)  # (HB, BLOCK_P)
        xrows = x_ptr + i * sx_b + t[:, None] * sx_t + h * sx_h + p[None, :]
        xn_raw = tl.load(xrows, mask=tm[:, None], other=0.0)
        xn = xn_raw.to(tl.float32)
        acc = dot_out(wh, xh, acc, False, RING16, OUT16)
        acc = dot_out(wn, xn, acc, False, X16, OUT16)
        acc += tl.load(D_ptr + h) * xn
        acc = tl.where(valid, acc, 0.0)
        tl.store(y_ptr + i * sy_b + t[:, None] * sy_t + h * sy_h + p[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=tm[:, None])

    Bn_raw = tl.load(B_ptr + i * sB_b + t[:, None] * sB_t + g * sB_g + n[None, :],
                     mask=tm[:, None] & nm[None, :], other=0.0)  # read again for the append (an L1/L2 hit)
    _appends(rx_ptr, rB_ptr, rdt_ptr, xn_raw, dtn, Bn_raw, s, o, hc, t, tma, p, n, nm, pid_p, h, hpg,
             xrow0, Brow0, P, N, R)
    if flush & (not JOIN):
        _fold(state_ptr, rx_ptr, rB_ptr, rdt_ptr, A, lam_h, o, hc, p, sbase, xrow0, Brow0, seed_mix,
              P, N, R, HB, NS, STATE_DTYPE, MAXV)


@triton.jit
def _split_row(idx_ptr, committed_ptr, window, Q: tl.constexpr, SPLIT: tl.constexpr):
    """`replay_mono._ordered_row` for split flush tiles: a grid of (SPLIT + 1) b rows, SPLIT parts of the
    flush rows first (program part k of a flush row works the k-th SPLIT-th of its tile's rows), then
    the others. (row, whether this program has work, part)."""
    k = tl.program_id(2)
    b = tl.num_programs(2) // (SPLIT + 1)
    first = k < b * SPLIT
    i = tl.where(first, k % b, k - b * SPLIT)
    s = tl.load(idx_ptr + i)
    flush = (s >= 0) & (tl.load(committed_ptr + tl.maximum(s, 0).to(tl.int64)) + Q > window)
    return i, flush == first, tl.where(first, k // b, 0)


@triton.jit
def _joined_pass(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, rx_ptr, rB_ptr, rdt_ptr,
                 y_ptr, seed_mix, i, h, g, hc, o, p0, sbase, xrow0, Brow0, R,
                 sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h,
                 Q: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                 BLOCK_P: tl.constexpr, FP: tl.constexpr, FNS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                 STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr, OUT16: tl.constexpr):
    """A flush row's outputs and fold in ONE pass over its state tile (JOIN): the fold first, the
    outputs from the folded state. With S_h = e^{Λ_h} S0 + Σ_j f_j x_j B_jᵀ (the history folded),

        y_t = e^{Λ_t - Λ_h} C_t S_hᵀ + Σ_{k<=t} w_tk x_k + D x_t,

    equal to the outputs from S0 and the history (w_tj = e^{Λ_t - Λ_h} f_j C_t·B_j). Each (FNS, FP) chunk of
    the tile is read once, folded by one tensor-core product with the history (`dot_split`: fp32
    accuracy), written (rounded for 16-bit pools) and, unrounded, multiplied into the outputs; the
    BLOCK_P rows go FP at a time through one flat loop, so the loop's loads pipeline across the
    sub-tiles and the chunks stay small. The program's ring appends are its caller's. QB, KB >= 16:
    tokens and history padded for the products. The decays are formed here again from the ring's Δ
    and the step's dt (the caller holds them too)."""
    X16: tl.constexpr = x_ptr.dtype.element_ty != tl.float32
    RING16: tl.constexpr = rB_ptr.dtype.element_ty != tl.float32
    j = tl.arange(0, KB)
    jm = j < hc
    rows = (o + j) % R
    t = tl.arange(0, QB)
    tm = t < Q
    A, dth, cumh, lam_h, dtn, cumn = _decays(A_ptr, rdt_ptr, dt_ptr, dt_bias_ptr, xrow0 + rows, jm,
                                             i * sdt_b + t * sdt_t + h * sdt_h, tm, h, DT_SOFTPLUS)
    cb_n = tl.zeros((QB, QB), dtype=tl.float32)  # C·B of this step's tokens (the history's is folded)
    for c in range(N // FNS):
        ncs = c * FNS + tl.arange(0, FNS)
        Cc = tl.load(C_ptr + i * sC_b + t[:, None] * sC_t + g * sC_g + ncs[None, :], mask=tm[:, None],
                     other=0.0).to(tl.float32)  # (QB, FNS)
        Bnc = tl.load(B_ptr + i * sB_b + t[None, :] * sB_t + g * sB_g + ncs[:, None], mask=tm[None, :],
                      other=0.0).to(tl.float32)  # (FNS, QB)
        cb_n = dot_out(Cc, Bnc, cb_n, X16, X16, OUT16)
    rel = cumn - lam_h  # Λ of this step's tokens from the folded state
    wn = dtn[None, :] * tl.exp(tl.minimum(rel[:, None] - rel[None, :], 0.0)) * cb_n
    wn = tl.where(t[:, None] >= t[None, :], wn, 0.0)  # causal: token k <= t
    er = tl.exp(rel)
    fk = dth * tl.exp(tl.minimum(lam_h - cumh, 0.0))  # fold coefficients; zero past h_c (Δ masked to 0)
    decay = tl.exp(lam_h)
    Dh = tl.load(D_ptr + h)
    NCF: tl.constexpr = N // FNS
    acc = tl.zeros((QB, FP), dtype=tl.float32)
    for k in range((BLOCK_P // FP) * NCF):
        c = k % NCF
        ps = p0 + (k // NCF) * FP + tl.arange(0, FP)
        ncs = c * FNS + tl.arange(0, FNS)
        xf = tl.load(rx_ptr + (xrow0 + rows)[:, None] * P + ps[None, :], mask=jm[:, None],
                     other=0.0).to(tl.float32) * fk[:, None]  # (KB, FP)
        Bhc = tl.load(rB_ptr + (Brow0 + rows)[None, :] * N + ncs[:, None], mask=jm[None, :],
                      other=0.0).to(tl.float32)  # (FNS, KB)
        at = sbase + ps[None, :] * N + ncs[:, None]  # (FNS, FP): the chunk, transposed
        S = dot_split(Bhc, xf, tl.load(state_ptr + at).to(tl.float32) * decay, RING16, False)
        tl.store(state_ptr + at, stochastic_round(S, at, seed_mix, STATE_DTYPE, MAXV))
        Cc = tl.load(C_ptr + i * sC_b + t[:, None] * sC_t + g * sC_g + ncs[None, :], mask=tm[:, None],
                     other=0.0).to(tl.float32)  # (QB, FNS)
        acc = dot_out(Cc, S, acc, X16, False, OUT16)
        # The FP rows' outputs once their last chunk is in; the store masked (not branched), so the
        # loop stays one straight body that Triton can pipeline.
        xs = tl.load(x_ptr + i * sx_b + t[:, None] * sx_t + h * sx_h + ps[None, :], mask=tm[:, None],
                     other=0.0).to(tl.float32)  # (QB, FP)
        yv = dot_out(wn, xs, er[:, None] * acc + Dh * xs, False, X16, OUT16)
        last = (t * 0 + c) == NCF - 1  # as a tensor: a scalar bool in a mask trips the interpreter
        tl.store(y_ptr + i * sy_b + t[:, None] * sy_t + h * sy_h + ps[None, :], yv.to(y_ptr.dtype.element_ty),
                 mask=(tm & last)[:, None])
        acc = tl.where(last[:, None], 0.0, acc)


def launch_mono_mma(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                    state_indices, window, dt_softplus, rand_seed, y, block_p: int, num_warps: int,
                    order: bool = False, join: bool = False, split: int = 1, maxnreg: int = 0) -> None:
    """One launch, grid (P / block_p, H, b), as `replay_mono.launch_mono` (same tile requirements,
    `order` as there). join: flush rows through `_joined_pass`, JOIN_ROWS rows at a time. split (with
    order and join): a flush row's tile in that many programs, grid (P / block_p, H, (split + 1) b).
    maxnreg: a register cap per thread (0: none)."""
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G, R = B.shape[2], ring_x.shape[2]
    if not stream_supported(P, N, block_p) or block_p < 16 or N < 16:
        raise ValueError(f"route MonoMMA needs block_p >= 16 dividing P and N >= 16, a multiple of 32 "
                         f"(P={P}, N={N})")
    assert split == 1 or (order and join and (block_p // split) % JOIN_ROWS == 0)
    sdt = tl_dtype(state.dtype)
    _mono_mma_kernel[(P // block_p, H, b * (split + 1 if split > 1 else 1 + order))](
        x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed, state_indices, y,
        device_seed(rand_seed, state.device), int(window), *x.stride()[:3], *dt.stride(), *B.stride()[:3],
        *C.stride()[:3],
        *y.stride()[:3], H, G, R,
        Q=q, QB=max(16, triton.next_power_of_2(q)), HB=max(16, triton.next_power_of_2(int(window))), P=P, N=N,
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N), NS=min(N, 32), DT_SOFTPLUS=bool(dt_softplus),
        STATE_DTYPE=sdt, MAXV=max_finite(sdt), OUT16=y.dtype != torch.float32,
        ORDER=bool(order), JOIN=bool(join), FP=JOIN_ROWS if join else 16, SPLIT=split, num_warps=num_warps,
        **regs(maxnreg),
    )  # fmt: skip
