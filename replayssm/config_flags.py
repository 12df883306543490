"""Command-line flags for the engine's config fields, shared by ``replayssm generate`` and ``serve``.

Each flag is a field of a config dataclass (config.py): its name, default and help text come from
the field, and its value is checked by the dataclass's ``__post_init__`` when the engine is built,
so the CLI and the Python API accept the same values and report the same errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from typing import Any

from replayssm.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig

_SIZE_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}

# Engine fields exposed as flags (model is a flag of its own; each subcommand sets the seed).
ENGINE_FLAGS = {
    EngineConfig: (
        "device", "dtype", "replayssm", "replay_window", "replay_stagger", "tokenizer", "load_format",
        "quantization", "cuda_graphs", "tensor_parallel_size", "host_threads", "async_scheduling",
    ),
    CacheConfig: (
        "memory_budget",
        "kv_block_size",
        "state_dtype",
        "kv_cache_dtype",
        "gpu_memory_utilization",
        "num_kv_blocks",
        "num_slots",
        "enable_prefix_caching",
        "prefix_checkpoint_interval",
    ),
    SchedulerConfig: ("max_num_seqs", "max_num_batched_tokens", "max_model_len"),
    SpecConfig: (
        "num_speculative_tokens",
        "speculative_method",
        "draft_model",
        "ngram_min",
        "ngram_max",
        "synthetic_acceptance_length",
    ),
}


def parse_size(text: str) -> int:
    """'1073741824', '512MiB', '2GB', '1.5G' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 512MiB, 2GB, 1073741824)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])


def _add_field_flag(parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    flag = "--" + f.name.replace("_", "-")
    help_text = f.metadata.get("help", "")
    if f.type in ("bool", bool, "bool | None"):
        # bool | None: not given -> None (the field's automatic choice).
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        return
    if f.name == "memory_budget":
        kind: Callable[[str], Any] = parse_size
    elif isinstance(f.default, float) or "float" in str(f.type):
        kind = float
    elif isinstance(f.default, int) or "int" in str(f.type):
        kind = int
    else:
        kind = str
    suffix = "" if f.default is None else f" (default: {f.default})"
    parser.add_argument(flag, type=kind, default=f.default, help=help_text + suffix)


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    """Flags for every engine field in ENGINE_FLAGS, defaults from the dataclasses."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        required=model_required,
        help="checkpoint directory (Hugging Face layout), or 'demo' for "
        "the built-in demo model (docs/demo.md)",
    )
    for cls, names in ENGINE_FLAGS.items():
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        for name in names:
            _add_field_flag(group, by_name[name])


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keyword arguments (LLM(model, **kw)) held in parsed flags."""
    return {name: getattr(args, name) for names in ENGINE_FLAGS.values() for name in names}
