"""Model registry: Hugging Face architecture name -> (module, class), imported lazily."""

from __future__ import annotations

import importlib

from replayssm.models.config import ModelConfig

MODEL_REGISTRY = {
    "NemotronHForCausalLM": ("replayssm.models.hybrid", "HybridForCausalLM"),
    "Mamba2ForCausalLM": ("replayssm.models.hybrid", "HybridForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("replayssm.models.two_part", "TwoPartForCausalLM"),
    "BambaForCausalLM": ("replayssm.models.two_part", "TwoPartForCausalLM"),
    "FalconH1ForCausalLM": ("replayssm.models.falcon_h1", "FalconH1ForCausalLM"),
    "Zamba2ForCausalLM": ("replayssm.models.zamba2", "Zamba2ForCausalLM"),
    **{arch: ("replayssm.models.qwen3_next", "Qwen3NextForCausalLM") for arch in (
        "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")},
}


def model_class(config: ModelConfig) -> type:
    """The nn.Module class that implements `config.architecture`."""
    if config.architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {config.architecture!r} is not registered: {sorted(MODEL_REGISTRY)}")
    module, name = MODEL_REGISTRY[config.architecture]
    return getattr(importlib.import_module(module), name)
