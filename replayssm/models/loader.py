"""Load a Hugging Face checkpoint (config.json + safetensors, single file or sharded) into a model.

Checkpoint names map one to one onto our modules. A model class may name its own mapping
(`checkpoint_name`, e.g. models/two_part.py); the default covers the names written by every
transformers version and by NVIDIA's remote code with three normalizations:
  - the `model.` or `backbone.` prefix is dropped; legacy Mamba-2 `embedding.` -> `embeddings.`;
  - per-expert MoE weights `experts.{e}.up_proj.weight` fill row e of the stacked `experts.up_proj`;
    for gated experts (Qwen's SwiGLU experts, rows [gate | up]) `experts.{e}.gate_proj.weight` fills
    the first half of row e and `up_proj` the second;
  - multi-token-prediction weights (`mtp.*`) are skipped here; the MTP drafter
    (replayssm/speculative/mtp_model.py) loads them with its own mapping.
Every parameter must be filled exactly; a missing tensor or a wrong shape raises ValueError
naming the file and the tensor. Under tensor parallelism each rank reads only its slices
(`safe_open(...).get_slice`, see distributed/sharding.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from replayssm.distributed.parallel import SINGLE, TensorParallel
from replayssm.distributed.sharding import check_shardable, read_shard
from replayssm.models import model_class
from replayssm.models.config import ModelConfig
from replayssm.models.config_quant import QUANTIZATIONS, RUNTIME_FP8
from replayssm.models.dummy import init_dummy_weights
from replayssm.models.layers.fp8_linear import apply_fp8, runtime_fp8_params, scale_name
from replayssm.ops.fp8 import FP8_DTYPE, quantize_fp8

LOAD_FORMATS = ("auto", "dummy")
_SCALES = ("weight_scale", "input_scale")  # FP8 scales, beside their `weight` in the checkpoint
_EXPERT = re.compile(
    r"^(layers\.\d+\.(?:mixer|mlp)\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (from the shard index when there is one)."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: unreadable shard index ({e!r})") from e
        files = [root / name for name in sorted(set(weight_map.values()))]
    elif (root / "model.safetensors").is_file():
        files = [root / "model.safetensors"]
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{root}: no model.safetensors, shard index or *.safetensors file")
    for file in files:
        if not file.is_file():
            raise ValueError(f"{file}: shard listed in the index is missing")
    return files


def _our_name(key: str) -> str | None:
    """Checkpoint tensor name -> our parameter name, or None for tensors we do not serve."""
    for prefix in ("model.", "backbone."):
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    if key.startswith("mtp."):
        return None
    if key.startswith("embedding."):
        key = "embeddings." + key[len("embedding."):]
    return key


def _read_whole(f, key: str, name: str) -> torch.Tensor:
    return f.get_tensor(key)


def _weight_key(key: str) -> tuple[str, str | None]:
    """(the checkpoint name of the weight a tensor belongs to, which scale it is or None for the weight)."""
    for kind in _SCALES:
        if key.endswith("." + kind):
            return key[: -len(kind)] + "weight", kind
    return key, None


def _target(rename, key: str, params: dict, gated: frozenset[str] = frozenset()
            ) -> tuple[str, int | tuple[int, int] | None, str | None] | None:
    """(our parameter, expert row or None, scale kind or None) that checkpoint tensor `key` fills, or None
    when we do not serve it. A weight_scale fills the scale of its weight (fp8_linear.scale_name); an
    input_scale fills the Fp8Linear's input_scale (the experts run dequantized and read none).
    gated: the stacked `up_proj`s of gated experts; row e of one is (e, 0) for gate_proj, (e, 1) for
    up_proj."""
    weight_key, kind = _weight_key(key)
    name = rename(weight_key)
    if name is None:
        return None
    m = _EXPERT.match(name)
    if m:
        if kind == "input_scale":
            return None
        proj = m.group(3)
        target = f"{m.group(1)}.{'down_proj' if proj == 'down_proj' else 'up_proj'}"
        row = int(m.group(2))
        if target in gated:
            row = (row, int(proj == "up_proj"))
        elif proj == "gate_proj":
            return None
    else:
        target, row = name, None
    if kind == "weight_scale":
        target = scale_name(target)
    elif kind == "input_scale":
        target = target.removesuffix("weight") + "input_scale"
    return (target, row, kind) if target in params else None


def load_weights(model: nn.Module, path: str | Path, rename=None,
                 read: Callable[..., torch.Tensor] = _read_whole) -> None:
    """Copy every parameter of `model` from the checkpoint at `path` (dtype converted, shapes checked).

    rename: checkpoint name -> parameter name or None to skip (default: the decoder's mapping
    above; the MTP drafter passes its own to read the `mtp.*` tensors). read(f, key, our_name)
    returns the part of checkpoint tensor `key` this process holds (tensor parallelism).
    FP8 parameters (layers/fp8_linear.py) take the checkpoint's E4M3 tensors and scales, or
    quantize a bf16 / fp32 tensor per output channel (--quantization fp8).
    """
    rename = rename or _our_name
    params = dict(model.named_parameters())
    gated = _gated_stacks(model)
    filled: set[str] = set()
    rows_filled: dict[str, set] = {}

    def fill(target: str, row: int | tuple[int, int] | None, tensor: torch.Tensor, file: Path,
             key: str) -> None:
        _copy(params[target], row, tensor, file, key)
        if row is None:
            filled.add(target)
        else:
            rows_filled.setdefault(target, set()).add(row)

    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    hit = _target(rename, key, params, gated)
                    if hit is None:
                        continue
                    target, row, kind = hit
                    tensor = read(f, key, _read_name(rename, key))
                    if params[target].dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
                        # --quantization fp8: E4M3 with one scale per output channel, computed here.
                        q, scale = quantize_fp8(tensor, per_channel=True)
                        fill(target, row, q, file, key)
                        fill(scale_name(target), row, scale, file, key)
                    else:
                        fill(target, row, tensor, file, key)
        except (OSError, SafetensorError) as e:
            raise ValueError(f"{file}: unreadable safetensors file ({e})") from e
    for name, rows in rows_filled.items():
        want = set(range(params[name].shape[0]))
        if name in gated:
            want = {(e, half) for e in want for half in (0, 1)}
        if rows == want:
            filled.add(name)
        else:
            first = min(want - rows)
            stem, proj = name.removesuffix("_scale").rsplit(".", 1)
            if isinstance(first, tuple):
                first, proj = first[0], ("gate_proj", "up_proj")[first[1]]
            leaf = "weight_scale" if name.endswith("_scale") else "weight"
            raise ValueError(f"{path}: missing tensor {stem}.{first}.{proj}.{leaf}")
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"{path}: missing tensor {missing[0]!r} (and {len(missing) - 1} more)"
                         if len(missing) > 1 else f"{path}: missing tensor {missing[0]!r}")


def _gated_stacks(model: nn.Module) -> frozenset[str]:
    """Names of the stacked `up_proj` of every gated Experts module (rows [gate | up])."""
    from replayssm.models.layers.mlp import Experts

    return frozenset(f"{name}.up_proj" for name, m in model.named_modules()
                     if isinstance(m, Experts) and m.gated)


def _read_name(rename, key: str) -> str:
    """Our name of checkpoint tensor `key` as read_shard takes it: a weight's (per-expert names kept),
    `<weight>_scale` for its weight_scale, `<module>.input_scale` for an input_scale."""
    weight_key, kind = _weight_key(key)
    name = rename(weight_key)
    if kind == "weight_scale":
        return scale_name(name)
    return name if kind is None else name.removesuffix("weight") + kind


def _copy(param: torch.Tensor, row: int | tuple[int, int] | None, tensor: torch.Tensor, file: Path,
          key: str) -> None:
    if isinstance(row, tuple):  # (expert, half) of a gated stack's [gate | up] rows
        dst = param.data[row[0]].unflatten(0, (2, -1))[row[1]]
    else:
        dst = param.data if row is None else param.data[row]
    if tensor.dtype == FP8_DTYPE and dst.dtype != FP8_DTYPE:
        raise ValueError(f"{file}: tensor {key!r} is FP8 E4M3, but this layer holds its weight in "
                         f"{dst.dtype} (no FP8 form of it)")
    if key.endswith(_SCALES) and tensor.numel() == dst.numel():
        tensor = tensor.reshape(dst.shape)  # per-tensor scales come as () or (1,)
    if tuple(tensor.shape) != tuple(dst.shape):
        raise ValueError(f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(dst.shape)}")
    dst.copy_(tensor.to(dst.dtype))


def fp8_param_names(path: str | Path, rename, params: set[str]) -> set[str]:
    """Our parameters whose checkpoint tensors are E4M3 (header reads only; a stacked experts
    parameter counts when any expert's tensor is)."""
    rename = rename or _our_name
    names = set()
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if f.get_slice(key).get_dtype() != "F8_E4M3" or rename(key) is None:
                        continue
                    hit = _target(rename, key, dict.fromkeys(params))
                    if hit is None:
                        raise ValueError(f"{file}: tensor {key!r} is FP8 E4M3, but it is no weight "
                                         f"this model holds")
                    names.add(hit[0])
        except (OSError, SafetensorError) as e:
            raise ValueError(f"{file}: unreadable safetensors file ({e})") from e
    return names


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               load_format: str = "auto", tp: TensorParallel = SINGLE,
               quantization: str | None = None) -> tuple[nn.Module, ModelConfig]:
    """Build the model for the checkpoint at `path` on `device` in `dtype` (default: the checkpoint's).

    Parameters are allocated uninitialized and every one is then filled from the checkpoint
    (load_format "auto"), or with seeded random values from config.json alone ("dummy"); with
    tp.size > 1 the model holds (and reads) only rank tp.rank's shard.
    FP8: a pre-quantized checkpoint (config.quantization) loads its E4M3 layers as they are;
    quantization="fp8" quantizes a bf16 / fp32 checkpoint's projections and experts at load time
    (layers/fp8_linear.py). Dummy weights with either take the load-time layer choice and scheme.
    The returned config's `quantization` is the scheme the model runs.
    """
    # EngineConfig checks the user's load_format, dtype and quantization.
    assert load_format in LOAD_FORMATS, load_format
    assert dtype in (None, torch.float32, torch.float16, torch.bfloat16), dtype
    assert quantization in (None, *QUANTIZATIONS), quantization
    config = ModelConfig.from_hf(path)
    check_shardable(config, tp.size)
    quant = config.quantization
    if load_format == "dummy" and (quant is not None or quantization is not None):
        quant = RUNTIME_FP8
    elif quant is None and quantization == "fp8":
        quant = RUNTIME_FP8
    config = dataclasses.replace(config, quantization=quant) if quant != config.quantization else config
    with torch.device("meta"):
        model = model_class(config)(config, dtype=dtype or config.dtype, tp=tp)
        rename = getattr(model, "checkpoint_name", None)
        if quant is not None:
            if quant.source == "runtime":
                names = runtime_fp8_params(model)
            else:
                names = fp8_param_names(path, rename, {name for name, _ in model.named_parameters()})
            apply_fp8(model, quant, names)
    model = model.to_empty(device=device)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        read = _read_whole if tp.size == 1 else functools.partial(read_shard, config, tp)
        load_weights(model, path, rename=rename, read=read)
        load_kv_scales(model, path, rename)
    return model.eval().requires_grad_(False), config


_KV_SCALE = re.compile(r"^(.*?)(?:\.[kv]_proj)?\.(k_scale|v_scale|kv_scale)$")


def load_kv_scales(model: nn.Module, path: str | Path, rename=None) -> None:
    """Set each attention layer's FP8 KV cache scales from the checkpoint's `k_scale` / `v_scale`.

    Published FP8 checkpoints store them per layer: llm-compressor (`kv_cache_scheme`) as
    `self_attn.k_scale`, NVIDIA ModelOpt (`kv_cache_quant_algo: FP8`) as `self_attn.k_proj.k_scale`,
    older exports one `kv_scale` for both. A per-head scale becomes its largest head's (any scale is
    exact for our cache, which quantizes with the scale it reads with; the largest saturates nothing
    the head's own would not). Layers without them keep 1.0. Only an FP8 cache reads them.
    """
    from replayssm.models.layers.attention import Attention

    rename = rename or _our_name
    modules = dict(model.named_modules())
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    m = _KV_SCALE.match(key)
                    name = m and rename(f"{m.group(1)}.k_proj.weight")
                    layer = modules.get(name.removesuffix(".k_proj.weight")) if name else None
                    if not isinstance(layer, Attention):
                        continue
                    value = float(f.get_tensor(key).float().max())
                    if not (value > 0 and value < float("inf")):
                        raise ValueError(f"{file}: tensor {key!r} is {value}, not a KV cache scale (> 0)")
                    for kind in ("k_scale", "v_scale"):
                        if m.group(2) in (kind, "kv_scale"):
                            setattr(layer, kind, value)
        except (OSError, SafetensorError) as e:
            raise ValueError(f"{file}: unreadable safetensors file ({e})") from e
