"""Load a Hugging Face checkpoint (config.json + safetensors, single file or sharded) into a model.

Checkpoint names map one to one onto our modules. A model class may name its own mapping
(`checkpoint_name`, e.g. models/two_part.py); the default covers the names written by every
transformers version and by NVIDIA's remote code with three normalizations:
  - the `model.` or `backbone.` prefix is dropped; legacy Mamba-2 `embedding.` -> `embeddings.`;
  - per-expert MoE weights `experts.{e}.up_proj.weight` fill row e of the stacked `experts.up_proj`;
  - multi-token-prediction weights (`mtp.*`) are skipped here; the MTP drafter
    (replayssm/speculative/mtp_model.py) loads them with its own mapping.
Every parameter must be filled exactly; a missing tensor or a wrong shape raises ValueError
naming the file and the tensor. Under tensor parallelism each rank reads only its slices
(`safe_open(...).get_slice`, see distributed/sharding.py).
"""

from __future__ import annotations

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
from replayssm.models.dummy import init_dummy_weights

LOAD_FORMATS = ("auto", "dummy")
_EXPERT = re.compile(r"^(layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


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


def load_weights(model: nn.Module, path: str | Path, rename=None,
                 read: Callable[..., torch.Tensor] = _read_whole) -> None:
    """Copy every parameter of `model` from the checkpoint at `path` (dtype converted, shapes checked).

    rename: checkpoint name -> parameter name or None to skip (default: the decoder's mapping
    above; the MTP drafter passes its own to read the `mtp.*` tensors). read(f, key, our_name)
    returns the part of checkpoint tensor `key` this process holds (tensor parallelism).
    """
    rename = rename or _our_name
    params = dict(model.named_parameters())
    filled: set[str] = set()
    experts_filled: dict[str, set[int]] = {}
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = rename(key)
                    if name is None:
                        continue
                    m = _EXPERT.match(name)
                    if m:
                        target = f"{m.group(1)}.{m.group(3)}"
                        if target not in params:
                            continue
                        e = int(m.group(2))
                        _copy(params[target], e, read(f, key, name), file, key)
                        experts_filled.setdefault(target, set()).add(e)
                    elif name in params:
                        _copy(params[name], None, read(f, key, name), file, key)
                        filled.add(name)
        except (OSError, SafetensorError) as e:
            raise ValueError(f"{file}: unreadable safetensors file ({e})") from e
    for name, rows in experts_filled.items():
        if len(rows) == params[name].shape[0]:
            filled.add(name)
        else:
            first = min(set(range(params[name].shape[0])) - rows)
            stem, proj = name.rsplit(".", 1)
            raise ValueError(f"{path}: missing tensor {stem}.{first}.{proj}.weight")
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"{path}: missing tensor {missing[0]!r} (and {len(missing) - 1} more)"
                         if len(missing) > 1 else f"{path}: missing tensor {missing[0]!r}")


def _copy(param: torch.Tensor, row: int | None, tensor: torch.Tensor, file: Path, key: str) -> None:
    dst = param.data if row is None else param.data[row]
    if tuple(tensor.shape) != tuple(dst.shape):
        raise ValueError(f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(dst.shape)}")
    dst.copy_(tensor.to(dst.dtype))


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               load_format: str = "auto", tp: TensorParallel = SINGLE) -> tuple[nn.Module, ModelConfig]:
    """Build the model for the checkpoint at `path` on `device` in `dtype` (default: the checkpoint's).

    Parameters are allocated uninitialized and every one is then filled from the checkpoint
    (load_format "auto"), or with seeded random values from config.json alone ("dummy"); with
    tp.size > 1 the model holds (and reads) only rank tp.rank's shard.
    """
    # EngineConfig checks the user's load_format and dtype.
    assert load_format in LOAD_FORMATS, load_format
    assert dtype in (None, torch.float32, torch.float16, torch.bfloat16), dtype
    config = ModelConfig.from_hf(path)
    check_shardable(config, tp.size)
    with torch.device("meta"):
        model = model_class(config)(config, dtype=dtype or config.dtype, tp=tp)
    model = model.to_empty(device=device)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        read = _read_whole if tp.size == 1 else functools.partial(read_shard, config, tp)
        load_weights(model, path, rename=getattr(model, "checkpoint_name", None), read=read)
    return model.eval().requires_grad_(False), config
