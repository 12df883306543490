"""Triton Gated DeltaNet kernels (baseline state update, replay forward, materialize) vs the references."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

pytest.importorskip("triton")
from gdn_triton_cases import HEADS, PARTS  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
# Head sizes of the Qwen3.5 / Qwen3-Next linear-attention layers (Dk = Dv = 128), fewer heads.
BIG = dict(Dk=128, Dv=128)


@pytest.mark.parametrize("part", sorted(PARTS))
def test_gdn_kernels_interpreted(part):
    """Under the interpreter at tiny shapes (Dk = 48: four key chunks, the last masked; two Dv tiles; W = 4,
    and W = 16 on nearly parallel keys; GQA 1 and 4, fp32 and bf16 state): every ring fill 0..W with and
    without flush, q = 1 and 4, padding rows; outputs and states match the float64 recurrence and the
    references, rings and untouched slots exact."""
    run_interpreted(part, script="gdn_triton_cases.py")


@requires_cuda
@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("n,verify", [(1, False), (4, True), (4, False)])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_state_update_gpu(heads, n, verify, state_dtype):
    """On the GPU at Dk = Dv = 128: baseline decode and verify match the recurrence; nothing else moves."""
    from gdn_triton_cases import check_state_update

    Hk, Hv = HEADS[heads]
    check_state_update("cuda", Hk=Hk * 2, Hv=Hv * 2, b=12, S=70, n=n, verify=verify, state_dtype=state_dtype,
                       act=BF16, **BIG)


@requires_cuda
@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_replay_forward_gpu(heads, n, state_dtype):
    """On the GPU at W = 16, Dk = Dv = 128: every ring fill 0..16, flush and not, q = 1 and 4, match."""
    from gdn_triton_cases import check_replay

    Hk, Hv = HEADS[heads]
    check_replay("cuda", Hk=Hk * 2, Hv=Hv * 2, n=n, W=16, state_dtype=state_dtype, act=state_dtype, **BIG)


@requires_cuda
@pytest.mark.parametrize("block_v,num_warps", [(64, 4), (64, 8), (128, 8)])
@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_replay_tiles_gpu(state_dtype, block_v, num_warps):
    """Replay forward and materialize at the tile configs the benchmark sweeps beyond the default (BLOCK_V
    up to Dv: one program per head) match, nearly parallel keys included."""
    from gdn_triton_cases import check_materialize, check_replay

    for similar in (False, True):
        check_replay("cuda", Hk=2, Hv=8, n=4, W=16, state_dtype=state_dtype, act=BF16, block_v=block_v,
                     num_warps=num_warps, similar=similar, **BIG)
    check_materialize("cuda", Hk=2, Hv=8, W=16, state_dtype=state_dtype, act=BF16, block_v=block_v,
                      num_warps=num_warps, **BIG)


@requires_cuda
@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_materialize_gpu(heads, state_dtype):
    """On the GPU at W = 16, Dk = Dv = 128: materialized states match, n = 0 copies exactly."""
    from gdn_triton_cases import check_materialize

    Hk, Hv = HEADS[heads]
    check_materialize("cuda", Hk=Hk * 2, Hv=Hv * 2, W=16, state_dtype=state_dtype, act=BF16, **BIG)


@requires_cuda
def test_dispatch_gpu():
    """The public ops on CUDA tensors run the Triton kernels (bit-identical to calling them directly)."""
    from gdn_triton_cases import _bits, _cache, _tokens

    from replayssm.ops.gdn import gdn_replay_forward, gdn_replay_materialize, gdn_state_update
    from replayssm.ops.triton.gdn import (
        gdn_replay_forward_triton,
        gdn_replay_materialize_triton,
        gdn_state_update_triton,
    )

    torch.manual_seed(0)
    Hk, Hv, D, W, S, dev = 2, 4, 128, 16, 12, "cuda"
    idx = torch.tensor([3, -1, 0, 7], dtype=torch.int32, device=dev)
    step = _tokens(4, 2, Hk, Hv, D, D, BF16, dev)
    committed = torch.randint(1, W - 1, (S,), dtype=torch.int32)  # materialize reads n = 1 from slot 0
    a = _cache(S, Hk, Hv, D, D, W + 2, committed, BF16, BF16, dev)
    b = [t.clone() for t in a]
    assert torch.equal(gdn_replay_forward(*step, *a, idx, W), gdn_replay_forward_triton(*step, *b, idx, W))
    assert torch.equal(gdn_state_update(a[0], *step, idx), gdn_state_update_triton(b[0], *step, idx))
    src, num, dst = (torch.tensor(x, dtype=torch.int32, device=dev) for x in ([3, 0], [0, 1], [5, 6]))
    gdn_replay_materialize(*a, src, num, dst)
    gdn_replay_materialize_triton(*b, src, num, dst)
    for x, y in zip(a, b):
        assert torch.equal(_bits(x), _bits(y))
