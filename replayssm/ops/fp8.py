"""FP8 (E4M3) weights: quantization, dequantization and the FP8 linear with its dispatch.

    fp8_linear(x, weight, weight_scale, bias, input_scale, activation) -> x @ (weight * weight_scale).T + bias
  x (..., K) in the model dtype; weight (N, K) float8_e4m3fn; weight_scale fp32, (N, 1) per output
  channel or (1,) per tensor; input_scale (1,) fp32 for static activations, else None.
  activation: "dynamic" (per-token scales computed on the fly), "static" (the checkpoint's per-tensor
  input_scale) or "none" (weight-only: activations stay in the model dtype).

A weight is q * scale with q in E4M3 (|q| <= 448) and scale broadcast over its rows; stacked
experts use the same rule with a leading expert dimension, (E, N, K) * (E, N | 1, 1).

On CUDA with FP8 tensor cores the activations are quantized to E4M3 (per token, or with the static
scale) and `torch._scaled_mm` multiplies in FP8 with fp32 accumulation; everywhere else
`fp8_linear_ref` runs the dequantized weight in the activation dtype (the exact reference the CPU
tests compare against the dequantized checkpoint).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
ACTIVATIONS = ("dynamic", "static", "none")
_MIN_SCALE = 1e-12  # an all-zero row or token gets a tiny scale, not a division by zero


def quantize_fp8(w: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w (..., N, K) -> (q (..., N, K) E4M3, scale fp32) with w ~ q * scale.

    per_channel: one scale per row, shape (..., N, 1); else one per matrix, (..., 1, 1) (shape (1,)
    for a plain 2-D weight, the layout of a per-tensor `weight_scale`).
    """
    w = w.float()
    if per_channel:
        amax = w.abs().amax(dim=-1, keepdim=True)
    else:
        amax = w.abs().amax(dim=(-2, -1), keepdim=True)
        if w.dim() == 2:
            amax = amax.reshape(1)
    scale = amax.clamp(min=_MIN_SCALE) / FP8_MAX
    q = (w / (scale if scale.dim() > 1 else scale.reshape(1, 1))).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in fp32, rounded once to `dtype`; scale broadcasts as in quantize_fp8."""
    if scale.dim() == 1:
        scale = scale.reshape(-1, 1)  # (N,) per channel or (1,) per tensor, against (N, K)
    return (q.float() * scale).to(dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (E4M3 (M, K), scales (M, 1) fp32): each row scaled so that its largest |x| maps to 448."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_SCALE) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) -> E4M3 with the per-tensor input_scale (values past 448 * scale saturate)."""
    return (x.float() / input_scale.reshape(1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_path(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, activation: str) -> str:
    """Which kernel runs this FP8 linear: "dequant", "tensorwise" or "rowwise" (`torch._scaled_mm`)."""
    if not x.is_cuda:
        return "dequant"  # CPU: no FP8 GEMM; the dequantized reference is exact
    if activation == "none":
        return "dequant"  # weight-only checkpoint: the activations stay in the model dtype
    cap = torch.cuda.get_device_capability(x.device)
    if cap < (8, 9):
        return "dequant"  # FP8 tensor cores start at compute capability 8.9 (Ada, Hopper)
    if x.dtype != torch.bfloat16:
        return "dequant"  # the row-wise scaled GEMM writes bf16 only; fp16 / fp32 models take the reference
    if weight.shape[0] % 16 or weight.shape[1] % 16:
        return "dequant"  # _scaled_mm needs K and N multiples of 16
    if activation == "static" and weight_scale.numel() == 1:
        return "tensorwise"  # one scale per operand (ModelOpt FP8)
    if cap < (9, 0):
        return "dequant"  # row-wise scales (per token, per channel) need Hopper or newer
    return "rowwise"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               input_scale: torch.Tensor | None, activation: str) -> torch.Tensor:
    """See the module docstring; the kernel comes from fp8_path."""
    assert weight.dtype == FP8_DTYPE and weight.dim() == 2, (weight.dtype, weight.shape)
    assert (input_scale is not None) == (activation == "static"), activation
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must be (..., {weight.shape[1]}), got {tuple(x.shape)}")
    path = fp8_path(x, weight, weight_scale, activation)
    if path == "dequant":
        return fp8_linear_ref(x, weight, weight_scale, bias)
    return _scaled_mm_linear(x, weight, weight_scale, bias, input_scale, path)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The dequantized reference: x @ (weight * weight_scale).T (+ bias) in x.dtype."""
    return F.linear(x, dequantize_fp8(weight, weight_scale, x.dtype), bias)


def _scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None, input_scale: torch.Tensor | None, path: str) -> torch.Tensor:
    """FP8 x FP8 -> bf16 on the tensor cores; activations quantized here (static or per token)."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if input_scale is None:
        xq, x_scale = quantize_per_token(x2)
    else:
        xq, x_scale = quantize_static(x2, input_scale), input_scale.float()
    if path == "tensorwise":
        scale_a, scale_b = x_scale.reshape(()), weight_scale.float().reshape(())
    else:
        # Row-wise: scale_a (M, 1) per token, scale_b (1, N) per output channel, both fp32 and dense.
        scale_a = x_scale.reshape(-1, 1).expand(M, 1).contiguous()
        scale_b = weight_scale.float().reshape(1, -1).expand(1, N).contiguous()
    # weight (N, K) row-major is the column-major (K, N) operand _scaled_mm wants.
    out = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], N)
