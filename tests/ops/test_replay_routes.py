"""The ReplaySSM route table (`ops.triton.replay.pick_route`): which kernels and launch settings a step
takes, over the measured shapes (CPU, no kernel runs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from replayssm.ops.triton.replay import (  # noqa: E402
    ROUTES,
    Fallback,
    Lean,
    Mono,
    MonoMMA,
    Stream,
    launch_replay_forward,
    pick_route,
)

SHAPES = {"8B": (128, 64, 128), "TP8": (16, 64, 128)}  # H, P, N
STATE = {"fp32": (torch.float32,), "16-bit": (torch.float16, torch.bfloat16)}
S32 = dict(flush_programs_per_sm=2, flush_parts=1, flush_maxnreg=160, stream_maxnreg=72, pdl=True)
S16 = dict(flush_programs_per_sm=4, flush_parts=2)
S16_FEW = Stream(**S16, flush_maxnreg=128, stream_maxnreg=0, pdl=True, items=2)
S16_MANY = Stream(**S16, flush_maxnreg=96, stream_maxnreg=80, pdl=False)
SPLIT = MonoMMA(64, 2, order=True, join=True, split=2)

# (shape, state, one or several tokens per row) -> [(first b, last b, route)] for b = 1..512: the
# dispatch this table must keep (the kernels, tiles and launch options the step takes).
EXPECTED = {
    ("8B", "fp32", "one"): [(1, 4, Mono(32, 4)), (5, 16, Mono(32, 2)), (17, 63, Lean(32, 4)),
                            (64, 255, Lean(32, 4, few_flush_programs_per_sm=2)),
                            (256, 512, Lean(32, 4, few_flush_programs_per_sm=1))],
    ("8B", "fp32", "several"): [(1, 1, MonoMMA(32, 4)), (2, 4, MonoMMA(32, 2)), (5, 12, SPLIT),
                                (13, 15, MonoMMA(64, 2, order=True)),
                                (16, 32, MonoMMA(64, 2, order=True, join=True, maxnreg=128)),
                                (33, 64, Stream(**S32, items=2)), (65, 512, Stream(**S32))],
    ("8B", "16-bit", "one"): [(1, 1, Mono(32, 4)), (2, 16, Mono(32, 2)),
                              (17, 512, Lean(32, 4, few_flush_programs_per_sm=2))],
    ("8B", "16-bit", "several"): [(1, 1, MonoMMA(32, 4, join=True)), (2, 4, MonoMMA(32, 2, join=True)),
                                  (5, 16, SPLIT), (17, 64, S16_FEW), (65, 512, S16_MANY)],
    ("TP8", "fp32", "one"): [(1, 32, Mono(32, 4)), (33, 63, Mono(32, 2)), (64, 128, Mono(32, 2, order=True)),
                             (129, 511, Lean(32, 4)), (512, 512, Lean(32, 4, few_flush_programs_per_sm=2))],
    ("TP8", "fp32", "several"): [(1, 8, MonoMMA(32, 4)), (9, 15, MonoMMA(32, 2)),
                                 (16, 32, MonoMMA(32, 2, join=True)), (33, 96, SPLIT),
                                 (97, 127, MonoMMA(64, 2, order=True, join=True, maxnreg=128)),
                                 (128, 256, MonoMMA(64, 2, order=True, join=True)),
                                 (257, 512, Stream(**S32, items=2))],
    ("TP8", "16-bit", "one"): [(1, 8, Mono(32, 4)), (9, 63, Mono(32, 2)), (64, 128, Mono(32, 2, order=True)),
                               (129, 512, Lean(32, 4, few_flush_programs_per_sm=2))],
    ("TP8", "16-bit", "several"): [(1, 8, MonoMMA(32, 4, join=True)), (9, 32, MonoMMA(32, 2, join=True)),
                                   (33, 128, SPLIT), (129, 512, S16_FEW)],
}


@pytest.mark.parametrize("shape, state, tokens", sorted(EXPECTED))
def test_table_keeps_measured_dispatch(shape, state, tokens):
    """Every batch 1..512, q 1..8 and state dtype of the measured shapes takes exactly the expected
    kernels and launch settings."""
    H, P, N = SHAPES[shape]
    runs = EXPECTED[(shape, state, tokens)]
    assert runs[0][0] == 1 and runs[-1][1] == 512 and all(a[1] + 1 == b[0] for a, b in zip(runs, runs[1:]))
    for lo, hi, want in runs:
        for b in range(lo, hi + 1):
            for q in (1,) if tokens == "one" else range(2, 9):
                for dtype in STATE[state]:
                    got = pick_route(b, q, H, P, N, dtype)
                    assert got == want, f"b={b} q={q} {dtype}: {got} != {want}"


@pytest.mark.parametrize("P, N", [(16, 16), (24, 12), (32, 128), (64, 40)])
def test_shapes_without_whole_tiles_take_the_fallback(P, N):
    """A shape whose P or N the table's tiles do not divide takes `Fallback` (masked tiles)."""
    for b, q in ((1, 1), (64, 1), (512, 1), (1, 4), (64, 4), (512, 4)):
        for dtype in (torch.float32, torch.bfloat16):
            route = pick_route(b, q, 16, P, N, dtype)
            assert route == Fallback() or (P % route.block_p == 0 and N % 32 == 0), (b, q, route)
    assert pick_route(256, 4, 16, 16, 16) == Fallback() and pick_route(1, 1, 4, 24, 12) == Fallback()


def test_table_rows_are_reasoned_and_reachable():
    """Each table row states a reason, and each kind of step (one or several tokens, fp32 or 16-bit) ends
    in a row that takes every size."""
    assert all(row.why and isinstance(row.route, (Mono, MonoMMA, Lean, Stream)) for row in ROUTES)
    for several in (False, True):
        for fp32 in (True, False):
            last = [r for r in ROUTES if r.several == several and r.fp32 in (None, fp32)][-1]
            assert last.most is None and last.rows == (0, None)


@pytest.mark.parametrize("make, error", [
    (lambda: MonoMMA(32, 2, split=2), "split"),
    (lambda: MonoMMA(32, 2, order=True, join=True, split=2), "multiple of 32"),
    (lambda: MonoMMA(16, 1, join=True), "multiple of 32"),
    (lambda: MonoMMA(64, 2, maxnreg=8), "24 to 255"),
    (lambda: Mono(8, 1), "< 16"),
    (lambda: Lean(32, 3), "num_warps"),
    (lambda: Stream(**S32, num_warps=8), "at most 4 warps"),
    (lambda: Stream(**dict(S32, flush_parts=4)), "flush_parts"),
])
def test_settings_are_checked(make, error):
    """Settings a kernel cannot run are refused when made, with the reason."""
    with pytest.raises(ValueError, match=error):
        make()


def _tiny_step(q: int, P: int, N: int) -> tuple:
    """The forward's tensors for one row of q tokens, H = 2, G = 1, S = 2 slots, R = 6 (CPU)."""
    b, H, G, S, R = 1, 2, 1, 2, 6
    i32 = dict(dtype=torch.int32)
    return (torch.randn(b, q, H, P), torch.randn(b, q, H), -torch.ones(H), torch.randn(b, q, G, N),
            torch.randn(b, q, G, N), torch.ones(H), torch.zeros(H), torch.randn(S, H, P, N),
            torch.randn(S, H, R, P), torch.randn(S, G, R, N), torch.rand(S, H, R), torch.zeros(S, **i32),
            torch.zeros(S, **i32), torch.zeros(b, **i32))


@pytest.mark.parametrize("route, q, error", [(Mono(32, 4), 1, "block_p dividing P"),
                                             (Lean(16, 1), 2, "one token"),
                                             (Stream(**S32, block_p=16, num_warps=1), 1, "several tokens"),
                                             ("Lean", 1, "route: a Mono")])
def test_forward_refuses_routes_it_cannot_run(route, q, error):
    """A forced route whose tiles do not cover the state, or that does not take q, or that is no
    settings object, is refused before any launch."""
    with pytest.raises((ValueError, TypeError), match=error):
        launch_replay_forward(*_tiny_step(q, 16, 32), 4, True, 0, None, route=route)
