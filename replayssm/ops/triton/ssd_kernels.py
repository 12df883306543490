"""Triton kernels of the chunked SSD scan (twin of `ops/ssd.py`); launched from `ops/triton/ssd.py`.

Each program works on one chunk (or one sequence) of one head and a tile of
BLOCK_P state rows, walking chunk positions BLOCK_K at a time (a power of two >= 16, so tl.dot
takes any chunk size); positions past a chunk's length get Δ = 0, which neither decays nor adds.
Segment sums seg(i, j) = a_{j+1} + ... + a_i are built from sums of the a_k themselves (masked
sums within a block plus whole-block sums, never differences of prefix sums), so decays close to 1
keep full fp32 precision as in the reference; every a_k = Δ_k A is <= 0, so no sum cancels.
Products with fp32 operands use 3xTF32 (fp32-level accuracy on tensor cores); only C·B of 16-bit
inputs (exact in tf32) runs in one pass.
"""

from __future__ import annotations

import triton
import triton.language as tl

from replayssm.ops.triton.rounding import stochastic_round


@triton.jit
def _softplus(v, DT_SOFTPLUS: tl.constexpr):
    """softplus(v) with identity above 20 (or v itself when off); log1p kept accurate for v << 0."""
    if DT_SOFTPLUS:
        u = tl.exp(tl.minimum(v, 20.0))
        w = 1.0 + u
        # log1p(u) = log(w) * u / (w - 1): the rounding of w cancels (the reference uses log1p).
        lp = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
        v = tl.where(v > 20.0, v, lp)
    return v


@triton.jit
def chunk_delta(idx_ptr, len_ptr, dt_ptr, sdt_t, sdt_h, c, h, L, A, bias, pos, DT_SOFTPLUS: tl.constexpr):
    """Chunk c, head h, positions `pos`: token (int64), live mask, Δ and a = Δ A (both 0 if not live)."""
    live = pos < tl.load(len_ptr + c)
    tok = tl.load(idx_ptr + c * L + pos, mask=pos < L, other=0)
    raw = tl.load(dt_ptr + tok * sdt_t + h * sdt_h, mask=live, other=0.0).to(tl.float32)
    delta = tl.where(live, _softplus(raw + bias, DT_SOFTPLUS), 0.0)
    return tok, live, delta, delta * A


@triton.jit
def state_from_zero(x_ptr, B_ptr, idx_ptr, len_ptr, dt_ptr, sx_t, sB_t, sdt_t, sdt_h, c, h, L, A, bias,
                    t, x_off, b_off, p, n, pm, nm, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK_N: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """(Σ_{j<=t} exp(seg(t, j)) Δ_j x_j B_jᵀ over chunk c, (BLOCK_P, BLOCK_N); Σ_{k<=t} a_k).

    Walks the chunk's positions backwards from t, BLOCK_K at a time, so seg(t, j) = (Σ_{j<k} in j's
    block) + (Σ of the later blocks up to t) adds two sums of same-sign terms: never a difference
    of prefix sums, which would be off by eps |a_1 + ... + a_t|, large next to a short segment.
    """
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    tail = tl.sum(tl.zeros((BLOCK_K,), dtype=tl.float32), axis=0)  # Σ a_k over the blocks done so far
    blocks = t // BLOCK_K + 1
    for b in range(0, blocks):
        pos = (blocks - 1 - b) * BLOCK_K + tl.arange(0, BLOCK_K)
        tok, live, delta, a = chunk_delta(idx_ptr, len_ptr, dt_ptr, sdt_t, sdt_h, c, h, L, A, bias, pos,
                                          DT_SOFTPLUS)
        a = tl.where(pos <= t, a, 0.0)
        own = tl.sum(tl.where(pos[:, None] > pos[None, :], a[:, None], 0.0), axis=0)  # [k, j]: k > j
        w = tl.where(pos <= t, tl.exp(own + tail) * delta, 0.0)
        rows = tok[:, None]
        xs = tl.load(x_ptr + x_off + rows * sx_t + p[None, :], mask=live[:, None] & pm[None, :], other=0.0)
        bs = tl.load(B_ptr + b_off + rows * sB_t + n[None, :], mask=live[:, None] & nm[None, :], other=0.0)
        xw = xs.to(tl.float32) * w[:, None]
        acc = tl.dot(tl.trans(xw), bs.to(tl.float32), acc, input_precision="tf32x3")
        tail += tl.sum(a)
    return acc, tail


@triton.jit
def chunk_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, dt_bias_ptr, idx_ptr, len_ptr, s_ptr, sum_ptr,
    sx_t, sx_h, sdt_t, sdt_h, sB_t, sB_g, H, HPG, L,
    P: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
):
    """Grid (nc, H, P tiles): the state of chunk c from zero -> s (nc, H, P, N); Σ a -> sum (nc, H)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2)
    p = pt * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    s, total = state_from_zero(x_ptr, B_ptr, idx_ptr, len_ptr, dt_ptr, sx_t, sB_t, sdt_t, sdt_h, c, h, L,
                               tl.load(A_ptr + h), tl.load(dt_bias_ptr + h), tl.load(len_ptr + c) - 1,
                               h * sx_h, (h // HPG) * sB_g, p, n, pm, nm, BLOCK_K, BLOCK_P, BLOCK_N,
                               DT_SOFTPLUS)
    if pt == 0:
        tl.store(sum_ptr + c * H + h, total)
    base = (c.to(tl.int64) * H + h) * (P * N)
    tl.store(s_ptr + base + p[:, None] * N + n[None, :], s, mask=pm[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["seed_mix"])
def chunk_pass_kernel(
    s_ptr, sum_ptr, state_ptr, offsets_ptr, count_ptr, init_ptr, final_ptr, seed_mix, H,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    """Grid (n, H, P tiles), sequences in rank order: chunk states from zero in s become the states
    entering each chunk (in place); the final state goes to the sequence's slot, stochastically rounded."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    tile = p[:, None] * N + n[None, :]
    tmask = (p < P)[:, None] & (n < N)[None, :]
    islot = tl.load(init_ptr + r)
    fslot = tl.load(final_ptr + r)
    # Slot checks broadcast as tensors (a scalar bool in a mask trips the interpreter).
    ibase = (tl.maximum(islot, 0) * H + h) * (P * N)
    s = tl.load(state_ptr + ibase + tile, mask=tmask & ((tile * 0 + islot) >= 0), other=0.0).to(tl.float32)
    for k in range(0, tl.load(count_ptr + r)):
        c = tl.load(offsets_ptr + k) + r  # this sequence's chunk at position k (ops/ssd_layout.py)
        base = (c * H + h) * (P * N)
        own = tl.load(s_ptr + base + tile, mask=tmask, other=0.0)
        tl.store(s_ptr + base + tile, s, mask=tmask)
        s = tl.exp(tl.load(sum_ptr + c * H + h)) * s + own
    fbase = (tl.maximum(fslot, 0) * H + h) * (P * N)
    val = stochastic_round(s, fbase + tile, seed_mix, STATE_DTYPE, MAXV)
    tl.store(state_ptr + fbase + tile, val, mask=tmask & ((tile * 0 + fslot) >= 0))


@triton.jit
def chunk_output_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, idx_ptr, len_ptr, valid_ptr, s_ptr, y_ptr,
    sx_t, sx_h, sdt_t, sdt_h, sB_t, sB_g, sC_t, sC_g, sy_t, sy_h, H, HPG, L,
    P: tl.constexpr, N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, NB: tl.constexpr, DT_SOFTPLUS: tl.constexpr, F32_DOT: tl.constexpr,
):
    """Grid (nc, H, P tiles x row blocks): for the BLOCK_K rows i of one block, y_i =
    Σ_{j<=i} (C_i·B_j) exp(seg(i, j)) Δ_j x_j + exp(a_1+..+a_i) C_i s_inᵀ + D x_i, written at the
    chunk's tokens (zeros for a padding sequence); s holds the states entering each chunk."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2) // (BLOCK_L // BLOCK_K)
    i0 = (tl.program_id(2) % (BLOCK_L // BLOCK_K)) * BLOCK_K
    if i0 < tl.load(len_ptr + c):  # row blocks past the chunk's end have nothing to write
        g = h // HPG
        A, bias = tl.load(A_ptr + h), tl.load(dt_bias_ptr + h)
        ri = i0 + tl.arange(0, BLOCK_K)
        tok, live, delta_i, a_i = chunk_delta(idx_ptr, len_ptr, dt_ptr, sdt_t, sdt_h, c, h, L, A, bias, ri,
                                              DT_SOFTPLUS)
        pre_i = tl.cumsum(a_i, axis=0)  # Σ_{i0<=k<=i} a_k
        p = pt * BLOCK_P + tl.arange(0, BLOCK_P)
        pm = p < P
        c_rows = C_ptr + g * sC_g + tok[:, None] * sC_t
        b_off = g * sB_g
        # Products over N go NB columns at a time: no (rows, N) tile is ever live in registers.
        s_rows = s_ptr + (c.to(tl.int64) * H + h) * (P * N) + p[:, None] * N
        carried = tl.zeros((BLOCK_K, BLOCK_P), dtype=tl.float32)
        for n0 in range(0, BLOCK_N, NB):
            n = n0 + tl.arange(0, NB)
            cs = tl.load(c_rows + n[None, :], mask=live[:, None] & (n < N)[None, :], other=0.0).to(tl.float32)
            s_in = tl.load(s_rows + n[None, :], mask=pm[:, None] & (n < N)[None, :], other=0.0)
            carried = tl.dot(cs, tl.trans(s_in), carried, input_precision="tf32x3")
        acc = tl.zeros((BLOCK_K, BLOCK_P), dtype=tl.float32)
        mid = tl.sum(tl.zeros((BLOCK_K,), dtype=tl.float32), axis=0)  # Σ a_k between block j and block i
        for b in range(0, i0 // BLOCK_K):  # the earlier blocks of the chunk, nearest first
            rj = i0 - (b + 1) * BLOCK_K + tl.arange(0, BLOCK_K)
            tj, lj, delta_j, a_j = chunk_delta(idx_ptr, len_ptr, dt_ptr, sdt_t, sdt_h, c, h, L, A, bias, rj,
                                               DT_SOFTPLUS)
            # seg(i, j) = (Σ_{k>j in j's block}) + (Σ between the blocks) + pre_i: three same-sign parts.
            suf_j = tl.sum(tl.where(rj[:, None] > rj[None, :], a_j[:, None], 0.0), axis=0)
            seg = pre_i[:, None] + (mid + suf_j)[None, :]
            acc = _intra(acc, c_rows, live, seg, delta_j, tj, lj, x_ptr, B_ptr, h * sx_h, b_off, sx_t, sB_t,
                         p, pm, N, BLOCK_K, BLOCK_N, NB, F32_DOT)
            mid += tl.sum(a_j)
        acc += tl.exp(mid + pre_i)[:, None] * carried  # mid is now Σ_{k<i0} a_k
        # The diagonal block: seg[i, j] = Σ_{j<k<=i} a_k as a masked cumulative sum down the columns.
        seg = tl.cumsum(tl.where(ri[:, None] > ri[None, :], a_i[:, None], 0.0), axis=0)
        seg = tl.where(ri[:, None] >= ri[None, :], seg, float("-inf"))
        acc = _intra(acc, c_rows, live, seg, delta_i, tok, live, x_ptr, B_ptr, h * sx_h, b_off, sx_t, sB_t, p,
                     pm, N, BLOCK_K, BLOCK_N, NB, F32_DOT)
        xs = tl.load(x_ptr + h * sx_h + tok[:, None] * sx_t + p[None, :], mask=live[:, None] & pm[None, :],
                     other=0.0).to(tl.float32)
        acc = acc + tl.load(D_ptr + h) * xs
        keep = (ri * 0 + tl.load(valid_ptr + c)) != 0
        acc = tl.where(keep[:, None], acc, 0.0)
        tl.store(y_ptr + h * sy_h + tok[:, None] * sy_t + p[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=live[:, None] & pm[None, :])


@triton.jit
def _intra(acc, c_rows, live, seg, delta_j, tj, lj, x_ptr, B_ptr, x_off, b_off, sx_t, sB_t, p, pm, N,
           BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, F32_DOT: tl.constexpr):
    """acc + ((C_i·B_j) exp(seg(i, j)) Δ_j) x_j over one block of columns j (seg = -inf: no term);
    c_rows: pointers to the C rows of the block's outputs i, live: those rows' mask."""
    cb = tl.zeros((BLOCK_K, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, BLOCK_N, NB):
        n = n0 + tl.arange(0, NB)
        cs = tl.load(c_rows + n[None, :], mask=live[:, None] & (n < N)[None, :], other=0.0).to(tl.float32)
        bs = tl.load(B_ptr + b_off + tj[:, None] * sB_t + n[None, :], mask=lj[:, None] & (n < N)[None, :],
                     other=0.0).to(tl.float32)
        if F32_DOT:
            cb = tl.dot(cs, tl.trans(bs), cb, input_precision="tf32x3")
        else:
            cb = tl.dot(cs, tl.trans(bs), cb, input_precision="tf32")  # 16-bit values are exact in tf32
    scores = cb * tl.exp(seg) * delta_j[None, :]
    xs = tl.load(x_ptr + x_off + tj[:, None] * sx_t + p[None, :], mask=lj[:, None] & pm[None, :],
                 other=0.0).to(tl.float32)
    return tl.dot(scores, xs, acc, input_precision="tf32x3")
