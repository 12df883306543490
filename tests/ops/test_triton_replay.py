"""Triton ReplaySSM forward / commit / materialize vs their references (interpreter, GPU when present)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

pytest.importorskip("triton")
from triton_cases import REPLAY_PARTS  # noqa: E402

from replayssm.ops.triton.replay import ROUTES, Fallback, Lean, Mono, MonoMMA, Stream  # noqa: E402

TABLE_ROUTES = list(dict.fromkeys(row.route for row in ROUTES))  # every route the table takes, once
ONE_TOKEN = [r for r in TABLE_ROUTES if isinstance(r, (Mono, Lean))]
SEVERAL = [r for r in TABLE_ROUTES if isinstance(r, (MonoMMA, Stream))]


@pytest.mark.parametrize("part", sorted(REPLAY_PARTS))
def test_replay_interpreted(part):
    """Under the interpreter: forward+commit cycles (flush, wrap, padding) of every route kind and
    materialize match the reference."""
    run_interpreted(part)


def _cycle_gpu(**kw):
    from triton_cases import check_replay_cycle

    check_replay_cycle("cuda", H=8, P=64, N=128, G=2, b=12, S=40, W=16, steps=24, act=torch.bfloat16, **kw)


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q", [1, 2, 4])
@pytest.mark.parametrize("route", [None, Fallback(), Fallback(64, 4), Fallback(64, 8)], ids=str)
def test_replay_cycle_gpu(state_dtype, q, route):
    """On the GPU: W=16 cycles with every accept count, flushes and ring wrap match the reference, by the
    table's choice (None) and by the fallback at its tiles."""
    _cycle_gpu(q=q, state_dtype=state_dtype, route=route)


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("route", ONE_TOKEN, ids=str)
def test_replay_cycle_one_token_gpu(state_dtype, route):
    """On the GPU: every one-token route of the table matches the reference."""
    _cycle_gpu(q=1, state_dtype=state_dtype, route=route)


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q", [2, 4])
@pytest.mark.parametrize("route", SEVERAL, ids=str)
def test_replay_cycle_several_tokens_gpu(state_dtype, q, route):
    """On the GPU: every several-token route of the table matches the reference."""
    _cycle_gpu(q=q, state_dtype=state_dtype, route=route)


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("route, q", [(r, 1) for r in ONE_TOKEN if isinstance(r, Mono) and r.order]
                         + [(r, 4) for r in SEVERAL if isinstance(r, MonoMMA) and r.order], ids=str)
@pytest.mark.parametrize("b", [12, 300])
@pytest.mark.parametrize("lockstep", [False, True])
def test_replay_cycle_ordered_gpu(state_dtype, route, q, b, lockstep):
    """On the GPU: the one-launch routes with the flush rows' programs first (a grid of 2b rows; split:
    3b, a flush row's tile in two programs) work every row once and match, with the rows' cursors apart
    or together (lock-step), also under a register cap (what spills must still be right)."""
    from triton_cases import check_replay_cycle

    check_replay_cycle("cuda", H=8, P=64, N=128, G=2, b=b, S=b + 28, W=16, steps=20, act=torch.bfloat16, q=q,
                       state_dtype=state_dtype, route=route, lockstep=lockstep)


@requires_cuda
@pytest.mark.parametrize("route, q", [(r, 1) for r in ONE_TOKEN if isinstance(r, Lean)]
                         + [(r, 4) for r in SEVERAL if isinstance(r, Stream)], ids=str)
def test_side_stream_routes_in_cuda_graph_gpu(route, q):
    """Routes with launches on a side stream give the same bits replayed from a CUDA graph as run
    eagerly (the decode and verify steps of the engine replay them from graphs)."""
    from triton_cases import check_graph_replay

    check_graph_replay(route, q)


@requires_cuda
@pytest.mark.parametrize("route", [None, Stream(flush_programs_per_sm=2, flush_parts=1, flush_maxnreg=160,
                                                stream_maxnreg=72, pdl=True), MonoMMA(32, 4)], ids=str)
def test_replay_cycle_fp32_act_gpu(route):
    """On the GPU with fp32 activations (fp32-accurate TF32 products, `tf32.dot_split`, at the fp32
    tolerance 2e-4): cycles match the reference."""
    from triton_cases import check_replay_cycle

    check_replay_cycle("cuda", H=8, P=64, N=128, G=2, b=12, S=40, W=16, steps=20, q=2, route=route)


@requires_cuda
@pytest.mark.parametrize("route", [MonoMMA(32, 4), MonoMMA(64, 2), MonoMMA(64, 2, order=True, join=True),
                                   [r for r in SEVERAL if isinstance(r, Stream)][0]], ids=str)
def test_output_products_one_pass_gpu(route):
    """bf16 outputs from cheaper products (one TF32 pass; bf16 hi + lo) stay within 2^-7 max |y| of
    the fp32 reference."""
    from triton_cases import check_output_passes

    check_output_passes("cuda", route)


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_materialize_gpu(state_dtype):
    """On the GPU: materialized states match, n = 0 copies exactly, sources and other slots untouched."""
    from triton_cases import check_materialize

    check_materialize("cuda", H=8, P=64, N=128, G=2, m=10, S=40, W=16, state_dtype=state_dtype,
                      act=torch.bfloat16)


@requires_cuda
def test_register_cap_gpu():
    """On the GPU: maxnreg compiles the one-launch kernel with at most that many registers per thread
    (the uncapped build of this tile takes more), and its outputs still match."""
    from triton_cases import check_replay_cycle

    from replayssm.ops.triton import replay_mono_mma

    fn = replay_mono_mma._mono_mma_kernel
    regs = {}
    for cap in (96, 0):
        # Forget the builds other tests of this process made, so that every kernel listed after the
        # cycle is one this cycle launched (the on-disk cache makes the rebuild cheap).
        fn.device_caches.clear()
        check_replay_cycle("cuda", H=8, P=64, N=128, G=2, b=40, S=60, W=16, steps=20, act=torch.bfloat16, q=4,
                           route=MonoMMA(64, 2, order=True, join=True, maxnreg=cap))
        regs[cap] = max(k.n_regs for k in _compiled(fn).values())
    assert regs[96] <= 96 < regs[0], regs


def _compiled(fn) -> dict:
    """id -> compiled kernel of every specialization of a Triton JIT function built so far."""
    out = {}
    for cache in fn.device_caches.values():
        for k in cache[0].values():
            k._init_handles()
            out[id(k)] = k
    return out
