"""Engine configuration: frozen dataclasses, validated on construction.

Every field carries its help text in ``metadata["help"]``; the CLI builds its flags and
defaults from these fields, so the two never drift apart. ``ModelConfig`` (the normalized
Hugging Face config) lives in ``replayssm.models.config`` and is re-exported here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model dtype; fp8 and fp8_e4m3: E4M3 with scales


def _doc(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of the paged attention KV cache and of the Mamba slot pool."""

    kv_block_size: int = _doc(16, "tokens per paged-attention KV block")
    memory_budget: int | None = _doc(
        None,
        "bytes for KV blocks + Mamba slots together (default: gpu_memory_utilization of free CUDA "
        "memory, or 1 GiB on CPU, capped at what max_num_seqs max-length requests need)",
    )
    gpu_memory_utilization: float = _doc(0.9, "share of free CUDA memory used when memory_budget is unset")
    num_kv_blocks: int | None = _doc(None, "force the number of KV blocks (overrides the memory planner)")
    num_slots: int | None = _doc(None, "force the number of Mamba slots (overrides the memory planner)")
    state_dtype: str = _doc("float32", "dtype of the Mamba checkpoint state: float32, float16 or bfloat16")
    kv_cache_dtype: str = _doc(
        "auto",
        "dtype of the attention KV cache: auto (the model dtype) or fp8 / fp8_e4m3 (E4M3 with the "
        "checkpoint's per-layer k_scale / v_scale, else 1.0; half the bytes of bf16, so twice the KV blocks)",
    )
    enable_prefix_caching: bool = _doc(
        False,
        "reuse cached prefixes: shared KV blocks + Mamba checkpoints published at block boundaries "
        "(checkpoints take free Mamba slots and are evicted LRU under memory pressure)",
    )
    prefix_checkpoint_interval: int | None = _doc(
        None,
        "tokens between published Mamba checkpoints, a multiple of kv_block_size (default: kv_block_size); "
        "a prefix hit ends on a checkpoint",
    )

    def __post_init__(self) -> None:
        _check_int("kv_block_size", self.kv_block_size, 1)
        _check_int("memory_budget", self.memory_budget, 1, allow_none=True)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check_int("num_kv_blocks", self.num_kv_blocks, 1, allow_none=True)
        _check_int("num_slots", self.num_slots, 1, allow_none=True)
        _check_int("prefix_checkpoint_interval", self.prefix_checkpoint_interval, 1, allow_none=True)
        interval = self.prefix_checkpoint_interval
        if interval is not None and interval % self.kv_block_size:
            raise ValueError(
                f"prefix_checkpoint_interval={self.prefix_checkpoint_interval} must be a multiple of "
                f"kv_block_size={self.kv_block_size}"
            )
        if self.state_dtype not in DTYPES:
            raise ValueError(f"state_dtype must be one of {DTYPES}, got {self.state_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = _doc(64, "most requests running at once")
    max_num_batched_tokens: int = _doc(
        512, "token budget of one engine step (prefill chunks + decode tokens)"
    )
    max_model_len: int | None = _doc(
        None, "longest prompt + output, at most the model's max_position_embeddings (the default)"
    )

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 2, allow_none=True)

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        """max_model_len, or the model's max_position_embeddings when unset; a ValueError past them
        (positions the model was never trained on)."""
        if self.max_model_len is None:
            return max_position_embeddings
        if self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_position_embeddings}")
        return self.max_model_len


SPEC_METHODS = ("ngram", "mtp", "draft", "synthetic")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (``replayssm.speculative``): a drafter proposes k tokens, one forward
    verifies them.

    ``synthetic`` is for benchmarks only: it forces a configured mean acceptance length and its
    output tokens are NOT the model's output (every output and the metrics say so).
    """

    num_speculative_tokens: int = _doc(
        0, "draft tokens per verify step (k, 0 = off, at most 8); with ReplaySSM needs 1 + k <= replay_window"
    )
    speculative_method: str = _doc(
        "ngram", "drafter: ngram (prompt lookup), mtp (the checkpoint's mtp.* layers), draft (a small draft "
        "model, see draft_model) or synthetic (benchmarks only: forced acceptance, output is not the model's)"
    )
    draft_model: str | None = _doc(None, "checkpoint directory of the draft model (speculative_method=draft)")
    ngram_min: int = _doc(1, "shortest suffix n-gram the ngram drafter looks up")
    ngram_max: int = _doc(4, "longest suffix n-gram the ngram drafter looks up (tried first)")
    synthetic_acceptance_length: float = _doc(
        3.0, "synthetic drafter: mean tokens per verify step (accepted drafts + 1), in [1, k + 1]"
    )

    def __post_init__(self) -> None:
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        if self.num_speculative_tokens > 8:
            raise ValueError(f"num_speculative_tokens must be at most 8, got {self.num_speculative_tokens}")
        if self.speculative_method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_method must be one of {SPEC_METHODS}, got {self.speculative_method!r}"
            )
        _check_int("ngram_min", self.ngram_min, 1)
        _check_int("ngram_max", self.ngram_max, self.ngram_min)
        k = self.num_speculative_tokens
        if k and self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method='draft' needs draft_model (a checkpoint directory)")
        length = self.synthetic_acceptance_length
        if not isinstance(length, (int, float)) or isinstance(length, bool) or length < 1.0:
            raise ValueError(f"synthetic_acceptance_length must be a number >= 1, got {length!r}")
        if k and self.speculative_method == "synthetic" and length > k + 1:
            raise ValueError(f"synthetic_acceptance_length must be in [1, k + 1 = {k + 1}], got {length!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``LLMEngine`` needs; build it with ``EngineConfig.from_kwargs(model, **kw)``."""

    model: str = field(metadata={"help": "checkpoint directory (Hugging Face layout) or 'demo'"})
    device: str = _doc("auto", "torch device: auto (cuda if available), cpu, cuda, cuda:N")
    dtype: str = _doc("auto", "activation/weight dtype: auto (bfloat16 on CUDA, float32 on CPU), or a name")
    replayssm: bool = _doc(
        True, "decode the recurrent layers with ReplaySSM (off: the baseline state update)"
    )
    replay_window: int = _doc(16, "ReplaySSM window W: ring entries kept before a state write")
    replay_stagger: bool = _doc(
        True, "ReplaySSM: start each request's first window with 0, 1, ..., W - q null entries in turn, so "
        "requests that start decoding together write their states on different steps instead of all on one "
        "(the results are those of an empty ring); off: every first state write comes W tokens in"
    )
    seed: int = _doc(
        0, "engine seed: draws the seeds of requests that set none (and the runner's rounding seed)"
    )
    tokenizer: str | None = _doc(None, "tokenizer directory (default: the model directory)")
    load_format: str = _doc(
        "auto", "weights: auto (the checkpoint's safetensors) or dummy (seeded random weights from "
        "config.json alone, for benchmarks)"
    )
    quantization: str | None = _doc(
        None, "fp8: quantize a bf16 / fp32 checkpoint's Mamba in/out, attention, MLP and expert weights to "
        "FP8 E4M3 at load time (per-channel scales; FP8 GEMMs with per-token activation scales on CUDA "
        "with compute capability >= 8.9, the dequantized weights elsewhere). FP8 checkpoints "
        "(compressed-tensors, ModelOpt) load as FP8 without it"
    )
    cuda_graphs: bool | None = _doc(
        None, "replay decode/verify steps as CUDA graphs (tested against eager steps on an H200). None = "
        "on wherever they are supported: a CUDA device, tensor_parallel_size 1, state_dtype float32, "
        "Triton installed and, with MoE layers, bfloat16; True refuses anything else, naming why"
    )
    host_threads: int = _doc(
        1, "CPU threads for PyTorch's host-side ops (torch.set_num_threads) in an engine on CUDA: a "
        "step's host tensors are small, and PyTorch's default thread pool spins up to 15 cores and "
        "doubles the H200 host loop once block tables outgrow its parallel grain; 0 leaves PyTorch's "
        "setting (CPU engines always do: their model runs on those threads)"
    )
    async_scheduling: bool | None = _doc(
        None, "launch each decode step before the previous step's tokens are read back, so the host's "
        "per-step work (stop checks, outputs) overlaps the GPU; a request that stops computes one extra "
        "row, dropped. With speculative decoding (ngram or synthetic drafts, no prefix caching) it splits "
        "the requests into two groups whose verify steps take turns, one group's host work overlapping "
        "the other's forward. None = on for CUDA engines; off with tensor_parallel_size > 1"
    )
    tensor_parallel_size: int = _doc(
        1, "GPUs (CPU processes with device cpu) that split every layer's heads and weights; "
        "N > 1 spawns N - 1 worker processes, or runs under torchrun with N processes"
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path, got {self.model!r}")
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.replayssm, bool):
            raise ValueError(f"replayssm must be True or False, got {self.replayssm!r}")
        _check_int("replay_window", self.replay_window, 1)
        if not isinstance(self.replay_stagger, bool):
            raise ValueError(f"replay_stagger must be True or False, got {self.replay_stagger!r}")
        _check_int("seed", self.seed, 0)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or unset, got {self.quantization!r}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("host_threads", self.host_threads, 0)
        if not (self.async_scheduling is None or isinstance(self.async_scheduling, bool)):
            raise ValueError(f"async_scheduling must be True, False or None (auto), "
                             f"got {self.async_scheduling!r}")
        if not (self.cuda_graphs is None or isinstance(self.cuda_graphs, bool)):
            raise ValueError(f"cuda_graphs must be True, False or None (auto), got {self.cuda_graphs!r}")
        if self.tensor_parallel_size > 1 and self.cuda_graphs:
            raise ValueError("cuda_graphs=True does not support tensor_parallel_size > 1 yet "
                             "(graphs with NCCL collectives are untested)")
        q_max = 1 + self.spec.num_speculative_tokens
        # A verify step appends its 1 + k tokens to the ring; the baseline keeps no ring.
        if self.replayssm and q_max > self.replay_window:
            raise ValueError(
                f"num_speculative_tokens={self.spec.num_speculative_tokens} needs 1 + k <= replay_window "
                f"({self.replay_window})"
            )

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Route flat keyword arguments (``LLM(path, max_num_seqs=8, ...)``) to the sub-configs;
        an unknown name raises ValueError."""
        groups: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "spec": {}, "": {}}
        owners = {"cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig}
        top = {f.name for f in dataclasses.fields(cls)} - set(owners)
        for name, value in kwargs.items():
            owner = next(
                (g for g, c in owners.items() if name in {f.name for f in dataclasses.fields(c)}), None
            )
            if owner is not None:
                groups[owner][name] = value
            elif name in top:
                groups[""][name] = value
            else:
                raise ValueError(f"unknown engine argument {name!r}")
        return cls(
            model=model,
            cache=CacheConfig(**groups["cache"]),
            scheduler=SchedulerConfig(**groups["scheduler"]),
            spec=SpecConfig(**groups["spec"]),
            **groups[""],
        )

    def resolved_device(self) -> str:
        """The device string with 'auto' resolved; ValueError for a CUDA device this process cannot use."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r}: CUDA is not available here (torch "
                                 f"{torch.__version__}, CUDA build {torch.version.cuda}); use --device cpu")
            index = self.device.partition(":")[2]
            count = torch.cuda.device_count()
            if index and not (index.isdigit() and int(index) < count):
                raise ValueError(f"device {self.device!r}: this process sees {count} CUDA device(s), "
                                 f"cuda:0 to cuda:{count - 1}")
        return self.device

    def resolved_dtype(self) -> str:
        """The dtype name with 'auto' resolved (bfloat16 on CUDA, float32 on CPU)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"


def __getattr__(name: str) -> Any:
    # Lazy re-export: the model package imports torch and its layers, which config users may not need.
    if name == "ModelConfig":
        from replayssm.models.config import ModelConfig

        return ModelConfig
    raise AttributeError(name)
