"""ReplaySSM Gated DeltaNet decode and materialize in Triton (twins of `ops/gdn.py: *_ref`).

Both kernels solve the chunked WY/UT form of the delta rule over at most W + q tokens on tensor cores,
one program per (Dv tile, value head, row), grid (cdiv(Dv, BLOCK_V), Hv, b). The tokens j of a row are
its h history entries in ring order, then its q new tokens, zero-padded to BLOCK_T = next_pow2(W + q)
(>= 16) rows: a zero row (k = v = 0, g = beta = 0) is a no-op token. With k, q L2-normalized in fp32
(q times Dk^-1/2), S0 the checkpoint's (Dk, BLOCK_V) tile and p = h + t the position of new token t:

    Gc_j = sum_{i<=j} g_i                                           gamma_j = exp(Gc_j)
    A[t, i] = beta_t exp(Gc_t - Gc_i) (k_t . k_i)      i < t        (BLOCK_T, BLOCK_T), strictly lower
    E = (I + A)^-1 (beta V - beta gamma (K S0))                      the delta each token adds
    out_t = gamma_p (q_t S0) + sum_{i<=p} exp(Gc_p - Gc_i) (q_t . k_i) E_i
    flush (h + q > W):  state[s] = gamma_{h-1} S0 + sum_{i<h} exp(Gc_{h-1} - Gc_i) k_i E_i^T

(from S_t = a_t S_{t-1} + k_t e_t^T, e_t = beta_t (v_t - a_t S_{t-1}^T k_t): e_t + sum_{i<t} A[t, i] e_i
= beta_t v_t - beta_t gamma_t S0^T k_t). E_i for i < h does not depend on the new tokens, so the flush
folds exactly the history. (I + A)^-1 comes from forward substitution on the (BLOCK_T, BLOCK_T) tile in
fp32 (a power series in A cancels catastrophically when keys repeat and beta, a are near 1).

Products run on tensor cores to fp32 accuracy (`tf32.dot_split`) with the raw keys and queries as
operands and their L2 scales applied to the result rows: 16-bit activations and a 16-bit state tile
are exact in TF32, so K S0 takes one pass with both 16-bit, two with one, three (tf32x3) with none.
K K^T, q K^T, K S0 and q S0 accumulate over key columns KEY_CHUNK at a time (a whole (T, Dk) operand
in registers spills at Dk = 128); the flush streams the same chunks again, reloading the history keys
and the checkpoint rows it folds, and stores each (KEY_CHUNK, BLOCK_V) piece of the new checkpoint.

    state[s] read once; out (q rows) stored; ring rows (o + h + t) mod R = raw (k_t, v_t, g_t, beta_t)
    state[s] written iff h + q > W (16-bit pools rounded with `stochastic_round_pairs`)

The state after the new tokens is never stored: the ring keeps them and the next step replays them.
Appended rows never overlap history rows (h + q <= R), so no program reads a row another writes. The
k-head's ring_k row is written by the head's first value head (hv % (Hv / Hk) == 0) in its first Dv
tile, g and beta by each value head's first Dv tile.

Cost per row and value head (T = BLOCK_T, Qp = max(16, next_pow2(q)), s / a state / activation bytes):
reads Dk Dv s of state, h (Dk + Dv) a + 8 h of ring and q (2 Dk + Dv) a + 8 q of inputs (the key rows
again per Dv tile, from L2); writes q Dv a of output, q (Dk + Dv) a + 8 q of ring, and on a flush
Dk Dv s (reading the state and the history keys again). Tensor-core MACs: T Dk Dv (K S0), Qp Dk Dv
(q S0), T^2 Dv + Qp T Dv (E, outputs), T Dk Dv more on a flush, and per Dv tile T^2 Dk + Qp T Dk
(k.k, q.k) and ~2 T^3 fp32 FLOPs of substitution on the CUDA cores; each MAC takes 1 to 3 TF32 passes
(above). At Dk = Dv = 128, T = 32, Qp = 16 and BLOCK_V = Dv: ~1.2 M MAC per (row, head) and step,
+0.5 M on a flush, against 64 KiB of fp32 state; the per-token recurrence would take ~5 Dk Dv FLOPs
per history token (~1.3 MFLOP at h = 16) on the CUDA cores, compute-bound at these bytes.

`gdn_replay_materialize`: the same solve over the first n ring entries of src (no new tokens, no
outputs), S after them stored to dst.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.gdn_state import LaunchConfig, load_state, store_state, unit_stride
from replayssm.ops.triton.rounding import device_seed, load_seed_mix, max_finite, tl_dtype
from replayssm.ops.triton.tf32 import dot_split

KEY_CHUNK = 16  # key columns per step of the products: 32 takes ~230 registers at BLOCK_V = 32 on sm_90
L2NORM_EPS = tl.constexpr(1e-6)  # inside the root, as `ops/gdn.py: l2norm` and `gdn_state.py: unit_key`


@triton.jit
def _key_rows(rk_ptr, k_row_ptr, sk_t, s64, hk, Hk, R, start, h, jt, kc, kcm,
              DK: tl.constexpr, Q: tl.constexpr):
    """Raw keys (BLOCK_T, BLOCK_KC) at key columns kc in the ring dtype: ring entry (start + j) mod R of
    slot s64 for j < h, new token t = j - h < Q at k_row_ptr + t sk_t, zero rows past h + Q."""
    tn = jt - h
    new = (jt >= h) & (tn < Q)
    rows = (s64 * Hk + hk) * R + (start + jt) % R
    ring = tl.load(rk_ptr + rows[:, None] * DK + kc[None, :], mask=(jt < h)[:, None] & kcm[None, :],
                   other=0.0)
    fresh = tl.load(k_row_ptr + tn[:, None] * sk_t + kc[None, :], mask=new[:, None] & kcm[None, :],
                    other=0.0)
    return tl.where(new[:, None], fresh, ring)


@triton.jit
def _ring_values(rv_ptr, rg_ptr, rb_ptr, s64, hv, Hv, R, start, count, jt, vv, vm, DV: tl.constexpr):
    """v (BLOCK_T, BLOCK_V) in the ring dtype, g and beta (BLOCK_T,) fp32 of ring entries (start + j)
    mod R, j < count, of slot s64; zero past count."""
    m = jt < count
    rows = (s64 * Hv + hv) * R + (start + jt) % R
    V = tl.load(rv_ptr + rows[:, None] * DV + vv[None, :], mask=m[:, None] & vm[None, :], other=0.0)
    return V, tl.load(rg_ptr + rows, mask=m, other=0.0), tl.load(rb_ptr + rows, mask=m, other=0.0)


@triton.jit
def _inverse_minus_identity(A, jt, rows):
    """N = (I + A)^-1 - I for a strictly lower A (BLOCK_T, BLOCK_T) whose rows >= `rows` are zero, by
    forward substitution: N[t] = -A[t] - sum_{j<t} A[t, j] N[j], rows 0 and 1 being -A."""
    N = -A
    for t in range(2, rows):
        at = jt[:, None] == t
        row = tl.sum(tl.where(at, N, 0.0), axis=0)  # -A[t]; its entries j >= t are zero
        row = row + tl.sum(row[:, None] * N, axis=0)
        N = tl.where(at, row[None, :], N)
    return N


@triton.jit
def _deltas(kdot, ks, rk, V, g, beta, jt, rows):
    """The WY/UT solve: (E (BLOCK_T, BLOCK_V), Gc (BLOCK_T,)) from the raw-key products kdot = K K^T and
    ks = K S0, the key scales rk, v V, log decay g and beta (rows >= `rows` zero)."""
    Gc = tl.cumsum(g, axis=0)
    # exp of Gc_t - Gc_i <= 0 for i < t (g <= 0); the clamp keeps the masked upper half finite.
    decay = tl.exp(tl.minimum(Gc[:, None] - Gc[None, :], 0.0))
    A = tl.where(jt[:, None] > jt[None, :], (beta * rk)[:, None] * decay * kdot * rk[None, :], 0.0)
    rhs = beta[:, None] * (V - (tl.exp(Gc) * rk)[:, None] * ks)
    return dot_split(_inverse_minus_identity(A, jt, rows), rhs, rhs, False, False), Gc  # (I + N) rhs


@triton.jit
def _fold_store(state_ptr, src, dst, hv, Hv, rk_ptr, s64, hk, Hk, R, start, count, E, Gc, rk, jt, vv, vm,
                seed_mix, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KC: tl.constexpr,
                KEY16: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr):
    """state[dst] = gamma_{c-1} state[src] + sum_{i<c} exp(Gc_{c-1} - Gc_i) k_i E_i^T: S after the first
    c = count ring entries of slot s64 (rk their key scales), BLOCK_KC key rows at a time."""
    g_end = tl.sum(tl.where(jt == count - 1, Gc, 0.0), axis=0)  # 0 for count = 0: S unchanged
    wE = tl.where(jt < count, tl.exp(tl.minimum(g_end - Gc, 0.0)) * rk, 0.0)[:, None] * E
    for c in range(0, BLOCK_K, BLOCK_KC):
        kc = c + tl.arange(0, BLOCK_KC)
        kcm = kc < DK
        cm = kcm[:, None] & vm[None, :]
        K = _key_rows(rk_ptr, rk_ptr, 0, s64, hk, Hk, R, start, count, jt, kc, kcm, DK, 0).to(tl.float32)
        S0 = load_state(state_ptr, src, hv, Hv, kc, vv, cm, DK, DV)
        S = dot_split(tl.trans(K), wE, tl.exp(g_end) * S0, KEY16, False)
        store_state(state_ptr, S, dst, hv, Hv, kc, vv, cm, seed_mix, DK, DV, STATE_DTYPE, MAXV)


@triton.jit
def _replay_forward_kernel(
    state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, start_ptr, committed_ptr,
    idx_ptr, o_ptr, seed_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    sg_b, sg_t, sg_h, sb_b, sb_t, sb_h, so_b, so_t, so_h,
    Hk, Hv, RATIO, R, W, q_scale,
    Q: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KC: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, KEY16: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    pid_v = tl.program_id(0)
    hv = tl.program_id(1)
    i = tl.program_id(2).to(tl.int64)
    hk = hv // RATIO
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    h = tl.where(valid, tl.load(committed_ptr + s64), 0)
    start = tl.load(start_ptr + s64)
    vv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = vv < DV
    jt = tl.arange(0, BLOCK_T)
    tq = tl.arange(0, BLOCK_Q)
    qm = tq < Q
    # Token rows j: history j < h, new token t at j = h + t, appended to the ring at (o + j) mod R
    # (scalar conditions enter the masks as vectors, jt * 0 + x: the interpreter takes only those).
    ring = (start + jt) % R
    app = (jt >= h) & (jt - h < Q) & ((jt * 0 + s) >= 0)
    k_writer = app & ((jt * 0 + pid_v) == 0) & ((jt * 0 + hv % RATIO) == 0)

    # The products with the raw keys and queries, BLOCK_KC key columns at a time (a whole (T, Dk) tile
    # in dot-operand registers spills at Dk = 128).
    kdot = tl.zeros((BLOCK_T, BLOCK_T), tl.float32)
    qk = tl.zeros((BLOCK_Q, BLOCK_T), tl.float32)
    ks = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    qs = tl.zeros((BLOCK_Q, BLOCK_V), tl.float32)
    k2 = tl.zeros((BLOCK_T,), tl.float32)
    q2 = tl.zeros((BLOCK_Q,), tl.float32)
    for c in range(0, BLOCK_K, BLOCK_KC):
        kc = c + tl.arange(0, BLOCK_KC)
        kcm = kc < DK
        K = _key_rows(rk_ptr, k_ptr + i * sk_b + hk * sk_h, sk_t, s64, hk, Hk, R, start, h, jt, kc, kcm,
                      DK, Q)
        tl.store(rk_ptr + ((s64 * Hk + hk) * R + ring)[:, None] * DK + kc[None, :], K,
                 mask=k_writer[:, None] & kcm[None, :])
        K = K.to(tl.float32)
        Qc = tl.load(q_ptr + i * sq_b + tq[:, None] * sq_t + hk * sq_h + kc[None, :],
                     mask=qm[:, None] & kcm[None, :], other=0.0).to(tl.float32)
        S0 = load_state(state_ptr, s, hv, Hv, kc, vv, kcm[:, None] & vm[None, :], DK, DV)
        kdot = dot_split(K, tl.trans(K), kdot, KEY16, KEY16)
        qk = dot_split(Qc, tl.trans(K), qk, KEY16, KEY16)
        ks = dot_split(K, S0, ks, KEY16, STATE_DTYPE != tl.float32)
        qs = dot_split(Qc, S0, qs, KEY16, STATE_DTYPE != tl.float32)
        k2 += tl.sum(K * K, axis=1)
        q2 += tl.sum(Qc * Qc, axis=1)
    rk = tl.rsqrt(k2 + L2NORM_EPS)
    rq = tl.rsqrt(q2 + L2NORM_EPS) * q_scale

    tn = jt - h
    new = (jt >= h) & (tn < Q)
    v_new = tl.load(v_ptr + i * sv_b + tn[:, None] * sv_t + hv * sv_h + vv[None, :],
                    mask=new[:, None] & vm[None, :], other=0.0)
    g_new = tl.load(g_ptr + i * sg_b + tn * sg_t + hv * sg_h, mask=new, other=0.0).to(tl.float32)
    b_new = tl.load(beta_ptr + i * sb_b + tn * sb_t + hv * sb_h, mask=new, other=0.0).to(tl.float32)
    rv_rows = (s64 * Hv + hv) * R + ring
    tl.store(rv_ptr + rv_rows[:, None] * DV + vv[None, :], v_new.to(rv_ptr.dtype.element_ty),
             mask=app[:, None] & vm[None, :])
    gb_writer = app & ((jt * 0 + pid_v) == 0)  # g and beta once per value head: its first Dv tile
    tl.store(rg_ptr + rv_rows, g_new, mask=gb_writer)
    tl.store(rb_ptr + rv_rows, b_new, mask=gb_writer)
    V, g, beta = _ring_values(rv_ptr, rg_ptr, rb_ptr, s64, hv, Hv, R, start, h, jt, vv, vm, DV)
    V = tl.where(new[:, None], v_new, V).to(tl.float32)
    E, Gc = _deltas(kdot, ks, rk, V, tl.where(new, g_new, g), tl.where(new, b_new, beta), jt, h + Q)

    # Outputs of the new tokens (rows t < Q of a BLOCK_Q tile) at positions p = h + t.
    p = h + tq
    g_p = tl.sum(tl.where(jt[None, :] == p[:, None], Gc[None, :], 0.0), axis=1)
    wq = tl.where(jt[None, :] <= p[:, None], tl.exp(tl.minimum(g_p[:, None] - Gc[None, :], 0.0)), 0.0)
    wq = wq * qk * rk[None, :] * rq[:, None]
    o = dot_split(wq, E, (tl.exp(g_p) * rq)[:, None] * qs, False, False)
    o = tl.where(valid, o, 0.0)  # padding rows read as zeros
    tl.store(o_ptr + i * so_b + tq[:, None] * so_t + hv * so_h + vv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=qm[:, None] & vm[None, :])

    if h + Q > W:  # flush: the history (rows j < h) folded into the checkpoint
        _fold_store(state_ptr, s, s, hv, Hv, rk_ptr, s64, hk, Hk, R, start, h, E, Gc, rk, jt, vv, vm,
                    seed_mix, DK, DV, BLOCK_K, BLOCK_KC, KEY16, STATE_DTYPE, MAXV)


@triton.jit
def _materialize_kernel(
    state_ptr, rk_ptr, rv_ptr, rg_ptr, rb_ptr, start_ptr, src_ptr, num_ptr, dst_ptr, seed_ptr,
    Hk, Hv, RATIO, R,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KC: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr, KEY16: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    hv = tl.program_id(1)
    i = tl.program_id(2).to(tl.int64)
    src = tl.load(src_ptr + i)
    dst = tl.load(dst_ptr + i)
    valid = (src >= 0) & (dst >= 0)
    s = tl.where(valid, src, -1)
    s64 = tl.maximum(src, 0).to(tl.int64)
    n = tl.where(valid, tl.load(num_ptr + i), 0)
    start = tl.load(start_ptr + s64)
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = vv < DV
    jt = tl.arange(0, BLOCK_T)
    kdot = tl.zeros((BLOCK_T, BLOCK_T), tl.float32)
    ks = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    k2 = tl.zeros((BLOCK_T,), tl.float32)
    for c in range(0, BLOCK_K, BLOCK_KC):
        kc = c + tl.arange(0, BLOCK_KC)
        kcm = kc < DK
        K = _key_rows(rk_ptr, rk_ptr, 0, s64, hv // RATIO, Hk, R, start, n, jt, kc, kcm, DK, 0).to(tl.float32)
        S0 = load_state(state_ptr, s, hv, Hv, kc, vv, kcm[:, None] & vm[None, :], DK, DV)
        kdot = dot_split(K, tl.trans(K), kdot, KEY16, KEY16)
        ks = dot_split(K, S0, ks, KEY16, STATE_DTYPE != tl.float32)
        k2 += tl.sum(K * K, axis=1)
    rk = tl.rsqrt(k2 + L2NORM_EPS)
    V, g, beta = _ring_values(rv_ptr, rg_ptr, rb_ptr, s64, hv, Hv, R, start, n, jt, vv, vm, DV)
    E, Gc = _deltas(kdot, ks, rk, V.to(tl.float32), g, beta, jt, n)
    _fold_store(state_ptr, s, tl.where(valid, dst, -1), hv, Hv, rk_ptr, s64, hv // RATIO, Hk, R, start, n, E,
                Gc, rk, jt, vv, vm, seed_mix, DK, DV, BLOCK_K, BLOCK_KC, KEY16, STATE_DTYPE, MAXV)


def _pad16(n: int) -> int:
    """A tile dim for n rows: a power of two, at least 16 (the smallest tl.dot operand dim)."""
    return max(16, triton.next_power_of_2(n))


def _tile(config: LaunchConfig, Dk: int, Dv: int) -> tuple[int, int]:
    """(BLOCK_V, BLOCK_K): config.block_v capped at Dv's power of two, both at least 16 (masked)."""
    return _pad16(min(config.block_v, triton.next_power_of_2(Dv))), _pad16(Dk)


def _check_pools(state, ring_k, ring_v, ring_g, ring_beta) -> None:
    for name, t in (("state", state), ("ring_k", ring_k), ("ring_v", ring_v), ("ring_g", ring_g),
                    ("ring_beta", ring_beta)):
        assert t.is_contiguous(), f"{name} must be contiguous (offsets are linear indices)"


def launch_replay_forward(q, k, v, g, beta, state, ring_k, ring_v, ring_g, ring_beta, ring_start, committed,
                          state_indices, window, rand_seed, out, config: LaunchConfig) -> torch.Tensor:
    """Launch the replay forward kernel with an explicit tile config (the benchmark times it)."""
    _check_pools(state, ring_k, ring_v, ring_g, ring_beta)
    _, Hv, Dk, Dv = state.shape
    b, n, Hk, _ = q.shape
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    o = out if out is not None else torch.empty_like(v)
    assert o.stride(-1) == 1
    if b == 0:
        return o
    block_v, block_k = _tile(config, Dk, Dv)
    sdt = tl_dtype(state.dtype)
    _replay_forward_kernel[(triton.cdiv(Dv, block_v), Hv, b)](
        state, q, k, v, g, beta, ring_k, ring_v, ring_g, ring_beta, ring_start, committed, state_indices, o,
        device_seed(rand_seed, state.device),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), *o.stride()[:3],
        Hk, Hv, Hv // Hk, ring_k.shape[2], window, Dk**-0.5,
        Q=n, DK=Dk, DV=Dv, BLOCK_K=block_k, BLOCK_KC=min(block_k, KEY_CHUNK), BLOCK_V=block_v,
        BLOCK_T=_pad16(window + n),
        BLOCK_Q=_pad16(n), KEY16=ring_k.dtype != torch.float32,
        STATE_DTYPE=sdt, MAXV=max_finite(sdt), num_warps=config.num_warps,
    )
    return o


def launch_materialize(state, ring_k, ring_v, ring_g, ring_beta, ring_start, src_indices, num_entries,
                       dst_indices, rand_seed, config: LaunchConfig) -> None:
    """Launch the materialize kernel with an explicit tile config."""
    _check_pools(state, ring_k, ring_v, ring_g, ring_beta)
    _, Hv, Dk, Dv = state.shape
    m = src_indices.shape[0]
    if m == 0:
        return
    block_v, block_k = _tile(config, Dk, Dv)
    sdt = tl_dtype(state.dtype)
    R = ring_k.shape[2]
    _materialize_kernel[(triton.cdiv(Dv, block_v), Hv, m)](
        state, ring_k, ring_v, ring_g, ring_beta, ring_start, src_indices, num_entries, dst_indices,
        device_seed(rand_seed, state.device),
        ring_k.shape[1], Hv, Hv // ring_k.shape[1], R,
        DK=Dk, DV=Dv, BLOCK_K=block_k, BLOCK_KC=min(block_k, KEY_CHUNK), BLOCK_V=block_v,
        BLOCK_T=_pad16(R),  # n <= committed <= W < R
        KEY16=ring_k.dtype != torch.float32, STATE_DTYPE=sdt, MAXV=max_finite(sdt),
        num_warps=config.num_warps,
    )
