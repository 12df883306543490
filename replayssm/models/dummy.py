"""Dummy weights: a model from config.json alone, for benchmarks (``load_format="dummy"``).

Every parameter is drawn on its own device from a seeded generator, at a scale that keeps
activations finite through many layers (fan-in scaled matrices, unit norms, a few tokens of
Mamba or Gated DeltaNet memory per head: A_log and dt_bias), so timing runs see real-looking data,
never zeros or NaN. FP8 weights (layers/fp8_linear.py) are drawn the same way and quantized with
their scales.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from replayssm.models import model_class
from replayssm.models.config import ModelConfig
from replayssm.ops.fp8 import FP8_DTYPE, quantize_fp8


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter of `model` in place with seeded random values (see module docstring)."""
    gens: dict[torch.device, torch.Generator] = {}
    params = dict(model.named_parameters())
    # Norms that scale by (1 + weight) (Qwen's OffsetRMSNorm) get weights near 0, i.e. scales near 1.
    offset = {f"{m}.weight" if m else "weight" for m, mod in model.named_modules()
              if getattr(mod, "unit_offset", False)}
    for name, p in params.items():
        if name.endswith("_scale"):
            continue  # an FP8 weight's scale: written with its weight below
        if p.device not in gens:
            gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        g = gens[p.device]
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.uniform_(1.0, 8.0, generator=g).log_()  # A in [-8, -1]
        elif leaf == "dt_bias":
            p.normal_(-3.0, 0.5, generator=g)  # softplus(-3) ~ 0.05
        elif name in offset:
            p.normal_(0.0, 0.1, generator=g)
        elif leaf == "D" or (leaf == "weight" and "norm" in name):
            p.normal_(1.0, 0.1, generator=g)
        elif leaf == "e_score_correction_bias" or leaf.endswith("bias"):
            p.normal_(0.0, 0.1, generator=g)
        elif name.startswith("embeddings"):
            p.normal_(0.0, 1.0, generator=g)
        elif p.dtype == FP8_DTYPE:
            w = torch.empty(p.shape, device=p.device).normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
            scale = params[name + "_scale"]
            q, s = quantize_fp8(w, per_channel=scale.shape[-2:] != (1, 1) and scale.dim() > 1)
            p.copy_(q)
            scale.copy_(s.reshape(scale.shape))
        else:
            # Matrices (and stacked experts, conv taps) keep unit output scale: std 1/sqrt(fan-in).
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)


def parameter_bytes(config: ModelConfig, dtype: torch.dtype | None = None,
                    quantization: str | None = None) -> int:
    """Bytes the model's parameters take on the device, each at its stored dtype (built on the meta
    device: nothing allocated). With quantization="fp8" (or an FP8 checkpoint's config) the layers
    `--quantization fp8` quantizes count 1 byte per weight plus their fp32 scales."""
    from replayssm.models.config_quant import RUNTIME_FP8
    from replayssm.models.layers.fp8_linear import apply_fp8, runtime_fp8_params

    assert quantization in (None, "fp8"), quantization
    with torch.device("meta"):
        model = model_class(config)(config, dtype=dtype or config.dtype)
        if quantization is not None or config.quantization is not None:
            apply_fp8(model, RUNTIME_FP8, runtime_fp8_params(model))  # as load_model does for dummy weights
    return sum(p.numel() * p.element_size() for p in model.parameters())
