"""One-token ReplaySSM step preparation in one launch (route "lean", q = 1).

Route "lean" (`replay_lean.py`) prepares a step in three small launches before the state passes:
the weights (`replay_step.py`: B·C per group, closed-form coefficients per head), the ring term
r = Σ_j w_j x_j + (w_new + D) x per (row, head), and the list of flush rows. On the H200 they cost
about 17 + 25 + 3 µs at batch 256, against ~240 µs for the state pass itself. For one token the
three fit one program per (row, group, block of HT heads): B·C of the group (recomputed by each
head block: a few KiB from L2), the coefficients of its heads kept in registers for the ring term,
and the row's flush record appended to the list with an atomic counter (list order varies between
runs; each listed row is folded by itself, so results do not).

Writes what the later launches read, in `launch_weights`' layout: the fold coefficients (row Q of
the weights scratch), the scales e^{Λ_t}, e^{Λ_h}; the ring term (b, 1, H, P); per-row flush
flags; flush records (row, slot, h_c, ring start) and their count (zeroed by the caller). Appends
Δ, B and x at ring row (o + h_c) mod R of valid rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.ssu import softplus_dt


@triton.jit
def _prep_one_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, rx_ptr, rB_ptr, rdt_ptr, ring_start_ptr,
    committed_ptr, idx_ptr, w_ptr, sc_ptr, r_ptr, flag_ptr, list_ptr, count_ptr, window,
    sx_b, sx_h, sdt_b, sdt_h, sB_b, sB_g, sC_b, sC_g, H, G, R,
    HB: tl.constexpr, HT: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr,
    BP: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):
    i = tl.program_id(0)
    hpg = H // G
    nblk = tl.cdiv(hpg, HT)
    g = tl.program_id(1) // nblk
    hb = tl.program_id(1) % nblk
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.where(valid, tl.load(committed_ptr + s64), 0)  # padding rows: no history
    o = tl.load(ring_start_ptr + s64)
    if tl.program_id(1) == 0:
        flush = valid & (hc + 1 > window)
        tl.store(flag_ptr + i, flush.to(tl.int32))
        if flush:
            at = list_ptr + tl.atomic_add(count_ptr, 1) * 4
            tl.store(at, i)
            tl.store(at + 1, s)
            tl.store(at + 2, hc)
            tl.store(at + 3, o)
    n = tl.arange(0, BLOCK_N)
    nm = n < N
    j = tl.arange(0, HB)
    jm = j < hc
    rows = (o + j) % R
    Brow0 = s64 * G * R + g * R
    # B·C of the group in fp32: history rows and the new token.
    Bh = tl.load(rB_ptr + (Brow0 + rows)[:, None] * N + n[None, :], mask=jm[:, None] & nm[None, :],
                 other=0.0).to(tl.float32)  # (HB, BLOCK_N)
    Bn_raw = tl.load(B_ptr + i * sB_b + g * sB_g + n, mask=nm, other=0.0)
    C = tl.load(C_ptr + i * sC_b + g * sC_g + n, mask=nm, other=0.0).to(tl.float32)
    bch = tl.sum(Bh * C[None, :], axis=1)  # (HB,)
    bcn = tl.sum(Bn_raw.to(tl.float32) * C, axis=0)
    # This block's heads: Λ from the stored history Δ and the new Δ (exponents clamped <= 0).
    u = hb * HT + tl.arange(0, HT)
    hm = u < hpg
    hh = g * hpg + tl.minimum(u, hpg - 1)
    A = tl.load(A_ptr + hh)
    xrow0 = s64 * H * R + hh.to(tl.int64) * R  # (HT,) ring rows of (slot, head)
    dth = tl.load(rdt_ptr + xrow0[:, None] + rows[None, :], mask=hm[:, None] & jm[None, :], other=0.0)
    cumh = tl.cumsum(dth, axis=1) * A[:, None]  # (HT, HB)
    lam_h = tl.sum(dth, axis=1) * A
    dtn = tl.load(dt_ptr + i * sdt_b + hh * sdt_h).to(tl.float32)
    dtn = softplus_dt(dtn, tl.load(dt_bias_ptr + hh), DT_SOFTPLUS)
    lam = lam_h + dtn * A  # (HT,) Λ of the new token
    wh = dth * tl.exp(tl.minimum(lam[:, None] - cumh, 0.0)) * bch[None, :]  # (HT, HB)
    fh = dth * tl.exp(tl.minimum(lam_h[:, None] - cumh, 0.0))  # fold coefficients
    JB: tl.constexpr = HB + 1
    wbase = (i.to(tl.int64) * H + hh) * (2 * JB)
    tl.store(w_ptr + wbase[:, None] + JB + j[None, :], fh, mask=hm[:, None])
    sbase = (i.to(tl.int64) * H + hh) * 2
    tl.store(sc_ptr + sbase, tl.exp(lam), mask=hm)
    tl.store(sc_ptr + sbase + 1, tl.exp(lam_h), mask=hm)
    # Ring term of the new token: Σ_j w_j x_j + (Δ B·C + D) x; every load before the first store.
    p = tl.arange(0, BP)
    pm = p < P
    hp = hm[:, None] & pm[None, :]
    xh = tl.load(rx_ptr + (xrow0[:, None, None] + rows[None, :, None]) * P + p[None, None, :],
                 mask=hm[:, None, None] & jm[None, :, None] & pm[None, None, :], other=0.0).to(tl.float32)
    xn_raw = tl.load(x_ptr + i * sx_b + hh[:, None] * sx_h + p[None, :], mask=hp, other=0.0)
    Dh = tl.load(D_ptr + hh)
    rt = tl.sum(wh[:, :, None] * xh, axis=1) + (dtn * bcn + Dh)[:, None] * xn_raw.to(tl.float32)
    tl.store(r_ptr + (i.to(tl.int64) * H + hh[:, None]) * P + p[None, :], tl.where(valid, rt, 0.0), mask=hp)
    # Appends at ring row (o + h_c) mod R, never a history row (validity as tensors: a scalar bool
    # in a mask trips the interpreter).
    arow = (o + hc) % R
    ok_h = hm & ((u * 0 + valid.to(tl.int32)) > 0)
    tl.store(rdt_ptr + xrow0 + arow, dtn, mask=ok_h)
    tl.store(rx_ptr + (xrow0[:, None] + arow) * P + p[None, :], xn_raw, mask=ok_h[:, None] & pm[None, :])
    ok_n = nm & ((n * 0 + valid.to(tl.int32) * (hb == 0).to(tl.int32)) > 0)
    tl.store(rB_ptr + (Brow0 + arow) * N + n, Bn_raw, mask=ok_n)


def launch_prep_one(x, dt, A, B, C, D, dt_bias, ring_x, ring_B, ring_dt, ring_start, committed, state_indices,
                    window, dt_softplus, heads_per_program: int = 4):
    """The one-launch preparation of a one-token step; returns (w, sc, r, flags, records, count)."""
    b = x.shape[0]
    H, R, P = ring_x.shape[1], ring_x.shape[2], ring_x.shape[3]
    G, N = B.shape[2], B.shape[3]
    HB = triton.next_power_of_2(int(window))
    dev = x.device
    w = torch.empty(b, H, 2, HB + 1, device=dev, dtype=torch.float32)
    sc = torch.empty(b, H, 2, device=dev, dtype=torch.float32)
    r = torch.empty(b, 1, H, P, device=dev, dtype=torch.float32)
    flags = torch.empty(b, device=dev, dtype=torch.int32)
    records = torch.empty(b, 4, device=dev, dtype=torch.int32)
    count = torch.zeros(1, device=dev, dtype=torch.int32)
    ht = min(triton.next_power_of_2(heads_per_program), triton.next_power_of_2(H // G))
    _prep_one_kernel[(b, G * triton.cdiv(H // G, ht))](
        x, dt, A, B, C, D, dt_bias, ring_x, ring_B, ring_dt, ring_start, committed, state_indices,
        w, sc, r, flags, records, count, int(window),
        x.stride(0), x.stride(2), dt.stride(0), dt.stride(2), B.stride(0), B.stride(2),
        C.stride(0), C.stride(2), H, G, R, HB=HB, HT=ht, N=N, BLOCK_N=triton.next_power_of_2(N), P=P,
        BP=triton.next_power_of_2(P), DT_SOFTPLUS=bool(dt_softplus), num_warps=4,
    )
    return w, sc, r, flags, records, count
