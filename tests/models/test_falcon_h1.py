"""Falcon-H1 (FalconH1ForCausalLM) on the engine, against transformers on tiny checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from checkpoints import cached_checkpoint, hf_greedy
from conftest import requires_cuda
from family_helpers import (
    NEW_TOKENS,
    check_graph_steps_equal_eager,
    check_tp2,
    family_prompts,
    hf_logits,
    our_logits,
)

from replayssm.models.config import PARALLEL, ModelConfig
from replayssm.models.falcon_h1 import FalconH1ForCausalLM
from replayssm.models.loader import load_model

# Falcon-H1-0.5B's shape (transformers' Falcon-H1 documentation): 36 parallel layers, 1024 wide,
# 8 query / 2 KV heads of 64, 24 Mamba heads of 64 (mamba_d_ssm 1536), state 128. The multipliers are
# stand-ins (all != 1), not the published values.
PUBLISHED_05B = {
    "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "hidden_size": 1024,
    "num_hidden_layers": 36, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 2048, "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64,
    "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 128,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_rms_norm": False,
    "mamba_norm_before_gate": False, "mamba_use_mlp": True, "projectors_bias": False,
    "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1e11, "rope_scaling": None,
    "max_position_embeddings": 16384, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32784, "bos_token_id": 1, "eos_token_id": 11, "embedding_multiplier": 5.5,
    "lm_head_multiplier": 0.04, "key_multiplier": 0.4, "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 0.9, "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.24,
    "ssm_multipliers": [0.35, 0.25, 0.35, 0.5, 0.35], "mlp_multipliers": [0.88, 0.59],
}
# (our field of FalconH1Multipliers or ModelConfig, transformers' config field)
MULTIPLIERS = [("attention_in", "attention_in_multiplier"), ("attention_out", "attention_out_multiplier"),
               ("key", "key_multiplier"), ("ssm_in", "ssm_in_multiplier"), ("ssm_out", "ssm_out_multiplier"),
               ("ssm_zxbcdt", "ssm_multipliers"), ("mlp_gate", "mlp_multipliers"),
               ("mlp_down", "mlp_multipliers"), ("lm_head", "lm_head_multiplier"),
               ("embedding_multiplier", "embedding_multiplier")]
NORMS = {"no_norm": dict(mamba_rms_norm=False),
         "gate_then_norm": dict(mamba_rms_norm=True, mamba_norm_before_gate=False),
         "norm_then_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True)}
BIASES = dict(projectors_bias=True, mamba_proj_bias=True, attention_bias=True, mlp_bias=True)


def _prompts():
    return family_prompts("falcon_h1")


def test_published_config_fields():
    """A Falcon-H1-0.5B-shaped config.json: 36 parallel layers, each one Mamba and one attention layer."""
    cfg = ModelConfig.from_hf(PUBLISHED_05B)
    assert cfg.layer_types == (PARALLEL,) * 36
    assert cfg.num_mamba_layers == cfg.num_attention_layers == 36
    mamba = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.mamba_n_groups)
    assert mamba == (24, 64, 128, 1)
    assert cfg.mamba_intermediate_size == 1536 and cfg.conv_dim == 1536 + 2 * 128
    attention = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta)
    assert attention == (8, 2, 64, 1e11)
    m = cfg.falcon_h1
    scalars = (m.key, m.ssm_in, m.ssm_out, m.mlp_gate, m.mlp_down, m.lm_head)
    assert scalars == (0.4, 1.25, 0.24, 0.88, 0.59, 0.04)
    assert m.ssm_zxbcdt == (0.35, 0.25, 0.35, 0.5, 0.35) and cfg.embedding_multiplier == 5.5
    assert not m.mamba_rms_norm and cfg.dtype == torch.bfloat16 and cfg.eos_token_ids == (11,)


@pytest.mark.parametrize("edit, field", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters"),
    (dict(time_step_limit=[0.001, 0.1]), "time_step_limit"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mamba_use_mlp=False), "mamba_use_mlp"),
    (dict(mamba_d_head=32), "mamba_d_head"),
    (dict(ssm_multipliers=[1.0, 1.0]), "ssm_multipliers"),
    (dict(mlp_multipliers="1.0"), "mlp_multipliers"),
])
def test_unserved_fields_are_errors(edit, field):
    """A field we do not implement, or an inconsistent one, is a ValueError naming it."""
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(dict(PUBLISHED_05B, **edit))


@pytest.mark.parametrize("size, field", [(16, "mamba_num_heads"), (3, "num_attention_heads")])
def test_indivisible_heads_are_named(size, field):
    """A tensor_parallel_size that does not divide a head count is a ValueError naming the field."""
    from replayssm.distributed.sharding import check_shardable

    cfg = ModelConfig.from_hf(PUBLISHED_05B)
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size}.*{field}"):
        check_shardable(cfg, size)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_prefill_logits_match_transformers(norm):
    """Packed varlen prefill gives transformers' logits at every position, for each Mamba output norm
    (none, norm(y * silu(z)), norm(y) * silu(z)), with biases on every projection."""
    path, hf = cached_checkpoint("falcon_h1", **NORMS[norm], **BIASES)
    logits, prompts = our_logits(path, FalconH1ForCausalLM)
    torch.testing.assert_close(logits, hf_logits(hf, prompts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ours, theirs", MULTIPLIERS)
def test_each_multiplier_is_applied(ours, theirs):
    """Serving the same weights with one multiplier dropped (set to 1) moves the logits off transformers'."""
    path, hf = cached_checkpoint("falcon_h1")
    cfg = ModelConfig.from_hf(path)
    if ours == "embedding_multiplier":
        assert cfg.embedding_multiplier != 1.0
        edited = dataclasses.replace(cfg, embedding_multiplier=1.0)
    else:
        one = (1.0,) * 5 if ours == "ssm_zxbcdt" else 1.0
        assert getattr(cfg.falcon_h1, ours) != one
        edited = dataclasses.replace(cfg, falcon_h1=dataclasses.replace(cfg.falcon_h1, **{ours: one}))
    logits, prompts = our_logits(path, FalconH1ForCausalLM, edited)
    assert (logits - hf_logits(hf, prompts)).abs().max() > 1e-2


def test_bf16_projection_multipliers_round_as_transformers():
    """In bf16, in_proj times the segment multipliers and k_proj times key equal transformers' products
    bit for bit (multipliers rounded to bf16, one bf16 multiply after the projection)."""
    from transformers import FalconH1ForCausalLM as HFFalconH1

    path, _ = cached_checkpoint("falcon_h1")
    hf = HFFalconH1.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours = load_model(path, dtype=torch.bfloat16)[0]
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    theirs, m = hf.model.layers[1], hf.config
    with torch.no_grad():
        want_in = theirs.mamba.in_proj(x * m.ssm_in_multiplier) * theirs.mamba.mup_vector[0, 0]
        want_k = theirs.self_attn.k_proj(x) * m.key_multiplier
        assert torch.equal(ours.layers[1].mixer.in_proj(x), want_in)
        assert torch.equal(ours.layers[1].self_attn.k_proj(x), want_k)


@pytest.mark.parametrize("overrides", [{}, dict(mamba_n_groups=1, **NORMS["norm_then_gate"], **BIASES)],
                         ids=["published", "spanning_norm_group_biases"])
def test_tp2_gives_transformers_tokens(overrides):
    """Tensor parallelism over 2 ranks (gloo): Mamba and attention split by heads, MLP by its
    intermediate dimension, multipliers on each shard; transformers' greedy tokens. The variant's one
    Mamba group spans both ranks (norm before gate all-reduces its sum of squares) and every projection
    has a bias."""
    path, hf = cached_checkpoint("falcon_h1", **overrides)
    check_tp2(path, _prompts(), hf_greedy(hf, _prompts(), NEW_TOKENS))


@requires_cuda
def test_graph_steps_equal_eager():
    """CUDA graph verify steps (ReplaySSM, q = 3, fp32) equal the eager steps' logits."""
    path, _ = cached_checkpoint("falcon_h1")
    check_graph_steps_equal_eager(path)
