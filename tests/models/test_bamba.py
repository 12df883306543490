"""Bamba (BambaForCausalLM) on the engine, against transformers on tiny checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from checkpoints import cached_checkpoint
from conftest import requires_cuda
from family_helpers import (
    check_graph_steps_equal_eager,
    check_tp2,
    family_case,
    family_prompts,
    hf_logits,
    our_logits,
)

from replayssm.models.config import ATTENTION, MAMBA, MLP, ModelConfig
from replayssm.models.two_part import TwoPartForCausalLM

# ibm-ai-platform/Bamba-9B's shape as far as it is public here (32 layers, 4096 wide, 32 heads, state
# 128, attention at layers 9, 18 and 27); the other values are transformers' Bamba defaults, not read
# from the published file.
PUBLISHED_9B = {
    "architectures": ["BambaForCausalLM"], "model_type": "bamba", "attn_layer_indices": [9, 18, 27],
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "mamba_chunk_size": 256, "mamba_conv_bias": True,
    "mamba_d_conv": 4, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1,
    "mamba_n_heads": 128, "mamba_proj_bias": False, "max_position_embeddings": 262144,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    "z_loss_coefficient": 0.0,
}


def _prompts():
    return family_prompts("bamba")


@pytest.fixture(scope="module")
def bamba():
    """(path, transformers model, prompts, transformers greedy tokens)."""
    return family_case("bamba")


def test_published_config_fields():
    """A Bamba-9B-shaped config.json: attention at layers 9, 18, 27, SwiGLU MLPs, RoPE on half a head."""
    cfg = ModelConfig.from_hf(PUBLISHED_9B)
    assert [i for i, t in enumerate(cfg.layer_types) if t == ATTENTION] == [9, 18, 27]
    assert cfg.layer_types.count(MAMBA) == 29 and cfg.ffn_types == (MLP,) * 32 and not cfg.has_moe
    mamba = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.mamba_n_groups)
    assert mamba == (128, 64, 128, 1)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert (cfg.rope_theta, cfg.rotary_dim, cfg.intermediate_size) == (10000.0, 64, 14336)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling) == (
        1.0, 1.0, 0.0, 1.0)
    assert not cfg.tie_word_embeddings and cfg.dtype == torch.bfloat16 and cfg.norm_eps == 1e-5


def test_transformers5_rope_parameters_are_read():
    """rope_parameters (as transformers 5 saves it) gives rope_theta and the stated partial factor."""
    raw = dict(PUBLISHED_9B, rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                              "partial_rotary_factor": 0.25})
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.rope_theta, cfg.rotary_dim) == (5e5, 32)


def test_z_loss_coefficient_is_ignored():
    """z_loss_coefficient is a training loss term: any value serves the same model."""
    with_loss = ModelConfig.from_hf(dict(PUBLISHED_9B, z_loss_coefficient=1e-4))
    assert with_loss == ModelConfig.from_hf(PUBLISHED_9B)


@pytest.mark.parametrize("edit, field", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_parameters"),
    (dict(partial_rotary_factor=1.0), "partial_rotary_factor"),
    (dict(attn_layer_indices=[9, 32]), "attn_layer_indices"),
    (dict(attn_layer_indices=[9, 9]), "attn_layer_indices"),
    (dict(layers_block_type=["mamba"] * 32), "layers_block_type"),
    (dict(time_step_limit=[0.001, 0.1]), "time_step_limit"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mamba_d_head=32), "mamba_d_head"),
])
def test_unserved_fields_are_errors(edit, field):
    """A field we do not implement, or an inconsistent one, is a ValueError naming it."""
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(dict(PUBLISHED_9B, **edit))


def test_prefill_logits_match_transformers():
    """Packed varlen prefill gives transformers' logits at every position."""
    path, hf = cached_checkpoint("bamba")
    logits, prompts = our_logits(path, TwoPartForCausalLM)
    torch.testing.assert_close(logits, hf_logits(hf, prompts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("edit", [dict(rope_theta=0.0), dict(rotary_dim=16)], ids=["no_rope", "full_rope"])
def test_partial_rotary_is_applied(edit):
    """The same weights without RoPE, or rotating the whole head, give logits off transformers'."""
    path, hf = cached_checkpoint("bamba")
    cfg = ModelConfig.from_hf(path)
    assert cfg.rotary_dim == cfg.head_dim // 2
    logits, prompts = our_logits(path, TwoPartForCausalLM, dataclasses.replace(cfg, **edit))
    assert (logits - hf_logits(hf, prompts)).abs().max() > 1e-2


def test_tp2_gives_transformers_tokens(bamba):
    """Tensor parallelism over 2 ranks (gloo): mixers split by heads, MLP replicated; same tokens."""
    path, _, prompts, hf = bamba
    check_tp2(path, prompts, hf)


@requires_cuda
def test_graph_steps_equal_eager():
    """CUDA graph verify steps (ReplaySSM, q = 3, rotary attention) equal the eager steps' logits (fp32)."""
    path, _ = cached_checkpoint("bamba")
    check_graph_steps_equal_eager(path)
