"""ReplaySSM forward step for one token with the ring term precomputed (route `Lean`).

A streaming launch that evaluates, per (head, P tile) piece,
    y = e^{Λ} (S0 C) + Σ_j w_j x_j + w_new x + D x
carries the ring rows, the weights and the new token next to the 16 KiB state tile. Here the
output launch is a bare gather-and-reduce of the state tiles, u = S0 C over the non-flush rows,
and everything else runs beside it on a high-priority side stream:

    weights (`replay_step.py`) -> ring term r = Σ_j w_j x_j + w_new x + D x and the x appends
    (`replay_ring.py`) -> flush rows listed and folded, with their outputs (`replay_flush.py`)

A last elementwise launch writes y = e^{Λ} u + r for the non-flush rows. The small launches leave
the step's critical path, and the fold's registers never throttle the output launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.replay_flush import launch_flush
from replayssm.ops.triton.replay_ring import launch_ring_term
from replayssm.ops.triton.replay_step import launch_weights, weights_scratch
from replayssm.ops.triton.replay_stream import run_beside

WEIGHTS_WARPS = 1  # the weights launch is bound by its chains of dependent loads: small programs, more per SM


@triton.jit
def _lean_kernel(
    C_ptr, state_ptr, idx_ptr, committed_ptr, u_ptr, window, sC_b, sC_g, su_b, su_h, H, G,
    Q: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, NS: tl.constexpr,
):
    # Program w: piece w % (H P / BLOCK_P) (head, P tile) of row w // (H P / BLOCK_P). The bare products
    # u = S0 C of the non-flush rows (fp32, zero on padding rows); the row's flush is decided from its
    # cursor here, as the ring-term launch decides its flag.
    w0 = tl.program_id(0)
    per_row = H * (P // BLOCK_P)
    i = w0 // per_row
    w = w0 % per_row
    s = tl.load(idx_ptr + i)
    s64 = tl.maximum(s, 0).to(tl.int64)  # padding rows read slot 0, zeroed below
    f = (s >= 0) & (tl.load(committed_ptr + s64) + Q > window)
    if f == 0:
        NPT: tl.constexpr = P // BLOCK_P
        h = w // NPT
        p = (w % NPT) * BLOCK_P + tl.arange(0, BLOCK_P)
        g = h // (H // G)
        sbase = (s64 * H + h) * (P * N)
        # One reduction over N, on the tile held as (N / NS chunks, BLOCK_P, NS) so the reduction is
        # mostly in-thread.
        NC: tl.constexpr = N // NS
        ncol = tl.arange(0, NC)[:, None] * NS + tl.arange(0, NS)[None, :]
        S0 = tl.load(state_ptr + sbase + p[None, :, None] * N + ncol[:, None, :]).to(tl.float32)
        Ct = tl.load(C_ptr + i * sC_b + g * sC_g + ncol).to(tl.float32)
        yt = tl.sum(tl.sum(S0 * Ct[:, None, :], axis=0), axis=1)
        yt = tl.where(s >= 0, yt, 0.0)
        tl.store(u_ptr + i * su_b + h * su_h + p, yt)


@triton.jit
def _lean_finish_kernel(u_ptr, sc_ptr, r_ptr, flag_ptr, y_ptr, sy_b, sy_t, sy_h, total, H,
                        Q: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr):
    # y_t = e^{Λ_t} u_t + r_t over the (b, Q, H, P) elements of the non-flush rows (the flush launch
    # wrote the others); u is zero on padding rows, where r is zero too.
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = e < total
    p = e % P
    h = (e // P) % H
    t = (e // (P * H)) % Q
    i = e // (P * H * Q)
    keep = m & (tl.load(flag_ptr + i, mask=m, other=1) == 0)
    u = tl.load(u_ptr + e, mask=keep, other=0.0)
    yt = tl.load(sc_ptr + (i * H + h) * (Q + 1) + t, mask=keep, other=0.0) * u + tl.load(r_ptr + e, mask=keep)
    tl.store(y_ptr + i * sy_b + t * sy_t + h * sy_h + p, yt.to(y_ptr.dtype.element_ty), mask=keep)


def launch_lean(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                state_indices, window, dt_softplus, rand_seed, y, block_p: int, num_warps: int,
                few_flush_programs_per_sm: int = 0) -> None:
    """One token: the output launch (bare products S0 C of the non-flush rows) on the current stream,
    and beside it on a high-priority side stream (CUDA) the weights, ring-term and flush launches;
    then y = e^{Λ} u + r for the non-flush rows. Needs whole tiles of >= 16 rows
    (`replay_stream.stream_supported`; the flush fold's tensor-core product); the caller checks.
    few_flush_programs_per_sm (0: off): the flush launch's programs per SM on steps where at most half
    the rows flush (`launch_flush`)."""
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    if q != 1:
        raise ValueError(f"route Lean takes one token per row, got q = {q}")
    G = B.shape[2]
    # Scratch on the current stream (a side stream only fills it; the join orders its reuse).
    w, sc = weights_scratch(b, q, H, window, x.device)
    r = torch.empty(b, q, H, P, device=x.device, dtype=torch.float32)
    flags = torch.empty(b, device=x.device, dtype=torch.int32)
    u = torch.empty(b, q, H, P, device=x.device, dtype=torch.float32)

    def side() -> None:
        launch_weights(x, dt, A, B, C, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                       state_indices, window, dt_softplus, out=(w, sc), num_warps=WEIGHTS_WARPS)
        launch_ring_term(x, D, ring_x, ring_start, committed, state_indices, w, window, out=(r, flags))
        launch_flush(C, state, ring_x, ring_B, ring_start, committed, state_indices, window, rand_seed, y, w,
                     sc, r, block_p, num_warps, few_programs_per_sm=few_flush_programs_per_sm)

    def outputs() -> None:
        _lean_kernel[(b * H * (P // block_p),)](
            C, state, state_indices, committed, u, int(window), C.stride(0), C.stride(2), u.stride(0),
            u.stride(2), H, G, Q=q, P=P, N=N, BLOCK_P=block_p, NS=min(N, 32), num_warps=num_warps,
        )

    # The output launch reads only the non-flush rows' tiles and C; the side launches write the
    # scratch, the ring appends and the flush rows' tiles and outputs: disjoint.
    run_beside(x.device, side, outputs)
    total = b * q * H * P
    block = 1024
    _lean_finish_kernel[(triton.cdiv(total, block),)](u, sc, r, flags, y, *y.stride()[:3], total, H,
                                                      Q=q, P=P, BLOCK=block, num_warps=4)
