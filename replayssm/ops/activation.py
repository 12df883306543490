"""relu² of the Nemotron-H MLP: y = relu(x)², rounded once to x's dtype.

The public op validates and runs the Triton twin (`ops/triton/activation.py`, one pass) on CUDA,
else the PyTorch reference (two elementwise passes: relu, then the square in fp32 opmath). relu is
exact and the square of a 16-bit value is exact in fp32, so both round once and agree bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replayssm.ops._checks import FLOAT_DTYPES, check_tensor
from replayssm.ops.common import pick_impl


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)² elementwise; x any shape and float dtype. Returns a new tensor of x's shape and dtype."""
    check_tensor("x", x, None, FLOAT_DTYPES)
    return pick_impl("activation", "relu2", x, relu2_ref)(x)


def relu2_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of `relu2` (same signature, no validation)."""
    return torch.square(F.relu(x))
