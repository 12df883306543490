"""Reading config.json fields: names, aliases, types and layer-kind spellings shared by every family."""

from __future__ import annotations

from typing import Any

import torch

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
# A parallel layer owns one KV cache and one Mamba cache: Falcon-H1 runs attention and Mamba-2 side by
# side; a Zamba2 hybrid layer runs its shared transformer block, then Mamba-2.
PARALLEL = "parallel"
# Gated DeltaNet (Qwen3-Next, Qwen3.5): a recurrent mixer with its own cache description
# (cache/mamba_cache.py).
GDN = "gdn"
LAYER_TYPES = (MAMBA, ATTENTION, MLP, MOE, PARALLEL, GDN)

# Every spelling of a layer kind across transformers versions and remote code.
LAYER_NAMES = {
    "M": MAMBA, "mamba": MAMBA, "linear_attention": MAMBA,
    "*": ATTENTION, "attention": ATTENTION, "full_attention": ATTENTION,
    "-": MLP, "mlp": MLP,
    "E": MOE, "moe": MOE,
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def field(raw: dict, source: str, *names: str, default: Any = ..., kind: type = int) -> Any:
    """The first present field among `names` (aliases across versions), type-checked."""
    for name in names:
        if raw.get(name) is not None:
            value = raw[name]
            if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if kind is int and isinstance(value, bool):
                raise ValueError(f"{source}: field {name!r} must be an integer, got {value!r}")
            if not isinstance(value, kind):
                raise ValueError(f"{source}: field {name!r} must be {kind.__name__}, got {value!r}")
            return value
    if default is ...:
        raise ValueError(f"{source}: missing field {names[0]!r}")
    return default


def layer_list(value: Any, source: str, name: str) -> tuple[str, ...]:
    items = list(value) if isinstance(value, (list, str)) else None
    if not items:
        raise ValueError(f"{source}: field {name!r} must be a non-empty list or pattern, got {value!r}")
    unknown = [t for t in items if t not in LAYER_NAMES]
    if unknown:
        raise ValueError(f"{source}: field {name!r} has unknown layer types {sorted(set(unknown))}")
    return tuple(LAYER_NAMES[t] for t in items)


def dtype_of(raw: dict, source: str) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"{source}: field 'dtype' must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def eos_ids(raw: dict, source: str) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{source}: field 'eos_token_id' must be an int or a list of ints, got {eos!r}")
    return tuple(ids)
