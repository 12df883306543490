"""Triton kernels of the chunked SSD scan (twin of `ops/ssd.py`); launched from `ops/triton/ssd.py`.

Each program works on one chunk (or one sequence, or one boundary) of one head and a tile of
BLOCK_P state rows. Chunk positions are padded to BLOCK_L (a power of two >= 16, so tl.dot
takes any chunk size); positions past a chunk's length get Δ = 0, which neither decays nor adds.
Segment sums seg(i, j) = a_{j+1} + ... + a_i are summed from the a_k themselves (masked sums,
never differences of prefix sums), so decays close to 1 keep full fp32 precision as in the
reference; every a_k = Δ_k A is <= 0, so no sum cancels. Products with fp32 operands use 3xTF32
(fp32-level accuracy on tensor cores); only C·B of 16-bit inputs (exact in tf32) runs in one pass.
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
def chunk_delta(idx_ptr, len_ptr, dt_ptr, sdt_t, sdt_h, c, h, L, A, bias,
                BLOCK_L: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """Chunk c, head h: token at each position (int64), live positions, Δ and a = Δ A (0 if not live)."""
    i = tl.arange(0, BLOCK_L)
    live = i < tl.load(len_ptr + c)
    tok = tl.load(idx_ptr + c * L + i, mask=i < L, other=0)
    raw = tl.load(dt_ptr + tok * sdt_t + h * sdt_h, mask=live, other=0.0).to(tl.float32)
    delta = tl.where(live, _softplus(raw + bias, DT_SOFTPLUS), 0.0)
    return tok, live, delta, delta * A


@triton.jit
def state_from_zero(x_ptr, B_ptr, tok, live, delta, a, t, x_off, b_off, sx_t, sB_t, p, n, pm, nm,
                    BLOCK_L: tl.constexpr):
    """Σ_{j<=t} exp(seg(t, j)) Δ_j x_j B_jᵀ over one chunk: (BLOCK_P, BLOCK_N) fp32."""
    k = tl.arange(0, BLOCK_L)
    # seg(t, j) = Σ_{j<k<=t} a_k summed directly (a difference of prefix sums would be off by
    # eps |a_1 + ... + a_t|, large next to a short segment; a reverse scan is avoided on purpose).
    inside = (k[:, None] > k[None, :]) & (k[:, None] <= t)  # [k, j]: a_k belongs to seg(t, j)
    seg = tl.sum(tl.where(inside, a[:, None], 0.0), axis=0)
    w = tl.where(k <= t, tl.exp(seg) * delta, 0.0)
    rows = tok[:, None]
    xs = tl.load(x_ptr + x_off + rows * sx_t + p[None, :], mask=live[:, None] & pm[None, :], other=0.0)
    bs = tl.load(B_ptr + b_off + rows * sB_t + n[None, :], mask=live[:, None] & nm[None, :], other=0.0)
    xw = xs.to(tl.float32) * w[:, None]
    return tl.dot(tl.trans(xw), bs.to(tl.float32), input_precision="tf32x3")


@triton.jit
def chunk_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, dt_bias_ptr, idx_ptr, len_ptr, s_ptr, sum_ptr,
    sx_t, sx_h, sdt_t, sdt_h, sB_t, sB_g, H, HPG, L,
    P: tl.constexpr, N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
):
    """Grid (nc, H, P tiles): the state of chunk c from zero -> s (nc, H, P, N); Σ a -> sum (nc, H)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2)
    tok, live, delta, a = chunk_delta(idx_ptr, len_ptr, dt_ptr, sdt_t, sdt_h, c, h, L, tl.load(A_ptr + h),
                                      tl.load(dt_bias_ptr + h), BLOCK_L, DT_SOFTPLUS)
    if pt == 0:
        tl.store(sum_ptr + c * H + h, tl.sum(a))
    p = pt * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    s = state_from_zero(x_ptr, B_ptr, tok, live, delta, a, BLOCK_L - 1, h * sx_h, (h // HPG) * sB_g,
                        sx_t, sB_t, p, n, pm, nm, BLOCK_L)
    base = (c.to(tl.int64) * H + h) * (P * N)
    tl.store(s_ptr + base + p[:, None] * N + n[None, :], s, mask=pm[:, None] & nm[None, :])


@triton.jit
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
    P: tl.constexpr, N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, F32_DOT: tl.constexpr,
):
    """Grid (nc, H, P tiles): y_i = Σ_{j<=i} (C_i·B_j) exp(seg(i, j)) Δ_j x_j + exp(a_1+..+a_i) C_i s_inᵀ
    + D x_i, written at the chunk's tokens (zeros for a padding sequence); s holds the incoming states."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2)
    g = h // HPG
    tok, live, delta, a = chunk_delta(idx_ptr, len_ptr, dt_ptr, sdt_t, sdt_h, c, h, L, tl.load(A_ptr + h),
                                      tl.load(dt_bias_ptr + h), BLOCK_L, DT_SOFTPLUS)
    i = tl.arange(0, BLOCK_L)
    # seg[i, j] = Σ_{j<k<=i} a_k as a masked cumulative sum down the columns (as `_segsum_exp`).
    seg = tl.cumsum(tl.where(i[:, None] > i[None, :], a[:, None], 0.0), axis=0)
    a_cum = tl.cumsum(a, axis=0)
    p = pt * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    ln = live[:, None] & nm[None, :]
    # Ordered so that few big tiles are live at once: carried term, then C·B, then the scores.
    cs = tl.load(C_ptr + g * sC_g + tok[:, None] * sC_t + n[None, :], mask=ln, other=0.0).to(tl.float32)
    base = (c.to(tl.int64) * H + h) * (P * N)
    s_in = tl.load(s_ptr + base + p[:, None] * N + n[None, :], mask=pm[:, None] & nm[None, :], other=0.0)
    acc = tl.exp(a_cum)[:, None] * tl.dot(cs, tl.trans(s_in), input_precision="tf32x3")
    bs = tl.load(B_ptr + g * sB_g + tok[:, None] * sB_t + n[None, :], mask=ln, other=0.0).to(tl.float32)
    if F32_DOT:
        cb = tl.dot(cs, tl.trans(bs), input_precision="tf32x3")
    else:
        cb = tl.dot(cs, tl.trans(bs), input_precision="tf32")  # 16-bit values are exact in tf32
    scores = tl.where(i[:, None] >= i[None, :], cb * tl.exp(seg) * delta[None, :], 0.0)
    xs = tl.load(x_ptr + h * sx_h + tok[:, None] * sx_t + p[None, :], mask=live[:, None] & pm[None, :],
                 other=0.0).to(tl.float32)
    acc = tl.dot(scores, xs, acc=acc, input_precision="tf32x3")
    acc = acc + tl.load(D_ptr + h) * xs
    keep = (i * 0 + tl.load(valid_ptr + c)) != 0
    acc = tl.where(keep[:, None], acc, 0.0)
    tl.store(y_ptr + h * sy_h + tok[:, None] * sy_t + p[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=live[:, None] & pm[None, :])


@triton.jit
def boundary_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, dt_bias_ptr, idx_ptr, len_ptr, s_ptr, state_ptr,
    bchunk_ptr, boff_ptr, brank_ptr, bflag_ptr, count_ptr, init_ptr, out_ptr,
    sx_t, sx_h, sdt_t, sdt_h, sB_t, sB_g, H, HPG, L,
    P: tl.constexpr, N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
):
    """Grid (m, H, P tiles): out[j] = exp(a_1+..+a_t) s_in[c] + Σ_{r<=t} exp(seg(t, r)) Δ_r x_r B_rᵀ for
    boundary j ending at position t of chunk c; a zero-length boundary is its sequence's initial state."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    tile = p[:, None] * N + n[None, :]
    tmask = pm[:, None] & nm[None, :]
    rank = tl.load(brank_ptr + j)
    if tl.load(bflag_ptr + j) != 0:
        if tl.load(count_ptr + rank) > 0:
            # The state entering the sequence's first chunk (chunk id = rank) is its initial state.
            s = tl.load(s_ptr + (rank * H + h) * (P * N) + tile, mask=tmask, other=0.0)
        else:
            # No chunks: the slot already holds the final state, which is the initial state exactly
            # (a value read from the pool rounds to itself); no slot (-1) means zeros.
            islot = tl.load(init_ptr + rank)
            ibase = (tl.maximum(islot, 0) * H + h) * (P * N)
            s = tl.load(state_ptr + ibase + tile, mask=tmask & ((tile * 0 + islot) >= 0),
                        other=0.0).to(tl.float32)
    else:
        c = tl.load(bchunk_ptr + j)
        t = tl.load(boff_ptr + j)
        tok, live, delta, a = chunk_delta(idx_ptr, len_ptr, dt_ptr, sdt_t, sdt_h, c, h, L, tl.load(A_ptr + h),
                                          tl.load(dt_bias_ptr + h), BLOCK_L, DT_SOFTPLUS)
        decay = tl.exp(tl.sum(tl.where(tl.arange(0, BLOCK_L) <= t, a, 0.0)))
        s_in = tl.load(s_ptr + (c * H + h) * (P * N) + tile, mask=tmask, other=0.0)
        s = decay * s_in + state_from_zero(x_ptr, B_ptr, tok, live, delta, a, t, h * sx_h, (h // HPG) * sB_g,
                                           sx_t, sB_t, p, n, pm, nm, BLOCK_L)
    tl.store(out_ptr + (j.to(tl.int64) * H + h) * (P * N) + tile, s, mask=tmask)
