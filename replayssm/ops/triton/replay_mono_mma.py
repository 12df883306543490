"""ReplaySSM forward step in one launch with tensor-core products (route "mono.t"), for small verify steps.

Route "mono" (replay_mono.py) works a token at a time on the CUDA cores: at q = 4 its per-token
reductions over N took 144 registers and 774 shuffles at 32x4 (sm_90 build), and FlashInfer's one
kernel ran small verify steps in about half its time (benchmarks/NOTES-kernels.md, session 6).
Here the same program (row, head, P tile) pads the step's tokens to QB >= 16 rows and forms
everything as products:

    C·Bᵀ           (QB, N) x (N, HB)   and (QB, N) x (N, QB): the coefficient weights
                   w_tj = Δ_j e^{Λ_t - Λ_j} C_t·B_j (history j) and w_tk (this step's k <= t);
    y              e^{Λ_t} C S0ᵀ + w_h x_h + w_n x_n + D x_t;

the three products over N in one pass of NS-column chunks, the state tile never held whole.

with fp32 accuracy (`tf32.dot_split`: one TF32 pass for two 16-bit operands, two with one fp32),
or one pass each where y is 16-bit (`tf32.dot_out`: the products reach only y). Appends and the
flush fold are replay_mono.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.replay_mono import _appends, _decays, _fold, _row_head
from replayssm.ops.triton.replay_stream import stream_supported
from replayssm.ops.triton.rounding import max_finite, seed_mix, stochastic_round, tl_dtype
from replayssm.ops.triton.tf32 import dot_out, dot_split


@triton.jit
def _chunk_products(C_ptr, rB_ptr, B_ptr, state_ptr, i, t, tm, g, rows, jm, Brow0, sbase, p, ncs,
                    sC_b, sC_t, sC_g, sB_b, sB_t, sB_g, cb_h, cb_n, acc, flush, xf, decay, seed_mix,
                    N: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr, OUT16: tl.constexpr,
                    FOLD: tl.constexpr):
    """One NS-column chunk ncs of the pass over N (no (rows, N) tile live): C·B of the history and of
    this step, and C S0ᵀ (the state tile read as an (NS, BLOCK_P) piece). FOLD: a flush row also folds
    the piece, S0ᵀ <- decay S0ᵀ + B_hᵀ xf (xf: the history's x rows times the fold coefficients), from
    the operands just loaded, and writes it."""
    X16: tl.constexpr = C_ptr.dtype.element_ty != tl.float32
    RING16: tl.constexpr = rB_ptr.dtype.element_ty != tl.float32
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
    if FOLD:
        if flush:
            tile = p[None, :] * N + ncs[:, None]
            S = dot_split(Bhc, xf, S0t * decay, RING16, False)
            tl.store(state_ptr + sbase + tile, stochastic_round(S, sbase + tile, seed_mix, STATE_DTYPE, MAXV))
    return cb_h, cb_n, acc


@triton.jit
def _step_rows(x_ptr, rx_ptr, i, t, tm, h, p, rows, jm, xrow0, sx_b, sx_t, sx_h, P: tl.constexpr):
    """The history's x rows of this P tile (fp32, zero past h_c) and the step's x rows as given."""
    xh = tl.load(rx_ptr + (xrow0 + rows)[:, None] * P + p[None, :], mask=jm[:, None],
                 other=0.0).to(tl.float32)  # (HB, BLOCK_P)
    xn_raw = tl.load(x_ptr + i * sx_b + t[:, None] * sx_t + h * sx_h + p[None, :], mask=tm[:, None],
                     other=0.0)
    return xh, xn_raw


@triton.jit(do_not_specialize=["seed_mix"])
def _mono_mma_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, rx_ptr, rB_ptr, rdt_ptr,
    ring_start_ptr, committed_ptr, idx_ptr, y_ptr, seed_mix, window,
    sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sB_b, sB_t, sB_g, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, NS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr, OUT16: tl.constexpr, WHOLE: tl.constexpr,
    STAGES: tl.constexpr, FOLD_STAGES: tl.constexpr, EARLY: tl.constexpr, FOLD: tl.constexpr,
):
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
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
    xf = 0.0
    if EARLY or FOLD:
        xh, xn_raw = _step_rows(x_ptr, rx_ptr, i, t, tm, h, p, rows, jm, xrow0, sx_b, sx_t, sx_h, P)
    if FOLD:
        xf = xh * (dth * tl.exp(tl.minimum(lam_h - cumh, 0.0)))[:, None]  # fold coefficients, zero past h_c
    if EARLY:
        Bn_raw = tl.load(B_ptr + i * sB_b + t[:, None] * sB_t + g * sB_g + n[None, :],
                         mask=tm[:, None] & nm[None, :], other=0.0)
        _appends(rx_ptr, rB_ptr, rdt_ptr, xn_raw, dtn, Bn_raw, s, o, hc, t, tm, p, n, nm, pid_p, h, hpg,
                 xrow0, Brow0, P, N, R)
    cb_h = tl.zeros((QB, HB), dtype=tl.float32)
    cb_n = tl.zeros((QB, QB), dtype=tl.float32)
    acc = tl.zeros((QB, BLOCK_P), dtype=tl.float32)
    if WHOLE:
        # Every operand at once (the state tile whole, (N, BLOCK_P)): all loads in flight together,
        # and a flush row folds from these registers below.
        Cc = tl.load(C_ptr + i * sC_b + t[:, None] * sC_t + g * sC_g + n[None, :],
                     mask=tm[:, None] & nm[None, :], other=0.0).to(tl.float32)  # (QB, BLOCK_N)
        Bhc = tl.load(rB_ptr + (Brow0 + rows)[None, :] * N + n[:, None], mask=jm[None, :] & nm[:, None],
                      other=0.0).to(tl.float32)  # (BLOCK_N, HB)
        Bnc = tl.load(B_ptr + i * sB_b + t[None, :] * sB_t + g * sB_g + n[:, None],
                      mask=tm[None, :] & nm[:, None], other=0.0).to(tl.float32)  # (BLOCK_N, QB)
        tileT = p[None, :] * N + n[:, None]  # the tile transposed: (BLOCK_N, BLOCK_P)
        S0t = tl.load(state_ptr + sbase + tileT, mask=nm[:, None], other=0.0).to(tl.float32)
        cb_h = dot_out(Cc, Bhc, cb_h, X16, RING16, OUT16)
        cb_n = dot_out(Cc, Bnc, cb_n, X16, X16, OUT16)
        acc = dot_out(Cc, S0t, acc, X16, STATE_DTYPE != tl.float32, OUT16)
    elif STAGES > 0:
        for c in tl.range(0, N // NS, num_stages=STAGES):
            cb_h, cb_n, acc = _chunk_products(
                C_ptr, rB_ptr, B_ptr, state_ptr, i, t, tm, g, rows, jm, Brow0, sbase, p,
                c * NS + tl.arange(0, NS), sC_b, sC_t, sC_g, sB_b, sB_t, sB_g, cb_h, cb_n, acc, flush, xf,
                tl.exp(lam_h), seed_mix, N, STATE_DTYPE, MAXV, OUT16, FOLD)
    else:
        for c in range(N // NS):
            cb_h, cb_n, acc = _chunk_products(
                C_ptr, rB_ptr, B_ptr, state_ptr, i, t, tm, g, rows, jm, Brow0, sbase, p,
                c * NS + tl.arange(0, NS), sC_b, sC_t, sC_g, sB_b, sB_t, sB_g, cb_h, cb_n, acc, flush, xf,
                tl.exp(lam_h), seed_mix, N, STATE_DTYPE, MAXV, OUT16, FOLD)
    wh = dth[None, :] * tl.exp(tl.minimum(cumn[:, None] - cumh[None, :], 0.0)) * cb_h  # zero past hc: Δ = 0
    wn = dtn[None, :] * tl.exp(tl.minimum(cumn[:, None] - cumn[None, :], 0.0)) * cb_n
    wn = tl.where(t[:, None] >= t[None, :], wn, 0.0)  # causal: token k <= t
    acc = tl.exp(cumn)[:, None] * acc
    if not (EARLY or FOLD):
        xh, xn_raw = _step_rows(x_ptr, rx_ptr, i, t, tm, h, p, rows, jm, xrow0, sx_b, sx_t, sx_h, P)
    xn = xn_raw.to(tl.float32)
    acc = dot_out(wh, xh, acc, False, RING16, OUT16)
    acc = dot_out(wn, xn, acc, False, X16, OUT16)
    acc += tl.load(D_ptr + h) * xn
    acc = tl.where(valid, acc, 0.0)
    tl.store(y_ptr + i * sy_b + t[:, None] * sy_t + h * sy_h + p[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tm[:, None])

    if not EARLY:
        Bn_raw = tl.load(B_ptr + i * sB_b + t[:, None] * sB_t + g * sB_g + n[None, :],
                         mask=tm[:, None] & nm[None, :], other=0.0)  # again for the append (an L1/L2 hit)
        _appends(rx_ptr, rB_ptr, rdt_ptr, xn_raw, dtn, Bn_raw, s, o, hc, t, tm, p, n, nm, pid_p, h, hpg,
                 xrow0, Brow0, P, N, R)
    if flush and not FOLD:
        if WHOLE:
            # S0ᵀ <- e^{Λ_h} S0ᵀ + B_hᵀ (f x_h): the history's B and x and the tile are in registers.
            fk = dth * tl.exp(tl.minimum(lam_h - cumh, 0.0))  # fold coefficients, zero past h_c
            S = dot_split(Bhc, xh * fk[:, None], S0t * tl.exp(lam_h), RING16, False)
            S = stochastic_round(S, sbase + tileT, seed_mix, STATE_DTYPE, MAXV)
            tl.store(state_ptr + sbase + tileT, S, mask=nm[:, None])
        else:
            _fold(state_ptr, rx_ptr, rB_ptr, rdt_ptr, A, lam_h, o, hc, p, sbase, xrow0, Brow0, seed_mix,
                  P, N, R, HB, NS, STATE_DTYPE, MAXV, FOLD_STAGES)


def launch_mono_mma(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                    state_indices, window, dt_softplus, rand_seed, y, block_p: int, num_warps: int,
                    exact: bool = False, whole: bool = False, columns: int = 32, stages: int = 0,
                    fold_stages: int = 0, early: bool = False, fold_in_pass: bool = False) -> None:
    """One launch, grid (P / block_p, H, b), as `replay_mono.launch_mono` (same tile requirements).
    exact: fp32-accurate products even where y is 16-bit (else one TF32 pass each there); whole: the
    state tile read whole and folded from registers (route option .w), not in column chunks; columns:
    the chunk width (.cN); stages / fold_stages: pipeline stages of the chunk loop / of the flush fold's
    loop (.sN / .kN; 0: the compiler's default / an unrolled fold); early: the step's x and B rows and
    the history's x rows read, and the ring appends written, before the pass over N (.a); fold_in_pass:
    flush rows fold each column chunk in the pass over N, from the operands it loaded (.f)."""
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G, R = B.shape[2], ring_x.shape[2]
    if not stream_supported(P, N, block_p) or block_p < 16 or N < 16:
        raise ValueError(f"route 'mono.t' needs block_p >= 16 dividing P and N >= 16, a multiple of 32 "
                         f"(P={P}, N={N})")
    sdt = tl_dtype(state.dtype)
    _mono_mma_kernel[(P // block_p, H, b)](
        x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed, state_indices, y,
        seed_mix(rand_seed), int(window), *x.stride()[:3], *dt.stride(), *B.stride()[:3], *C.stride()[:3],
        *y.stride()[:3], H, G, R,
        Q=q, QB=max(16, triton.next_power_of_2(q)), HB=max(16, triton.next_power_of_2(int(window))), P=P, N=N,
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N), NS=min(N, columns), DT_SOFTPLUS=bool(dt_softplus),
        STATE_DTYPE=sdt, MAXV=max_finite(sdt), OUT16=y.dtype != torch.float32 and not exact, WHOLE=whole,
        STAGES=stages, FOLD_STAGES=fold_stages, EARLY=early, FOLD=fold_in_pass and not whole,
        num_warps=num_warps,
    )  # fmt: skip
