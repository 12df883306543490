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

Activation quantization, `quantize_per_token` and `quantize_static`, is one Triton launch on CUDA
(ops/triton/fp8_quant.py) and the PyTorch `*_ref` elsewhere, bit for bit the same
(`quantize_path` picks). The row-wise GEMMs take the weight scale as dense fp32 rows, (1, N) or
(E, N): `scale_rows` gives a view of a per-channel scale and expands a per-tensor one once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from replayssm.ops.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE

ACTIVATIONS = ("dynamic", "static", "none")
# Per-tensor / per-expert weight scales expanded to dense rows (scale_rows), kept while the scale lives.
_EXPANDED_SCALES: WeakIdKeyDictionary = WeakIdKeyDictionary()


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
    scale = amax.clamp(min=MIN_SCALE) / FP8_MAX
    q = (w / (scale if scale.dim() > 1 else scale.reshape(1, 1))).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in fp32, rounded once to `dtype`; scale broadcasts as in quantize_fp8."""
    if scale.dim() == 1:
        scale = scale.reshape(-1, 1)  # (N,) per channel or (1,) per tensor, against (N, K)
    return (q.float() * scale).to(dtype)


def quantize_path(x: torch.Tensor) -> str:
    """Which code quantizes activations x: "triton" (one launch) or "torch" (the `*_ref` functions)."""
    if not x.is_cuda:
        return "torch"  # CPU: the Triton kernel runs on CUDA only (tests run it under the interpreter)
    if not _has_triton():
        return "torch"  # no Triton installed: the PyTorch reference, the same bits in ~7 kernels
    return "triton"


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (E4M3 (M, K), scales (M, 1) fp32): each row scaled so that its largest |x| maps to 448
    (see quantize_per_token_ref; the kernel comes from quantize_path)."""
    if quantize_path(x) == "triton":
        from replayssm.ops.triton.fp8_quant import quantize_rows_triton

        return quantize_rows_triton(x)
    return quantize_per_token_ref(x)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: scale = max(amax, 1e-12) * fl(1 / 448) per row, x / scale in fp32, saturated to
    +-448, rounded to nearest even in E4M3.

    The product with the fp32 reciprocal is what CUDA's tensor-by-scalar division computes anyway
    (and differs from a true division in the last bit); written out, the CPU gives the same bits."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_SCALE) * (1.0 / FP8_MAX)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (E4M3 (M, K), scales (M, 1) fp32) with the per-tensor input_scale (1,) fp32 as every
    row's scale (values past 448 * scale saturate); the kernel comes from quantize_path."""
    if quantize_path(x) == "triton":
        from replayssm.ops.triton.fp8_quant import quantize_rows_triton

        return quantize_rows_triton(x, input_scale)
    return quantize_static_ref(x, input_scale)


def quantize_static_ref(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: x / input_scale in fp32, saturated to +-448, rounded to nearest even in E4M3."""
    xq = (x.float() / input_scale.reshape(1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()


def scale_rows(weight_scale: torch.Tensor, N: int) -> torch.Tensor:
    """A weight scale as the row-wise scaled GEMMs take it: fp32, dense, (1, N) for a linear's (N, 1) or
    (1,) scale, (E, N) for stacked experts' (E, N, 1) or (E, 1, 1).

    A per-channel scale is a view (no copy). A per-tensor or per-expert one is expanded once and kept
    beside the scale tensor (`_EXPANDED_SCALES`), keyed on its version counter, so a scale loaded in
    place later is expanded again; inference tensors keep no version counter and are expanded at every
    call."""
    lead = weight_scale.shape[0] if weight_scale.dim() == 3 else 1
    rows = weight_scale.reshape(lead, -1)
    if rows.shape[1] == N and rows.dtype == torch.float32 and rows.is_contiguous():
        return rows
    if weight_scale.is_inference():
        return rows.float().expand(lead, N).contiguous()
    key = (weight_scale._version, N)
    kept = _EXPANDED_SCALES.get(weight_scale)
    if kept is None or kept[0] != key:
        kept = _EXPANDED_SCALES[weight_scale] = (key, rows.float().expand(lead, N).contiguous())
    return kept[1]


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
    xq, x_scale = quantize_per_token(x2) if input_scale is None else quantize_static(x2, input_scale)
    if path == "tensorwise":
        scale_a, scale_b = input_scale.reshape(()), weight_scale.reshape(())
    else:
        # Row-wise: scale_a (M, 1) per token, scale_b (1, N) per output channel, both fp32 and dense.
        scale_a, scale_b = x_scale, scale_rows(weight_scale, N)
    # weight (N, K) row-major is the column-major (K, N) operand _scaled_mm wants.
    out = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], N)
