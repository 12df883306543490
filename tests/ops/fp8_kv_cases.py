"""Fused FP8 KV store (ops/triton/fp8_kv.py) vs the PyTorch store: bit-exact on every cache byte.

Shared by the GPU test and the interpreter run (as a script under TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import sys

import torch

from replayssm.ops.attention import quantize_kv
from replayssm.ops.fp8 import FP8_DTYPE
from replayssm.ops.triton.fp8_kv import store_kv_fp8_triton


def check_store_kv_fp8(device, T=11, H=2, D=24, num_blocks=6, block_size=4, dtype=torch.bfloat16) -> None:
    """k, v strided slices of one qkv tensor, magnitudes from E4M3 subnormals to past saturation,
    ties in the rounding, permuted slots of a larger pool: Triton and the reference write the same bytes,
    and every other byte keeps its NaN poison."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, 3 * H * D, generator=g) * torch.logspace(-6, 2, T).view(T, 1)
    k_scale, v_scale = 0.25, 0.0375
    # k_scale a power of two keeps x / scale exact: ties of E4M3 steps (normal and subnormal, rounding
    # down and up to the even neighbour) and values past saturation.
    ties = torch.tensor([4.25, 4.75, 0.5 * 2.0 ** -9, 1.5 * 2.0 ** -9, 500.0, -1e4])
    qkv[0, H * D:H * D + 6] = ties * k_scale
    qkv = qkv.to(dtype).to(device)
    k = qkv[:, H * D:2 * H * D].view(T, H, D)
    v = qkv[:, 2 * H * D:].view(T, H, D)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T].to(device)
    poison = torch.full((num_blocks, block_size, H, D), float("nan"), device=device).to(FP8_DTYPE)
    got_k, got_v, want_k, want_v = (poison.clone() for _ in range(4))
    store_kv_fp8_triton(k, v, got_k, got_v, slots, k_scale, v_scale)
    want_k.view(-1, H, D)[slots] = quantize_kv(k, k_scale, FP8_DTYPE)
    want_v.view(-1, H, D)[slots] = quantize_kv(v, v_scale, FP8_DTYPE)
    for name, got, want in (("k", got_k, want_k), ("v", got_v, want_v)):
        diff = got.view(torch.uint8) != want.view(torch.uint8)
        assert not diff.any(), f"{name}: {int(diff.sum())} bytes differ"
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slots] = True
    assert got_k.view(-1, H, D)[~written].float().isnan().all(), "a slot outside slot_mapping was written"
    assert not got_k.view(-1, H, D)[written].float().isnan().any()


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check_store_kv_fp8("cpu", dtype=dtype)
    check_store_kv_fp8("cpu", T=3, H=1, D=20)  # H * D not a power of two: masked tail
    sys.exit(0)
