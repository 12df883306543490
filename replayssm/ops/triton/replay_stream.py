"""ReplaySSM forward step for several tokens, row-streaming launches (route `Stream`).

Same weights launch and arithmetic as `replay_step.py`; the output launches differ in shape. A
grid-per-tile launch gives every program one 16 KiB (P tile, head) piece of the state behind a
chain of dependent loads (slot index, then cursor, then ring rows). Here one program takes ITEMS
consecutive pieces of ONE row (`replay_pieces.py`): the slot, cursor and flush decision are loaded
once, the pieces are contiguous in the slot's state, and the loop over them is software-pipelined.
Each program loads C once for its pieces where they share a group, so the pipeline stages only the
state tiles. A piece's products run on the tensor cores: the tile as bf16 hi + lo against bf16 C
where y is 16-bit (~2^-17 of each term, far below a 16-bit output's rounding), else as TF32 hi + lo.

A row flushes as a whole. The streaming launch takes the non-flush rows; the flush rows are listed
on the device (one small program) and a persistent launch of a few programs per SM writes their
outputs and folds them in one pass, one product per column chunk, on a high-priority side stream
beside the streaming launch. So the fold's registers never throttle the common case and few flush
rows still spread over every SM. The weights launch forms B·C as tensor-core products in one warp
per program (it is bound by its chains of dependent loads, so small programs let an SM hold more),
and may let the streaming launch start early (programmatic dependent launch, `pdl`). Register caps
on both launches (`flush_maxnreg`, `stream_maxnreg`) let an SM hold programs of both while the flush
rows fold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.replay_flush import LIST_BLOCK, flush_programs
from replayssm.ops.triton.replay_pieces import _piece_mma, c_chunks
from replayssm.ops.triton.replay_step import gdc_wait, launch_weights, pdl_supported
from replayssm.ops.triton.rounding import device_seed, load_seed_mix, max_finite, tl_dtype

WEIGHTS_WARPS = 1  # the weights launch is bound by its chains of dependent loads: small programs, more per SM
STREAM_STAGES = 2  # the streaming loop's pipeline depth
FLUSH_STAGES = 3  # the flush loop's pipeline depth over column parts


@triton.jit
def _stream_kernel(
    x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, ring_start_ptr, committed_ptr, idx_ptr, y_ptr,
    w_ptr, sc_ptr, seed_ptr, window, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, NS: tl.constexpr, ITEMS: tl.constexpr, STAGES: tl.constexpr,
    MMA: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr,
    PDL: tl.constexpr = False, HOIST_C: tl.constexpr = False,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    # Non-flush rows only (flush rows are the flush launch's). ITEMS divides H * (P / BLOCK_P), so
    # every program stays inside one row.
    w0 = tl.program_id(0) * ITEMS
    per_row = H * (P // BLOCK_P)
    i = w0 // per_row
    first = w0 % per_row
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.where(valid, tl.load(committed_ptr + s64), 0)
    o = tl.load(ring_start_ptr + s64)
    flush = valid & (hc + Q > window)
    if PDL:
        gdc_wait()  # launched programmatically dependent on the weights launch: its writes from here
    if flush == 0:
        # HOIST_C (the ITEMS pieces share a group): C^T loaded once here, so the pipelined loop stages
        # only the state tiles (C is an earlier launch's output: no PDL wait).
        Cs = 0
        if HOIST_C:
            Cs = c_chunks(C_ptr, i, (first // (P // BLOCK_P)) // (H // G), sC_b, sC_t, sC_g, Q, QB, N, NS)
        for k in tl.range(0, ITEMS, num_stages=STAGES):
            _piece_mma(k, first, i, s64, valid, hc, o, 0.0, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr,
                       y_ptr, w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h,
                       H, G, R, Q, QB, HB, P, N, BLOCK_P, NS, False, STATE_DTYPE, MAXV, MMA, 1, Cs, HOIST_C)


@triton.jit
def _flush_list_kernel(idx_ptr, committed_ptr, list_ptr, count_ptr, b, window, Q: tl.constexpr,
                       BLOCK: tl.constexpr):
    # One program: the rows that flush this step, in row order, and their count.
    base = 0
    for start in range(0, b, BLOCK):
        r = start + tl.arange(0, BLOCK)
        s = tl.load(idx_ptr + r, mask=r < b, other=-1)
        hc = tl.load(committed_ptr + tl.maximum(s, 0), mask=s >= 0, other=0)
        f = ((s >= 0) & (hc + Q > window)).to(tl.int32)
        tl.store(list_ptr + base + tl.cumsum(f, axis=0) - 1, r, mask=f > 0)
        base += tl.sum(f, axis=0)
    tl.store(count_ptr, base)


@triton.jit
def _flush_kernel(
    list_ptr, count_ptr, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, ring_start_ptr, committed_ptr,
    idx_ptr, y_ptr, w_ptr, sc_ptr, seed_ptr, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, NS: tl.constexpr, MMA: tl.constexpr, STATE_DTYPE: tl.constexpr,
    MAXV: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    # Persistent over the pieces of the listed flush rows: a fixed, small grid whatever the batch,
    # so the fold's registers never throttle the launch of programs with nothing to do, and the
    # work of few flush rows still spreads over every SM.
    per_row = H * (P // BLOCK_P)
    if SPLIT > 1:
        # This program's pieces (pid, pid + programs, ...) in SPLIT column parts, one per pipelined
        # iteration (`_piece_mma`), so the next part's copies stay in flight while one computes.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        mine = tl.maximum(tl.load(count_ptr) * per_row - pid + nprog - 1, 0) // nprog
        TB: tl.constexpr = 16 if QB < 16 else QB
        acc = tl.zeros((BLOCK_P, TB), dtype=tl.float32)
        for m2 in tl.range(0, mine * SPLIT, num_stages=STAGES):
            w = pid + (m2 // SPLIT) * nprog
            i = tl.load(list_ptr + w // per_row)
            s = tl.load(idx_ptr + i)
            s64 = s.to(tl.int64)
            hc = tl.load(committed_ptr + s64)
            o = tl.load(ring_start_ptr + s64)
            acc = _piece_mma((w % per_row) * SPLIT + m2 % SPLIT, 0, i, s64, s >= 0, hc, o, acc, x_ptr, D_ptr,
                             C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr, w_ptr, sc_ptr, seed_mix, sx_b, sx_t,
                             sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R, Q, QB, HB, P, N, BLOCK_P, NS,
                             True, STATE_DTYPE, MAXV, MMA, SPLIT)
        return
    for w in range(tl.program_id(0), tl.load(count_ptr) * per_row, tl.num_programs(0)):
        i = tl.load(list_ptr + w // per_row)
        s = tl.load(idx_ptr + i)
        s64 = s.to(tl.int64)
        hc = tl.load(committed_ptr + s64)
        o = tl.load(ring_start_ptr + s64)
        _piece_mma(w % per_row, 0, i, s64, s >= 0, hc, o, 0.0, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr,
                   y_ptr, w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h,
                   H, G, R, Q, QB, HB, P, N, BLOCK_P, NS, True, STATE_DTYPE, MAXV, MMA, 1)


def stream_items(H: int, P: int, block_p: int, items: int) -> int:
    """Pieces per program: the largest power of two <= items that divides a row's piece count."""
    per_row = H * (P // block_p)
    k = 1
    while k * 2 <= items and per_row % (k * 2) == 0:
        k *= 2
    return k


def piece_products(C: torch.Tensor, y: torch.Tensor) -> int:
    """How a piece forms its state products (the pieces' MMA): 1 = tensor-core products with the tile
    as TF32 hi + lo, 2 = as bf16 hi + lo (bf16 C and a 16-bit y)."""
    return 2 if C.dtype == torch.bfloat16 and y.dtype in (torch.bfloat16, torch.float16) else 1


def stream_supported(P: int, N: int, block_p: int) -> bool:
    """The streaming launch has no tail masks: whole tiles over P and N a multiple of 32 (or less)."""
    return P % block_p == 0 and (N <= 32 and N & (N - 1) == 0 or N % 32 == 0)


def launch_stream(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                  state_indices, window, dt_softplus, rand_seed, y, block_p: int, num_warps: int,
                  items: int = 8, flush_programs_per_sm: int = 4, flush_parts: int = 1,
                  flush_maxnreg: int = 0, stream_maxnreg: int = 0, pdl: bool = False) -> None:
    """Weights launch (`replay_step.py`, B·C as tensor-core products), the streaming launch over the
    non-flush rows, and beside it on a high-priority side stream (CUDA) the flush rows listed on the
    device and folded by a persistent launch. Several tokens, tiles of >= 16 rows.

    items: pieces per streaming program (the largest power of two up to it that divides a row's
    pieces). flush_programs_per_sm: programs per SM of the persistent flush launch. flush_parts: the
    flush launch takes each piece in that many column parts, one per iteration of its loop.
    flush_maxnreg / stream_maxnreg: a register cap for the flush / streaming launch (0: none). pdl: the
    streaming launch starts while the weights launch runs (programmatic dependent launch, where
    `pdl_supported`; it waits for the weights' writes after loading its rows' slots and cursors).
    """
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G, R = B.shape[2], ring_x.shape[2]
    assert stream_supported(P, N, block_p)
    if q == 1 or block_p < 16:
        raise ValueError(f"route Stream takes several tokens per row and tiles of >= 16 rows "
                         f"(q = {q}, block_p = {block_p})")
    QB, HB = triton.next_power_of_2(q), triton.next_power_of_2(int(window))
    pdl = bool(pdl and pdl_supported(x.device))
    w, sc = launch_weights(x, dt, A, B, C, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                           state_indices, window, dt_softplus, bc_dot=True, pdl=pdl, num_warps=WEIGHTS_WARPS)
    k = stream_items(H, P, block_p, items)
    sdt = tl_dtype(state.dtype)
    seed = device_seed(rand_seed, state.device)
    common = (seed, *x.stride()[:3], *C.stride()[:3], *y.stride()[:3], H, G, R)
    mma = piece_products(C, y)
    if flush_parts > 1 and N % (min(N, 32) * flush_parts):
        raise ValueError(f"{flush_parts} column parts need N a multiple of {min(N, 32) * flush_parts}")
    meta = dict(Q=q, QB=QB, HB=HB, P=P, N=N, BLOCK_P=block_p, NS=min(N, 32), MMA=mma,
                STATE_DTYPE=sdt, MAXV=max_finite(sdt), num_warps=num_warps)
    def flush_launches() -> None:
        # Flush rows listed on the device, then folded by a persistent launch.
        rows = torch.empty(b, device=x.device, dtype=torch.int32)
        count = torch.empty(1, device=x.device, dtype=torch.int32)
        _flush_list_kernel[(1,)](state_indices, committed, rows, count, b, int(window), Q=q,
                                 BLOCK=LIST_BLOCK, num_warps=4)
        programs = min(b * H * (P // block_p), flush_programs(x.device, flush_programs_per_sm))
        _flush_kernel[(programs,)](rows, count, x, D, C, state, ring_x, ring_B, ring_start, committed,
                                   state_indices, y, w, sc, *common, **meta, SPLIT=flush_parts,
                                   STAGES=FLUSH_STAGES, **regs(flush_maxnreg))

    hoist_c = (H // G) * (P // block_p) % k == 0  # every program's pieces in one group

    def stream_launch() -> None:
        _stream_kernel[(b * H * (P // block_p) // k,)](
            x, D, C, state, ring_x, ring_B, ring_start, committed, state_indices, y, w, sc,
            common[0], int(window), *common[1:], ITEMS=k, STAGES=STREAM_STAGES, HOIST_C=hoist_c,
            **meta,
            **regs(stream_maxnreg), **(dict(PDL=True, launch_pdl=True) if pdl else {}),
        )

    # The two launches touch disjoint rows (state, outputs, ring appends) and only read the
    # weights scratch, so the latency-bound flush launch may run beside the bandwidth-bound one.
    run_beside(x.device, flush_launches, stream_launch)


def regs(maxnreg: int) -> dict:
    """Launch options for a register cap (none when 0)."""
    return dict(maxnreg=maxnreg) if maxnreg else {}


def run_beside(device: torch.device, side_work, main_work) -> None:
    """main_work() on the current stream and side_work() beside it on the device's high-priority side
    stream (forked after the work queued so far, joined before returning: the join also orders any
    reuse of the step's scratch after both; its blocks are dispatched ahead of the main launch's
    waiting blocks, and PyTorch's CUDA graphs keep the priority of the capturing stream); one after
    the other off CUDA."""
    if device.type != "cuda":
        main_work()
        side_work()
        return
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        side_work()
    main_work()
    main.wait_stream(side)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One high-priority side stream per device for the launches beside the main one (created on first
    use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return _SIDE_STREAMS[index]
