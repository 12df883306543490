"""The ring term of route "lean" (`replay_lean.py`): everything of a ReplaySSM output but the state.

Per row i, head h and new token t, from the weights launch's scratch w (`replay_step.py`):
    r_t = Σ_j w_tj x_j + Σ_{k<=t} w_tk x_k + D x_t        (b, q, H, P) fp32, zero on padding rows
The launch also appends the new x rows to the ring and writes each row's flush flag. One token
takes a block of heads per program on the CUDA cores; several take one head per program as
3xTF32 tensor-core products (as `replay_pieces._piece_mma`). Every load issues before the first
store: a loop over heads with stores in between ran 5x slower on the H200 (a store may alias the
next head's ring rows), and the block form at q = 4 was L1-bound (795 µs at batch 256).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ring_term_kernel(
    x_ptr, D_ptr, rx_ptr, ring_start_ptr, committed_ptr, idx_ptr, w_ptr, r_ptr, flag_ptr, window,
    sx_b, sx_t, sx_h, H, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, HT: tl.constexpr, P: tl.constexpr,
    BP: tl.constexpr,
):
    # Program (row i, block of HT heads): r_t for its heads, the x appends, and (first block) the
    # row's flush flag. Every load issues before the first store (a loop over heads with stores in
    # between ran 5x slower on the H200: the stores may alias the next head's ring rows).
    i = tl.program_id(0)
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.where(valid, tl.load(committed_ptr + s64), 0)
    o = tl.load(ring_start_ptr + s64)
    if tl.program_id(1) == 0:
        tl.store(flag_ptr + i, (valid & (hc + Q > window)).to(tl.int32))
    hh = tl.program_id(1) * HT + tl.arange(0, HT)
    hm = hh < H
    p = tl.arange(0, BP)
    pm = p < P
    j = tl.arange(0, HB)
    jm = j < hc
    kk = tl.arange(0, QB)
    km = kk < Q
    xrow0 = s64 * H * R + hh.to(tl.int64) * R  # (HT,) ring rows of (slot, head)
    m3 = hm[:, None, None] & pm[None, None, :]
    xh = tl.load(rx_ptr + (xrow0[:, None, None] + ((o + j) % R)[None, :, None]) * P + p[None, None, :],
                 mask=m3 & jm[None, :, None], other=0.0).to(tl.float32)  # (HT, HB, BP)
    xrows = x_ptr + i * sx_b + kk[None, :, None] * sx_t + hh[:, None, None] * sx_h + p[None, None, :]
    xn_raw = tl.load(xrows, mask=m3 & km[None, :, None], other=0.0)
    xn = xn_raw.to(tl.float32)  # (HT, QB, BP)
    Dh = tl.load(D_ptr + hh, mask=hm, other=0.0)
    JB: tl.constexpr = HB + QB
    wbase = (i.to(tl.int64) * H + hh) * ((Q + 1) * JB)  # (HT,)
    hp = hm[:, None] & pm[None, :]
    for t in tl.static_range(Q):
        wh = tl.load(w_ptr + wbase[:, None] + t * JB + j[None, :], mask=hm[:, None] & jm[None, :], other=0.0)
        wn = tl.load(w_ptr + wbase[:, None] + t * JB + HB + kk[None, :], mask=hm[:, None] & km[None, :],
                     other=0.0)
        rt = tl.sum(wh[:, :, None] * xh, axis=1) + tl.sum(wn[:, :, None] * xn, axis=1)
        xt = tl.load(x_ptr + i * sx_b + t * sx_t + hh[:, None] * sx_h + p[None, :], mask=hp, other=0.0)
        rt = tl.where(valid, rt + Dh[:, None] * xt.to(tl.float32), 0.0)
        tl.store(r_ptr + ((i.to(tl.int64) * Q + t) * H + hh[:, None]) * P + p[None, :], rt, mask=hp)
    ok = km & ((kk * 0 + valid.to(tl.int32)) > 0)  # a scalar bool in a mask trips the interpreter
    tl.store(rx_ptr + (xrow0[:, None, None] + ((o + hc + kk) % R)[None, :, None]) * P + p[None, None, :],
             xn_raw, mask=m3 & ok[None, :, None])


@triton.jit
def _ring_term_mma_kernel(
    x_ptr, D_ptr, rx_ptr, ring_start_ptr, committed_ptr, idx_ptr, w_ptr, r_ptr, flag_ptr, window,
    sx_b, sx_t, sx_h, H, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, BP: tl.constexpr,
):
    # Several tokens, program (row i, head h): r^T (P, t) = x_hist^T w_hist^T + x_new^T w_new^T as
    # 3xTF32 tensor-core products (as `_piece_mma`; the block form above was L1-bound at q = 4 on
    # the H200, 795 us), plus D x; every load before the first store.
    i = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.where(valid, tl.load(committed_ptr + s64), 0)
    o = tl.load(ring_start_ptr + s64)
    if h == 0:
        tl.store(flag_ptr + i, (valid & (hc + Q > window)).to(tl.int32))
    KB: tl.constexpr = 16 if HB < 16 else HB
    TB: tl.constexpr = 16 if QB < 16 else QB
    JB: tl.constexpr = HB + QB
    p = tl.arange(0, BP)
    pm = p < P
    j = tl.arange(0, KB)
    jm = j < hc
    t = tl.arange(0, TB)
    tm = t < Q
    xrow0 = s64 * H * R + h * R
    xh = tl.load(rx_ptr + (xrow0 + (o + j) % R)[None, :] * P + p[:, None], mask=jm[None, :] & pm[:, None],
                 other=0.0).to(tl.float32)  # (BP, KB)
    wbase = (i.to(tl.int64) * H + h) * ((Q + 1) * JB)
    wh = tl.load(w_ptr + wbase + t[None, :] * JB + j[:, None], mask=jm[:, None] & tm[None, :], other=0.0)
    tp = tm[None, :] & pm[:, None]
    xn_raw = tl.load(x_ptr + i * sx_b + t[None, :] * sx_t + h * sx_h + p[:, None], mask=tp, other=0.0)
    xn = xn_raw.to(tl.float32)  # (BP, TB): token k in column k
    wn = tl.load(w_ptr + wbase + t[None, :] * JB + HB + t[:, None], mask=tm[:, None] & tm[None, :], other=0.0)
    Dh = tl.load(D_ptr + h)
    acc = tl.dot(xh, wh, tl.zeros((BP, TB), dtype=tl.float32), input_precision="tf32x3")
    acc = tl.dot(xn, wn, acc, input_precision="tf32x3")
    acc = tl.where(valid, acc + Dh * xn, 0.0)
    tl.store(r_ptr + ((i.to(tl.int64) * Q + t[None, :]) * H + h) * P + p[:, None], acc, mask=tp)
    ok = tm & ((t * 0 + valid.to(tl.int32)) > 0)  # a scalar bool in a mask trips the interpreter
    tl.store(rx_ptr + (xrow0 + (o + hc + t) % R)[None, :] * P + p[:, None], xn_raw,
             mask=ok[None, :] & pm[:, None])


def launch_ring_term(x, D, ring_x, ring_start, committed, state_indices, w, window,
                     heads_per_program: int | None = None, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring term r (b, q, H, P) and the per-row flush flags (b,) int32; appends x to the ring.
    out: (r, flags) to fill instead of new tensors."""
    b, q, H, P = x.shape
    R = ring_x.shape[2]
    QB, HB = triton.next_power_of_2(q), triton.next_power_of_2(int(window))
    if out is None:
        out = (torch.empty(b, q, H, P, device=x.device, dtype=torch.float32),
               torch.empty(b, device=x.device, dtype=torch.int32))
    r, flags = out
    BP = triton.next_power_of_2(P)
    args = (x, D, ring_x, ring_start, committed, state_indices, w, r, flags, int(window),
            x.stride(0), x.stride(1), x.stride(2), H, R)
    if q > 1 and BP >= 16:
        _ring_term_mma_kernel[(b, H)](*args, Q=q, QB=QB, HB=HB, P=P, BP=BP, num_warps=4)
    else:
        ht = min(triton.next_power_of_2(heads_per_program or 4), triton.next_power_of_2(H))
        _ring_term_kernel[(b, triton.cdiv(H, ht))](*args, Q=q, QB=QB, HB=HB, HT=ht, P=P, BP=BP, num_warps=4)
    return r, flags
