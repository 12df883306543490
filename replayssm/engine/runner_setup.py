"""Engine start-up: checkpoint -> model config, tokenizer, cache plan, pools and model runner."""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from typing import Any

from replayssm.cache.block_pool import BlockPool
from replayssm.cache.planner import CachePlan, plan_cache, slots_per_request
from replayssm.cache.prefix_cache import PrefixCache
from replayssm.cache.prefix_pools import CachingBlockPool, CachingSlotPool
from replayssm.cache.slot_pool import SlotPool
from replayssm.config import EngineConfig
from replayssm.engine.tokenizer import Tokenizer, load_tokenizer, read_eos_token_ids
from replayssm.sampling_params import read_generation_defaults

CPU_DEFAULT_BUDGET = 1 << 30  # 1 GiB; the planner still caps it at what max_num_seqs requests need


@dataclass
class RunnerSetup:
    runner: Any
    model_config: Any
    plan: CachePlan
    tokenizer: Tokenizer | None
    max_model_len: int
    model_name: str
    eos_token_ids: list[int]
    block_pool: BlockPool
    slot_pool: SlotPool
    prefix_cache: PrefixCache | None = None
    generation_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)


def resolve_model_dir(model: str, need_weights: bool = True) -> str:
    """A checkpoint directory, or the built-in demo checkpoint for ``"demo"``.

    need_weights=False (load_format "dummy") accepts a directory holding only config.json.
    """
    if model == "demo":
        from replayssm.demo import demo_checkpoint

        return demo_checkpoint()
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is not a directory (pass a checkpoint directory or 'demo')")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model {model!r} has no config.json")
    if need_weights and not glob.glob(os.path.join(model, "*.safetensors")):
        raise ValueError(f"model {model!r} has no *.safetensors weights")
    return model


def default_memory_budget(device: str, gpu_memory_utilization: float, model_dir: str,
                          weight_bytes: int | None = None, tensor_parallel_size: int = 1) -> int:
    """CPU: 1 GiB. CUDA: the utilization share of free memory, minus this GPU's share of the weights'
    file size (or of weight_bytes when given: dummy weights have no files)."""
    if not device.startswith("cuda"):
        return CPU_DEFAULT_BUDGET
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    weights = weight_bytes
    if weights is None:
        weights = sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_dir, "*.safetensors")))
    return max(1, int(free * gpu_memory_utilization) - weights // tensor_parallel_size)


def weight_bytes_on_device(config: EngineConfig, model_config: Any, dtype: str) -> int | None:
    """The weights' bytes where their files do not tell them (None: the safetensors size does).

    Dummy weights have no files, and a bf16 / fp32 checkpoint quantized at load time (--quantization
    fp8) holds about half its file size: both count the parameters at their stored dtype (FP8 weights
    1 byte plus their scales), so the memory FP8 frees goes to the KV and state caches."""
    quantized_at_load = config.quantization is not None and model_config.quantization is None
    if config.load_format != "dummy" and not quantized_at_load:
        return None
    from replayssm.cache.mamba_cache import as_dtype
    from replayssm.models.dummy import parameter_bytes

    return parameter_bytes(model_config, as_dtype(dtype, "dtype"), config.quantization)


def build_runner(config: EngineConfig, runner_cls: Any = None) -> RunnerSetup:
    """Load the config and tokenizer, plan the cache from the memory budget, build the runner."""
    from replayssm.models.config import ModelConfig

    tp = config.tensor_parallel_size
    if runner_cls is None and tp > 1:
        from replayssm.distributed.runner import TPModelRunner as runner_cls
    elif runner_cls is None:
        from replayssm.engine.model_runner import ModelRunner as runner_cls
    dummy = config.load_format == "dummy"
    model_dir = resolve_model_dir(config.model, need_weights=not dummy)
    model_config = ModelConfig.from_hf(model_dir)
    tokenizer = load_tokenizer(config.tokenizer or model_dir)
    if tokenizer is None and config.tokenizer is not None:  # asked for, so not optional as the model's is
        raise ValueError(f"tokenizer {config.tokenizer!r}: no tokenizer.json there (a tokenizer directory in "
                         f"the Hugging Face layout)")
    device, dtype = config.resolved_device(), config.resolved_dtype()
    if device.startswith("cuda") and config.host_threads:
        import torch

        # Process-wide, like every torch thread setting: the engine owns its process's host loop.
        torch.set_num_threads(config.host_threads)
    max_model_len = config.scheduler.resolved_max_model_len(model_config.max_model_len)
    cache, spec = config.cache, config.spec
    sizes = dict(
        dtype=dtype,
        state_dtype=cache.state_dtype,
        replayssm=config.replayssm,
        replay_window=config.replay_window,
        num_speculative_tokens=spec.num_speculative_tokens,
        kv_block_size=cache.kv_block_size,
        kv_cache_dtype=cache.kv_cache_dtype,
        tensor_parallel_size=tp,  # sizes per GPU: each rank holds 1/tp of the heads
    )
    interval = cache.prefix_checkpoint_interval or cache.kv_block_size
    kv_block_bytes = runner_cls.kv_block_bytes(model_config, **sizes)
    if spec.num_speculative_tokens and spec.speculative_method == "mtp" and model_config.mtp_layer_types:
        # The MTP head's attention KV is addressed by the same block ids: it grows every block.
        from replayssm.speculative.mtp_model import mtp_config

        kv_block_bytes += runner_cls.kv_block_bytes(mtp_config(model_config), **sizes)
    weight_bytes = None
    if not cache.memory_budget and device.startswith("cuda"):
        weight_bytes = weight_bytes_on_device(config, model_config, dtype)
    budget = cache.memory_budget or default_memory_budget(device, cache.gpu_memory_utilization, model_dir,
                                                          weight_bytes, tp)
    plan = plan_cache(
        budget,
        bytes_per_slot=runner_cls.slot_bytes(model_config, **sizes),
        bytes_per_kv_block=kv_block_bytes,
        kv_block_size=cache.kv_block_size,
        max_model_len=max_model_len,
        slots_per_request=slots_per_request(config.replayssm, spec.num_speculative_tokens),
        max_num_seqs=config.scheduler.max_num_seqs,
        num_kv_blocks=cache.num_kv_blocks,
        num_slots=cache.num_slots,
        checkpoint_interval=interval if cache.enable_prefix_caching else None,
    )
    runner = runner_cls(
        model_dir,
        device=device,
        dtype=dtype,
        replayssm=config.replayssm,
        replay_window=config.replay_window,
        replay_stagger=config.replay_stagger,
        state_dtype=cache.state_dtype,
        num_speculative_tokens=spec.num_speculative_tokens,
        num_kv_blocks=plan.num_kv_blocks,
        kv_block_size=cache.kv_block_size,
        num_slots=plan.num_slots,
        max_num_seqs=min(config.scheduler.max_num_seqs, plan.num_requests_fit),
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        seed=config.seed,
        **({"load_format": "dummy"} if dummy else {}),
        **({"quantization": config.quantization} if config.quantization else {}),
        **({"kv_cache_dtype": cache.kv_cache_dtype} if cache.kv_cache_dtype != "auto" else {}),
        **({"cuda_graphs": config.cuda_graphs} if tp == 1 and config.cuda_graphs is not False else {}),
        **({"tensor_parallel_size": tp} if tp > 1 else {}),
    )
    # Stop at the tokenizer's eos and at every eos the generation config names.
    eos = set(read_eos_token_ids(model_dir) or model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    name = "demo" if config.model == "demo" else os.path.basename(os.path.normpath(model_dir))
    block_pool = BlockPool(plan.num_kv_blocks)
    slot_pool = SlotPool(plan.num_slots, plan.slots_per_request)
    prefix = None
    if cache.enable_prefix_caching:
        block_pool = CachingBlockPool(plan.num_kv_blocks)
        slot_pool = CachingSlotPool(plan.num_slots, plan.slots_per_request)
        prefix = PrefixCache(
            block_pool, slot_pool, block_size=cache.kv_block_size, checkpoint_interval=interval
        )
    return RunnerSetup(
        runner=runner,
        model_config=model_config,
        plan=plan,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        model_name=name,
        eos_token_ids=sorted(eos),
        block_pool=block_pool,
        slot_pool=slot_pool,
        prefix_cache=prefix,
        generation_defaults=read_generation_defaults(model_dir),
    )
