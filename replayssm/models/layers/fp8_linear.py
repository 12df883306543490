"""FP8 linear layers: `Fp8Linear` and the swap that puts FP8 weights into a model built in bf16 / fp32.

Models are built with plain `nn.Linear` and stacked `Experts`; before the weights are loaded (on the
meta device) `apply_fp8` turns the chosen ones into FP8:

    module                         FP8 parameters                          scale shape
    -----------------------------------------------------------------------------------------------
    nn.Linear -> Fp8Linear         weight (N, K) E4M3, weight_scale,       (N, 1) per channel, (1,) per
                                   input_scale (static activations only)    tensor; input_scale (1,)
    Experts.up_proj / down_proj    the stacked (E, N, K) E4M3 weight and    (E, N, 1) or (E, 1, 1)
                                   `up_proj_scale` / `down_proj_scale`

Which ones: a pre-quantized checkpoint decides by its tensors (every E4M3 weight, `fp8_param_names`
in models/loader.py); `--quantization fp8` (and dummy weights) take `runtime_fp8_params`: the Mamba
in/out projections, attention q/k/v/o, dense and shared MLPs and the routed experts, as the published
FP8 checkpoints do. Norms, conv, A / D / dt, routers, embeddings, the LM head, MoE latent projections
and Zamba2's LoRA adapters stay in the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from replayssm.models.config_quant import QuantConfig
from replayssm.models.layers.mlp import Experts
from replayssm.ops.fp8 import FP8_DTYPE, fp8_linear

# Linear layers that --quantization fp8 quantizes (by their attribute name; Falcon-H1's muP
# subclasses of nn.Linear scale their output and stay as they are).
PROJECTIONS = frozenset({"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                         "down_proj", "gate_proj", "gate_up_proj", "input_linear", "output_linear"})
EXPERT_WEIGHTS = ("up_proj", "down_proj")


def scale_name(param: str) -> str:
    """Name of the scale of FP8 parameter `param`: `x.weight` -> `x.weight_scale`, `experts.up_proj` ->
    `experts.up_proj_scale`."""
    return param + "_scale"


class Fp8Linear(nn.Module):
    """x (..., K) -> (..., N) through an E4M3 weight (ops/fp8.py: fp8_linear and its dispatch)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantConfig, *,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.activation = quant.activation

        def param(*shape, dt):
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dt), requires_grad=False)

        self.weight = param(out_features, in_features, dt=FP8_DTYPE)
        self.weight_scale = param(*((out_features, 1) if quant.per_channel else (1,)), dt=torch.float32)
        self.input_scale = param(1, dt=torch.float32) if quant.activation == "static" else None
        self.bias = param(out_features, dt=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.input_scale, self.activation)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scale={tuple(self.weight_scale.shape)}, activation={self.activation}")


def runtime_fp8_params(model: nn.Module) -> set[str]:
    """The parameters --quantization fp8 stores in FP8 (see the module docstring)."""
    names = set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if type(module) is nn.Linear and leaf in PROJECTIONS and "_adapter" not in name:
            names.add(f"{name}.weight")
        elif isinstance(module, Experts):
            names.update(f"{name}.{w}" for w in EXPERT_WEIGHTS)
    return names


def apply_fp8(model: nn.Module, quant: QuantConfig, fp8_params: set[str]) -> None:
    """Turn the modules holding `fp8_params` into FP8 (in place, on the model's device; call on meta).

    ValueError when a name is not a weight we can hold in FP8 (e.g. a checkpoint that quantized a
    layer whose forward scales its weight itself).
    """
    done = set()
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and f"{name}.weight" in fp8_params:
            w = module.weight
            fp8 = Fp8Linear(module.in_features, module.out_features, module.bias is not None, quant,
                            device=w.device, dtype=w.dtype)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, fp8)
            done.add(f"{name}.weight")
        elif isinstance(module, Experts):
            for w_name in EXPERT_WEIGHTS:
                full = f"{name}.{w_name}"
                if full not in fp8_params:
                    continue
                w = getattr(module, w_name)
                E, N, K = w.shape
                setattr(module, w_name, nn.Parameter(torch.empty(E, N, K, device=w.device, dtype=FP8_DTYPE),
                                                     requires_grad=False))
                rows = N if quant.per_channel else 1
                setattr(module, scale_name(w_name),
                        nn.Parameter(torch.empty(E, rows, 1, device=w.device), requires_grad=False))
                module.fp8_activation = quant.activation
                done.add(full)
    left = sorted(fp8_params - done)
    if left:
        raise ValueError(f"the checkpoint stores {left[0]!r} in FP8, which this model runs in the model "
                         f"dtype only ({len(left)} such tensor(s))")
