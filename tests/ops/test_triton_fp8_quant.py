"""Triton FP8 activation quantizer vs the PyTorch references, bit for bit (interpreter, GPU when present)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

from replayssm.ops.fp8 import quantize_path

pytest.importorskip("triton")


def test_quantize_rows_interpreted():
    """Under the interpreter the Triton quantizer writes the references' codes and scales (bf16, fp16,
    fp32 rows with zero, tiny and huge values; K masked, K past one pass; per token and static)."""
    run_interpreted(script="fp8_quant_cases.py")


def test_cpu_takes_the_reference():
    """On the CPU activations are quantized by the PyTorch reference."""
    assert quantize_path(torch.randn(2, 16)) == "torch"


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M, K", [(1, 4096), (256, 4096), (96, 2688), (33, 21504)])
def test_quantize_rows_gpu(dtype, M, K):
    """On the GPU, at Nemotron-H 8B and Nemotron 3 Nano widths (one pass and two), the kernel gives the
    references' bits, per token and static."""
    from fp8_quant_cases import check_per_token, check_static

    check_per_token("cuda", M=M, K=K, dtype=dtype)
    check_static("cuda", M=M, K=K, dtype=dtype)


@requires_cuda
def test_reference_same_bits_on_cpu_and_cuda():
    """The PyTorch reference gives the same scales and codes on CUDA as on the CPU (the scale is a product
    with fl(1 / 448), what CUDA's division by a scalar computes)."""
    from fp8_quant_cases import check_same, rows

    from replayssm.ops.fp8 import quantize_per_token_ref

    x = rows(64, 1000, torch.bfloat16, "cuda")
    got = [t.cpu() for t in quantize_per_token_ref(x)]
    check_same(got, quantize_per_token_ref(x.cpu()), "reference cuda vs cpu")


@requires_cuda
def test_cuda_takes_triton(monkeypatch):
    """On CUDA quantize_per_token and quantize_static run the Triton kernel, not the PyTorch reference."""
    import replayssm.ops.fp8 as fp8

    def refuse(*a, **kw):
        raise AssertionError("the PyTorch quantizer ran")

    monkeypatch.setattr(fp8, "quantize_per_token_ref", refuse)
    monkeypatch.setattr(fp8, "quantize_static_ref", refuse)
    x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    assert quantize_path(x) == "triton"
    xq, scale = fp8.quantize_per_token(x)
    assert xq.dtype == fp8.FP8_DTYPE and scale.shape == (5, 1)
    xq, scale = fp8.quantize_static(x, torch.tensor([0.01], device="cuda"))
    assert xq.dtype == fp8.FP8_DTYPE and scale.shape == (5, 1)
