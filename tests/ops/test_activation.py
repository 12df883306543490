"""relu² of the Nemotron-H MLP: reference vs float64, Triton twin bit-exact (interpreter; GPU if any)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

from replayssm.ops.activation import relu2, relu2_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_relu2_ref_is_the_square_of_relu_rounded_once(dtype):
    """The reference equals float64 relu(x)² rounded once to x's dtype (random signs, no zeros)."""
    x = (torch.randn(7, 333) * 20).to(dtype)
    want = torch.clamp(x.double(), min=0).pow(2).to(dtype)
    got = relu2(x)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(relu2_ref(x), want)


def test_relu2_refuses_integer_input():
    """A non-float tensor raises ValueError naming x."""
    with pytest.raises(ValueError, match="x"):
        relu2(torch.ones(3, dtype=torch.int32))


def test_relu2_interpreted():
    """Under the Triton interpreter: the same bits as the reference, ragged block, strided input."""
    pytest.importorskip("triton")
    run_interpreted("activation")


@requires_cuda
def test_relu2_gpu():
    """On the GPU at an 8B MLP width (batch 256 x 21,504): bit-exact, and the public op takes Triton."""
    from triton_cases import check_relu2

    from replayssm.ops.triton.activation import relu2_triton

    check_relu2("cuda", shape=(256, 21504))
    x = torch.randn(256, 21504, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(relu2(x), relu2_triton(x))
