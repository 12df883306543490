"""Triton ReplaySSM forward / commit / materialize vs their references (interpreter, GPU when present)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

pytest.importorskip("triton")
from triton_cases import REPLAY_PARTS  # noqa: E402


@pytest.mark.parametrize("part", sorted(REPLAY_PARTS))
def test_replay_interpreted(part):
    """Under the interpreter: forward+commit cycles (flush, wrap, padding) and materialize match."""
    run_interpreted(part)


def _cycle_gpu(**kw):
    from triton_cases import check_replay_cycle

    check_replay_cycle("cuda", H=8, P=64, N=128, G=2, b=12, S=40, W=16, steps=24, act=torch.bfloat16, **kw)


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q", [1, 2, 4])
@pytest.mark.parametrize("route", ["fused", "split", "mma"])
def test_replay_cycle_gpu(state_dtype, q, route):
    """On the GPU: W=16 cycles with every accept count, flushes and ring wrap match the reference."""
    _cycle_gpu(q=q, state_dtype=state_dtype, route=route)


STREAM_ROUTES = ["stream-list", "stream-list.s3.i16", "stream-list.s1", "stream-list.c", "stream-list.o",
                 "stream-list.o.p5", "stream-list.c.y", "stream-list.o.p5.b", "stream-list.o.p5.b.t",
                 "stream-list.c.y.b.t", "stream-list.c.y.b.t.p2.g128.r96"]
# Options for several tokens only: flush pieces in column parts (.fN, .kN), the streaming launch
# programmatically dependent on the weights launch (.l), the weights launch's warps (.vN), C loaded
# once per streaming program (.h; the test shape's programs stay in one group, so it is taken).
SEVERAL_TOKEN_ROUTES = ["stream-list.f2", "stream-list.c.y.b.t.f2.g128.p4", "stream-list.c.y.b.t.f4.k2",
                        "stream-list.c.y.b.t.p2.l", "stream-list.c.y.b.t.f2.g128.p4.l", "stream-list.b.t.l",
                        "stream-list.c.y.b.t.p2.l.v1", "stream-list.c.y.b.t.f2.g128.p4.v1",
                        "stream-list.c.y.b.t.p2.l.v2", "stream-list.c.y.b.t.p2.l.v1.h",
                        "stream-list.c.y.b.t.f2.g128.p4.v1.h", "stream-list.c.t.h",
                        "stream-list.c.y.b.t.p2.l.v1.h.i2", "stream-list.c.y.b.t.f2.g128.p4.v1.h.i2.l",
                        "stream-list.c.y.b.t.p2.l.v1.h.g160.r72", "stream-list.c.y.b.t.p2.l.v1.h.g160.r72.i2",
                        "stream-list.c.y.b.t.f2.g96.p4.v1.h.r80"]
STREAM_CASES = ([(r, q) for r in STREAM_ROUTES for q in (1, 4)]
                + [(r, q) for r in SEVERAL_TOKEN_ROUTES for q in (2, 4)])


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("route, q", STREAM_CASES)
def test_replay_cycle_stream_gpu(state_dtype, route, q):
    """On the GPU: the row-streaming routes (pipelining depths, side-stream flush, flush pieces in
    column parts, PDL) match the reference."""
    _cycle_gpu(q=q, state_dtype=state_dtype, route=route)


LEAN_ROUTES = ["lean", "lean.i8.s2", "lean.c", "lean.e", "lean.c.f32.w8.h2", "lean.p8.f16.w2.e", "lean.o",
               "lean.a", "lean.a.y", "lean.c.y", "lean.a.b", "lean.a.y.v1", "lean.a.y.v1.p2",
               "lean.a.y.v1.n2", "lean.a.y.v1.n1"]


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("route", LEAN_ROUTES)
def test_replay_cycle_lean_gpu(state_dtype, q, route):
    """On the GPU: the precomputed-ring-term route (pipelined, side-stream flush) matches the reference."""
    _cycle_gpu(q=q, state_dtype=state_dtype, route=route)


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("block", [(64, 4), (32, 4), (16, 2), (64, 2), (32, 2)])
@pytest.mark.parametrize("route", ["mono", "mono.t", "mono.t.x", "mono.t.j16"])
def test_replay_cycle_mono_gpu(state_dtype, q, block, route):
    """On the GPU: the one-launch routes (small batches) match the reference at each tile, also with a
    flush row's outputs and fold in one pass (.j16)."""
    from replayssm.ops.triton.ssu import LaunchConfig

    _cycle_gpu(q=q, state_dtype=state_dtype, route=route, config=LaunchConfig(*block))


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("route, block", [("mono.o", (32, 2)), ("mono.t.o", (64, 2)), ("mono.t.o", (32, 4)),
                                          ("mono.t.o.j16", (64, 2)), ("mono.t.o.j32", (64, 2)),
                                          ("mono.t.o.j32", (32, 2)), ("mono.t.o.j32.f2", (64, 2)),
                                          ("mono.t.o.j16.f2", (32, 2)), ("mono.t.o.j32.f2.r128", (64, 2)),
                                          ("mono.o.r96", (32, 2))])
@pytest.mark.parametrize("b", [12, 300])
@pytest.mark.parametrize("lockstep", [False, True])
def test_replay_cycle_ordered_gpu(state_dtype, q, route, block, b, lockstep):
    """On the GPU: the one-launch routes with the flush rows' programs first (.o: a grid of 2b rows; .f2:
    3b, a flush row's tile in two programs) work every row once and match, with the rows' cursors apart
    or together (lock-step), also under a register cap (.rN: what spills must still be right)."""
    from triton_cases import check_replay_cycle

    from replayssm.ops.triton.ssu import LaunchConfig

    check_replay_cycle("cuda", H=8, P=64, N=128, G=2, b=b, S=b + 28, W=16, steps=20, act=torch.bfloat16, q=q,
                       state_dtype=state_dtype, route=route, config=LaunchConfig(*block), lockstep=lockstep)


@requires_cuda
@pytest.mark.parametrize("q, block", [(1, (64, 4)), (1, (64, 8)), (4, (32, 4)), (4, (64, 4))])
def test_replay_cycle_lean_tiles_gpu(q, block):
    """On the GPU: the lean route's other tiles match the reference."""
    from replayssm.ops.triton.ssu import LaunchConfig

    _cycle_gpu(q=q, state_dtype=torch.float32, route="lean", config=LaunchConfig(*block))


@requires_cuda
@pytest.mark.parametrize("q, block", [(1, (16, 2)), (1, (64, 8)), (4, (64, 4)), (4, (16, 2))])
def test_replay_cycle_stream_tiles_gpu(q, block):
    """On the GPU: the streaming route's other tiles (64x4: the default for q > 1) match the reference."""
    from replayssm.ops.triton.ssu import LaunchConfig

    _cycle_gpu(q=q, state_dtype=torch.float32, route="stream-list", config=LaunchConfig(*block))


@requires_cuda
def test_stream_route_refuses_eight_warps_for_several_tokens():
    """q > 1 on the streaming route refuses 8 warps (an illegal memory access in the H200 sweep)."""
    from replayssm.ops.triton.ssu import LaunchConfig

    with pytest.raises(ValueError, match="num_warps"):
        _cycle_gpu(q=4, state_dtype=torch.float32, config=LaunchConfig(64, 8), route="stream-list")


@requires_cuda
@pytest.mark.parametrize("route, block, q", [("lean.a.y.v1", (32, 4), 1), ("lean.c", (32, 4), 1),
                                             ("lean.a.y.v1.p2", (32, 4), 1), ("lean.a.y.v1.n1", (32, 4), 1),
                                             ("stream-list.c.y.b.t.p2", (64, 4), 4),
                                             ("stream-list.c.y.b.t.p2.f2", (64, 4), 4),
                                             ("stream-list.c.y.b.t.f2.g128.p4.l", (64, 4), 4),
                                             ("stream-list.c.y.b.t.p2.l.v1", (64, 4), 4),
                                             ("stream-list.c", (64, 4), 4)])
def test_side_stream_routes_in_cuda_graph_gpu(route, block, q):
    """Routes with launches on a side stream give the same bits replayed from a CUDA graph as run
    eagerly (the decode and verify steps of the engine replay them from graphs)."""
    from triton_cases import check_graph_replay

    from replayssm.ops.triton.ssu import LaunchConfig

    check_graph_replay(route, LaunchConfig(*block), q)


@requires_cuda
@pytest.mark.parametrize("route, block", [("auto", None), ("stream-list.o.p5", (64, 4)), ("mono.t", (32, 4))])
def test_replay_cycle_fp32_act_gpu(route, block):
    """On the GPU with fp32 activations (fp32-accurate TF32 products, `tf32.dot_split`, at the fp32
    tolerance 2e-4): cycles match the reference."""
    from triton_cases import check_replay_cycle

    from replayssm.ops.triton.ssu import LaunchConfig

    config = LaunchConfig(*block) if block else None
    check_replay_cycle("cuda", H=8, P=64, N=128, G=2, b=12, S=40, W=16, steps=20, q=2, route=route,
                       config=config)


@requires_cuda
@pytest.mark.parametrize("route, block, accurate", [("mono.t", (32, 4), None), ("mono.t", (64, 4), None),
                                                    ("mono.t", (32, 2), None), ("mono.t", (64, 2), None),
                                                    ("stream-list.o.p5.b", (64, 4), "stream-list.o.p5"),
                                                    ("lean.a.b", (64, 4), "lean.a")])
def test_output_products_one_pass_gpu(route, block, accurate):
    """bf16 outputs from cheaper products (one TF32 pass; bf16 hi + lo) stay within 2^-7 max |y| of
    the fp32 reference, as the fp32-accurate products do."""
    from triton_cases import check_output_passes

    from replayssm.ops.triton.ssu import LaunchConfig

    check_output_passes("cuda", route, LaunchConfig(*block), accurate=accurate)


@requires_cuda
@pytest.mark.parametrize(
    "route, block",
    [(r, b) for r in ("fused", "split", "mma") for b in ((32, 4), (64, 4), (64, 8))
     if (r, b) != ("mma", (64, 8))],
)
def test_replay_cycle_tiles_gpu(route, block):
    """On the GPU: the other tile configs the benchmark sweeps compute the same cycles."""
    from replayssm.ops.triton.ssu import LaunchConfig

    _cycle_gpu(q=4, state_dtype=torch.float32, config=LaunchConfig(*block), route=route)


@requires_cuda
def test_mma_route_refuses_eight_warps():
    """The tensor-core route refuses the 8-warp tile that computed wrong outputs on the H200."""
    from replayssm.ops.triton.ssu import LaunchConfig

    with pytest.raises(ValueError, match="num_warps"):
        _cycle_gpu(q=4, state_dtype=torch.float32, config=LaunchConfig(64, 8), route="mma")


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_materialize_gpu(state_dtype):
    """On the GPU: materialized states match, n = 0 copies exactly, sources and other slots untouched."""
    from triton_cases import check_materialize

    check_materialize("cuda", H=8, P=64, N=128, G=2, m=10, S=40, W=16, state_dtype=state_dtype,
                      act=torch.bfloat16)


def test_auto_route_policy():
    """"auto" takes the one-launch route only for small steps, else the measured split routes."""
    from replayssm.ops.triton.replay import auto_route

    assert auto_route(1, 1, 128, 64, 128)[0] == "mono"
    assert auto_route(128, 1, 16, 64, 128)[0] == "mono.o"  # TP8 shape, b = 128: many short rows, ordered
    assert auto_route(64, 1, 16, 64, 128)[0] == "mono.o" and auto_route(32, 1, 16, 64, 128)[0] == "mono"
    assert auto_route(16, 1, 128, 64, 128)[0] == "mono"  # 2,048 row-heads in 16 long rows: unordered
    assert auto_route(32, 1, 128, 64, 128)[0] == "lean.a.y.v1"  # 4,096 row-heads
    # One token, fp32 state: fewer flush programs while few rows flush, from 8,192 row-heads.
    assert auto_route(512, 1, 16, 64, 128)[0] == "lean.a.y.v1.n2"  # TP8 shape, 8,192
    assert auto_route(128, 1, 128, 64, 128)[0] == "lean.a.y.v1.n2"  # 16,384
    assert auto_route(256, 1, 128, 64, 128)[0] == "lean.a.y.v1.n1"  # 32,768
    assert auto_route(4, 4, 128, 64, 128)[0] == "mono.t"
    assert auto_route(32, 4, 16, 64, 128)[0] == "mono.t.j32"  # 512 row-heads in 32 rows: flush rows joined
    assert auto_route(8, 4, 16, 64, 128)[0] == "mono.t"  # 8 rows: not joined
    # 513-1,536 row-heads (fp32): a flush row's tile in two programs, whatever the rows.
    assert auto_route(8, 4, 128, 64, 128)[0] == "mono.t.o.j32.f2"  # 1,024 row-heads
    assert auto_route(64, 4, 16, 64, 128)[0] == "mono.t.o.j32.f2"  # TP8, 1,024
    assert auto_route(48, 2, 16, 64, 128)[0] == "mono.t.o.j32.f2"  # 768
    assert auto_route(96, 3, 16, 64, 128)[0] == "mono.t.o.j32.f2"  # 1,536
    assert auto_route(112, 4, 16, 64, 128)[0] == "mono.t.o.j32.r128"  # 1,792: capped under 128 rows
    assert auto_route(64, 4, 16, 32, 128)[0] == "mono.t.o.j32"  # P = 32: no 64-row tile to split
    assert auto_route(128, 4, 16, 64, 128)[0] == "mono.t.o.j32"  # TP8 shape, 2,048
    assert auto_route(32, 4, 128, 64, 128)[0] == "mono.t.o.j32.r128"  # 4,096 row-heads
    assert auto_route(16, 4, 128, 64, 128)[0] == "mono.t.o.j32.r128"  # 2,048
    assert auto_route(13, 4, 128, 64, 128)[0] == "mono.t.o"  # 1,664 row-heads in 13 rows: not joined
    fp32 = "stream-list.c.y.b.t.p2.l.v1.h.g160.r72"
    assert auto_route(512, 4, 16, 64, 128)[0] == fp32 + ".i2"  # TP8 shape, 8,192 row-heads
    assert auto_route(64, 4, 128, 64, 128)[0] == fp32 + ".i2"  # 8,192 pieces
    assert auto_route(128, 4, 128, 64, 128)[0] == fp32  # 16,384
    assert auto_route(256, 4, 128, 64, 128)[0] == fp32
    # 16-bit states: mono.t up to 2,048 row-heads (split flush tiles above 512), then the flush pieces in
    # column parts, .l only with .i2.
    f16 = torch.float16
    assert auto_route(64, 4, 16, 64, 128, f16)[0] == "mono.t.o.j32.f2"  # 1,024 row-heads
    assert auto_route(128, 4, 16, 64, 128, f16)[0] == "mono.t.o.j32.f2"  # 2,048
    assert auto_route(32, 4, 16, 64, 128, f16)[0] == "mono.t.j32"  # 512; joined at any size
    assert auto_route(1, 4, 128, 64, 128, f16)[0] == "mono.t.j32"
    assert auto_route(64, 4, 16, 32, 128, f16)[0] == "mono.t.o.j32"  # P = 32: 32-row tiles
    assert auto_route(192, 4, 16, 64, 128, f16)[0] == "stream-list.c.y.b.t.f2.g128.p4.v1.h.i2.l"
    assert auto_route(64, 4, 128, 64, 128, f16)[0] == "stream-list.c.y.b.t.f2.g128.p4.v1.h.i2.l"
    assert auto_route(128, 4, 128, 64, 128, f16)[0] == "stream-list.c.y.b.t.f2.g96.p4.v1.h.r80"
    assert auto_route(256, 4, 128, 64, 128, torch.bfloat16)[0] == "stream-list.c.y.b.t.f2.g96.p4.v1.h.r80"
    assert auto_route(128, 1, 16, 64, 128, f16)[0] == "mono.o"  # one token: as fp32
    assert auto_route(256, 1, 128, 64, 128, f16)[0] == "lean.a.y.v1"
    assert auto_route(1, 1, 4, 24, 12) is None  # no whole tile: the masked routes
    # Their tiles by size and state dtype: two warps above 512 row-heads (128 for mono.t and for 16-bit
    # states), 64-row tiles for mono.t above 512 with fp32 state, 32-row tiles where 64 do not fit.
    from replayssm.ops.triton.ssu import LaunchConfig as L

    assert auto_route(32, 1, 16, 64, 128)[1] == L(32, 4) and auto_route(128, 1, 16, 64, 128)[1] == L(32, 2)
    assert auto_route(32, 1, 16, 64, 128, f16)[1] == L(32, 2)
    assert auto_route(8, 1, 16, 64, 128, f16)[1] == L(32, 4)
    assert auto_route(8, 4, 16, 64, 128)[1] == L(32, 4) and auto_route(32, 4, 16, 64, 128)[1] == L(32, 2)
    assert auto_route(64, 4, 16, 64, 128)[1] == L(64, 2) and auto_route(64, 4, 16, 32, 128)[1] == L(32, 2)
    # No streaming tile (P = 32): fp32 steps keep mono.t up to 8,192 row-heads.
    assert auto_route(128, 4, 16, 32, 128) == ("mono.t.o.j32", L(32, 2))
    assert auto_route(512, 4, 16, 32, 128) == ("mono.t.j32", L(32, 2))
    assert auto_route(1024, 4, 16, 32, 128) is None
    assert auto_route(64, 4, 16, 64, 128, f16)[1] == L(64, 2)
    assert auto_route(32, 4, 16, 64, 128, f16)[1] == L(32, 2)



def _tiny_step(q: int, P: int, N: int) -> tuple:
    """The forward's tensors for one row of q tokens, H = 2, G = 1, S = 2 slots, R = 6 (CPU)."""
    b, H, G, S, R = 1, 2, 1, 2, 6
    i32 = dict(dtype=torch.int32)
    return (torch.randn(b, q, H, P), torch.randn(b, q, H), -torch.ones(H), torch.randn(b, q, G, N),
            torch.randn(b, q, G, N), torch.ones(H), torch.zeros(H), torch.randn(S, H, P, N),
            torch.randn(S, H, R, P), torch.randn(S, G, R, N), torch.rand(S, H, R), torch.zeros(S, **i32),
            torch.zeros(S, **i32), torch.zeros(b, **i32))


@pytest.mark.parametrize("route", ["stream-list.d", "stream-list.m", "lean.x3", "mono.e", "stream-list.a",
                                   "lean.f", "lean.t", "weights.x", "weights.t.w2", "mono.j16.o"])
def test_route_options_are_checked(route):
    """A route option the route does not take, or an unknown route, is refused (no silent default)."""
    from replayssm.ops.triton.replay import launch_replay_forward

    with pytest.raises(ValueError, match="unknown"):
        launch_replay_forward(*_tiny_step(1, 16, 32), 4, True, 0, None, route=route)


@pytest.mark.parametrize("route, error", [("mono.t.j8", "needs 16 <="), ("mono.t.x.j24", "needs 16 <="),
                                          ("mono.t.o.j64", "needs 16 <="), ("mono.j32", "mono.t's"),
                                          ("mono.t.o.j32.f2", "needs 16 <="), ("mono.o.f2", "mono.t's"),
                                          ("mono.t.j16.f2", "with options"), ("mono.t.o.f2", "with options"),
                                          ("mono.t.o.j16.f1", "needs M >= 2"), ("mono.t.o.r8", "24 to 255"),
                                          ("mono.o.r256", "24 to 255")])
def test_join_rows_are_checked(route, error):
    """Option .jN takes N >= 16 dividing the tile's rows (a 32-row tile here; with .fM its M-th) and only on
    mono.t, .fM only with .o and .jN, .rN a register cap of 24 to 255; else a clear error."""
    from replayssm.ops.triton.replay import launch_replay_forward
    from replayssm.ops.triton.ssu import LaunchConfig

    with pytest.raises(ValueError, match=error):
        launch_replay_forward(*_tiny_step(2, 32, 32), 4, True, 0, None, LaunchConfig(32, 1), route=route)


@requires_cuda
@pytest.mark.parametrize("route, kernel", [("mono.o.r80", "_mono_kernel"),
                                           ("mono.t.o.j32.r96", "_mono_mma_kernel")])
def test_register_cap_gpu(route, kernel):
    """On the GPU: option .rN compiles the one-launch kernel with at most N registers per thread (the
    uncapped build of this tile takes more), and its outputs still match."""
    from triton_cases import check_replay_cycle

    from replayssm.ops.triton import replay_mono, replay_mono_mma
    from replayssm.ops.triton.ssu import LaunchConfig

    fn = getattr(replay_mono if kernel == "_mono_kernel" else replay_mono_mma, kernel)
    bare, cap = route.rsplit(".r", 1)
    regs = {}
    for r in (route, bare):
        before = _compiled(fn)
        check_replay_cycle("cuda", H=8, P=64, N=128, G=2, b=40, S=60, W=16, steps=20, act=torch.bfloat16,
                           q=1 if kernel == "_mono_kernel" else 4, route=r, config=LaunchConfig(64, 2))
        regs[r] = max(k.n_regs for i, k in _compiled(fn).items() if i not in before)
    assert regs[route] <= int(cap) < regs[bare], regs


def _compiled(fn) -> dict:
    """id -> compiled kernel of every specialization of a Triton JIT function built so far."""
    out = {}
    for cache in fn.device_caches.values():
        for k in cache[0].values():
            k._init_handles()
            out[id(k)] = k
    return out
