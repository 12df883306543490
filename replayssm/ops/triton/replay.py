"""ReplaySSM forward and commit in Triton (twins of `ops/replay.py`).

Forward of a row with slot s, h_c = committed[s], o = ring_start[s], q new tokens:

    history j < h_c at ring row (o + j) mod R      new token t < q at row (o + h_c + t) mod R
    Λ = A * cumsum([Δ_hist, Δ_new])                (fp32, recomputed every step, all <= 0)
    y_t = e^{Λ_t} (S0 C_t) + Σ_j Δ_j e^{Λ_t-Λ_j} (B_j·C_t) x_j + Σ_{k<=t} (same, new) + D x_t

Routes (all read S0 once per row and write it only on flush rows):
- "lean" (`replay_lean.py`, the default for one token where its tiles fit): the weights launch,
  a launch that precomputes the ring term r_t of every row and head, an output launch over the
  non-flush rows that is a gather-and-reduce of the state tiles plus r_t, and the flush rows
  listed and folded (3xTF32 product) by a persistent launch. The default "lean.a.y.v1" runs the
  output launch (bare products S0 C_t) beside all the others, which go on a high-priority side
  stream, then scales and adds r_t in one elementwise launch; with fp32 state from 8,192 row-heads
  its flush launch works with two programs per SM (from 32,768 one) while at most half the rows
  flush (.n2 / .n1, `ONE_TOKEN_FEW_FLUSH`), the whole grid when the batch flushes together.
- "stream-list" (`replay_stream.py`): the weights launch of `replay_step.py`, a pipelined launch
  streaming every non-flush row (tensor-core pieces for several tokens), and the flush rows
  listed on the device and folded by a persistent launch. Suffixes .sN (pipeline stages), .iN
  (pieces per program) and .c (flush launch on a side stream) are for the benchmark sweeps.
  "stream-list.o" streams the outputs of every row and then folds the flush rows in a fold-only
  launch: flush rows read S0 twice, but neither launch holds outputs and fold at once (q = 4, 8B,
  b = 256 on the H200: 500 vs 582 µs, NOTES-kernels.md). The default for several tokens,
  "stream-list.c.y.b.t.p2", streams the non-flush rows while the flush launch (outputs and fold
  of the flush rows in one pass) runs beside it on a high-priority side stream, with bf16 hi + lo
  state products for the outputs (~2^-17 of each term, far below a 16-bit output's rounding;
  TF32 hi + lo otherwise), the weights launch's B·C as tensor-core products, two persistent
  flush programs per SM (as many as its registers let an SM hold at once), and with fp32 state
  the streaming launch programmatically dependent on the weights launch (.l); the weights launch
  runs one warp per program (.v1). Steps with a 16-bit state take the flush pieces in two column
  parts, four programs per SM instead ("stream-list.c.y.b.t.f2.g96.p4.v1.h"). Both load C once per
  streaming program (.h), so the pipeline stages only the state tiles, and cap the registers of
  the flush and streaming launches so that an SM holds programs of both while the flush rows fold
  (fp32 .g160.r72, 16-bit .g96.r80). Up to 8,192 pieces they take two pieces per program instead
  of eight (.i2, `FEW_PIECES`; the 16-bit route then as before the caps, with .l:
  "stream-list.c.y.b.t.f2.g128.p4.v1.h.i2.l"). Small steps take "mono.t" (`auto_route`): up to
  4,096 row-heads with fp32 state (2,048 with 16-bit states), from 1,024 on as "mono.t.o", which
  dispatches the flush rows' programs first, and with ".j32" by rows (`MONO_T_JOIN_ROWS`; fp32 64-row
  tiles under 128 rows with a register cap, ".r128"); above 512
  row-heads and up to 1,536 (fp32) or 2,048 (16-bit) as "mono.t.o.j32.f2" at 64x2, a flush row's tile
  in two programs (`MONO_T_SPLIT_ROW_HEADS`).
- "mono" / "mono.t" (`replay_mono.py`, `replay_mono_mma.py`): one launch, one program per (P tile,
  head, row) that reads its tile, writes the outputs and appends, and on a flush row folds after
  (mono.t with .jN: folds first and forms its outputs from the folded state in the same pass, N rows at
  a time; with .o.jN.fM, M programs of 1/M of its rows each work a flush row's tile, dispatched first).
  "auto" takes "mono" for small one-token steps, as "mono.o" from 64 rows (`MONO_ORDER_ROWS`).
- "fused" (`replay_step.py`): the weights launch, then one output launch per (P tile, head, row)
  that also folds and writes the flush rows from the tile already in registers.
- "split": the same two launches, flush rows folded by `replay_fold.py` afterwards (re-reads S0
  of flush rows only).
- "mma" (`replay_mma.py`): tensor-core outputs (split-TF32 / 3xTF32 products) + `replay_fold.py`.
Appended rows never overlap history rows (h_c + q <= R), so no launch reads what it writes.
"""

from __future__ import annotations

import functools
import re

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.replay_fold import launch_fold, replay_materialize_triton
from replayssm.ops.triton.replay_lean import launch_lean
from replayssm.ops.triton.replay_mma import MMA_CONFIG, launch_mma
from replayssm.ops.triton.replay_mono import launch_mono
from replayssm.ops.triton.replay_mono_mma import launch_mono_mma
from replayssm.ops.triton.replay_step import launch_step
from replayssm.ops.triton.replay_stream import launch_stream, stream_supported
from replayssm.ops.triton.ssu import LaunchConfig

__all__ = ["replay_commit_triton", "replay_forward_triton", "replay_materialize_triton"]

# Routes and tiles from the H200 runs of benchmarks/bench_kernels.py (NOTES-kernels.md), where
# their whole tiles fit: one token takes "lean.a.y.v1" at 32x4, several
# "stream-list.c.y.b.t.p2.l.v1.h.g160.r72" at 64x4 (VERIFY_16BIT_ROUTE with a 16-bit state);
# else replay_step.py (q = 1) or the tensor-core route (q > 1). 8B shape, b = 256, fp32 state:
#   q = 1: lean.a.y 314.3 us vs lean.c 320.1 (small launches beside the output launch on a
#          high-priority stream; lean.a on a normal one 320.8), stream-list 380 (sessions 4, 11);
#   q = 4 (session 11, call 6, one run): stream-list.c.y.b.t 433.4 us (flush rows' outputs and
#          product fold in one pass beside the streaming launch, high-priority; B·C as products),
#          .c.y.b 444.1, .c.y.b.t.p8 443.0, .b.t (flush launch after) 466.6, stream-list.o.p5.b.t
#          462.3, stream-list.o.p5.b 471.7 (calls 1-3: 470.8-476.0 vs 483.5-487.0 without .b);
#          session 12, call 2: .p2 408.2 vs 431.8 / 433.0 for .c.y.b.t (4 flush programs per SM, of
#          which its 173 registers let 2 run at once), .g128.p3 415.5, .g128 421.9.
# Session 13 (calls 2-3, q = 4, 64x4; NOTES-kernels.md): the flush pieces in two column parts under a
# 128-register cap with four programs per SM (.f2.g128.p4) win for 16-bit states at every size
# measured (8B b = 64-512: 110.5-693.1 vs 121.3-725.8 us; TP8 b = 128-512: 39.7-110.7 vs 40.3-120.4)
# and for fp32 states up to 8,192 row-heads (TP8 b = 256 65.1 vs 69.9, b = 512 120.7 vs 127.2, 8B
# b = 32 65.1 vs 69.2, b = 64 120.4 vs 125.5), and lose above (8B b = 128 228.3 vs 217.3, b = 256
# 431.2 vs 409.4, b = 512 846.4 vs 791.7). The streaming launch programmatically dependent on the
# weights launch (.l) gains 0.2-2% with fp32 state wherever a stream route is taken (8B b = 256
# 407.8 vs 409.4; TP8 b = 256 with .f2.g128.p4 63.7 vs 65.1), but with fp16 state it lost at TP8
# b = 128 (44.6 vs 39.7): fp32 only.
# Session 14 (calls 3-4, q = 4): the weights launch is bound by its chains of dependent loads, not
# its arithmetic; in one warp per program (.v1; 178 registers x 32 threads in the sm_90 build at q = 4
# against 123 x 128, so an SM holds about eleven programs instead of four) the step gains 0.7-4% at
# every size a stream route takes: 8B fp32 b = 256 397.3 vs 409.7 us,
# b = 512 769.9 vs 794.5, b = 64 / 32 (.f2.g128.p4.l) 118.4 / 63.6 vs 119.7 / 64.4; 8B fp16 b = 256
# 343.7 vs 357.0; TP8 fp16 b = 256 59.5 vs 60.3. Two warps gain a little less (399.9 at 8B b = 256),
# eight lose (426.1). Measured and dropped: several groups per weights program (.wN, 417-443 vs
# 411), state prefetched into L2 before the wait (.eN, 428-458; mono.t / mono with their tile
# prefetched: 44.0 vs 41.7 at TP8 b = 128), a weights register cap (.uN, 410-411). One token
# (call 6, lean.a.y.v1 vs lean.a.y, whose weights launch runs beside the output launch): 8B fp32
# b = 512 602.1 vs 628.4 us, b = 256 306.6 vs 311.9, b = 128 158.9 vs 160.9, b = 32 47.4 vs 48.2;
# 8B fp16 b = 256 217.0 vs 222.8; TP8 fp32 b = 256 46.5 vs 47.9 (b = 512 84.3 vs 83.8).
# Session 15, measured and not taken: the one-token flush launch at two programs per SM (.p2, four by
# default). In the kernel benchmark, whose rows flush at random steps (a few per step), it gained
# (calls 3-4: 8B fp32 b = 256 303.7-304.5 vs 310.0-310.4 us, 299.7 in run 22; TP8 b = 512 81.5-81.7 vs
# 84.3-84.4; it lost at TP8 b = 256, 48.9-49.4 vs 46.4-46.6). In e2e mode (a) it lost 3.3% (call 6: ON
# 14,159 / 14,176 tok/s vs 14,645 / 14,648 for lean.a.y.v1, interleaved): there the batch decodes in
# lock-step, so every row flushes on the same step, and the fold of the whole batch gets half the
# programs (NOTES-kernels.md, session 15). Session 16 (call 1, bench_kernels --lockstep): .p2 lock-step
# 345.2 / 339.2 vs 311.0 / 316.1 at 8B b = 256; .n2 (fewer flush programs only while at most half the
# rows flush) 306.2 vs 311 at random, 311.2 / 312.6 lock-step, 14,600 / 14,612 vs 14,632 / 14,593
# tok/s in e2e mode (a), 49.3 vs 46.6 at TP8 b = 256: an option, not the default.
# Session 18 (call 2, q = 4, µs, .h = C loaded once per streaming program: sm_90 build 89 registers and
# 45 KB of shared memory vs 104 and 49, five programs per SM instead of four): fp16 state with
# .f2.g128.p4.v1, 8B b = 128 / 256 / 512 183.7 / 335.6 / 657.8 vs 188.1 / 344.5 / 671.3, TP8 b = 256 /
# 512 59.3 / 107.1 vs 60.1 / 110.3; fp32 with .p2.l.v1, 8B b = 256 395.1 / 395.9 / 395.2 vs 397.2 /
# 397.8 / 396.7 (three timings each), b = 128 210.7 vs 210.3, b = 512 771.7 vs 768.6.
CONFIG = LaunchConfig(block_p=32, num_warps=4)
AUTO_ROUTES = (("lean.a.y.v1", LaunchConfig(block_p=32, num_warps=4)),
               ("stream-list.c.y.b.t.p2.l.v1.h.g160.r72", LaunchConfig(block_p=64, num_warps=4)))
VERIFY_16BIT_ROUTE = "stream-list.c.y.b.t.f2.g96.p4.v1.h.r80"  # several tokens, 16-bit state, above mono.t
VERIFY_16BIT_FEW_ROUTE = "stream-list.c.y.b.t.f2.g128.p4.v1.h.i2.l"  # the same up to FEW_PIECES
FOLD_CONFIG = LaunchConfig(block_p=32, num_warps=4)
# Small steps take "mono", one launch: the split routes' four or five launches cost more than their
# bytes there. H200, fp32 state, session 6 call 3 (benchmarks/NOTES-kernels.md), mono vs split:
#   one token:  8B b = 1 5.4 vs 11.8 us, b = 8 17.3 vs 22.0, b = 32 57.0 vs 52.6 (4,096 row-heads);
#               TP8 shape (H = 16) b = 32 12.1 vs 19.1, b = 128 30.8 vs 33.6, b = 256 55.5 vs 52.9;
#   q = 4:      8B b = 1 12.1 vs 34.2, b = 8 50.9 vs 45.3 (1,024 row-heads); TP8 b = 32 29.4 vs 40.6,
#               b = 128 97.8 vs 57.5.
# Several tokens take its tensor-core twin "mono.t" instead (session 7 call 3, 8B shape, q = 4, mono.t
# vs mono vs the split route): b = 1 7.3 vs 12.1 (32x4; 64x4 7.9), b = 8 26.5 (64x4; 32x4 30.9) vs 51.0
# vs 45.7, b = 32 88.6 vs 178.8 vs 79.2 (4,096 row-heads: the split route), b = 128 331.6 vs 258.2;
# TP8 shape (call 4) b = 128 (2,048 row-heads) 49.9 vs 57.7 for the split route, b = 256 89.8 vs 80.4.
# One TF32 pass per product where y is 16-bit vs fp32-accurate products ("mono.t.x"; session 10 call 1,
# q = 4, bf16 y): 8B b = 8 22.4 vs 26.6 us, TP8 b = 32 16.6 vs 19.1, b = 128 41.4 vs 50.3. Against the
# split route (call 2, mono.t 64x4 vs "stream-list.o.p5"): 8B b = 32 (4,096 row-heads) 68.7 vs 78.8 us,
# TP8 b = 256 71.3 vs 80.0, TP8 b = 512 (8,192) 130.6 vs 139.1; hence up to 8,192 row-heads. Above
# (8B b = 128, 16,384), mono.t.x took 333 us against 256 for the split route (call 1). Against
# "stream-list.c.y.b.t" (session 12 call 1, q = 4, mono.t 64x4 second): fp32 TP8 b = 256 (4,096
# row-heads) 71.3 vs 71.2 us, b = 512 128.2 vs 130.3, 8B b = 32 70.8 vs 69.3, b = 64 126.8 vs 128.0;
# fp16 state TP8 b = 256 61.3 vs 80.0, b = 512 123.4 vs 148.2, 8B b = 32 61.7 vs 76.0, b = 64 123.1
# vs 143.5. Hence mono.t up to 2,048 row-heads only. With 16-bit state, session 13 call 3 (TP8, q = 4):
# b = 64 (1,024 row-heads) mono.t 27.8 vs 33.2 for .f2.g128.p4, b = 128 (2,048) 44.6 vs 39.7 (fp32
# state there: 41.8 vs 43.9): 1,024 row-heads for 16-bit states.
# Session 15 (calls 1-2, µs; auto = the 4-warp tiles then): fewer warps let an SM hold more programs
# of these latency-bound steps, and mono.t at 64x2 beats the split route up to 8,192 row-heads with
# fp32 state. mono.t, fp32: TP8 b = 32 (512 row-heads) 32x2 14.5 vs 16.6; 8B b = 8 (1,024) 64x2 20.6
# vs 22.2; TP8 b = 128 (2,048) 39.2 vs 41.4; 4,096: 8B b = 32 62.0 / 62.3 vs 64.1 / 64.5 for the split
# route, TP8 b = 256 64.0 vs 62.5; 8,192: 8B b = 64 111.5 vs 119.3, TP8 b = 512 113.0 vs 118.1; above,
# 8B b = 128 207.2 vs 209.7, b = 256 409.7 vs 397.5 (so not past 8,192); at 128 row-heads 32x4 stays
# (8.5 vs 9.2). mono.t, fp16: 32x2 (64x2 lost there): TP8 b = 64 (1,024) 26.9 vs 32.8 for 64x2, 8B b = 8
# 21.8 vs 25.6 (64x4 22.7), TP8 b = 32 17.3 vs 17.0 for 64x4; the split route still wins above 1,024
# (TP8 b = 128 39.2 vs 43.0). mono, fp32: TP8 b = 128 (2,048) 32x2 29.6 / 30.0 vs 30.8 / 30.9, 8B
# b = 8 (1,024) 16.1 / 16.1 vs 17.5 / 17.4; at 512 32x4 stays (TP8 b = 32 12.2 vs 12.6). mono, fp16:
# TP8 b = 32 (512) 32x2 13.7 vs 14.3, b = 8 (128) 32x4 7.6 vs 8.1.
MONO_CONFIGS = {  # (up to row-heads, tile), by fp32 (True) or 16-bit (False) state
    True: ((512, LaunchConfig(block_p=32, num_warps=4)), (None, LaunchConfig(block_p=32, num_warps=2))),
    False: ((128, LaunchConfig(block_p=32, num_warps=4)), (None, LaunchConfig(block_p=32, num_warps=2))),
}
MONO_T_CONFIGS = {
    True: ((128, LaunchConfig(block_p=32, num_warps=4)), (512, LaunchConfig(block_p=32, num_warps=2)),
           (None, LaunchConfig(block_p=64, num_warps=2))),
    False: ((128, LaunchConfig(block_p=32, num_warps=4)), (None, LaunchConfig(block_p=32, num_warps=2))),
}
MONO_MAX_ROW_HEADS = 2048  # b * H at or below which "auto" takes "mono" (one token)
# Session 20 (calls 4-5): with the streaming routes' register caps (below) they beat mono.t from 2,048
# row-heads on (fp32, µs, mono.t vs .i2.g160.r72): TP8 b = 128 39.4-39.6 vs 36.9-37.0, b = 256 63.7-64.5
# vs 61.0-61.1, b = 512 112.5-114.0 vs 108.2-108.5; 8B b = 32 (4,096) 62.0-62.6 vs 62.0, b = 64 110.7-111.5
# vs 108.6-108.8; at 1,024 mono.t still wins (TP8 b = 64 23.5 vs 25.7-25.9). 16-bit states already
# stopped at 1,024.
# Session 22 (calls 1-3, µs per step, the usual cursor mix): a flush row's program folds after its
# outputs, and where a fold started in the last wave it set the step's end. With the flush rows'
# programs dispatched first (.o) the short programs fill in behind them. fp32, q = 4, mono.t 64x2 ->
# .o vs "auto" then: TP8 b = 64 (1,024 row-heads) 23.4 -> 22.2 vs 23.4; b = 128 (2,048) 39.4 -> 34.5 vs
# 37.2 (the streaming route); b = 256 (4,096) 64.2 -> 60.0 vs 60.7; 8B b = 16 (2,048) 37.3 -> 34.7 vs
# 38.7; b = 32 (4,096) 62.3 -> 60.2 vs 61.7; at 8,192 it loses (8B b = 64 111.8 vs 108.5), at 512 and at
# 8B b = 8 it ties (TP8 b = 32 32x2 14.2 vs 14.4; 20.8 vs 20.8). fp16, mono.t 32x2 -> .o: TP8 b = 64
# 26.7 -> 23.9 (auto); above 1,024 the 16-bit streaming route stays ahead (TP8 b = 128 34.7 vs .o 38.7).
# One token (mono 32x2 -> .o), random mix: TP8 b = 64 18.3 -> 17.1, b = 128 29.9 -> 28.1 (fp16 29.3 ->
# 26.2); but lock-step (a batch that began together, e2e mode (a): 15 steps in 16 flush no row, and the
# doubled grid is all cost) 15.8 -> 16.8 and 27.0 -> 28.9. So one token stayed unordered until the engine
# staggered its requests' checkpoints (session 27: `MONO_ORDER_ROWS` below); verify steps' rows drift
# apart with their accept counts.
# Several tokens, by fp32 (True) or 16-bit (False) state: "auto" takes "mono.t" up to the second b * H
# (16-bit: session 13, 1,024), as "mono.t.o" from the first.
MONO_T_ROW_HEADS = {True: (1024, 4096), False: (1024, 1024)}
# One token takes "mono.o" from this many rows (session 27, call 5, µs, the random mix, mono 32x2 -> .o):
# fp32 TP8 b = 64 18.3 -> 17.0, b = 128 29.8 -> 28.1; fp16 b = 64 19.0 -> 17.5, b = 128 29.4 -> 26.2.
# Fewer, longer rows lose (8B b = 8 / 16: fp32 16.1 / 27.4 -> 16.4 / 28.3, fp16 14.5 / 24.5 -> 15.0 /
# 24.4; TP8 b = 32 fp16 13.6 -> 14.0, fp32 at its 32x4 tile 12.2 -> 11.5). Lock-step still loses (TP8
# b = 64 / 128: 15.7 / 26.9 -> 16.6 / 28.7), but the engine staggers its requests' checkpoints
# (engine/model_runner.py), so a batch admitted together no longer flushes on one step.
MONO_ORDER_ROWS = 64
# Several tokens: a flush row's outputs and fold in one pass, 32 rows at a time (.j32, the fold first and
# the outputs from the folded state; replay_mono_mma._joined_pass), from this many rows, by fp32 (True) or
# 16-bit (False) state and the tile's rows (absent: never). Session 28 (calls 1-4, µs, the usual mix,
# two timings each, mono.t -> .j32 at auto's tile and order): 16-bit states gain at every size timed
# (TP8 b = 1 / 8 / 16 / 32 6.8 / 12.0 / 15.0 / 17.3 -> 6.0 / 9.3 / 11.8 / 16.3, b = 64 .o 23.9 -> 23.2;
# 8B b = 1 / 2 / 4 7.6 / 9.9 / 13.0 -> 7.0 / 8.6 / 11.7, b = 8 .o 20.7 -> 19.9). fp32 gains with many
# rows (32-row tiles: TP8 b = 16 / 32 11.3 / 14.4 -> 10.6 / 13.4; 64-row tiles: TP8 b = 128 / 256 34.5 /
# 60.0 -> 33.1 / 58.7) and loses or ties with few (8B b = 4 12.4 -> 13.7, TP8 b = 1 6.0 -> 6.0, TP8 b = 64
# 22.3 -> 23.2, 8B b = 8 / 16 / 32 20.8 / 34.5 / 60.4 -> 21.3 / 34.6 / 61.4), except 8B b = 1 / 2 (7.2 /
# 9.1 -> 7.1 / 8.7), left out with the rest of the few-row sizes. One token (mono) loses (TP8 b = 64 / 128
# 17.1 / 28.6 -> 18.8 / 32.1).
# Session 30 (call 1, µs, two timings each): with a register cap of 128 (.r128) the fp32 join gains at
# 64-row tiles below 128 rows too: 8B q = 4 b = 16 / 32 (2,048 / 4,096 row-heads) "mono.t.o" 34.69-34.76 /
# 60.15-60.16 -> ".o.j32.r128" 32.77 / 57.85 (".o.r128" 36.5 / 62.8); from 128 rows the cap loses a little
# (TP8 b = 128 / 256 ".o.j32" 32.93 / 58.56-59.07 -> 33.15-33.41 / 59.25). Triton 3.6's sm_90 build of
# ".o.j32" at 64x2 is 128 registers, no spill; ".r128" spills 2 bytes (another allocation and schedule).
# Call 2, side by side: 8B b = 16 / 32 ".o" 34.4-34.8 / 60.6-60.7, uncapped ".o.j32" 34.8-34.9 / 62.2 (so
# the cap, not the join alone, gains), ".o.j32.r128" 33.0 / 58.4-58.5; TP8 b = 112 31.3-31.4 / 29.8 / 29.9.
MONO_T_JOIN_ROWS = {True: {32: 16, 64: 16}, False: {32: 1}}  # 16-bit mono.t tiles are 32 rows (but .f2's)
MONO_T_JOIN_CAP_BELOW = 128  # fp32 joins at 64-row tiles below this many rows take ".r128"
# Several tokens: above the first b * H and up to the second, by fp32 (True) or 16-bit (False) state, "auto"
# takes "mono.t.o.j32.f2" at a 64x2 tile: a flush row's tile in two programs of 32 rows (option .fM,
# replay_mono_mma._split_row). Where the grid is about one wave the step ends with its longest programs,
# the flush rows' (fold, write and outputs); halved, they end sooner. Session 29 (calls 1-2, µs, the
# usual mix, two timings each; auto before -> .f2): fp32 q = 4 TP8 b = 48 / 64 / 96 (768 / 1,024 / 1,536
# row-heads) 19.5 / 22.2 / 27.6 -> 16.8 / 20.3 / 27.2, 8B b = 6 / 8 / 12 16.8 / 20.8 / 27.4 -> 16.5 / 20.0
# / 27.0, q = 2 TP8 b = 64 20.7 -> 19.7; fp16 q = 4 TP8 b = 64 / 96 / 128 23.1 / 31.1 / 34.7 (the last two
# the streaming route) -> 20.5 / 25.6 / 32.5, 8B b = 8 / 16 19.8 / 36.9 -> 18.8 / 31.5, q = 2 / 3 TP8
# b = 64 / 128 20.9 / 32.6 -> 19.4 / 30.1. Outside, or where it lost: fp32 q = 3 TP8 b = 64 20.2 -> 20.7;
# fp32 TP8 b = 32 (512, 32x2 .j32) 13.3 -> 14.0, b = 128 / 256 (.o.j32) 33.0 / 58.6 -> 34.1 / 62.7, 8B
# b = 16 / 32 34.5 / 60.6 -> 34.5 / 61.9; fp16 8B b = 4 (512) 11.7 -> 13.0, TP8 b = 192 (3,072) 43.4 ->
# 46.7; 8,192 row-heads 8-12% slower than the streaming route.
MONO_T_SPLIT_ROW_HEADS = {True: (512, 1536), False: (512, 2048)}
MONO_T_NO_STREAM_ROW_HEADS = 8192  # "mono.t" with fp32 state where the streaming tile does not fit
# Several-token stream routes over at most this many pieces take two pieces per program (.i2), not eight:
# session 18 (calls 4-6, µs, .i2 vs .i8): 8B fp32 b = 128 (16,384 pieces) 204.4-205.2 vs 210.2-210.8 in
# three calls; fp16 TP8 b = 128 / 256 / 512 35.7 / 55.3 / 95.8 vs 37.9 / 59.2 / 107.4, 8B b = 128 182.3
# vs 182.6; above, eight win or tie: 8B fp32 b = 256 393.0-394.5 vs 394.6-395.4, b = 512 779-791 vs
# 769-773, fp16 b = 256 / 512 347-350 / 690 vs 335 / 657. There the 16-bit route also takes .l (session 19,
# calls 2-4, µs, .i2.l vs .i2, side by side): TP8 fp16 b = 128 34.45-34.67 vs 35.65-35.69, b = 256
# 53.80-53.93 vs 55.00-55.07, b = 512 94.31-95.00 vs 95.40-95.86; 8B fp16 b = 64 98.3 vs 99.2-99.4, b = 128
# 181.9-184.1 vs 183.0-184.1 (a tie); without .i2 it still ties or loses (8B b = 256 335.4 vs 336.0).
# Session 20 (calls 3-5, µs): the register caps .g160.r72 (fp32) and .g96.r80 (16-bit; below) moved the
# crossover to 8,192 pieces: at 16,384 (8B b = 128) fp32 .g160.r72 198.8-199.0 vs .i2.g160.r72
# 202.2-202.6, fp16 .g96.r80 178.3-178.8 vs .i2.l 181.7-181.8; at 8,192 .i2 still wins or ties (8B fp32
# b = 64 108.6-108.8 vs 109.4-110.0; TP8 b = 512 108.2-108.5 vs 107.9-108.1; fp16 TP8 b = 512 .i2.l
# 93.4-94.3 vs 103.1-103.4).
FEW_PIECES = 8192
# The caps (session 20; benchmarks/NOTES-kernels.md): the flush launch (172 registers) and the streaming
# launch (89) share the SMs while the flush rows fold, and an SM's 64 K registers held two flush
# programs and ONE streaming program (of five alone), so the flush rows' 30% of the step's bytes moved
# at 2.3 TB/s beside a starved stream (Nsight Compute, 8B b = 256: flush alone 400 MB in 176 µs, stream
# 950 MB in 251 µs). Flush capped at 160 and stream at 72 registers fit two of each (µs, 8B fp32 q = 4,
# side by side in calls 3-5): b = 256 375.2-375.7 vs 394.4-395.2 for the uncapped route (.g160 375.5-376.7,
# .r72 376.2-378.2), b = 512 736.2-748.5 vs 769.2-780.8, b = 128 198.8-199.0 vs 204.6-205.7 (.i2). With
# 16-bit state the flush launch held whole SMs (four programs at 128); at 96 the stream capped at 80 gains
# 1.4-2%: 8B fp16 b = 256 330.0-330.3 vs 334.2-335.5, b = 512 642.4-644.3 vs 655.7-657.2.


# One token with fp32 state, from the first b * H on: the flush launch's programs per SM while at most
# half the rows flush (.nN; the whole grid on a step where the batch flushes together). Session 23
# (call 3, µs, 8B shape unless named, the random mix; two timings of auto and .n2 each): b = 256
# (32,768 row-heads) .n1 301.3 / .n2 304.5-304.8 / .n3 307.9 vs 309.6-310.0; b = 512 601.2 / 602.7-604.1 /
# 621.5 vs 625.8-635.2; b = 128 (16,384) 157.6 / 156.8-156.9 / 159.0 vs 160.4-162.0; b = 64 (8,192) 89.4 /
# 83.8-84.6 / 85.4 vs 84.9-85.6; TP8 b = 512 (8,192) 86.2 / 83.8-84.1 / 85.4 vs 84.8-85.6. Lock-step
# (every row flushing on one step of the W) they tie: b = 256 309.0 / 309.3 vs 309.0-309.4, b = 512
# 613.9 / 615.0-615.6 vs 614.0-618.8, b = 128 and TP8 b = 512 within 1 µs. At 4,096 row-heads .n2 lost
# (session 16: TP8 b = 256 49.3 vs 46.6), and with fp16 state it ties or loses (8B b = 256 219.4-220.2
# vs 218.2-219.6): fp32 only.
ONE_TOKEN_FEW_FLUSH = ((32768, 1), (8192, 2))


def auto_route(b: int, q: int, H: int, P: int, N: int,
               state_dtype: torch.dtype = torch.float32) -> tuple[str, LaunchConfig] | None:
    """The route and tile "auto" takes for b rows of q tokens with that state dtype; None where no
    whole-tile route fits."""
    wide = state_dtype == torch.float32
    split_lo, split_hi = MONO_T_SPLIT_ROW_HEADS[wide]
    if q > 1 and split_lo < b * H <= split_hi and stream_supported(P, N, 64):
        return "mono.t.o.j32.f2", LaunchConfig(block_p=64, num_warps=2)
    route, cfg = AUTO_ROUTES[q > 1]
    lo, hi = MONO_T_ROW_HEADS[wide] if q > 1 else (None, MONO_MAX_ROW_HEADS)
    ordered = lo <= b * H <= hi if q > 1 else b >= MONO_ORDER_ROWS
    mono_max = hi
    if q > 1 and wide and not stream_supported(P, N, cfg.block_p):
        mono_max = MONO_T_NO_STREAM_ROW_HEADS  # no streaming tile: mono.t as far as it beat the others
    if b * H <= mono_max:
        one, sizes = ("mono.t", MONO_T_CONFIGS[wide]) if q > 1 else ("mono", MONO_CONFIGS[wide])
        one += ".o" if ordered else ""
        tile = next(c for most, c in sizes if most is None or b * H <= most)
        for c in (tile, LaunchConfig(32, tile.num_warps)):
            if stream_supported(P, N, c.block_p):
                least = MONO_T_JOIN_ROWS[wide].get(c.block_p)  # None: this tile never joins
                join = q > 1 and least is not None and b >= least
                cap = join and wide and c.block_p == 64 and b < MONO_T_JOIN_CAP_BELOW
                return one + (".j32" if join else "") + (".r128" if cap else ""), c
    if not stream_supported(P, N, cfg.block_p):
        return None
    few = q > 1 and b * H * (P // cfg.block_p) <= FEW_PIECES
    if q > 1 and not wide:
        route = VERIFY_16BIT_FEW_ROUTE if few else VERIFY_16BIT_ROUTE
    elif few:
        route += ".i2"
    elif q == 1 and wide:
        route += next((f".n{n}" for least, n in ONE_TOKEN_FEW_FLUSH if b * H >= least), "")
    return route, cfg


# Route options: a letter and a number (keyword = the number), or a flag letter (keyword = value).
_SPLIT_NAMES = dict(s="stages", i="items", p="flush_programs_per_sm", v="weights_warps")
_SPLIT_FLAGS = dict(c=("concurrent", True), o=("outputs_all", True), y=("priority", True),
                    b=("bf16_products", True))
_OPTIONS = {
    "stream-list": ({**_SPLIT_NAMES, "r": "stream_maxnreg", "g": "flush_maxnreg", "f": "flush_parts",
                     "k": "flush_stages"},
                    {**_SPLIT_FLAGS, "t": ("bc_dot", True), "l": ("pdl", True), "h": ("hoist_c", True)}),
    "lean": ({**_SPLIT_NAMES, "f": "flush_block_p", "w": "flush_warps", "h": "heads_per_program",
              "n": "few_flush_programs_per_sm"},
             {**_SPLIT_FLAGS, "d": ("dot_fold", True), "e": ("dot_fold", False), "a": ("parallel", True)}),
    "weights": (dict(v="weights_warps"), dict(t=("bc_dot", True))),
}


def route_options(route: str) -> dict:
    """The launch keywords a "stream-list", "lean" or "weights" route's dot-separated options stand
    for (`launch_stream`, `launch_lean`, `launch_weights` via `launch_step`); ValueError for an option
    the route does not take. Parsed once per route string: eager steps call this every layer."""
    return dict(_parse_route(route))


@functools.lru_cache(maxsize=64)
def _parse_route(route: str) -> tuple:
    family, *opts = route.split(".")
    names, flags = _OPTIONS[family]
    bad = [o for o in opts if o not in flags and not (o[:1] in names and o[1:].isdigit())]
    if bad:
        raise ValueError(f"route {route!r}: unknown options {bad}")
    return tuple({**{names[o[0]]: int(o[1:]) for o in opts if o not in flags},
                  **dict(flags[o] for o in opts if o in flags)}.items())


@functools.lru_cache(maxsize=64)
def _parse_mono(route: str) -> tuple[str, bool, int, int, int] | None:
    """(family, order, join rows, flush programs per tile, register cap) of a one-launch route
    "mono[.o][.rN]" or "mono.t[.x][.o][.jN][.fM][.rN]"; None for other routes."""
    m = re.fullmatch(r"(mono|mono\.t|mono\.t\.x)(\.o)?(?:\.j(\d+))?(?:\.f(\d+))?(?:\.r(\d+))?", route)
    if m is not None and m[1] == "mono" and (m[3] or m[4]):
        raise ValueError(f"route {route!r}: options .jN and .fM are mono.t's (several tokens); route 'mono' "
                         f"has none")
    if m is not None and m[4] and int(m[4]) < 2:
        raise ValueError(f"route {route!r}: option .fM needs M >= 2 flush programs per tile")
    if m is not None and m[5] and not 24 <= int(m[5]) <= 255:
        raise ValueError(f"route {route!r}: option .rN caps the registers per thread at N, 24 to 255")
    return None if m is None else (m[1], bool(m[2]), int(m[3] or 0), int(m[4] or 1), int(m[5] or 0))


def launch_replay_forward(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                          state_indices, window, dt_softplus, rand_seed, out,
                          config: LaunchConfig | None = None, route: str = "auto") -> torch.Tensor:
    """Launch one forward step with an explicit tile config.

    route "stream-list" (with its sweep suffixes): `replay_stream.py`; "fused":
    `replay_step.py`, flush folded in the output launch; "split": the same outputs, flush rows
    folded by `replay_fold.py`; "mono": `replay_mono.py`, one launch ("mono.t": its tensor-core
    twin `replay_mono_mma.py`, one TF32 pass per product where y is 16-bit; "mono.t.x": fp32-accurate
    products there too, for the benchmarks; each with .o: the flush rows' programs first); "auto":
    `auto_route` ("mono"
    for small steps, else "lean.a.y.v1" for one token, a "stream-list.c.y.b.t" route for several) where
    their tiles fit, else "mma" for q > 1, "fused" (fp32 state) or "split";
    "weights[.t][.vN]": the weights launch alone (benchmark diagnostics only: y is not written).
    """
    b, q = x.shape[:2]
    assert state.is_contiguous() and ring_x.is_contiguous() and ring_B.is_contiguous()
    assert ring_dt.is_contiguous() and x.stride(3) == 1 and B.stride(3) == 1 and C.stride(3) == 1
    y = out if out is not None else torch.empty_like(x)
    if b == 0:
        return y
    if route == "auto":
        picked = auto_route(b, q, *state.shape[1:], state.dtype) if config is None else None
        if picked is not None:
            route, config = picked
        else:
            # The fused fold's stochastic rounding costs registers every program pays for (see
            # NOTES-kernels.md), so 16-bit states fold in their own launch.
            route = "mma" if q > 1 else "fused" if state.dtype == torch.float32 else "split"
    if route.split(".")[0] in ("stream-list", "lean"):
        # "stream-list|lean[.sSTAGES][.iITEMS][.c][.o][.pN][.y][.b]": pipeline stages, pieces per
        # program, flush launches on a side stream (replay_stream.py, replay_lean.py), outputs of every
        # row in one launch with a fold-only flush launch after it, flush programs per SM, a
        # high-priority side stream, bf16 hi + lo state products (several tokens, bf16 C and y). lean
        # also takes .d / .e (fold flush tiles with a 3xTF32 product, the default / fp32 rank-one
        # updates), .fROWS / .wWARPS (flush tile), .hN (heads per ring-term program), .nN (flush
        # programs per SM while at most half the rows flush) and .a (the small launches beside the
        # output launch, `launch_lean` parallel); stream-list .t (the weights launch's B·C as
        # tensor-core products), .rN / .gN (register caps of the streaming / flush launch), .fN (the
        # flush pieces in N column parts), .kN (the flush loop's pipeline stages with .fN), .l (the
        # streaming launch programmatically dependent on the weights launch), .vN (the weights
        # launch's warps; lean takes it too). The benchmarks sweep them.
        lean = route.startswith("lean")
        kw = route_options(route)
        cfg = config or CONFIG
        if not stream_supported(state.shape[2], state.shape[3], cfg.block_p):
            raise ValueError(f"route {route!r} needs block_p dividing P and N a multiple of 32")
        if q > 1 and cfg.num_warps > 4:
            # Its tensor-core pieces hit an illegal memory access on the H200 with 8 warps (64x8,
            # q = 4, benchmark sweep); not established why, so as the mma route: at most 4.
            raise ValueError(f"config.num_warps must be at most 4 for {route!r} with q > 1")
        launch = launch_lean if lean else launch_stream
        launch(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
               state_indices, window, dt_softplus, rand_seed, y, cfg.block_p, cfg.num_warps, **kw)
        return y
    mono = _parse_mono(route)
    if mono is not None:
        # .o: the flush rows' programs dispatched first (`replay_mono._ordered_row`); .jN (mono.t): a flush
        # row's outputs and fold in one pass, N rows at a time (`replay_mono_mma._joined_pass`); .fM
        # (mono.t): a flush row's tile in M programs (`replay_mono_mma._split_row`); .rN: at most N
        # registers per thread.
        cfg = config or CONFIG
        family, order, join, split, maxnreg = mono
        if family == "mono":
            launch_mono(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                        state_indices, window, dt_softplus, rand_seed, y, cfg.block_p, cfg.num_warps,
                        order=order, maxnreg=maxnreg)
        else:
            launch_mono_mma(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                            state_indices, window, dt_softplus, rand_seed, y, cfg.block_p, cfg.num_warps,
                            exact=family == "mono.t.x", order=order, join=join, split=split,
                            maxnreg=maxnreg)
        return y
    diag = route.split(".")[0] == "weights"
    if route in ("fused", "split") or diag:
        # "weights[.t][.vN]": the weights launch alone as a stream-list route with those options runs
        # it (.t: B·C on tensor cores; .vN: N warps per program).
        kw = route_options(route) if diag else {}
        cfg = config or CONFIG
        launch_step(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                    state_indices, window, dt_softplus, rand_seed, y, cfg.block_p, cfg.num_warps,
                    fuse_flush=route == "fused", outputs=not diag, bc_dot=kw.get("bc_dot", False),
                    weights_warps=kw.get("weights_warps", 4))
        if route != "split":
            return y
    elif route != "mma":
        raise ValueError(f"route: unknown {route!r}")
    else:
        launch_mma(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                   state_indices, window, dt_softplus, y, config or MMA_CONFIG)
    launch_fold(state, ring_x, ring_B, ring_dt, A, ring_start, committed, state_indices, window, q, rand_seed,
                FOLD_CONFIG.block_p, FOLD_CONFIG.num_warps)
    return y


def replay_forward_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    ring_x: torch.Tensor,
    ring_B: torch.Tensor,
    ring_dt: torch.Tensor,
    ring_start: torch.Tensor,
    committed: torch.Tensor,
    state_indices: torch.Tensor,
    window: int,
    *,
    dt_softplus: bool = True,
    rand_seed: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """ReplaySSM forward (`ops.replay.replay_forward`); arguments validated by that public op.

    x (b,q,H,P); dt (b,q,H) raw; B, C (b,q,G,N); state (S,H,P,N), written only on flush rows;
    ring_x (S,H,R,P), ring_B (S,G,R,N), ring_dt (S,H,R) fp32: the q new entries are appended;
    ring_start, committed (S,) int32 read-only; state_indices (b,) int32, -1 = padding.
    Returns y (b,q,H,P) in x.dtype (zero rows for padding).
    """
    return launch_replay_forward(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start,
                                 committed, state_indices, window, dt_softplus, rand_seed, out)


@triton.jit
def _replay_commit_kernel(ring_start_ptr, committed_ptr, idx_ptr, acc_ptr, b, q, window, ring_rows,
                          HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(idx_ptr + i, mask=i < b, other=-1)
    m = s >= 0
    s = tl.maximum(s, 0)
    hc = tl.load(committed_ptr + s, mask=m, other=0)
    o = tl.load(ring_start_ptr + s, mask=m, other=0)
    a = tl.load(acc_ptr + i, mask=m, other=0)
    # Decided from the pre-commit cursor, exactly as the forward decided its flush.
    flushed = hc + q > window
    start = tl.where(flushed, o + hc, o)
    if HAS_ROWS:
        start = start % ring_rows
    tl.store(ring_start_ptr + s, start, mask=m)
    tl.store(committed_ptr + s, tl.where(flushed, a, hc + a), mask=m)


def replay_commit_triton(ring_start: torch.Tensor, committed: torch.Tensor, state_indices: torch.Tensor,
                         num_accepted: torch.Tensor, q: int, window: int, *,
                         ring_rows: int | None = None) -> None:
    """Cursor commit on device (`ops.replay.replay_commit`); padding rows untouched, no host sync."""
    b = state_indices.shape[0]
    if b == 0:
        return
    block = 128
    _replay_commit_kernel[(triton.cdiv(b, block),)](
        ring_start, committed, state_indices, num_accepted, b, int(q), int(window),
        int(ring_rows) if ring_rows is not None else 1,
        HAS_ROWS=ring_rows is not None, BLOCK=block, num_warps=4,
    )
