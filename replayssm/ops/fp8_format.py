"""The FP8 E4M3 format's constants, in a module of their own: the PyTorch ops (ops/fp8.py) and the
Triton kernels they dispatch to (ops/triton/fp8_*.py) both import them, without an import cycle."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row or token gets a tiny scale, not a division by zero
