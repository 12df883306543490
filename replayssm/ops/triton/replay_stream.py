"""ReplaySSM forward step, row-streaming launches (route "stream-list"; several tokens take
"stream-list.c.y.b.t.p2.l.v1.h.g160.r72" or "stream-list.c.y.b.t.f2.g96.p4.v1.h.r80" by state dtype,
with .i2 on small steps, `replay.auto_route`).

Same weights launch and arithmetic as `replay_step.py`; the output launches differ in shape. A
grid-per-tile launch gives every program one 16 KiB (P tile, head) piece of the state behind a
chain of dependent loads (slot index, then cursor, then ring rows). Here one program takes ITEMS
consecutive pieces of ONE row (`replay_pieces.py`): the slot, cursor and flush decision are
loaded once, the pieces are contiguous in the slot's state, and the loop over them is
software-pipelined. With two stages the sm_90 build keeps one shared-memory copy of a piece and
issues the next piece's copies only after this one's stores (benchmarks/compile_sm90.py), so the
overlap is between programs. (Pieces in two column parts, one per iteration with three stages,
kept the next part in flight while a part computed, and measured slower: H200, q = 4, 8B,
b = 256, 451.7 vs 409.1 us; NOTES-kernels.md, session 13. The flush launch keeps that form, .fN.)

A row flushes as a whole. "stream-list" streams the non-flush rows, lists the flush rows on the
device (one small program) and folds them in a persistent launch of a few programs per SM, so
the fold's registers never throttle the common case and few flush rows still spread over every
SM (the H200 profile in benchmarks/NOTES-kernels.md showed a flush-only grid launch at a third of
the step). Measured and dropped (NOTES-kernels.md, session 3): folding in the streaming launch
(its registers cut every program's occupancy) and a flush-only grid launch (a launch storm).
The default for several tokens runs the flush launch on a high-priority side stream beside the
streaming launch (.c.y), with bf16 hi + lo output products (.b) and the weights launch's B·C as
tensor-core products (.t); a flush piece writes its outputs and folds in one pass, one product
per column chunk (H200, q = 4, 8B: 433-435 vs 472 us for ".o.p5.b" at b = 256, 228.5 vs 250.3 at
128, 836.1 vs 919.8 at 512; NOTES-kernels.md, session 11), two flush programs per SM (.p2: its
173 registers let an SM hold two; four left half waiting for a second wave: 408.2-409.9 vs
431.8-435.2 us at b = 256, 217.1 vs 229.8 at 128, 794.5 vs 842.2 at 512; session 12), and with
fp32 state the streaming launch programmatically dependent on the weights launch (.l: 407.8 vs
409.4 us at b = 256). Steps of up to 8,192 row-heads with fp32 state and every step with a 16-bit
state take the flush pieces in two column parts under a 128-register cap, four programs per SM
(.f2.g128.p4: TP8 b = 256 63.7 vs 68.4 us with .l; 8B fp16 b = 256 354.2 vs 372.4; session 13).
The weights launch takes one warp per program (.v1: 8B fp32 b = 256 397.3 vs 409.7 us; session 14).
Each streaming program loads C once for its pieces, which share a group (.h: the pipeline then
stages only the state tiles, five programs per SM instead of four; fp16 state 8B b = 256 335.6 vs
344.5 us, fp32 395-396 vs 397-398; session 18). Both launches run under register caps (.gN flush,
.rN streaming) chosen so that an SM holds two programs of each while the flush rows fold: uncapped,
two flush programs (172 registers) left room for one streaming program of five (fp32 8B b = 256
375-376 vs 394-395 us; session 20, the caps' note in `replay.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.replay_flush import LIST_BLOCK, flush_programs, launch_flush
from replayssm.ops.triton.replay_pieces import _any_piece, _piece_mma, c_chunks
from replayssm.ops.triton.replay_step import gdc_wait, launch_weights, pdl_supported
from replayssm.ops.triton.rounding import max_finite, seed_mix, tl_dtype


@triton.jit(do_not_specialize=["seed_mix"])
def _stream_kernel(
    x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, ring_start_ptr, committed_ptr, idx_ptr, y_ptr,
    w_ptr, sc_ptr, seed_mix, window, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, NS: tl.constexpr, ITEMS: tl.constexpr, STAGES: tl.constexpr,
    MMA: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr, ALL: tl.constexpr,
    PDL: tl.constexpr = False, HOIST_C: tl.constexpr = False,
):
    # Non-flush rows only (flush rows are the flush launch's), or with ALL every row's outputs
    # (a fold-only launch then folds the flush rows). ITEMS divides H * (P / BLOCK_P), so every
    # program stays inside one row. (Folding flush rows in this launch too, 3xTF32 per column
    # chunk, measured 646 vs 330 us for it at q = 4 on the H200: NOTES-kernels.md, session 6.)
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
    if ALL or flush == 0:
        # HOIST_C (tensor-core pieces whose ITEMS pieces share a group): C^T loaded once here, so the
        # pipelined loop stages only the state tiles (C is an earlier launch's output: no PDL wait).
        Cs = 0
        if HOIST_C:
            Cs = c_chunks(C_ptr, i, (first // (P // BLOCK_P)) // (H // G), sC_b, sC_t, sC_g, Q, QB, N, NS)
        for k in tl.range(0, ITEMS, num_stages=STAGES):
            _any_piece(k, first, i, s64, valid, hc, o, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr,
                       w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
                       Q, QB, HB, P, N, BLOCK_P, NS, False, MMA, STATE_DTYPE, MAXV, Cs, HOIST_C)


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


@triton.jit(do_not_specialize=["seed_mix"])
def _flush_kernel(
    list_ptr, count_ptr, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, ring_start_ptr, committed_ptr,
    idx_ptr, y_ptr, w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h, H, G, R,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, NS: tl.constexpr, MMA: tl.constexpr, STATE_DTYPE: tl.constexpr,
    MAXV: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
):
    # Persistent over the pieces of the listed flush rows: a fixed, small grid whatever the batch,
    # so the fold's registers never throttle the launch of programs with nothing to do, and the
    # work of few flush rows still spreads over every SM.
    per_row = H * (P // BLOCK_P)
    if SPLIT > 1:
        # This program's pieces (pid, pid + programs, ...) in SPLIT column parts, one per pipelined
        # iteration (`_piece_mma`).
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
        _any_piece(w % per_row, 0, i, s64, s >= 0, hc, o, x_ptr, D_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr,
                   y_ptr, w_ptr, sc_ptr, seed_mix, sx_b, sx_t, sx_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h,
                   H, G, R, Q, QB, HB, P, N, BLOCK_P, NS, True, MMA, STATE_DTYPE, MAXV)


def stream_items(H: int, P: int, block_p: int, items: int) -> int:
    """Pieces per program: the largest power of two <= items that divides a row's piece count."""
    per_row = H * (P // block_p)
    k = 1
    while k * 2 <= items and per_row % (k * 2) == 0:
        k *= 2
    return k


def piece_products(q: int, block_p: int, bf16_products: bool, C: torch.Tensor, y: torch.Tensor) -> int:
    """How a piece forms its state products (the pieces' MMA): 0 = CUDA-core reductions (one token,
    or tiles under the 16 rows a tensor-core operand needs), 1 = tensor-core products with the tile
    as TF32 hi + lo, 2 = as bf16 hi + lo (asked for, with bf16 C and a 16-bit y only)."""
    if q == 1 or block_p < 16:
        return 0
    bf16 = bf16_products and C.dtype == torch.bfloat16 and y.dtype in (torch.bfloat16, torch.float16)
    return 2 if bf16 else 1


def stream_supported(P: int, N: int, block_p: int) -> bool:
    """The streaming launch has no tail masks: whole tiles over P and N a multiple of 32 (or less)."""
    return P % block_p == 0 and (N <= 32 and N & (N - 1) == 0 or N % 32 == 0)


def launch_stream(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                  state_indices, window, dt_softplus, rand_seed, y, block_p: int, num_warps: int,
                  items: int = 8, stages: int = 2, concurrent: bool = False, outputs_all: bool = False,
                  flush_programs_per_sm: int = 4, priority: bool = False,
                  bf16_products: bool = False, bc_dot: bool = False, stream_maxnreg: int = 0,
                  flush_maxnreg: int = 0, flush_parts: int = 1,
                  flush_stages: int = 3, pdl: bool = False, weights_warps: int = 4,
                  hoist_c: bool = False) -> None:
    """Weights launch (`replay_step.py`), the streaming launch over non-flush rows, then the flush
    rows listed on the device and folded by a persistent launch (concurrent, on CUDA: the flush
    launches run on a side stream beside the streaming launch). outputs_all (tiles of >= 16 rows):
    the streaming launch takes every row and the lean route's fold-only launch follows it.
    flush_programs_per_sm: programs per SM of the persistent flush (or, with outputs_all, fold-only)
    launch. priority: the side stream is high-priority. bf16_products: the pieces' output products
    take the tile as bf16 hi + lo (bf16 C and 16-bit y only). bc_dot: the weights launch's B·C as
    tensor-core products (`launch_weights`). stream_maxnreg / flush_maxnreg: a register cap for the
    streaming / flush launch (0: the compiler's choice; sweep options, more programs per SM).
    flush_parts (several tokens): the flush launch takes each piece in that many column parts,
    one per iteration of its loop, pipelined flush_stages deep (`_piece_mma`). pdl: the streaming
    launch starts while the weights launch runs (programmatic dependent launch, where
    `pdl_supported`; it waits for the weights' writes after loading its rows' slots and cursors).
    weights_warps: the weights launch's warps. hoist_c: the streaming launch loads C once per program
    (tensor-core pieces whose programs stay in one group; else ignored), so its pipeline stages
    only state tiles.
    """
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G, R = B.shape[2], ring_x.shape[2]
    assert stream_supported(P, N, block_p)
    QB, HB = triton.next_power_of_2(q), triton.next_power_of_2(int(window))
    pdl = bool(pdl and not outputs_all and pdl_supported(x.device))
    w, sc = launch_weights(x, dt, A, B, C, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                           state_indices, window, dt_softplus, bc_dot=bc_dot, pdl=pdl,
                           num_warps=weights_warps)
    k = stream_items(H, P, block_p, items)
    sdt = tl_dtype(state.dtype)
    common = (seed_mix(rand_seed), *x.stride()[:3], *C.stride()[:3], *y.stride()[:3], H, G, R)
    mma = piece_products(q, block_p, bf16_products, C, y)
    if flush_parts > 1 and not (mma and N % (min(N, 32) * flush_parts) == 0):
        raise ValueError(f"{flush_parts} column parts need tensor-core pieces (q > 1, block_p >= 16) "
                         f"and N a multiple of {min(N, 32) * flush_parts}")
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
                                   STAGES=flush_stages, **regs(flush_maxnreg))

    outputs_all = outputs_all and block_p >= 16  # fold-only pieces are tensor-core products
    hoist_c = bool(hoist_c and mma and (H // G) * (P // block_p) % k == 0)

    def stream_launch() -> None:
        _stream_kernel[(b * H * (P // block_p) // k,)](
            x, D, C, state, ring_x, ring_B, ring_start, committed, state_indices, y, w, sc,
            common[0], int(window), *common[1:], ITEMS=k, STAGES=stages, ALL=outputs_all, HOIST_C=hoist_c,
            **meta,
            **regs(stream_maxnreg), **(dict(PDL=True, launch_pdl=True) if pdl else {}),
        )

    if outputs_all:
        # The fold overwrites tiles the streaming launch reads: after it, on the same stream.
        stream_launch()
        launch_flush(C, state, ring_x, ring_B, ring_start, committed, state_indices, window, rand_seed, y, w,
                     sc, sc, block_p, num_warps, flush_programs_per_sm, outputs=False)
        return

    # The two launches touch disjoint rows (state, outputs, ring appends) and only read the
    # weights scratch, so the latency-bound flush launch may run beside the bandwidth-bound one.
    run_beside(x.device, flush_launches, stream_launch, concurrent, priority)


def regs(maxnreg: int) -> dict:
    """Launch options for a register cap (none when 0)."""
    return dict(maxnreg=maxnreg) if maxnreg else {}


def run_beside(device: torch.device, side_work, main_work, concurrent: bool, priority: bool = False) -> None:
    """main_work() on the current stream and side_work() beside it on the device's side stream
    (forked after the work queued so far, joined before returning: the join also orders any reuse
    of the step's scratch after both); one after the other when not concurrent or not on CUDA.
    priority: the side stream is a high-priority one (its blocks are dispatched ahead of the main
    launch's waiting blocks; PyTorch's CUDA graphs keep the priority of the capturing stream)."""
    if not (concurrent and device.type == "cuda"):
        main_work()
        side_work()
        return
    main = torch.cuda.current_stream(device)
    side = _side_stream(device, priority)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        side_work()
    main_work()
    main.wait_stream(side)


_SIDE_STREAMS: dict[tuple[int, bool], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, priority: bool = False) -> torch.cuda.Stream:
    """One side stream per device and priority for the concurrent launches (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=index, priority=-1 if priority else 0)
    return _SIDE_STREAMS[key]
