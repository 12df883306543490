"""ReplaySSM forward step in two launches: per-group weights, then per-head outputs (route `Fallback`).

1. Weights, grid (b, G): B_j·C_t once per group (history j < h_c and new tokens), then for each
   head of the group the closed-form coefficients, into a small fp32 scratch (b, H, Q+1, HB+QB):
       row t < Q:  [Δ_j e^{Λ_t-Λ_j} (B_j·C_t) for history j | same for new k <= t]
       row Q:      [Δ_j e^{Λ_h-Λ_j} for history j]   (fold coefficients; Λ_h = end of history)
   and scale (b, H, Q+1) = [e^{Λ_t} for t < Q | e^{Λ_h}]. Appends the new B rows and Δ.
2. Outputs, grid (P tiles, H, b) like the baseline: load the S0 tile once, then per token
       y_t = scale_t (S0 C_t) + Σ_j w_tj x_j + Σ_k w_tk x_k + D x_t
   (one reduction over N per token, as in the baseline; no B·C and no cumulative sums here), with
   masked tail tiles, so any (P, N) runs. Appends x. The caller folds the flush rows afterwards
   (`replay_fold.py`).

The weights launch also serves routes `Lean` and `Stream` (`launch_weights`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.ssu import softplus_dt
from replayssm.ops.triton.tf32 import dot_split

try:  # programmatic dependent launch (sm_90+; Triton >= 3.4)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton: no programmatic dependent launch (`pdl_supported`)
    gdc_launch_dependents = gdc_wait = None


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: a CUDA device of compute capability >= 9 and a Triton with it."""
    return (gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


@triton.jit
def _weights_kernel(
    dt_ptr, A_ptr, B_ptr, C_ptr, dt_bias_ptr, rB_ptr, rdt_ptr, ring_start_ptr, committed_ptr, idx_ptr,
    w_ptr, sc_ptr,
    sdt_b, sdt_t, sdt_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, HPB: tl.constexpr, N: tl.constexpr,
    BLOCK_N: tl.constexpr, DT_SOFTPLUS: tl.constexpr, BC_DOT: tl.constexpr, TT: tl.constexpr,
    JJ: tl.constexpr, PDL: tl.constexpr = False,
):
    # Tokens t < TT and history entries j < JJ (QB and HB, or with BC_DOT both padded to >= 16: B·C
    # is then two tensor-core products instead of a chain of per-token reductions). Program
    # (i, g): group g of row i.
    if PDL:
        # The next launch on this stream (launched programmatically dependent) may start now; it
        # waits (gdc_wait) before it reads anything this launch writes.
        gdc_launch_dependents()
    i = tl.program_id(0)
    s = tl.load(idx_ptr + i)
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.where(s >= 0, tl.load(committed_ptr + s64), 0)  # padding rows: no history
    o = tl.load(ring_start_ptr + s64)
    n = tl.arange(0, BLOCK_N)
    nm = n < N
    j = tl.arange(0, JJ)
    jm = j < hc
    JB: tl.constexpr = HB + QB  # a w row: history j < HB, then new k < QB
    g = tl.program_id(1)
    t = tl.arange(0, TT)
    tm = t < Q
    tb, tbm = t, tm  # the loaded token rows (the coefficients below take QB of them)
    rows = (o + j) % R
    Brow0 = s64 * G * R + g * R
    Bh = tl.load(rB_ptr + (Brow0 + rows)[:, None] * N + n[None, :], mask=jm[:, None] & nm[None, :],
                 other=0.0).to(tl.float32)
    tn = tm[:, None] & nm[None, :]
    Bn_raw = tl.load(B_ptr + i * sB_b + t[:, None] * sB_t + g * sB_g + n[None, :], mask=tn, other=0.0)
    C = tl.load(C_ptr + i * sC_b + t[:, None] * sC_t + g * sC_g + n[None, :], mask=tn, other=0.0)
    C = C.to(tl.float32)
    Bn = Bn_raw.to(tl.float32)
    # B·C: (TT, JJ) history and (TT, TT) new (tiny: once per group). BC_DOT: two products, exact
    # for 16-bit B and C (`dot_split`). Else in fp32 on the CUDA cores a token's row at a time: the
    # whole (QB, HB, N) broadcast product took 163 registers at q = 4 (sm_90 build), against 48 at
    # q = 1.
    if BC_DOT:
        bch = dot_split(C, tl.trans(Bh), tl.zeros((TT, JJ), dtype=tl.float32),
                        C_ptr.dtype.element_ty != tl.float32, rB_ptr.dtype.element_ty != tl.float32)
        bcn = dot_split(C, tl.trans(Bn), tl.zeros((TT, TT), dtype=tl.float32),
                        C_ptr.dtype.element_ty != tl.float32, B_ptr.dtype.element_ty != tl.float32)
        # Back to QB tokens before the per-head coefficients (their exps would otherwise run over
        # every padded token row): rows and columns past Q are exact zeros (masked C and B rows),
        # so summing the TT / QB row blocks keeps the first QB rows exactly.
        bch = tl.sum(tl.reshape(bch, (TT // QB, QB, JJ)), axis=0)
        bcn = tl.sum(tl.reshape(bcn, (TT // QB, QB, TT)), axis=0)
        bcn = tl.sum(tl.reshape(bcn, (QB, TT // QB, QB)), axis=1)
        t = tl.arange(0, QB)
        tm = t < Q
    else:
        bch = tl.zeros((TT, JJ), dtype=tl.float32)
        bcn = tl.zeros((TT, TT), dtype=tl.float32)
        for tt in tl.static_range(Q):
            Crow = tl.sum(tl.where((t == tt)[:, None], C, 0.0), axis=0)
            bch = tl.where((t == tt)[:, None], tl.sum(Crow[None, :] * Bh, axis=1)[None, :], bch)
            bcn = tl.where((t == tt)[:, None], tl.sum(Crow[None, :] * Bn, axis=1)[None, :], bcn)
    # Heads of this group: Λ from the stored history Δ and the new Δ, all exponents <= 0
    # (clamped so masked entries cannot overflow before being zeroed).
    hpg = H // G
    hh = tl.arange(0, HPB)
    hm = hh < hpg
    head = g * hpg + hh
    A = tl.load(A_ptr + head, mask=hm, other=0.0)
    xrow0 = s64 * H * R + head.to(tl.int64) * R  # ring_dt rows of (s, head)
    dth = tl.load(rdt_ptr + xrow0[:, None] + rows[None, :], mask=hm[:, None] & jm[None, :], other=0.0)
    cumh = tl.cumsum(dth, axis=1) * A[:, None]  # (HPB, JJ)
    lam_h = tl.sum(dth, axis=1) * A  # (HPB,)
    ht = hm[:, None] & tm[None, :]
    dtn = tl.load(dt_ptr + i * sdt_b + t[None, :] * sdt_t + head[:, None] * sdt_h, mask=ht, other=0.0)
    dtn = dtn.to(tl.float32)
    bias = tl.load(dt_bias_ptr + head, mask=hm, other=0.0)
    dtn = tl.where(tm[None, :], softplus_dt(dtn, bias[:, None], DT_SOFTPLUS), 0.0)
    cumn = lam_h[:, None] + tl.cumsum(dtn, axis=1) * A[:, None]  # (HPB, QB)
    wh = dth[:, None, :] * tl.exp(tl.minimum(cumn[:, :, None] - cumh[:, None, :], 0.0)) * bch[None, :, :]
    wn = dtn[:, None, :] * tl.exp(tl.minimum(cumn[:, :, None] - cumn[:, None, :], 0.0)) * bcn[None, :, :]
    wn = tl.where(t[None, None, :] <= t[None, :, None], wn, 0.0)  # causal: token k <= t
    fh = dth * tl.exp(tl.minimum(lam_h[:, None] - cumh, 0.0))  # fold coefficients (HPB, JJ)
    wbase = (i.to(tl.int64) * H + head) * ((Q + 1) * JB)  # (HPB,)
    hq = hm[:, None, None] & tm[None, :, None]
    wrow = wbase[:, None, None] + t[None, :, None] * JB
    # Rows of JB = HB + QB entries: history j < HB, then new k < QB (padded entries stay out).
    tl.store(w_ptr + wrow + j[None, None, :], wh, mask=hq & (j < HB)[None, None, :])
    tl.store(w_ptr + wrow + HB + t[None, None, :], wn, mask=hq & (t < QB)[None, None, :])
    tl.store(w_ptr + wbase[:, None] + Q * JB + j[None, :], fh, mask=hm[:, None] & (j < HB)[None, :])
    sbase = (i.to(tl.int64) * H + head) * (Q + 1)
    tl.store(sc_ptr + sbase[:, None] + t[None, :], tl.exp(cumn), mask=ht)
    tl.store(sc_ptr + sbase + Q, tl.exp(lam_h), mask=hm)
    # Appends after the history (never a history row): Δ of each head, B of the group.
    ok = tm & ((t * 0 + s) >= 0)  # validity as a tensor (a scalar bool in a mask trips the interpreter)
    arow = (o + hc + t) % R
    tl.store(rdt_ptr + xrow0[:, None] + arow[None, :], dtn, mask=hm[:, None] & ok[None, :])
    okb = tbm & ((tb * 0 + s) >= 0)  # the B rows as loaded (TT of them)
    tl.store(rB_ptr + (Brow0 + (o + hc + tb) % R)[:, None] * N + n[None, :], Bn_raw,
             mask=okb[:, None] & nm[None, :])


@triton.jit
def _out_kernel(
    x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, ring_start_ptr, committed_ptr, idx_ptr, y_ptr,
    w_ptr, sc_ptr, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, NS: tl.constexpr, EVEN: tl.constexpr,
):
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.where(valid, tl.load(committed_ptr + s64), 0)
    o = tl.load(ring_start_ptr + s64)
    g = h // (H // G)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = p < P
    pmv = pm & ((p * 0 + s) >= 0)
    # The tile as (NC, BLOCK_P, NS): N cut into NC chunks of NS contiguous columns, chunks
    # outermost, so a warp spans several P rows and one chunk width: the reduction over N is
    # mostly in-thread (over chunks) plus a short cross-lane tree over NS.
    NC: tl.constexpr = BLOCK_N // NS
    ncol = tl.arange(0, NC)[:, None] * NS + tl.arange(0, NS)[None, :]  # (NC, NS)
    nm = ncol < N
    tile = p[None, :, None] * N + ncol[:, None, :]
    tmask = pmv[None, :, None] & nm[:, None, :]
    sbase = (s64 * H + h) * (P * N)
    if EVEN:
        # Padding rows read slot 0 (valid memory) and are zeroed below: no masks on the big load.
        S0 = tl.load(state_ptr + sbase + tile).to(tl.float32)
    else:
        S0 = tl.load(state_ptr + sbase + tile, mask=tmask, other=0.0).to(tl.float32)
    xrow0 = s64 * H * R + h * R
    j = tl.arange(0, HB)
    jm = j < hc
    xh = tl.load(rx_ptr + (xrow0 + (o + j) % R)[:, None] * P + p[None, :], mask=jm[:, None] & pm[None, :],
                 other=0.0).to(tl.float32)  # (HB, BLOCK_P)
    k = tl.arange(0, QB)
    km = k < Q
    kp = km[:, None] & pm[None, :]
    xn_raw = tl.load(x_ptr + i * sx_b + k[:, None] * sx_t + h * sx_h + p[None, :], mask=kp, other=0.0)
    xn = xn_raw.to(tl.float32)  # (QB, BLOCK_P)
    JB: tl.constexpr = HB + QB
    wbase = (i.to(tl.int64) * H + h) * ((Q + 1) * JB)
    scbase = (i.to(tl.int64) * H + h) * (Q + 1)
    Dh = tl.load(D_ptr + h)
    for t in tl.static_range(Q):
        Ct = tl.load(C_ptr + i * sC_b + t * sC_t + g * sC_g + ncol, mask=nm, other=0.0).to(tl.float32)
        yt = tl.load(sc_ptr + scbase + t) * tl.sum(tl.sum(S0 * Ct[:, None, :], axis=0), axis=1)
        wh = tl.load(w_ptr + wbase + t * JB + j, mask=jm, other=0.0)
        wn = tl.load(w_ptr + wbase + t * JB + HB + k, mask=km, other=0.0)
        yt += tl.sum(wh[:, None] * xh, axis=0) + tl.sum(wn[:, None] * xn, axis=0)
        xt = tl.load(x_ptr + i * sx_b + t * sx_t + h * sx_h + p, mask=pm, other=0.0).to(tl.float32)
        yt = tl.where(valid, yt + Dh * xt, 0.0)
        tl.store(y_ptr + i * sy_b + t * sy_t + h * sy_h + p, yt.to(y_ptr.dtype.element_ty), mask=pm)
    arow = (o + hc + k) % R
    kv = km & ((k * 0 + s) >= 0)  # validity as a tensor (a scalar bool in a mask trips the interpreter)
    tl.store(rx_ptr + (xrow0 + arow)[:, None] * P + p[None, :], xn_raw, mask=kv[:, None] & pm[None, :])


def weights_scratch(b: int, q: int, H: int, window: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights launch's outputs (w, sc), empty: (b, H, q+1, HB+QB) and (b, H, q+1) fp32."""
    QB, HB = triton.next_power_of_2(q), triton.next_power_of_2(int(window))
    return (torch.empty(b, H, q + 1, HB + QB, device=device, dtype=torch.float32),
            torch.empty(b, H, q + 1, device=device, dtype=torch.float32))


def launch_weights(x, dt, A, B, C, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                   state_indices, window, dt_softplus, out=None,
                   bc_dot: bool = False, pdl: bool = False,
                   num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights launch (step 1 above) that every output launch reads; returns (w, sc) scratch
    (out: `weights_scratch` tensors to fill, e.g. allocated on the stream that later reads them).
    bc_dot (several tokens): B·C as two tensor-core products over token and history axes padded
    to 16, instead of per-token reductions on the CUDA cores. pdl: every program lets the
    stream's next launch start at once (`pdl_supported` devices; that launch must be launched
    with launch_pdl and wait with gdc_wait before reading w, sc or the appended ring rows).
    num_warps: the launch's warps (routes `Lean` and `Stream` take one: it is bound by its chains of
    dependent loads, and one-warp programs let an SM hold more of them)."""
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G, R = B.shape[2], ring_x.shape[2]
    QB, HB = triton.next_power_of_2(q), triton.next_power_of_2(int(window))
    w, sc = out if out is not None else weights_scratch(b, q, H, window, x.device)
    dot = bool(bc_dot and q > 1 and triton.next_power_of_2(N) >= 16)
    _weights_kernel[(b, G)](
        dt, A, B, C, dt_bias, ring_B, ring_dt, ring_start, committed, state_indices, w, sc,
        dt.stride(0), dt.stride(1), dt.stride(2), B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2), H, G, R,
        Q=q, QB=QB, HB=HB, HPB=triton.next_power_of_2(H // G), N=N, BLOCK_N=triton.next_power_of_2(N),
        DT_SOFTPLUS=bool(dt_softplus), BC_DOT=dot, TT=max(QB, 16) if dot else QB,
        JJ=max(HB, 16) if dot else HB, PDL=pdl, num_warps=num_warps,
    )
    return w, sc


def launch_step(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                state_indices, window, dt_softplus, rand_seed, y, block_p: int, num_warps: int) -> None:
    """Weights launch, then the output launch over every row (flush rows are folded by the caller)."""
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G, R = B.shape[2], ring_x.shape[2]
    QB, HB = triton.next_power_of_2(q), triton.next_power_of_2(int(window))
    BN = triton.next_power_of_2(N)
    w, sc = launch_weights(x, dt, A, B, C, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                           state_indices, window, dt_softplus)
    block_p = min(block_p, triton.next_power_of_2(P))
    _out_kernel[(triton.cdiv(P, block_p), H, b)](
        x, D, C, state, ring_x, ring_start, committed, state_indices, y, w, sc,
        x.stride(0), x.stride(1), x.stride(2),
        C.stride(0), C.stride(1), C.stride(2), y.stride(0), y.stride(1), y.stride(2), H, G, R,
        Q=q, QB=QB, HB=HB, P=P, N=N, BLOCK_P=block_p, BLOCK_N=BN, NS=min(BN, 32),
        EVEN=(P % block_p == 0) and BN == N, num_warps=num_warps,
    )
