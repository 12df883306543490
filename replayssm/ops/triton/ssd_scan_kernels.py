"""Triton kernels of the chunked SSD scan (twin of `ops/ssd.py`); launched from `ops/triton/ssd.py`.

Each program works on one chunk of one head and a tile of state rows, walking chunk positions
BLOCK_K at a time (a power of two >= 16, so tl.dot takes any chunk size); positions past a chunk's
length get Δ = 0, which neither decays nor adds. Segment sums seg(i, j) = a_{j+1} + ... + a_i are
built from sums of the a_k themselves (masked sums within a block plus whole-block sums, never
differences of prefix sums), so decays close to 1 keep full fp32 precision as in the reference;
every a_k = Δ_k A is <= 0, so no sum cancels. The boundary walk (ops/triton/ssd_boundary.py) follows
the same rules with the helpers here. Organised against memory latency:

- A chunk's live positions are consecutive tokens of the packed input (ops/ssd_layout.py), so the
  token at position i of chunk c is start[c] + i, start[c] = idx[c, 0] read once per program.
  Every address in a loop is affine in the loop counter: no dependent index load before Δ and no
  dependent Δ load before x/B/C, so consecutive steps' loads can be in flight together (a token
  index loaded per position would put one more load in every chain).
- Products with one 16-bit operand (exact in tf32) take two tf32 passes over the hi and lo parts
  of the fp32 operand instead of three (ops/triton/tf32.py: dot_split); C·B of 16-bit inputs
  takes one; fp32 activations keep 3xTF32. (A bf16 tl.dot would halve C·B's tensor-core time,
  but Triton 3.9's interpreter computes bf16 dots wrong, so the tested path is the tf32 one.)
- An output program covers BLOCK_I rows (BLOCK_I / BLOCK_K blocks of the product): the states
  entering the chunk are read once per row block and each C·B tile serves all its rows.
- The pass loads chunk k+1's state before it stores chunk k's, so its loads overlap.
"""
from __future__ import annotations

import triton
import triton.language as tl

from replayssm.ops.triton.rounding import load_seed_mix, stochastic_round
from replayssm.ops.triton.tf32 import dot_split


@triton.jit
def softplus(v, DT_SOFTPLUS: tl.constexpr):
    """softplus(v) with identity above 20 (or v itself when off); log1p kept accurate for v << 0."""
    if DT_SOFTPLUS:
        u = tl.exp(tl.minimum(v, 20.0))
        w = 1.0 + u
        # log1p(u) = log(w) * u / (w - 1): the rounding of w cancels (the reference uses log1p).
        lp = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
        v = tl.where(v > 20.0, v, lp)
    return v


@triton.jit
def chunk_delta(dt_ptr, dt_off, sdt_t, start, pos, use, A, bias, DT_SOFTPLUS: tl.constexpr):
    """Positions `pos` of a chunk whose tokens are start, start + 1, ...: Δ and a = Δ A where `use`
    (the caller's mask: live positions, or those of a span), 0 elsewhere."""
    raw = tl.load(dt_ptr + dt_off + (start + pos) * sdt_t, mask=use, other=0.0).to(tl.float32)
    delta = tl.where(use, softplus(raw + bias, DT_SOFTPLUS), 0.0)
    return delta, delta * A


@triton.jit
def chunk_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, dt_bias_ptr, idx_ptr, len_ptr, s_ptr, sum_ptr,
    sx_t, sx_h, sdt_t, sdt_h, sB_t, sB_g, H, HPG, L,
    P: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, F32_DOT: tl.constexpr,
):
    """Grid (nc, H, P tiles): the state of chunk c from zero -> s (nc, H, P, N); Σ a -> sum (nc, H).

    Walks the chunk backwards, BLOCK_K positions at a time: the decay from position j to the end is
    (Σ_{k>j} a_k in j's block) + (Σ of the later blocks), two sums of same-sign terms."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    start = tl.load(idx_ptr + c.to(tl.int64) * L)
    n_live = tl.load(len_ptr + c)
    A, bias = tl.load(A_ptr + h), tl.load(dt_bias_ptr + h)
    x_cols = x_ptr + h * sx_h + p[None, :]
    b_cols = B_ptr + (h // HPG) * sB_g + n[None, :]
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    tail = tl.sum(tl.zeros((BLOCK_K,), dtype=tl.float32), axis=0)  # Σ a_k over the blocks done so far
    blocks = tl.cdiv(n_live, BLOCK_K)
    for b in range(0, blocks):
        pos = (blocks - 1 - b) * BLOCK_K + tl.arange(0, BLOCK_K)
        live = pos < n_live
        delta, a = chunk_delta(dt_ptr, h * sdt_h, sdt_t, start, pos, live, A, bias, DT_SOFTPLUS)
        rows = (start + pos)[:, None]
        xs = tl.load(x_cols + rows * sx_t, mask=live[:, None] & pm[None, :], other=0.0)
        bs = tl.load(b_cols + rows * sB_t, mask=live[:, None] & nm[None, :], other=0.0)
        own = tl.sum(tl.where(pos[:, None] > pos[None, :], a[:, None], 0.0), axis=0)  # [k, j]: k > j
        xw = xs.to(tl.float32) * (tl.exp(own + tail) * delta)[:, None]
        acc = dot_split(tl.trans(xw), bs.to(tl.float32), acc, False, not F32_DOT)
        tail += tl.sum(a)
    if tl.program_id(2) == 0:
        tl.store(sum_ptr + c * H + h, tail)
    base = (c.to(tl.int64) * H + h) * (P * N)
    tl.store(s_ptr + base + p[:, None] * N + n[None, :], acc, mask=pm[:, None] & nm[None, :])


@triton.jit
def chunk_pass_kernel(
    s_ptr, sum_ptr, state_ptr, offsets_ptr, count_ptr, init_ptr, final_ptr, seed_ptr, H,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    """Grid (n, H, P tiles x N tiles), sequences in rank order: chunk states from zero in s become the
    states entering each chunk (in place); the final state goes to the sequence's slot, stochastically
    rounded."""
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    r = tl.program_id(0)
    h = tl.program_id(1)
    NT: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    p = (tl.program_id(2) // NT) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(2) % NT) * BLOCK_N + tl.arange(0, BLOCK_N)
    tile = p[:, None] * N + n[None, :]
    tmask = (p < P)[:, None] & (n < N)[None, :]
    islot = tl.load(init_ptr + r)
    fslot = tl.load(final_ptr + r)
    count = tl.load(count_ptr + r)
    # Slot checks broadcast as tensors (a scalar bool in a mask trips the interpreter).
    ibase = (tl.maximum(islot, 0) * H + h) * (P * N)
    s = tl.load(state_ptr + ibase + tile, mask=tmask & ((tile * 0 + islot) >= 0), other=0.0).to(tl.float32)
    c = tl.load(offsets_ptr) + r  # this sequence's chunk at position 0 (ops/ssd_layout.py)
    own = tl.load(s_ptr + (c * H + h) * (P * N) + tile, mask=tmask & ((tile * 0 + count) > 0), other=0.0)
    for k in range(0, count):
        # Next step's chunk (the last one again at the last step: a harmless in-bounds reload).
        nxt = tl.load(offsets_ptr + tl.minimum(k + 1, count - 1)) + r
        own_next = tl.load(s_ptr + (nxt * H + h) * (P * N) + tile, mask=tmask, other=0.0)
        decay = tl.exp(tl.load(sum_ptr + c * H + h))
        tl.store(s_ptr + (c * H + h) * (P * N) + tile, s, mask=tmask)
        s = decay * s + own
        c = nxt
        own = own_next
    fbase = (tl.maximum(fslot, 0) * H + h) * (P * N)
    val = stochastic_round(s, fbase + tile, seed_mix, STATE_DTYPE, MAXV)
    tl.store(state_ptr + fbase + tile, val, mask=tmask & ((tile * 0 + fslot) >= 0))


@triton.jit
def chunk_output_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, idx_ptr, len_ptr, valid_ptr, s_ptr, y_ptr,
    sx_t, sx_h, sdt_t, sdt_h, sB_t, sB_g, sC_t, sC_g, sy_t, sy_h, H, HPG, L,
    P: tl.constexpr, N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """Grid (nc, H, P tiles x row blocks): for the BLOCK_I rows i of one row block, y_i =
    Σ_{j<=i} (C_i·B_j) exp(seg(i, j)) Δ_j x_j + exp(a_1+..+a_i) C_i s_inᵀ + D x_i, written at the
    chunk's tokens (zeros for a padding sequence); s holds the states entering each chunk."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2) // (BLOCK_L // BLOCK_I)
    i0 = (tl.program_id(2) % (BLOCK_L // BLOCK_I)) * BLOCK_I
    n_live = tl.load(len_ptr + c)
    start = tl.load(idx_ptr + c.to(tl.int64) * L)
    if i0 < n_live:  # row blocks past the chunk's end have nothing to write
        g = h // HPG
        A, bias = tl.load(A_ptr + h), tl.load(dt_bias_ptr + h)
        ri = i0 + tl.arange(0, BLOCK_I)
        live_i = ri < n_live
        delta_i, a_i = chunk_delta(dt_ptr, h * sdt_h, sdt_t, start, ri, live_i, A, bias, DT_SOFTPLUS)
        p = pt * BLOCK_P + tl.arange(0, BLOCK_P)
        pm = p < P
        c_rows = C_ptr + g * sC_g + (start + ri)[:, None] * sC_t
        b_cols = B_ptr + g * sB_g
        x_cols = x_ptr + h * sx_h + p[None, :]
        pre_i = tl.cumsum(a_i, axis=0)  # Σ_{i0<=k<=i} a_k
        acc = tl.zeros((BLOCK_I, BLOCK_P), dtype=tl.float32)
        mid = tl.sum(tl.zeros((BLOCK_K,), dtype=tl.float32), axis=0)  # Σ a_k between block j and row i0
        blocks = tl.cdiv(tl.minimum(i0 + BLOCK_I, n_live), BLOCK_K)
        for b in range(0, blocks):  # column blocks, nearest first
            j0 = (blocks - 1 - b) * BLOCK_K
            rj = j0 + tl.arange(0, BLOCK_K)
            live_j = rj < n_live
            delta_j, a_j = chunk_delta(dt_ptr, h * sdt_h, sdt_t, start, rj, live_j, A, bias, DT_SOFTPLUS)
            xs = tl.load(x_cols + (start + rj)[:, None] * sx_t, mask=live_j[:, None] & pm[None, :], other=0.0)
            cb = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
            for n0 in range(0, BLOCK_N, NB):  # NB columns of N at a time: no (rows, N) tile stays live
                n = n0 + tl.arange(0, NB)
                cs = tl.load(c_rows + n[None, :], mask=live_i[:, None] & (n < N)[None, :],
                             other=0.0).to(tl.float32)
                bs = tl.load(b_cols + (start + rj)[:, None] * sB_t + n[None, :],
                             mask=live_j[:, None] & (n < N)[None, :], other=0.0).to(tl.float32)
                if F32_DOT:
                    cb = tl.dot(cs, tl.trans(bs), cb, input_precision="tf32x3")
                else:
                    cb = tl.dot(cs, tl.trans(bs), cb, input_precision="tf32")  # 16-bit values: exact in tf32
            if j0 < i0:
                # seg(i, j) = (Σ_{k>j in j's block}) + (Σ between the blocks) + (Σ_{i0<=k<=i}): three
                # same-sign parts.
                suf_j = tl.sum(tl.where(rj[:, None] > rj[None, :], a_j[:, None], 0.0), axis=0)
                seg = (mid + pre_i)[:, None] + suf_j[None, :]
            else:
                # A block inside the row block: seg[i, j] = Σ_{j<k<=i} a_k as a masked cumulative sum
                # down the columns (-inf above the diagonal: no term).
                seg = tl.cumsum(tl.where(ri[:, None] > rj[None, :], a_i[:, None], 0.0), axis=0)
                seg = tl.where(ri[:, None] >= rj[None, :], seg, float("-inf"))
            scores = cb * tl.exp(seg) * delta_j[None, :]
            acc = dot_split(scores, xs.to(tl.float32), acc, False, not F32_DOT)
            if j0 < i0:
                mid += tl.sum(a_j)
        # The carried state, after the loop (its tile is not live during it); mid = Σ_{k<i0} a_k now.
        s_rows = s_ptr + (c.to(tl.int64) * H + h) * (P * N) + p[:, None] * N
        carried = tl.zeros((BLOCK_I, BLOCK_P), dtype=tl.float32)
        for n0 in range(0, BLOCK_N, NB):
            n = n0 + tl.arange(0, NB)
            cs = tl.load(c_rows + n[None, :], mask=live_i[:, None] & (n < N)[None, :], other=0.0)
            s_in = tl.load(s_rows + n[None, :], mask=pm[:, None] & (n < N)[None, :], other=0.0)
            carried = dot_split(cs.to(tl.float32), tl.trans(s_in), carried, not F32_DOT, False)
        acc += tl.exp(mid + pre_i)[:, None] * carried
        xi = tl.load(x_cols + (start + ri)[:, None] * sx_t, mask=live_i[:, None] & pm[None, :], other=0.0)
        acc = acc + tl.load(D_ptr + h) * xi.to(tl.float32)
        keep = (ri * 0 + tl.load(valid_ptr + c)) != 0
        acc = tl.where(keep[:, None], acc, 0.0)
        tl.store(y_ptr + h * sy_h + (start + ri)[:, None] * sy_t + p[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=live_i[:, None] & pm[None, :])
