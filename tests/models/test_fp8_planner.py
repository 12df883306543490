"""Memory planning with FP8 weights: weights count at their stored dtype, the freed bytes go to the caches."""

from __future__ import annotations

import glob
import os

import torch
from checkpoints import cached_checkpoint

from replayssm.cache.planner import plan_cache
from replayssm.config import EngineConfig
from replayssm.engine.runner_setup import default_memory_budget, weight_bytes_on_device
from replayssm.models import model_class
from replayssm.models.config import ModelConfig
from replayssm.models.dummy import parameter_bytes
from replayssm.models.layers.fp8_linear import runtime_fp8_params


def test_parameter_bytes_count_fp8_weights_at_one_byte():
    """parameter_bytes with quantization="fp8": every quantized weight (projections and stacked experts)
    takes 1 byte per element plus one fp32 scale per output channel; the rest stays 2 bytes (bf16)."""
    path, _ = cached_checkpoint("nemotron_h")
    cfg = ModelConfig.from_hf(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    names = runtime_fp8_params(model)
    assert any("experts" in n for n in names)
    bf16 = sum(p.numel() * p.element_size() for p in params.values())
    freed = sum(params[n].numel() for n in names)  # 2 -> 1 byte each
    scales = sum(4 * params[n].numel() // params[n].shape[-1] for n in names)  # (.., N, 1) fp32
    assert parameter_bytes(cfg, torch.bfloat16) == bf16
    assert parameter_bytes(cfg, torch.bfloat16, "fp8") == bf16 - freed + scales


def test_quantized_checkpoint_gives_freed_memory_to_the_caches(monkeypatch):
    """--quantization fp8 on a bf16 checkpoint: the budget subtracts the FP8 weight bytes, not the file
    size, so the planner gives the KV cache the difference (here: more KV blocks)."""
    path, _ = cached_checkpoint("nemotron_h")
    cfg = ModelConfig.from_hf(path)
    plain = EngineConfig(model=path, device="cuda", dtype="bfloat16")
    fp8 = EngineConfig(model=path, device="cuda", dtype="bfloat16", quantization="fp8")
    assert weight_bytes_on_device(plain, cfg, "bfloat16") is None  # the file size tells
    fp8_bytes = weight_bytes_on_device(fp8, cfg, "bfloat16")
    assert fp8_bytes == parameter_bytes(cfg, torch.bfloat16, "fp8")
    file_bytes = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors")))
    assert fp8_bytes < file_bytes
    free = 64 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    budgets = [default_memory_budget("cuda", 0.5, path, w) for w in (None, fp8_bytes)]
    assert budgets[1] - budgets[0] == file_bytes - fp8_bytes
    kw = dict(bytes_per_slot=1000, bytes_per_kv_block=4096, kv_block_size=16, max_model_len=256,
              slots_per_request=1, max_num_seqs=10_000)
    blocks = [plan_cache(b, **kw).num_kv_blocks for b in budgets]
    assert blocks[1] > blocks[0]
