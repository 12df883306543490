"""FP8 weight quantization: the checkpoint formats we read, normalized into one QuantConfig.

    format                declared in                              weights              activations
    ----------------------------------------------------------------------------------------------------
    compressed-tensors    config.json quantization_config:         E4M3, strategy       dynamic "token",
    (llm-compressor)      quant_method "compressed-tensors",       "channel" (N, 1) or  static "tensor"
                          format "float-quantized", config_groups  "tensor" (1,)        (input_scale), or
                                                                                        none (weight-only)
    NVIDIA ModelOpt       hf_quant_config.json "quantization", or  E4M3, per tensor     static per tensor
                          quantization_config quant_method         weight_scale ()      (input_scale)
                          "modelopt": quant_algo "FP8"
                          (FP8_PER_CHANNEL_PER_TOKEN: per channel, dynamic per token)
    --quantization fp8    a bf16 / fp32 checkpoint                 per channel          dynamic per token

Which linear layers a checkpoint quantized is read from its tensors (an E4M3 `*.weight` with its
`weight_scale`); the `ignore` / `exclude_modules` lists name the others and are kept for the record.
Anything else (NVFP4, int4 / int8, block-wise or group-wise scales, asymmetric) is a ValueError
naming the field and its value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization
SOURCES = ("compressed-tensors", "modelopt", "runtime")


@dataclass(frozen=True)
class QuantConfig:
    """FP8 E4M3 weights: per-channel or per-tensor weight scales and the activation scaling on CUDA."""

    source: str
    per_channel: bool
    activation: str  # "dynamic" (per token), "static" (per-tensor input_scale) or "none" (weight-only)
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.source in SOURCES, self.source
        assert self.activation in ("dynamic", "static", "none"), self.activation


RUNTIME_FP8 = QuantConfig(source="runtime", per_channel=True, activation="dynamic")


def quant_config_from_hf(raw: dict[str, Any], root: Path | None, source: str) -> QuantConfig | None:
    """The checkpoint's FP8 scheme from config.json (`raw`) and hf_quant_config.json beside it, or None."""
    qc = raw.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise ValueError(f"{source}: field 'quantization_config' must be an object")
        method = qc.get("quant_method")
        if method == "compressed-tensors":
            return _compressed_tensors(qc, source)
        if method == "modelopt":
            return _modelopt(qc, source)
        raise ValueError(f"{source}: field 'quantization_config.quant_method' is {method!r}; supported: "
                         f"'compressed-tensors' and 'modelopt' FP8 (block-wise 'fp8' is not)")
    file = root / "hf_quant_config.json" if root is not None else None
    if file is not None and file.is_file():
        try:
            hqc = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{file}: unreadable hf_quant_config.json ({e})") from e
        q = hqc.get("quantization") if isinstance(hqc, dict) else None
        if not isinstance(q, dict):
            raise ValueError(f"{file}: missing object 'quantization'")
        return _modelopt(q, str(file))
    return None


def _names(value: Any, source: str, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{source}: field {field!r} must be a list of module names, got {value!r}")
    return tuple(value)


def _modelopt(q: dict[str, Any], source: str) -> QuantConfig:
    algo = q.get("quant_algo")
    ignore = _names(q.get("exclude_modules", q.get("ignore")), source, "exclude_modules")
    if algo == "FP8":
        return QuantConfig(source="modelopt", per_channel=False, activation="static", ignore=ignore)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return QuantConfig(source="modelopt", per_channel=True, activation="dynamic", ignore=ignore)
    raise ValueError(f"{source}: field 'quant_algo' is {algo!r}; supported: 'FP8' and "
                     f"'FP8_PER_CHANNEL_PER_TOKEN' (NVFP4, INT4 and block-wise FP8 are not)")


def _compressed_tensors(qc: dict[str, Any], source: str) -> QuantConfig:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"{source}: field 'quantization_config.format' is {fmt!r}; supported: "
                         f"'float-quantized' (FP8 E4M3)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{source}: field 'quantization_config.config_groups' must be a non-empty object")
    schemes = {_ct_group(group, source, f"config_groups.{name}") for name, group in groups.items()}
    if len(schemes) > 1:
        raise ValueError(f"{source}: field 'quantization_config.config_groups' mixes FP8 schemes "
                         f"{sorted(schemes)}; one scheme for every layer is supported")
    per_channel, activation = schemes.pop()
    ignore = _names(qc.get("ignore"), source, "quantization_config.ignore")
    return QuantConfig(source="compressed-tensors", per_channel=per_channel, activation=activation,
                       ignore=ignore)


def _ct_group(group: Any, source: str, where: str) -> tuple[bool, str]:
    """(per_channel, activation) of one compressed-tensors config group."""
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise ValueError(f"{source}: field '{where}.weights' must be an object")
    w = group["weights"]

    def need(args: dict, prefix: str, key: str, allowed: tuple) -> Any:
        value = args.get(key)
        if value not in allowed:
            raise ValueError(f"{source}: field '{where}.{prefix}.{key}' is {value!r}; supported: "
                             f"{' or '.join(repr(a) for a in allowed if a is not None) or 'unset'}")
        return value

    need(w, "weights", "type", ("float",))
    need(w, "weights", "num_bits", (8,))
    need(w, "weights", "symmetric", (True, None))
    need(w, "weights", "dynamic", (False, None))
    need(w, "weights", "group_size", (None,))
    need(w, "weights", "block_structure", (None,))
    strategy = need(w, "weights", "strategy", ("channel", "tensor"))
    a = group.get("input_activations")
    if a is None:
        return strategy == "channel", "none"
    if not isinstance(a, dict):
        raise ValueError(f"{source}: field '{where}.input_activations' must be an object or null")
    need(a, "input_activations", "type", ("float",))
    need(a, "input_activations", "num_bits", (8,))
    if a.get("dynamic") is True:
        need(a, "input_activations", "strategy", ("token",))
        return strategy == "channel", "dynamic"
    need(a, "input_activations", "strategy", ("tensor",))
    return strategy == "channel", "static"
