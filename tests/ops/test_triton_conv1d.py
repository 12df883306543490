"""Triton causal conv1d update and commit vs their references (interpreter, GPU when present)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

pytest.importorskip("triton")


def test_conv_interpreted():
    """Under the interpreter: update outputs match with the window unchanged; commit matches exactly."""
    run_interpreted("conv")


@requires_cuda
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,q", [(4, 1), (4, 4), (2, 3)])
def test_conv_gpu(act, K, q):
    """On the GPU at a Nemotron-like channel count: update and commit match the reference."""
    from triton_cases import check_conv

    check_conv("cuda", Dc=1000, K=K, b=12, q=q, S=40, act=act)
