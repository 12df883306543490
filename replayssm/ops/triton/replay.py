"""ReplaySSM forward and commit in Triton (twins of `ops/replay.py`), and the route table.

Forward of a row with slot s, h_c = committed[s], o = ring_start[s], q new tokens:

    history j < h_c at ring row (o + j) mod R      new token t < q at row (o + h_c + t) mod R
    Λ = A * cumsum([Δ_hist, Δ_new])                (fp32, recomputed every step, all <= 0)
    y_t = e^{Λ_t} (S0 C_t) + Σ_j Δ_j e^{Λ_t-Λ_j} (B_j·C_t) x_j + Σ_{k<=t} (same, new) + D x_t

A route is how one step runs these sums; every route reads S0 once per row and writes it only on
flush rows (h_c + q > W). Each is a frozen settings object:

    Mono      one launch, one program per (P tile, head, row), CUDA-core reductions (`replay_mono.py`)
    MonoMMA   the same with tensor-core products, for several tokens (`replay_mono_mma.py`)
    Lean      one token: the state product beside the ring term and flush launches (`replay_lean.py`)
    Stream    several tokens: a weights launch, a launch streaming the non-flush rows, and the flush
              rows folded beside it by a persistent launch (`replay_stream.py`)
    Fallback  any shape (masked tiles): the weights and output launches of `replay_step.py`, then the
              flush rows folded per token in fp32 (`replay_fold.py`)

`pick_route` chooses one from `ROUTES` by tokens per row, state dtype and size; a shape whose tiles
the chosen route cannot cover takes `Fallback`. Appended rows never overlap history rows
(h_c + q <= R), so no launch reads what it writes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.replay_fold import launch_fold, replay_materialize_triton
from replayssm.ops.triton.replay_lean import launch_lean
from replayssm.ops.triton.replay_mono import launch_mono
from replayssm.ops.triton.replay_mono_mma import JOIN_ROWS, launch_mono_mma
from replayssm.ops.triton.replay_step import launch_step
from replayssm.ops.triton.replay_stream import launch_stream, stream_supported
from replayssm.ops.triton.rounding import device_seed

__all__ = ["ROUTES", "Fallback", "Lean", "Mono", "MonoMMA", "Row", "Stream", "pick_route",
           "replay_commit_triton", "replay_forward_triton", "replay_materialize_triton"]


def _check_tile(block_p: int, num_warps: int) -> None:
    if block_p < 1 or block_p & (block_p - 1) or num_warps not in (1, 2, 4, 8):
        raise ValueError(f"tile {block_p}x{num_warps}: block_p a power of two, num_warps 1, 2, 4 or 8")


def _check_maxnreg(name: str, value: int) -> None:
    if value and not 24 <= value <= 255:
        raise ValueError(f"{name}={value}: a register cap per thread is 24 to 255 (0: none)")


@dataclass(frozen=True)
class Mono:
    """One launch per step (`replay_mono.launch_mono`). order: a grid of 2b rows that dispatches the
    flush rows' (longer, folding) programs first, so the short ones fill in behind them."""

    block_p: int = 32
    num_warps: int = 4
    order: bool = False

    def __post_init__(self):
        _check_tile(self.block_p, self.num_warps)
        if self.block_p < 16:
            raise ValueError(f"Mono: block_p={self.block_p} < 16 (the fold's tensor-core product)")


@dataclass(frozen=True)
class MonoMMA:
    """One launch per step with tensor-core products (`replay_mono_mma.launch_mono_mma`). order: as
    `Mono`; join: a flush row's fold first and its outputs from the folded state, in one pass over
    its tile, JOIN_ROWS rows at a time; split: a flush row's tile in that many programs (with order
    and join); maxnreg: a register cap per thread (0: none)."""

    block_p: int = 32
    num_warps: int = 4
    order: bool = False
    join: bool = False
    split: int = 1
    maxnreg: int = 0

    def __post_init__(self):
        _check_tile(self.block_p, self.num_warps)
        _check_maxnreg("maxnreg", self.maxnreg)
        if self.block_p < 16:
            raise ValueError(f"MonoMMA: block_p={self.block_p} < 16 (tensor-core products)")
        if self.split not in (1, 2) or (self.split > 1 and not (self.order and self.join)):
            raise ValueError(f"MonoMMA: split={self.split} is 1, or 2 with order and join")
        if self.join and (self.block_p // self.split) % JOIN_ROWS:
            raise ValueError(f"MonoMMA: join needs block_p / split = {self.block_p // self.split} "
                             f"a multiple of {JOIN_ROWS}")


@dataclass(frozen=True)
class Lean:
    """One token (`replay_lean.launch_lean`). few_flush_programs_per_sm: on steps where at most half
    the rows flush, the flush launch works with that many programs per SM (0: always its default)."""

    block_p: int = 32
    num_warps: int = 4
    few_flush_programs_per_sm: int = 0

    def __post_init__(self):
        _check_tile(self.block_p, self.num_warps)
        if self.block_p < 16:
            raise ValueError(f"Lean: block_p={self.block_p} < 16 (the fold's tensor-core product)")


@dataclass(frozen=True)
class Stream:
    """Several tokens (`replay_stream.launch_stream`). items: pieces per streaming program;
    flush_programs_per_sm: of the persistent flush launch; flush_parts: a flush piece in that many
    column parts, one per pipelined iteration; flush_maxnreg / stream_maxnreg: register caps of the
    two launches (0: none); pdl: the streaming launch programmatically dependent on the weights
    launch (sm_90+)."""

    flush_programs_per_sm: int
    flush_parts: int
    flush_maxnreg: int
    stream_maxnreg: int
    pdl: bool
    items: int = 8
    block_p: int = 64
    num_warps: int = 4

    def __post_init__(self):
        _check_tile(self.block_p, self.num_warps)
        _check_maxnreg("flush_maxnreg", self.flush_maxnreg)
        _check_maxnreg("stream_maxnreg", self.stream_maxnreg)
        if self.block_p < 16 or self.num_warps > 4:
            # Its tensor-core pieces hit an illegal memory access with 8 warps (64x8, q = 4, H200).
            raise ValueError(f"Stream: tile {self.block_p}x{self.num_warps} needs block_p >= 16 and "
                             f"at most 4 warps")
        if self.flush_parts not in (1, 2):
            raise ValueError(f"Stream: flush_parts={self.flush_parts} is 1 or 2")


@dataclass(frozen=True)
class Fallback:
    """Any shape and dtype (tail tiles masked): `replay_step.launch_step`'s weights and output launches,
    then `replay_fold.launch_fold` folds the flush rows (re-reading only their S0)."""

    block_p: int = 32
    num_warps: int = 4

    def __post_init__(self):
        _check_tile(self.block_p, self.num_warps)


Route = Mono | MonoMMA | Lean | Stream | Fallback


class Row(NamedTuple):
    """A row of `ROUTES`: steps of several tokens per row (or one), with an fp32 state (or 16-bit; None:
    either), of at most `most` row-heads b * H (None: any) and lo <= b < hi rows (hi None: any)."""

    several: bool
    fp32: bool | None
    most: int | None
    rows: tuple[int, int | None]
    route: Route
    why: str


_ONE, _SEVERAL, _ANY_ROWS = False, True, (0, None)
_STREAM_FP32 = dict(flush_programs_per_sm=2, flush_parts=1, flush_maxnreg=160, stream_maxnreg=72, pdl=True)
_STREAM_16BIT = dict(flush_programs_per_sm=4, flush_parts=2)

# The route table; a step takes the first row that matches it. Small steps take one launch (there a
# launch's latency outweighs the bytes the split routes save), larger ones the split routes.
ROUTES = (
    Row(_ONE, True, 512, _ANY_ROWS, Mono(32, 4), "few programs: four warps each keep the SMs busy"),
    Row(_ONE, False, 128, _ANY_ROWS, Mono(32, 4), "the same, at the smaller 16-bit tiles' bytes"),
    Row(_ONE, None, 2048, (0, 64), Mono(32, 2),
        "two-warp programs: an SM holds more of these latency-bound ones"),
    Row(_ONE, None, 2048, (64, None), Mono(32, 2, order=True),
        "many short rows: the flush rows' programs first, so no fold starts in the last wave"),
    Row(_ONE, True, 8191, _ANY_ROWS, Lean(32, 4), "from here one launch's latency costs less than its bytes"),
    Row(_ONE, True, 32767, _ANY_ROWS, Lean(32, 4, few_flush_programs_per_sm=2),
        "while few rows flush, fewer fold programs leave the SMs to the output launch beside them"),
    Row(_ONE, True, None, _ANY_ROWS, Lean(32, 4, few_flush_programs_per_sm=1), "the same, at larger steps"),
    Row(_ONE, False, None, _ANY_ROWS, Lean(32, 4, few_flush_programs_per_sm=2),
        "16-bit states: two fold programs per SM on few-flush steps (H100, 8B b=256: 246 vs 254 us)"),
    Row(_SEVERAL, True, 128, _ANY_ROWS, MonoMMA(32, 4), "few programs: four warps each"),
    Row(_SEVERAL, True, 512, (0, 16), MonoMMA(32, 2), "two-warp programs; few rows: not joined"),
    Row(_SEVERAL, True, 512, (16, None), MonoMMA(32, 2, join=True),
        "many rows: a flush row's fold and outputs in one pass over its tile"),
    Row(_SEVERAL, True, 1536, _ANY_ROWS, MonoMMA(64, 2, order=True, join=True, split=2),
        "about one wave: flush tiles in two programs each, dispatched first, end the step sooner"),
    Row(_SEVERAL, True, 4096, (0, 16), MonoMMA(64, 2, order=True),
        "few, long rows: flush rows first, not joined"),
    Row(_SEVERAL, True, 4096, (16, 128), MonoMMA(64, 2, order=True, join=True, maxnreg=128),
        "joined under a 128-register cap: more programs per SM below 128 rows"),
    Row(_SEVERAL, True, 4096, (128, None), MonoMMA(64, 2, order=True, join=True),
        "from 128 rows the cap costs more than it gains"),
    Row(_SEVERAL, True, 8192, _ANY_ROWS, Stream(**_STREAM_FP32, items=2),
        "the split routes from here; two pieces per program keep small grids full"),
    Row(_SEVERAL, True, None, _ANY_ROWS, Stream(**_STREAM_FP32),
        "eight pieces per program; the caps fit two flush and two streaming programs per SM"),
    Row(_SEVERAL, False, 128, _ANY_ROWS, MonoMMA(32, 4, join=True),
        "few programs: four warps; flush rows joined"),
    Row(_SEVERAL, False, 512, _ANY_ROWS, MonoMMA(32, 2, join=True), "two-warp programs, flush rows joined"),
    Row(_SEVERAL, False, 2048, _ANY_ROWS, MonoMMA(64, 2, order=True, join=True, split=2),
        "about one wave: flush tiles in two programs each, dispatched first"),
    Row(_SEVERAL, False, 8192, _ANY_ROWS,
        Stream(**_STREAM_16BIT, flush_maxnreg=128, stream_maxnreg=0, pdl=True, items=2),
        "two pieces per program; flush pieces in two column parts, four flush programs per SM"),
    Row(_SEVERAL, False, None, _ANY_ROWS,
        Stream(**_STREAM_16BIT, flush_maxnreg=96, stream_maxnreg=80, pdl=False),
        "eight pieces per program; the caps let an SM hold flush and streaming programs at once"),
)


def _fits(route: Route, P: int, N: int) -> bool:
    """Whether the route's whole tiles cover a (P, N) state (it has no tail masks)."""
    return isinstance(route, Fallback) or (stream_supported(P, N, route.block_p) and N >= 16)


@functools.lru_cache(maxsize=1024)
def pick_route(b: int, q: int, H: int, P: int, N: int, state_dtype: torch.dtype = torch.float32) -> Route:
    """The route for b rows of q tokens of an (H, P, N) state: the first matching row of `ROUTES`, or
    `Fallback()` where its tiles do not fit the shape."""
    fp32 = state_dtype == torch.float32
    for row in ROUTES:
        lo, hi = row.rows
        if (row.several == (q > 1) and row.fp32 in (None, fp32) and (row.most is None or b * H <= row.most)
                and lo <= b and (hi is None or b < hi)):
            return row.route if _fits(row.route, P, N) else Fallback()
    raise AssertionError("ROUTES has a last row for every (tokens, state dtype)")


def launch_replay_forward(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                          state_indices, window, dt_softplus, rand_seed, out,
                          route: Route | None = None) -> torch.Tensor:
    """One forward step by `route` (None: `pick_route`). Returns y (`out` when given)."""
    b, q = x.shape[:2]
    assert state.is_contiguous() and ring_x.is_contiguous() and ring_B.is_contiguous()
    assert ring_dt.is_contiguous() and x.stride(3) == 1 and B.stride(3) == 1 and C.stride(3) == 1
    y = out if out is not None else torch.empty_like(x)
    if b == 0:
        return y
    rand_seed = device_seed(rand_seed, state.device)
    S, H, P, N = state.shape
    r = pick_route(b, q, H, P, N, state.dtype) if route is None else route
    if not isinstance(r, (Mono, MonoMMA, Lean, Stream, Fallback)):
        raise TypeError(f"route: a Mono, MonoMMA, Lean, Stream or Fallback, got {r!r}")
    if not _fits(r, P, N):
        raise ValueError(f"{r}: needs block_p dividing P and N a multiple of 32 (P={P}, N={N})")
    args = (x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed, state_indices,
            window, dt_softplus, rand_seed, y, r.block_p, r.num_warps)
    if isinstance(r, Mono):
        launch_mono(*args, order=r.order)
    elif isinstance(r, MonoMMA):
        launch_mono_mma(*args, order=r.order, join=r.join, split=r.split, maxnreg=r.maxnreg)
    elif isinstance(r, Lean):
        launch_lean(*args, few_flush_programs_per_sm=r.few_flush_programs_per_sm)
    elif isinstance(r, Stream):
        launch_stream(*args, items=r.items, flush_programs_per_sm=r.flush_programs_per_sm,
                      flush_parts=r.flush_parts, flush_maxnreg=r.flush_maxnreg,
                      stream_maxnreg=r.stream_maxnreg, pdl=r.pdl)
    else:
        launch_step(*args)
        launch_fold(state, ring_x, ring_B, ring_dt, A, ring_start, committed, state_indices, window, q,
                    rand_seed, r.block_p, r.num_warps)
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
    rand_seed: torch.Tensor | None = None,
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
