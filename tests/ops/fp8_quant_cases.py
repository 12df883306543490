"""Triton activation quantizer (ops/triton/fp8_quant.py) vs the PyTorch references: the same bits.

Shared by the GPU tests and the interpreter run (as a script under TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import sys

import torch

from replayssm.ops.fp8 import quantize_per_token_ref, quantize_static_ref
from replayssm.ops.triton.fp8_quant import quantize_rows_triton


def rows(M: int, K: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """Random rows spanning 1e-30 .. 1e30 in magnitude (bf16 and fp32 reach them), with a zero row, a row
    of tiny values (amax below the 1e-12 floor), a row with one huge outlier (the rest fall to E4M3
    subnormals and zero) and negative zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    x *= torch.logspace(-30 if dtype != torch.float16 else -4, 30 if dtype != torch.float16 else 4, M,
                        dtype=torch.float64).view(M, 1)
    special = torch.randn(K, generator=g, dtype=torch.float64) * 1e-14
    if M > 1:  # the special rows where there are rows for them (M = 1 keeps one random row)
        x[0] = 0.0
        x[1] = special
    if M > 2:
        x[2, K // 2] = x[2].abs().max() * 1e5 if dtype != torch.float16 else 6e4
    if M > 3:
        x[3, :3] = -0.0
    return x.to(dtype).to(device)


def check_same(got, want, what: str) -> None:
    (gq, gs), (wq, ws) = got, want
    assert gs.shape == ws.shape and gs.dtype == ws.dtype == torch.float32, (what, gs.shape, ws.shape)
    diff = gs.view(torch.int32) != ws.view(torch.int32)
    assert not diff.any(), f"{what}: {int(diff.sum())} scales differ"
    assert gq.shape == wq.shape and gq.dtype == wq.dtype, (what, gq.dtype, wq.dtype)
    diff = gq.view(torch.uint8) != wq.view(torch.uint8)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.numel()} codes differ"


def check_per_token(device, M: int, K: int, dtype: torch.dtype) -> None:
    """quantize_rows_triton(x) gives quantize_per_token_ref's codes and scales bit for bit."""
    x = rows(M, K, dtype, device)
    check_same(quantize_rows_triton(x), quantize_per_token_ref(x), f"per token {dtype} {M}x{K}")
    # a strided view (every other column of a wider tensor) reads the same values
    wide = rows(M, 2 * K, dtype, device, seed=1)[:, ::2]
    check_same(quantize_rows_triton(wide), quantize_per_token_ref(wide), f"strided {dtype} {M}x{K}")


def check_static(device, M: int, K: int, dtype: torch.dtype) -> None:
    """quantize_rows_triton(x, input_scale) gives quantize_static_ref's codes bit for bit: ties of E4M3
    steps (normal and subnormal) round to even, values past 448 * scale saturate."""
    input_scale = torch.tensor([0.25], device=device)  # a power of two: x / scale is exact, ties stay ties
    g = torch.Generator().manual_seed(2)
    x = torch.randn(M, K, generator=g) * torch.logspace(-4, 3, M).view(M, 1)
    ties = torch.tensor([4.25, 4.75, 0.5 * 2.0 ** -9, 1.5 * 2.0 ** -9, 2.5 * 2.0 ** -9, 500.0, -1e4, 13.0])
    x[0, :len(ties)] = ties * 0.25
    x = x.to(dtype).to(device)
    check_same(quantize_rows_triton(x, input_scale), quantize_static_ref(x, input_scale),
               f"static {dtype} {M}x{K}")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check_per_token("cpu", M=7, K=200, dtype=dtype)  # K not a power of two: masked tail
        check_static("cpu", M=5, K=72, dtype=dtype)
    check_per_token("cpu", M=5, K=8192 + 300, dtype=torch.bfloat16)  # two passes over K
    check_static("cpu", M=3, K=8192 + 40, dtype=torch.float32)
    sys.exit(0)
