"""ReplaySSM Gated DeltaNet decode and materialize in Triton (twins of `ops/gdn.py: *_ref`).

The ring holds each token's delta e_t = beta_t (v_t - a_t S_{t-1}^T k_t) (fp32, written once, in the step
where its token is new), so a step solves only its new tokens. One program per (Dv tile, value head, row),
grid (cdiv(Dv, BLOCK_V), Hv, b). The h history entries sit in BLOCK_T = next_pow2(W) (>= 16) rows, the
q new tokens in BLOCK_Q = next_pow2(q) (>= 16) rows; rows past them are zero. With k, q L2-normalized in
fp32 (q times Dk^-1/2), S0 the checkpoint's (Dk, BLOCK_V) tile, Gc the cumulative g from the checkpoint
over the history then the new tokens and gamma = exp(Gc):

    e_t   = beta_t (v_t - gamma_t k_t S0 - sum_{i<t} exp(Gc_t - Gc_i) (k_t . k_i) e_i)    new t, in order
    out_t = gamma_t q_t S0 + sum_{i<=t} exp(Gc_t - Gc_i) (q_t . k_i) e_i
    flush (h + q > W):  state[s] = gamma_{h-1} S0 + sum_{i<h} exp(Gc_{h-1} - Gc_i) k_i e_i^T

The history's part of every e_t is one product (weights (BLOCK_Q, BLOCK_T) @ E_hist); the new tokens'
part runs row by row (q - 1 dependent rows, none for q = 1), on (BLOCK_Q, BLOCK_V) tiles in fp32.

Products run on tensor cores to fp32 accuracy (`tf32.dot_split`) with the raw keys and queries as
operands and their L2 scales applied to the result rows: 16-bit activations and a 16-bit state tile are
exact in TF32, so k S0 takes one pass with both 16-bit, two with one, three (tf32x3) with none. The
token dim of the new tokens pads to 16 (the smallest tl.dot dim) for q = 1 too: one code path, and the
padded k S0 and q S0 products stay below the time of the state's bytes (estimate in docs/kernels.md §6).
k S0, q S0 and the key dot products (new keys and queries against the history keys and the new keys)
accumulate over key columns KEY_CHUNK at a time (a whole (T, Dk) operand in registers spills at
Dk = 128); the flush streams the key chunks again, reloading the history keys and the checkpoint rows
it folds, and stores each (KEY_CHUNK, BLOCK_V) piece of the new checkpoint.

    state[s] read once; out (q rows) stored; ring rows (o + h + t) mod R = (k_t raw, e_t fp32, g_t)
    state[s] written iff h + q > W (16-bit pools rounded with `stochastic_round_pairs`)

The state after the new tokens is never stored: the ring keeps their e and the next step reads them.
Appended rows never overlap history rows (h + q <= R), so no program reads a row another writes. The
k-head's ring_k row is written by the head's first value head (hv % (Hv / Hk) == 0) in its first Dv
tile, g by each value head's first Dv tile, e by every Dv tile (its columns). beta is folded into e, so
the ring keeps no copy of it.

Cost per row and value head (Qp = max(16, next_pow2(q)), T = BLOCK_T, s / a state / activation bytes):
reads Dk Dv s of state, h Dk a + 4 h (Dv + 1) of ring (keys, e, g) and q (2 Dk + Dv) a + 8 q of inputs
(the key rows again per Dv tile, from L2); writes q Dv a of output, q Dk a + 4 q (Dv + 1) of ring, and on
a flush Dk Dv s (reading the state and the history keys again). Tensor-core MACs per Dv tile: 2 Qp Dk
BLOCK_V (k S0, q S0), 2 Qp (T + Qp) Dk (key dot products), Qp (2 T + Qp) BLOCK_V (history part of e,
outputs), T Dk BLOCK_V more on a flush; each 1 to 3 TF32 passes (above). CUDA cores: ~2 q Qp BLOCK_V
FLOPs of substitution.

`gdn_replay_materialize`: the fold over the first n ring entries of src (no solve: the entries carry
their e), stored to dst.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.gdn_state import LaunchConfig, load_state, store_state, unit_stride
from replayssm.ops.triton.rounding import device_seed, load_seed_mix, max_finite, tl_dtype
from replayssm.ops.triton.tf32 import dot_split

KEY_CHUNK = 16  # key columns per step of the products: a whole (T, Dk) operand spills at Dk = 128
L2NORM_EPS = tl.constexpr(1e-6)  # inside the root, as `ops/gdn.py: l2norm` and `gdn_state.py: unit_key`


@triton.jit
def _ring_keys(rk_ptr, s64, hk, Hk, R, start, count, jt, kc, kcm, DK: tl.constexpr):
    """Raw keys (BLOCK_T, BLOCK_KC) at key columns kc, in the ring dtype: ring entry (start + j) mod R of
    slot s64 for j < count, zero rows past it."""
    rows = (s64 * Hk + hk) * R + (start + jt) % R
    return tl.load(rk_ptr + rows[:, None] * DK + kc[None, :], mask=(jt < count)[:, None] & kcm[None, :],
                   other=0.0)


@triton.jit
def _ring_history(re_ptr, rg_ptr, s64, hv, Hv, R, start, count, jt, vv, vm, DV: tl.constexpr):
    """(E (BLOCK_T, BLOCK_V) fp32 deltas, Gc (BLOCK_T,) cumulative g) of ring entries (start + j) mod R,
    j < count, of slot s64; zero entries past count (Gc stays at its last value there)."""
    m = jt < count
    rows = (s64 * Hv + hv) * R + (start + jt) % R
    E = tl.load(re_ptr + rows[:, None] * DV + vv[None, :], mask=m[:, None] & vm[None, :], other=0.0)
    return E, tl.cumsum(tl.load(rg_ptr + rows, mask=m, other=0.0), axis=0)


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
        K = _ring_keys(rk_ptr, s64, hk, Hk, R, start, count, jt, kc, kcm, DK).to(tl.float32)
        S0 = load_state(state_ptr, src, hv, Hv, kc, vv, cm, DK, DV)
        S = dot_split(tl.trans(K), wE, tl.exp(g_end) * S0, KEY16, False)
        store_state(state_ptr, S, dst, hv, Hv, kc, vv, cm, seed_mix, DK, DV, STATE_DTYPE, MAXV)


@triton.jit
def _replay_forward_kernel(
    state_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, rk_ptr, re_ptr, rg_ptr, start_ptr, committed_ptr,
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
    jt = tl.arange(0, BLOCK_T)  # history entries j < h
    tq = tl.arange(0, BLOCK_Q)  # new tokens t < Q, appended at ring row (start + h + t) mod R
    # Scalar conditions enter the masks as vectors (tq * 0 + x): the interpreter takes only those.
    app = (tq < Q) & ((tq * 0 + s) >= 0)
    k_writer = app & ((tq * 0 + pid_v) == 0) & ((tq * 0 + hv % RATIO) == 0)
    app_rows = (start + h + tq) % R

    # Raw-key products, BLOCK_KC key columns at a time: new keys and queries against the history keys,
    # the new keys and the checkpoint tile.
    knh = tl.zeros((BLOCK_Q, BLOCK_T), tl.float32)
    qh = tl.zeros((BLOCK_Q, BLOCK_T), tl.float32)
    knn = tl.zeros((BLOCK_Q, BLOCK_Q), tl.float32)
    qn = tl.zeros((BLOCK_Q, BLOCK_Q), tl.float32)
    ks = tl.zeros((BLOCK_Q, BLOCK_V), tl.float32)
    qs = tl.zeros((BLOCK_Q, BLOCK_V), tl.float32)
    kh2 = tl.zeros((BLOCK_T,), tl.float32)
    kn2 = tl.zeros((BLOCK_Q,), tl.float32)
    q2 = tl.zeros((BLOCK_Q,), tl.float32)
    for c in range(0, BLOCK_K, BLOCK_KC):
        kc = c + tl.arange(0, BLOCK_KC)
        kcm = kc < DK
        tm = (tq < Q)[:, None] & kcm[None, :]
        KN = tl.load(k_ptr + i * sk_b + tq[:, None] * sk_t + hk * sk_h + kc[None, :], mask=tm, other=0.0)
        tl.store(rk_ptr + ((s64 * Hk + hk) * R + app_rows)[:, None] * DK + kc[None, :], KN,
                 mask=k_writer[:, None] & kcm[None, :])
        KN = KN.to(tl.float32)
        QN = tl.load(q_ptr + i * sq_b + tq[:, None] * sq_t + hk * sq_h + kc[None, :], mask=tm,
                     other=0.0).to(tl.float32)
        KH = _ring_keys(rk_ptr, s64, hk, Hk, R, start, h, jt, kc, kcm, DK).to(tl.float32)
        S0 = load_state(state_ptr, s, hv, Hv, kc, vv, kcm[:, None] & vm[None, :], DK, DV)
        knh = dot_split(KN, tl.trans(KH), knh, KEY16, KEY16)
        qh = dot_split(QN, tl.trans(KH), qh, KEY16, KEY16)
        knn = dot_split(KN, tl.trans(KN), knn, KEY16, KEY16)
        qn = dot_split(QN, tl.trans(KN), qn, KEY16, KEY16)
        ks = dot_split(KN, S0, ks, KEY16, STATE_DTYPE != tl.float32)
        qs = dot_split(QN, S0, qs, KEY16, STATE_DTYPE != tl.float32)
        kh2 += tl.sum(KH * KH, axis=1)
        kn2 += tl.sum(KN * KN, axis=1)
        q2 += tl.sum(QN * QN, axis=1)
    rkh = tl.rsqrt(kh2 + L2NORM_EPS)
    rkn = tl.rsqrt(kn2 + L2NORM_EPS)
    rq = tl.rsqrt(q2 + L2NORM_EPS) * q_scale

    # History deltas and decay; the new tokens' cumulative decay continues from the history's.
    EH, Gh = _ring_history(re_ptr, rg_ptr, s64, hv, Hv, R, start, h, jt, vv, vm, DV)
    g_new = tl.load(g_ptr + i * sg_b + tq * sg_t + hv * sg_h, mask=app, other=0.0).to(tl.float32)
    b_new = tl.load(beta_ptr + i * sb_b + tq * sb_t + hv * sb_h, mask=app, other=0.0).to(tl.float32)
    Gn = tl.sum(tl.where(jt == h - 1, Gh, 0.0), axis=0) + tl.cumsum(g_new, axis=0)
    hist = jt[None, :] < h
    dh = tl.where(hist, tl.exp(tl.minimum(Gn[:, None] - Gh[None, :], 0.0)), 0.0)  # (BLOCK_Q, BLOCK_T)
    dn = tl.exp(tl.minimum(Gn[:, None] - Gn[None, :], 0.0))  # (BLOCK_Q, BLOCK_Q); masked by its users

    # e_t = beta_t (v_t - gamma_t S0^T k_t - sum_{i<t} exp(Gc_t - Gc_i) (k_i . k_t) e_i): the history's
    # part for every t at once, then the new tokens' part row by row (each needs the rows before it).
    VN = tl.load(v_ptr + i * sv_b + tq[:, None] * sv_t + hv * sv_h + vv[None, :],
                 mask=app[:, None] & vm[None, :], other=0.0).to(tl.float32)
    wkh = dh * knh * rkn[:, None] * rkh[None, :]
    EN = b_new[:, None] * (VN - dot_split(wkh, EH, (tl.exp(Gn) * rkn)[:, None] * ks, False, False))
    wkn = tl.where(tq[None, :] < tq[:, None], dn * knn, 0.0) * (b_new * rkn)[:, None] * rkn[None, :]
    for t in tl.static_range(1, Q):
        at = tq[:, None] == t
        w_t = tl.sum(tl.where(at, wkn, 0.0), axis=0)  # (BLOCK_Q,): nonzero only for u < t, rows already final
        e_t = tl.sum(tl.where(at, EN, 0.0), axis=0) - tl.sum(w_t[:, None] * EN, axis=0)
        EN = tl.where(at, e_t[None, :], EN)

    # Outputs o_t = gamma_t S0^T q_t + sum_{i<=t} exp(Gc_t - Gc_i) (k_i . q_t) e_i.
    wqh = dh * qh * rq[:, None] * rkh[None, :]
    wqn = tl.where(tq[None, :] <= tq[:, None], dn * qn, 0.0) * rq[:, None] * rkn[None, :]
    o = dot_split(wqn, EN, dot_split(wqh, EH, (tl.exp(Gn) * rq)[:, None] * qs, False, False), False, False)
    o = tl.where(valid, o, 0.0)  # padding rows read as zeros
    tl.store(o_ptr + i * so_b + tq[:, None] * so_t + hv * so_h + vv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=(tq < Q)[:, None] & vm[None, :])

    # Appends: e per Dv tile, g once per value head (its first Dv tile); k above.
    e_rows = (s64 * Hv + hv) * R + app_rows
    tl.store(re_ptr + e_rows[:, None] * DV + vv[None, :], EN, mask=app[:, None] & vm[None, :])
    tl.store(rg_ptr + e_rows, g_new, mask=app & ((tq * 0 + pid_v) == 0))

    if h + Q > W:  # flush: the history folded into the checkpoint
        _fold_store(state_ptr, s, s, hv, Hv, rk_ptr, s64, hk, Hk, R, start, h, EH, Gh, rkh, jt, vv, vm,
                    seed_mix, DK, DV, BLOCK_K, BLOCK_KC, KEY16, STATE_DTYPE, MAXV)


@triton.jit
def _materialize_kernel(
    state_ptr, rk_ptr, re_ptr, rg_ptr, start_ptr, src_ptr, num_ptr, dst_ptr, seed_ptr,
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
    s64 = tl.maximum(src, 0).to(tl.int64)
    n = tl.where(valid, tl.load(num_ptr + i), 0)
    start = tl.load(start_ptr + s64)
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = vv < DV
    jt = tl.arange(0, BLOCK_T)
    k2 = tl.zeros((BLOCK_T,), tl.float32)
    for c in range(0, BLOCK_K, BLOCK_KC):  # the key scales first: the fold weights every row by its own
        kc = c + tl.arange(0, BLOCK_KC)
        K = _ring_keys(rk_ptr, s64, hv // RATIO, Hk, R, start, n, jt, kc, kc < DK, DK).to(tl.float32)
        k2 += tl.sum(K * K, axis=1)
    E, Gc = _ring_history(re_ptr, rg_ptr, s64, hv, Hv, R, start, n, jt, vv, vm, DV)
    _fold_store(state_ptr, tl.where(valid, src, -1), tl.where(valid, dst, -1), hv, Hv, rk_ptr, s64,
                hv // RATIO, Hk, R, start, n, E, Gc, tl.rsqrt(k2 + L2NORM_EPS), jt, vv, vm, seed_mix, DK, DV,
                BLOCK_K, BLOCK_KC, KEY16, STATE_DTYPE, MAXV)


def _pad16(n: int) -> int:
    """A tile dim for n rows: a power of two, at least 16 (the smallest tl.dot operand dim)."""
    return max(16, triton.next_power_of_2(n))


def _tile(config: LaunchConfig, Dk: int, Dv: int) -> tuple[int, int]:
    """(BLOCK_V, BLOCK_K): config.block_v capped at Dv's power of two, both at least 16 (masked)."""
    return _pad16(min(config.block_v, triton.next_power_of_2(Dv))), _pad16(Dk)


def _check_pools(state, ring_k, ring_e, ring_g) -> None:
    for name, t in (("state", state), ("ring_k", ring_k), ("ring_e", ring_e), ("ring_g", ring_g)):
        assert t.is_contiguous(), f"{name} must be contiguous (offsets are linear indices)"


def launch_replay_forward(q, k, v, g, beta, state, ring_k, ring_e, ring_g, ring_start, committed,
                          state_indices, window, rand_seed, out, config: LaunchConfig) -> torch.Tensor:
    """Launch the replay forward kernel with an explicit tile config (the benchmark times it)."""
    _check_pools(state, ring_k, ring_e, ring_g)
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
        state, q, k, v, g, beta, ring_k, ring_e, ring_g, ring_start, committed, state_indices, o,
        device_seed(rand_seed, state.device),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), *o.stride()[:3],
        Hk, Hv, Hv // Hk, ring_k.shape[2], window, Dk**-0.5,
        Q=n, DK=Dk, DV=Dv, BLOCK_K=block_k, BLOCK_KC=min(block_k, KEY_CHUNK), BLOCK_V=block_v,
        BLOCK_T=_pad16(window), BLOCK_Q=_pad16(n), KEY16=ring_k.dtype != torch.float32,
        STATE_DTYPE=sdt, MAXV=max_finite(sdt), num_warps=config.num_warps,
    )
    return o


def launch_materialize(state, ring_k, ring_e, ring_g, ring_start, src_indices, num_entries,
                       dst_indices, rand_seed, config: LaunchConfig) -> None:
    """Launch the materialize kernel with an explicit tile config."""
    _check_pools(state, ring_k, ring_e, ring_g)
    _, Hv, Dk, Dv = state.shape
    m = src_indices.shape[0]
    if m == 0:
        return
    block_v, block_k = _tile(config, Dk, Dv)
    sdt = tl_dtype(state.dtype)
    R = ring_k.shape[2]
    _materialize_kernel[(triton.cdiv(Dv, block_v), Hv, m)](
        state, ring_k, ring_e, ring_g, ring_start, src_indices, num_entries, dst_indices,
        device_seed(rand_seed, state.device),
        ring_k.shape[1], Hv, Hv // ring_k.shape[1], R,
        DK=Dk, DV=Dv, BLOCK_K=block_k, BLOCK_KC=min(block_k, KEY_CHUNK), BLOCK_V=block_v,
        BLOCK_T=_pad16(R),  # n <= committed <= W < R
        KEY16=ring_k.dtype != torch.float32, STATE_DTYPE=sdt, MAXV=max_finite(sdt),
        num_warps=config.num_warps,
    )
