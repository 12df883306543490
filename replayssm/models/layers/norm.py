"""RMSNorm over the hidden size (the pre-norm of every block and the final norm)."""

from __future__ import annotations

import torch
from torch import nn

from replayssm.ops.norm import rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalized in fp32.

    The two checkpoint families round differently and we follow each exactly: Nemotron-H
    multiplies by the weight in fp32 and casts the product to x's dtype; Mamba-2
    (`cast_before_weight`) casts the normalized x first, then multiplies in the weight's dtype.
    """

    def __init__(self, hidden_size: int, eps: float, *, cast_before_weight: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.cast_before_weight = cast_before_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        return rms_norm(x, self.weight, self.eps, self.cast_before_weight)
