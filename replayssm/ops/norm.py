"""RMSNorm of the blocks and the gated RMSNorm of the Mamba-2 mixer (Nemotron-H: gate first, then
a per-group RMS norm). Each public op validates, then runs the Triton twin on CUDA
(`ops/triton/norm.py`) or the PyTorch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replayssm.ops._checks import FLOAT_DTYPES, check_tensor
from replayssm.ops.common import pick_impl


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
    return pick_impl("norm", "rms_norm_gated", x, rms_norm_gated_ref)(x, z, weight, eps, group_size)


def rms_norm_gated_ref(
    x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """PyTorch reference of `rms_norm_gated` (same signature, no validation)."""
    C = x.shape[-1]
    g = x.float()
    if z is not None:
        g = g * F.silu(z.float())
    grouped = g.reshape(*g.shape[:-1], C // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.reshape(g.shape).to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cast_before_weight: bool = False
) -> torch.Tensor:
    """y = x / rms(x over the last dimension) * weight, normalized in fp32.

    x (..., C), weight (C,). Nemotron-H multiplies by the weight in fp32 and casts the product to
    x's dtype; Mamba-2 (`cast_before_weight`) casts the normalized x first and multiplies in the
    promoted dtype of (x, weight). Both are matched exactly by the reference.
    """
    check_tensor("x", x, None, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x: needs at least one dimension")
    check_tensor("weight", weight, (x.shape[-1],), FLOAT_DTYPES, x.device)
    if not eps > 0:
        raise ValueError(f"eps: must be positive, got {eps!r}")
    return pick_impl("norm", "rms_norm", x, rms_norm_ref)(x, weight, eps, cast_before_weight)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_before_weight: bool) -> torch.Tensor:
    """PyTorch reference of `rms_norm` (same signature, no validation)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        return weight * h.to(x.dtype)
    return (weight.float() * h).to(x.dtype)
