"""Triton RMSNorm and gated RMSNorm vs their references (interpreter, GPU when present)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

pytest.importorskip("triton")


def test_norm_interpreted():
    """Under the interpreter: dtypes, gate on/off, masked groups, strided rows and the float64 formula."""
    run_interpreted("norm")


@requires_cuda
def test_norm_gpu():
    """On the GPU, at the Nemotron-H-8B widths (hidden 4096, mixer groups of 1024), the same checks pass."""
    from triton_cases import check_norm

    check_norm("cuda", rows=300, shapes=((4096, 4096), (8192, 1024), (96, 24)))


@requires_cuda
def test_public_ops_take_triton_on_cuda():
    """On CUDA the public ops dispatch to the Triton twins (same results as calling them directly)."""
    from replayssm.ops.norm import rms_norm, rms_norm_gated
    from replayssm.ops.triton.norm import rms_norm_gated_triton, rms_norm_triton

    x, z, w = (torch.randn(9, 256, device="cuda") for _ in range(3))
    assert torch.equal(rms_norm(x, w[0], 1e-5), rms_norm_triton(x, w[0], 1e-5, False))
    assert torch.equal(rms_norm_gated(x, z, w[0], 1e-5, 64), rms_norm_gated_triton(x, z, w[0], 1e-5, 64))
