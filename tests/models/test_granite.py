"""Granite 4.0-H (GraniteMoeHybridForCausalLM) on the engine, against transformers on tiny checkpoints."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from checkpoints import cached_checkpoint, hf_greedy
from conftest import requires_cuda
from family_helpers import (
    FAMILIES,
    NEW_TOKENS,
    check_graph_steps_equal_eager,
    check_tp2,
    family_case,
    family_llm,
    family_prompts,
    greedy_tokens,
    hf_logits,
    our_logits,
)
from safetensors.torch import load_file, save_file

from replayssm.distributed.parallel import TensorParallel
from replayssm.models.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig
from replayssm.models.loader import load_model
from replayssm.models.two_part import TwoPartForCausalLM

MULTIPLIERS = FAMILIES["granite"][1]

# The fields of ibm-granite/granite-4.0-h-small's config.json that shape the model.
PUBLISHED_SMALL = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "attention_bias": False, "attention_dropout": 0.0, "attention_multiplier": 0.0078125,
    "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100256, "embedding_multiplier": 12,
    "hidden_act": "silu", "hidden_size": 4096, "init_method": "mup", "intermediate_size": 768,
    "layer_types": (["mamba"] * 5 + ["attention"] + ["mamba"] * 4) * 4,
    "logits_scaling": 16, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_d_conv": 4,
    "mamba_d_head": 64, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 128,
    "mamba_proj_bias": False, "max_position_embeddings": 131072, "normalization_function": "rmsnorm",
    "num_attention_heads": 32, "num_experts_per_tok": 10, "num_hidden_layers": 40, "num_key_value_heads": 8,
    "num_local_experts": 72, "output_router_logits": False, "position_embedding_type": "nope",
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000,
    "router_aux_loss_coef": 0.0, "shared_intermediate_size": 1536, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 100352,
}


def _checkpoint(**overrides):
    return cached_checkpoint("granite_hybrid", **{**MULTIPLIERS, **overrides})


def _prompts():
    return family_prompts("granite")


@pytest.fixture(scope="module")
def granite():
    """(path, transformers model, prompts, transformers greedy tokens)."""
    return family_case("granite")


def test_published_config_fields():
    """granite-4.0-h-small's config.json: Mamba/attention mixers, MoE + shared MLP per layer, multipliers."""
    cfg = ModelConfig.from_hf(PUBLISHED_SMALL)
    assert cfg.layer_types.count(ATTENTION) == 4 and cfg.layer_types.count(MAMBA) == 36
    assert cfg.ffn_types == (MOE,) * 40 and cfg.router == "softmax_topk"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (72, 10, 768)
    assert cfg.intermediate_size == cfg.moe_shared_intermediate_size == 1536
    mamba = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.mamba_n_groups)
    assert mamba == (128, 64, 128, 1)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling) == (
        12.0, 0.22, 0.0078125, 16.0)
    assert cfg.tie_word_embeddings and cfg.dtype == torch.bfloat16 and cfg.eos_token_ids == (100257,)
    dense = ModelConfig.from_hf(dict(PUBLISHED_SMALL, num_local_experts=0))
    assert dense.ffn_types == (MLP,) * 40 and not dense.has_moe


@pytest.mark.parametrize("edit, field", [
    (dict(position_embedding_type="rope"), "position_embedding_type"),
    (dict(time_step_limit=[0.001, 0.1]), "time_step_limit"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(normalization_function="layernorm"), "normalization_function"),
    (dict(layer_types=["mamba", "moe"] * 20), "layer_types"),
    (dict(num_hidden_layers=39), "num_hidden_layers"),
    (dict(mamba_d_head=32), "mamba_d_head"),
    (dict(num_local_experts=None), "num_local_experts"),
])
def test_unserved_fields_are_errors(edit, field):
    """A field we do not implement, or an inconsistent one, is a ValueError naming it."""
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(dict(PUBLISHED_SMALL, **edit))


def test_transformers_infinity_spelling_is_accepted():
    """time_step_limit as transformers writes it ([0.0, {"__float__": "Infinity"}]) is the no-op clamp."""
    cfg = ModelConfig.from_hf(dict(PUBLISHED_SMALL, time_step_limit=[0.0, {"__float__": "Infinity"}]))
    assert cfg == ModelConfig.from_hf(PUBLISHED_SMALL)


@pytest.mark.parametrize("experts", [8, 0])
def test_prefill_logits_match_transformers(experts):
    """Packed varlen prefill gives transformers' logits at every position (MoE and dense layouts)."""
    path, hf = _checkpoint(num_local_experts=experts)
    logits, prompts = our_logits(path, TwoPartForCausalLM)
    torch.testing.assert_close(logits, hf_logits(hf, prompts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("field", ["embedding_multiplier", "residual_multiplier", "attention_scale",
                                   "logits_scaling"])
def test_each_multiplier_is_applied(field):
    """Serving the same weights with one multiplier dropped (set to 1) moves the logits off transformers'."""
    path, hf = _checkpoint()
    cfg = ModelConfig.from_hf(path)
    assert getattr(cfg, field) not in (0.0, 1.0)
    logits, prompts = our_logits(path, TwoPartForCausalLM, dataclasses.replace(cfg, **{field: 1.0}))
    assert (logits - hf_logits(hf, prompts)).abs().max() > 1e-2


def test_dense_layout_greedy_matches_transformers():
    """num_local_experts = 0 (shared MLP only, as granite-4.0-h-micro): transformers' greedy tokens."""
    path, hf = _checkpoint(num_local_experts=0)
    assert greedy_tokens(family_llm(path), _prompts()) == hf_greedy(hf, _prompts(), NEW_TOKENS)


def test_transformers5_tensor_names_load(tmp_path):
    """transformers 5's in-memory names (experts.gate_up_proj, router.weight) load like the published ones."""
    path, _ = _checkpoint()
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    file = tmp_path / "model.safetensors"
    moe = {"input_linear.weight": "experts.gate_up_proj", "output_linear.weight": "experts.down_proj",
           "router.layer.weight": "router.weight"}
    renamed = {}
    for key, value in load_file(str(file)).items():
        stem, sep, leaf = key.partition("block_sparse_moe.")
        renamed[stem + sep + moe.get(leaf, leaf) if sep else key] = value
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in renamed
    save_file(renamed, str(file), metadata={"format": "pt"})
    ours, _ = load_model(tmp_path)
    ref, _ = load_model(path)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))


def test_missing_tensor_is_named(tmp_path):
    """A checkpoint without one expert tensor is a ValueError naming our parameter."""
    path, _ = _checkpoint()
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    file = tmp_path / "model.safetensors"
    weights = load_file(str(file))
    del weights["model.layers.3.block_sparse_moe.output_linear.weight"]
    save_file(weights, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.3\.block_sparse_moe\.experts\.down_proj"):
        load_model(tmp_path)


def test_tp2_gives_transformers_tokens(granite):
    """Tensor parallelism over 2 ranks (gloo): mixers split by heads, MLP and experts by their
    intermediate dims; same tokens."""
    path, _, prompts, hf = granite
    check_tp2(path, prompts, hf)


def _halves_of(w: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    """Rank `rank` of 2's rows of a fused [gate | up] weight along `dim`: its half of each part."""
    gate, up = w.chunk(2, dim=dim)
    return torch.cat([gate.chunk(2, dim=dim)[rank], up.chunk(2, dim=dim)[rank]], dim=dim)


def test_tp2_shards_split_every_expert():
    """Under TP=2 each rank holds every expert's and the shared MLP's half of the intermediate
    dimension: its half of the gate and of the up rows, and the matching down columns."""
    path, _ = _checkpoint()
    full = dict(load_model(path)[0].named_parameters())
    up, down = "layers.0.block_sparse_moe.experts.up_proj", "layers.0.block_sparse_moe.experts.down_proj"
    gate_up, out = "layers.0.mlp.input_linear.weight", "layers.0.mlp.output_linear.weight"
    router = "layers.0.block_sparse_moe.router.weight"
    for r in range(2):
        shard = dict(load_model(path, tp=TensorParallel(r, 2))[0].named_parameters())
        assert torch.equal(shard[up], _halves_of(full[up], 1, r))
        assert torch.equal(shard[down], full[down].chunk(2, dim=2)[r])
        assert torch.equal(shard[gate_up], _halves_of(full[gate_up], 0, r))
        assert torch.equal(shard[out], full[out].chunk(2, dim=1)[r])
        assert torch.equal(shard[router], full[router])


@requires_cuda
@pytest.mark.parametrize(("experts", "dtype"), [(8, "bfloat16"), (0, "float32")])
def test_graph_steps_equal_eager(experts, dtype):
    """CUDA graph verify steps (ReplaySSM, q = 3) equal the eager steps' logits: MoE (bf16), dense (fp32)."""
    path, _ = _checkpoint(num_local_experts=experts)
    check_graph_steps_equal_eager(path, dtype, 2e-2 if dtype == "bfloat16" else 1e-3)
