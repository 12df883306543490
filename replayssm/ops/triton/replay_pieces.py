"""One (head, P tile) piece of a several-token ReplaySSM forward row, as `@triton.jit` helpers of
`replay_stream.py`.

`_piece_mma` takes the step's tokens as tensor-core products (whole pieces, or a piece in column parts
carried over loop iterations) and computes
    y_t = e^{Λ_t} (S0 C_t) + Σ_j w_tj x_j + Σ_k w_tk x_k + D x_t
from the weights launch's scratch (`replay_step.py`), appends the new x rows to the ring and, with
FOLD, folds the history into the tile and writes it: S0 <- e^{Λ_h} S0 + Σ_j f_j x_j B_jᵀ.
"""

from __future__ import annotations

import triton
import triton.language as tl

from replayssm.ops.triton.rounding import stochastic_round_pairs
from replayssm.ops.triton.tf32 import dot_bf16_split, dot_split


@triton.jit
def _piece_mma(
    k, first, i, s64, valid, hc, o, acc, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr, w_ptr,
    sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, NS: tl.constexpr, FOLD: tl.constexpr, STATE_DTYPE: tl.constexpr,
    MAXV: tl.constexpr, MMA: tl.constexpr, SPLIT: tl.constexpr, Cs=0, CH: tl.constexpr = False,
):
    # The Q outputs of a piece as tensor-core products of the (BLOCK_P, NS) column chunks of the tile
    # with C^T (tokens padded to TB >= 16 columns), chunk by chunk so that no warp holds all of C^T.
    # 16-bit C is exact in TF32, so an fp32 tile split into hi + lo TF32 parts gives ~fp32 products
    # (two MMAs, `tf32.dot_split`); MMA == 2: the tile as bf16 hi + lo against bf16 C (16-bit y).
    # FOLD (the flush launch's pieces): the fold is one fp32-accurate product per column chunk
    # (`dot_split`, ~2^-22 of each term).
    # SPLIT > 1 (the flush launch's column parts): one of SPLIT column parts of piece k // SPLIT per
    # call, acc carrying the state product between the parts (returned; SPLIT = 1 ignores it):
    # a loop over parts copies 1 / SPLIT of a tile per iteration, so the pipeline can keep the next
    # part's copies in flight while this one computes, within the shared memory one tile took. The
    # last part adds the ring terms and writes; FOLD parts fold and write their own columns.
    # CH (whole pieces only): C^T comes in Cs, its column chunks loaded once per program by the
    # caller (`c_chunks`: every piece of the program in one group), not once per piece.
    TB: tl.constexpr = 16 if QB < 16 else QB
    JB: tl.constexpr = HB + QB
    NPT: tl.constexpr = P // BLOCK_P
    CPP: tl.constexpr = N // NS // SPLIT  # column chunks per part
    if SPLIT == 1:
        w = first + k
        part = 0
    else:
        w = first + k // SPLIT
        part = k % SPLIT
    h = w // NPT
    p = (w % NPT) * BLOCK_P + tl.arange(0, BLOCK_P)
    g = h // (H // G)
    t = tl.arange(0, TB)
    sbase = (s64 * H + h) * (P * N)
    wbase = (i.to(tl.int64) * H + h) * ((Q + 1) * JB)
    scbase = (i.to(tl.int64) * H + h) * (Q + 1)
    xrow0 = s64 * H * R + h * R
    if SPLIT == 1:
        xh = _history_x(rx_ptr, xrow0, o, hc, p, R, P, HB)
    if FOLD:
        # The fold as one (BLOCK_P, KB) x (KB, NS) product per column chunk onto the decayed chunk:
        # xf = history x scaled by the fold coefficients, the chunk's history B rows.
        KB: tl.constexpr = 16 if HB < 16 else HB
        decay = tl.load(sc_ptr + scbase + Q)
        Brow0 = s64 * G * R + g * R
        jf = tl.arange(0, KB)
        jfm = jf < hc
        frows = (o + jf) % R
        xf = tl.load(rx_ptr + (xrow0 + frows)[None, :] * P + p[:, None], mask=jfm[None, :], other=0.0)
        xf = xf.to(tl.float32) * tl.load(w_ptr + wbase + Q * JB + jf, mask=jfm, other=0.0)[None, :]
    if SPLIT == 1:
        acc = tl.zeros((BLOCK_P, TB), dtype=tl.float32)
    for c in tl.static_range(CPP):
        n = (part * CPP + c) * NS + tl.arange(0, NS)
        tile = p[:, None] * N + n[None, :]
        S0 = tl.load(state_ptr + sbase + tile).to(tl.float32)  # padding rows read slot 0, zeroed below
        if CH:
            Ct = Cs[c]
        else:
            Ct = _c_chunk(C_ptr, i, g, n, t, Q, sC_b, sC_t, sC_g)
        if MMA == 2:
            # The tile as bf16 hi + lo against bf16 C (the launch checks the dtypes: 16-bit y).
            acc = dot_bf16_split(S0, Ct, acc)
        else:
            Ct = Ct.to(tl.float32)  # (NS, TB): C^T of this chunk
            acc = dot_split(S0, Ct, acc, STATE_DTYPE != tl.float32, C_ptr.dtype.element_ty != tl.float32)
        if FOLD:
            Bc = tl.load(rB_ptr + (Brow0 + frows)[:, None] * N + n[None, :], mask=jfm[:, None], other=0.0)
            S = dot_split(xf, Bc.to(tl.float32), S0 * decay, False, rB_ptr.dtype.element_ty != tl.float32)
            val = stochastic_round_pairs(S, sbase + tile, seed_mix, STATE_DTYPE, MAXV, N)
            tl.store(state_ptr + sbase + tile, val)
    if SPLIT == 1:
        _piece_outputs(acc, xh, i, h, p, t, valid, hc, o, xrow0, wbase, scbase, x_ptr, D_ptr, rx_ptr, y_ptr,
                       w_ptr, sc_ptr, sx_b, sx_t, sx_h, sy_b, sy_t, sy_h, R, Q, QB, HB, P)
    elif part == SPLIT - 1:
        # Its small loads sit in this branch, outside the pipeline (the next part's copies are in
        # flight here): hoisted, the pipeline would stage them too, at more registers and shared
        # memory per program.
        xh = _history_x(rx_ptr, xrow0, o, hc, p, R, P, HB)
        _piece_outputs(acc, xh, i, h, p, t, valid, hc, o, xrow0, wbase, scbase, x_ptr, D_ptr, rx_ptr, y_ptr,
                       w_ptr, sc_ptr, sx_b, sx_t, sx_h, sy_b, sy_t, sy_h, R, Q, QB, HB, P)
        acc = tl.zeros((BLOCK_P, TB), dtype=tl.float32)
    return acc


@triton.jit
def c_chunks(C_ptr, i, g, sC_b, sC_t, sC_g, Q: tl.constexpr, QB: tl.constexpr, N: tl.constexpr,
             NS: tl.constexpr):
    """Row i's C^T for group g as a tuple of N / NS (NS, TB) column chunks (tokens padded to TB >= 16
    columns, zero past Q), as `_piece_mma` loads them per chunk."""
    TB: tl.constexpr = 16 if QB < 16 else QB
    t = tl.arange(0, TB)
    Cs = ()
    for c in tl.static_range(N // NS):
        Cs = Cs + (_c_chunk(C_ptr, i, g, c * NS + tl.arange(0, NS), t, Q, sC_b, sC_t, sC_g),)
    return Cs


@triton.jit
def _c_chunk(C_ptr, i, g, n, t, Q: tl.constexpr, sC_b, sC_t, sC_g):
    """C^T of row i, group g, columns n as (len(n), len(t)), zero in token columns t >= Q."""
    return tl.load(C_ptr + i * sC_b + g * sC_g + t[None, :] * sC_t + n[:, None], mask=(t < Q)[None, :],
                   other=0.)


@triton.jit
def _history_x(rx_ptr, xrow0, o, hc, p, R, P: tl.constexpr, HB: tl.constexpr):
    """The h_c history x rows of a piece as (BLOCK_P, HB) fp32 (zero past h_c)."""
    j = tl.arange(0, HB)
    return tl.load(rx_ptr + (xrow0 + (o + j) % R)[None, :] * P + p[:, None], mask=(j < hc)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _piece_outputs(
    acc, xh, i, h, p, t, valid, hc, o, xrow0, wbase, scbase, x_ptr, D_ptr, rx_ptr, y_ptr, w_ptr, sc_ptr,
    sx_b, sx_t, sx_h, sy_b, sy_t, sy_h, R, Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr,
    P: tl.constexpr,
):
    """y_t = e^{Λ_t} (S0 C_t) + Σ_j w_tj x_j + Σ_k w_tk x_k + D x_t from the state products acc
    (BLOCK_P, TB), written as y; the new x rows appended to the ring."""
    JB: tl.constexpr = HB + QB
    tm = t < Q
    j = tl.arange(0, HB)
    jm = j < hc
    acc = acc * tl.load(sc_ptr + scbase + t, mask=tm, other=0.0)[None, :]
    wh = tl.load(w_ptr + wbase + t[None, :] * JB + j[:, None], mask=jm[:, None] & tm[None, :], other=0.0)
    acc = dot_split(xh, wh, acc, rx_ptr.dtype.element_ty != tl.float32, False)
    xrows = x_ptr + i * sx_b + t[None, :] * sx_t + h * sx_h + p[:, None]
    xn_raw = tl.load(xrows, mask=tm[None, :], other=0.0)
    xn = xn_raw.to(tl.float32)  # (BLOCK_P, TB): token k in column k
    wn = tl.load(w_ptr + wbase + t[None, :] * JB + HB + t[:, None], mask=tm[:, None] & tm[None, :], other=0.0)
    acc = dot_split(xn, wn, acc, x_ptr.dtype.element_ty != tl.float32, False)
    acc = tl.where(valid, acc + tl.load(D_ptr + h) * xn, 0.0)
    tl.store(y_ptr + i * sy_b + t[None, :] * sy_t + h * sy_h + p[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=tm[None, :])
    tv = tm & ((t * 0 + valid.to(tl.int32)) > 0)  # a scalar bool in a mask trips the interpreter
    tl.store(rx_ptr + (xrow0 + (o + hc + t) % R)[None, :] * P + p[:, None], xn_raw, mask=tv[None, :])
