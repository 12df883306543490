"""Fused FP8 KV store vs the PyTorch store_kv path (interpreter, GPU when present)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

pytest.importorskip("triton")


def test_store_kv_fp8_interpreted():
    """Under the interpreter the Triton store writes the PyTorch path's bytes (bf16, fp16, fp32 inputs)."""
    run_interpreted(script="fp8_kv_cases.py")


@requires_cuda
def test_store_kv_fp8_gpu():
    """On the GPU, at a Nemotron attention layer's width (8 KV heads of 128), the bytes are the same."""
    from fp8_kv_cases import check_store_kv_fp8

    check_store_kv_fp8("cuda", T=300, H=8, D=128, num_blocks=40, block_size=16)


@requires_cuda
def test_store_kv_takes_triton_on_cuda(monkeypatch):
    """On CUDA store_kv with an FP8 cache runs the fused kernel (one launch, no PyTorch quantize)."""
    import replayssm.ops.attention as attention
    from replayssm.ops.attention import store_kv
    from replayssm.ops.fp8 import FP8_DTYPE

    def refuse(*a, **kw):
        raise AssertionError("the PyTorch quantize ran")

    monkeypatch.setattr(attention, "quantize_kv", refuse)
    k = torch.randn(5, 2, 16, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 2, 16, device="cuda").to(FP8_DTYPE)
    store_kv(k, k, cache, cache.clone(), torch.tensor([0, 3, 5, 6, 7], device="cuda"), k_scale=0.5)
    assert cache.view(-1, 2, 16)[3].float().abs().sum() > 0
