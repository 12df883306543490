"""Gated RMSNorm of the Mamba-2 block (Nemotron-H: gate first, then a per-group RMS norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replayssm.ops._checks import FLOAT_DTYPES, check_tensor


def rms_norm_gated(
    x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """g = x * silu(z); y = g / rms(g over each group of group_size channels) * weight.

    x, z (..., C) (z None: no gate); weight (C,); C divisible by group_size. The gate and the
    norm run in fp32; the normalized value is cast back to x.dtype *before* the weight is
    applied, as transformers' Nemotron-H does, so the result has the promoted dtype of
    (x, weight) and matches it bit for bit.
    """
    check_tensor("x", x, None, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x: needs at least one dimension")
    C = x.shape[-1]
    if z is not None:
        check_tensor("z", z, tuple(x.shape), FLOAT_DTYPES, x.device)
    check_tensor("weight", weight, (C,), FLOAT_DTYPES, x.device)
    if not isinstance(group_size, int) or group_size < 1 or C % group_size != 0:
        raise ValueError(f"group_size: must be a positive divisor of {C}, got {group_size!r}")
    if not eps > 0:
        raise ValueError(f"eps: must be positive, got {eps!r}")
    g = x.float()
    if z is not None:
        g = g * F.silu(z.float())
    grouped = g.reshape(*g.shape[:-1], C // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.reshape(g.shape).to(x.dtype)
