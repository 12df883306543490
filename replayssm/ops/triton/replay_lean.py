"""ReplaySSM forward step with the ring term precomputed (route "lean").

The streaming launch of `replay_stream.py` evaluates, per (head, P tile) piece,
    y_t = e^{Λ_t} (S0 C_t) + Σ_j w_tj x_j + Σ_k w_tk x_k + D x_t
and so carries the ring rows, the weights and the new tokens next to the 16 KiB state tile. The
H200 profile (benchmarks/NOTES-kernels.md, session 3) had that launch at ~300 µs against 246 µs
for a bare gather-and-reduce of the same tiles. Here everything but the state product moves into
a small launch (`replay_ring.py`) that writes the fp32 ring term
    r_t = Σ_j w_tj x_j + Σ_k w_tk x_k + D x_t        (b, Q, H, P), zero on padding rows
and appends the new x rows to the ring. The output launch over the non-flush rows is then the
gather-and-reduce plus a scale and an add: y_t = e^{Λ_t} (S0 C_t) + r_t. Flush rows (a per-row
flag from the same small launch) are listed and folded by a persistent launch of their own
(`replay_flush.py`, shared with "stream-list.o").

Launches: weights (`replay_step.py`) -> ring term -> outputs -> flush list -> flush fold. Merging
the first three into one launch for one token measured slower on the H200 (381 vs 321 µs at the
8B headline, NOTES-kernels.md) and was dropped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.replay_flush import launch_flush
from replayssm.ops.triton.replay_ring import launch_ring_term
from replayssm.ops.triton.replay_step import launch_weights, weights_scratch
from replayssm.ops.triton.replay_stream import piece_products, run_beside, stream_items
from replayssm.ops.triton.tf32 import dot_bf16_split


@triton.jit
def _lean_piece(
    k, first, i, s64, valid, C_ptr, state_ptr, y_ptr, sc_ptr, r_ptr, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G,
    Q: tl.constexpr, QB: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
    NS: tl.constexpr, MMA: tl.constexpr, RAW: tl.constexpr,
):
    # Outputs of one (head, P tile) piece of row i: e^{Λ_t} (S0 C_t) + r_t, or with RAW the bare
    # products S0 C_t (fp32 into y_ptr, zero on padding rows) for `_lean_finish_kernel` to scale.
    # MMA: 0 = reductions on the CUDA cores, 1 = tensor-core products with the tile as TF32 hi + lo,
    # 2 = as bf16 hi + lo (bf16 C only; ~2^-17 of each term, for 16-bit outputs).
    NPT: tl.constexpr = P // BLOCK_P
    w = first + k
    h = w // NPT
    p = (w % NPT) * BLOCK_P + tl.arange(0, BLOCK_P)
    g = h // (H // G)
    sbase = (s64 * H + h) * (P * N)
    scbase = (i.to(tl.int64) * H + h) * (Q + 1)
    if MMA:
        # Several tokens: (BLOCK_P, NS) column chunks times C^T on the tensor cores, the fp32 tile
        # split into hi + lo TF32 parts (16-bit C is exact in TF32), as `_piece_mma`.
        TB: tl.constexpr = 16 if QB < 16 else QB
        t = tl.arange(0, TB)
        tm = t < Q
        acc = tl.zeros((BLOCK_P, TB), dtype=tl.float32)
        for c in tl.static_range(N // NS):
            n = c * NS + tl.arange(0, NS)
            S0 = tl.load(state_ptr + sbase + p[:, None] * N + n[None, :]).to(tl.float32)
            Ct = tl.load(C_ptr + i * sC_b + g * sC_g + t[None, :] * sC_t + n[:, None], mask=tm[None, :],
                         other=0.0).to(tl.float32)
            if MMA == 2:
                acc = dot_bf16_split(S0, Ct.to(tl.bfloat16), acc)
            elif C_ptr.dtype.element_ty == tl.float32:
                acc = tl.dot(S0, Ct, acc, input_precision="tf32x3")
            elif state_ptr.dtype.element_ty == tl.float32:
                hi = (S0.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                acc = tl.dot(hi, Ct, acc, input_precision="tf32")
                acc = tl.dot(S0 - hi, Ct, acc, input_precision="tf32")
            else:
                acc = tl.dot(S0, Ct, acc, input_precision="tf32")
        if RAW:
            acc = tl.where(valid, acc, 0.0)
        else:
            acc = tl.where(valid, acc * tl.load(sc_ptr + scbase + t, mask=tm, other=0.0)[None, :], 0.0)
            rows = (i.to(tl.int64) * Q + t[None, :]) * H + h
            acc += tl.load(r_ptr + rows * P + p[:, None], mask=tm[None, :], other=0.0)
        tl.store(y_ptr + i * sy_b + t[None, :] * sy_t + h * sy_h + p[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=tm[None, :])
    else:
        # One reduction over N per token, on the tile held as (N / NS chunks, BLOCK_P, NS) so the
        # reduction is mostly in-thread (as `_piece`).
        NC: tl.constexpr = N // NS
        ncol = tl.arange(0, NC)[:, None] * NS + tl.arange(0, NS)[None, :]
        S0 = tl.load(state_ptr + sbase + p[None, :, None] * N + ncol[:, None, :]).to(tl.float32)
        for t in tl.static_range(Q):
            Ct = tl.load(C_ptr + i * sC_b + t * sC_t + g * sC_g + ncol).to(tl.float32)
            yt = tl.sum(tl.sum(S0 * Ct[:, None, :], axis=0), axis=1)
            if RAW:
                yt = tl.where(valid, yt, 0.0)
            else:
                yt = tl.where(valid, tl.load(sc_ptr + scbase + t) * yt, 0.0)
                yt += tl.load(r_ptr + ((i.to(tl.int64) * Q + t) * H + h) * P + p)
            tl.store(y_ptr + i * sy_b + t * sy_t + h * sy_h + p, yt.to(y_ptr.dtype.element_ty))


@triton.jit
def _lean_kernel(
    C_ptr, state_ptr, idx_ptr, flag_ptr, committed_ptr, y_ptr, sc_ptr, r_ptr, window, sC_b, sC_t, sC_g,
    sy_b, sy_t, sy_h, H, G,
    Q: tl.constexpr, QB: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
    NS: tl.constexpr, ITEMS: tl.constexpr, STAGES: tl.constexpr, MMA: tl.constexpr, ALL: tl.constexpr,
    RAW: tl.constexpr,
):
    # ITEMS consecutive pieces of one row (ITEMS divides the row's piece count); the slot and the
    # flush flag are both indexed by the row, so the tile load waits on one small load only.
    # ALL: flush rows too (their outputs come from the same S0; the flush launch only folds).
    # RAW: bare products S0 C_t of the non-flush rows into y_ptr (fp32), read from no scratch: the
    # row's flush is decided from its cursor here, as the ring-term launch decides its flag.
    w0 = tl.program_id(0) * ITEMS
    per_row = H * (P // BLOCK_P)
    i = w0 // per_row
    first = w0 % per_row
    s = tl.load(idx_ptr + i)
    s64 = tl.maximum(s, 0).to(tl.int64)  # padding rows read slot 0, zeroed in the piece
    if RAW:
        f = (s >= 0) & (tl.load(committed_ptr + s64) + Q > window)
    else:
        f = 0 if ALL else tl.load(flag_ptr + i)
    if f == 0:
        for k in tl.range(0, ITEMS, num_stages=STAGES):
            _lean_piece(k, first, i, s64, s >= 0, C_ptr, state_ptr, y_ptr, sc_ptr, r_ptr, sC_b, sC_t, sC_g,
                        sy_b, sy_t, sy_h, H, G, Q, QB, P, N, BLOCK_P, NS, MMA, RAW)


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
                items: int = 1, stages: int = 1, concurrent: bool = False,
                heads_per_program: int | None = None, dot_fold: bool = True,
                flush_block_p: int | None = None, flush_warps: int | None = None,
                flush_programs_per_sm: int = 4, outputs_all: bool = False, parallel: bool = False,
                priority: bool = False, bf16_products: bool = False, weights_warps: int = 4,
                few_flush_programs_per_sm: int = 0) -> None:
    """Weights, ring term, outputs of the non-flush rows, then the flush rows listed and folded
    (concurrent, on CUDA: the two flush launches on a side stream beside the output launch).

    Needs whole tiles (`replay_stream.stream_supported`); the caller checks. The flush launch has
    its own tile (flush_block_p rows, flush_warps warps; default the output tile) and runs
    flush_programs_per_sm programs per SM (4 on the CPU interpreter's "SMs"); dot_fold folds with
    one 3xTF32 product per piece (tiles of >= 16 rows), else with rank-one fp32 updates.
    outputs_all: the output launch takes every row and the flush launch (after it, on the same
    stream: it overwrites tiles the output launch reads) only folds; flush rows read S0 twice.
    parallel: the output launch needs none of the small launches: it writes the bare products
    S0 C_t of the non-flush rows while weights, ring term and flush launches run beside it on the
    side stream, and a last elementwise launch scales them and adds r_t (the small launches leave
    the step's critical path; not with outputs_all). priority: that side stream is high-priority.
    bf16_products: several tokens' products take the tile as bf16 hi + lo (bf16 C, 16-bit y).
    weights_warps: the weights launch's warps. few_flush_programs_per_sm (0: off): the flush launch's
    programs per SM on steps where at most half the rows flush (`launch_flush`).
    """
    flush_block_p = flush_block_p or block_p
    outputs_all = outputs_all and flush_block_p >= 16 and not parallel  # fold-only pieces are products
    flush_warps = flush_warps or num_warps
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G = B.shape[2]
    QB = triton.next_power_of_2(q)
    mma = piece_products(q, block_p, bf16_products, C, y)
    k = stream_items(H, P, block_p, items)
    # Scratch on the current stream (a side stream only fills it; the join orders its reuse).
    w, sc = weights_scratch(b, q, H, window, x.device)
    r = torch.empty(b, q, H, P, device=x.device, dtype=torch.float32)
    flags = torch.empty(b, device=x.device, dtype=torch.int32)
    u = torch.empty(b, q, H, P, device=x.device, dtype=torch.float32) if parallel else None

    def small() -> None:
        launch_weights(x, dt, A, B, C, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                       state_indices, window, dt_softplus, out=(w, sc), num_warps=weights_warps)
        launch_ring_term(x, D, ring_x, ring_start, committed, state_indices, w, window, heads_per_program,
                         out=(r, flags))

    def outputs() -> None:
        out = u if parallel else y
        _lean_kernel[(b * H * (P // block_p) // k,)](
            C, state, state_indices, flags, committed, out, sc, r, int(window), *C.stride()[:3],
            *out.stride()[:3], H, G, Q=q, QB=QB, P=P, N=N, BLOCK_P=block_p, NS=min(N, 32), ITEMS=k,
            STAGES=stages, MMA=mma, ALL=outputs_all, RAW=parallel, num_warps=num_warps,
        )

    def flush() -> None:
        launch_flush(C, state, ring_x, ring_B, ring_start, committed, state_indices, window, rand_seed, y, w,
                     sc, r, flush_block_p, flush_warps, flush_programs_per_sm, dot_fold,
                     outputs=not outputs_all, few_programs_per_sm=few_flush_programs_per_sm)

    if parallel:
        def side() -> None:
            small()
            flush()

        # The output launch reads only the non-flush rows' tiles and C; the side launches write the
        # scratch, the ring appends and the flush rows' tiles and outputs: disjoint.
        run_beside(x.device, side, outputs, True, priority)
        total = b * q * H * P
        block = 1024
        _lean_finish_kernel[(triton.cdiv(total, block),)](u, sc, r, flags, y, *y.stride()[:3], total, H,
                                                          Q=q, P=P, BLOCK=block, num_warps=4)
        return
    small()
    if outputs_all:
        outputs()
        flush()
        return
    # Disjoint rows; both only read the scratch (see replay_stream.launch_stream).
    run_beside(x.device, flush, outputs, concurrent, priority)
