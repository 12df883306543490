"""The ring term of route `Lean` (`replay_lean.py`): everything of a ReplaySSM output but the state.

Per row i, head h and new token t, from the weights launch's scratch w (`replay_step.py`):
    r_t = Σ_j w_tj x_j + Σ_{k<=t} w_tk x_k + D x_t        (b, q, H, P) fp32, zero on padding rows
The launch also appends the new x rows to the ring and writes each row's flush flag, a block of
HEADS_PER_PROGRAM heads per program on the CUDA cores. Every load issues before the first store: the
stores may alias the next head's ring rows, so stores in between would serialize the loads.
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
    # row's flush flag. Every load issues before the first store.
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


HEADS_PER_PROGRAM = 4


def launch_ring_term(x, D, ring_x, ring_start, committed, state_indices, w, window,
                     out=None) -> tuple[torch.Tensor, torch.Tensor]:
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
    ht = min(HEADS_PER_PROGRAM, triton.next_power_of_2(H))
    _ring_term_kernel[(b, triton.cdiv(H, ht))](*args, Q=q, QB=QB, HB=HB, HT=ht, P=P, BP=BP, num_warps=4)
    return r, flags
