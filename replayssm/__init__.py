"""replayssm: a serving engine for hybrid state-space language models with ReplaySSM decoding."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy exports: `import replayssm` stays cheap and does not import torch or the models.
    if name == "LLM":
        from replayssm.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from replayssm.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from replayssm.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'replayssm' has no attribute {name!r}")
