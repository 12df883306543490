"""Zamba2 (Zamba2ForCausalLM) on the engine, against transformers on tiny checkpoints."""

from __future__ import annotations

import pytest
import torch
from checkpoints import ZAMBA2_LAYERS, cached_checkpoint, hf_greedy
from conftest import requires_cuda
from family_helpers import (
    NEW_TOKENS,
    check_graph_steps_equal_eager,
    check_tp2,
    family_prompts,
    hf_logits,
    our_logits,
)

from replayssm.models.config import MAMBA, PARALLEL, ModelConfig
from replayssm.models.zamba2 import Zamba2ForCausalLM

# A Zamba2-1.2B-sized config.json (width 2048, 38 layers, 32 query = 32 KV heads, RoPE, attention
# adapters of rank 128, state 64): the sizes and the layer pattern are stand-ins, not read from the hub.
_PATTERN = (["mamba"] * 5 + ["hybrid"]) * 6 + ["mamba"] * 2
PUBLISHED_12B = {
    "architectures": ["Zamba2ForCausalLM"], "model_type": "zamba2", "hidden_size": 2048,
    "num_hidden_layers": 38, "layers_block_type": _PATTERN, "num_attention_heads": 32,
    "num_key_value_heads": 32, "n_mamba_heads": 64, "mamba_d_state": 64, "mamba_ngroups": 1,
    "mamba_expand": 2, "mamba_d_conv": 4, "chunk_size": 256, "intermediate_size": 8192,
    "num_mem_blocks": 1, "use_shared_attention_adapter": True, "adapter_rank": 128, "use_mem_rope": True,
    "rope_theta": 10000, "hidden_act": "gelu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
    "tie_word_embeddings": True, "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2,
    "add_bias_linear": False, "torch_dtype": "bfloat16",
}


def _prompts():
    return family_prompts("zamba2")


def test_published_config_fields():
    """A Zamba2-1.2B-shaped config.json: hybrid layers are parallel (one Mamba and one KV cache each),
    attention is 2 * hidden wide with head_dim 2 * hidden / heads."""
    cfg = ModelConfig.from_hf(PUBLISHED_12B)
    assert cfg.layer_types == tuple(PARALLEL if t == "hybrid" else MAMBA for t in _PATTERN)
    assert cfg.num_mamba_layers == 38 and cfg.num_attention_layers == 6
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size) == (64, 64, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 32, 128)
    assert cfg.rope_theta == 10000.0 and cfg.mlp_act == "gelu" and cfg.tie_word_embeddings
    assert cfg.zamba2.num_mem_blocks == 1 and cfg.zamba2.attention_adapter and cfg.zamba2.adapter_rank == 128


def test_rope_off_without_use_mem_rope():
    """use_mem_rope false: the shared attention has no positional encoding."""
    assert ModelConfig.from_hf(dict(PUBLISHED_12B, use_mem_rope=False)).rope_theta == 0.0


@pytest.mark.parametrize("edit, field", [
    (dict(hidden_act="relu"), "hidden_act"),
    (dict(layers_block_type=["mamba", "attention"], num_hidden_layers=2), "layers_block_type"),
    (dict(num_hidden_layers=40), "layers_block_type"),
    (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(n_mamba_heads=48), "n_mamba_heads"),
    (dict(num_attention_heads=48, num_key_value_heads=48), "num_attention_heads"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters"),
    (dict(num_mem_blocks=0), "num_mem_blocks"),
    (dict(use_shared_mlp_adapter=False), "use_shared_mlp_adapter"),
])
def test_unserved_fields_are_errors(edit, field):
    """A field we do not implement, or an inconsistent one, is a ValueError naming it."""
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(dict(PUBLISHED_12B, **edit))


@pytest.mark.parametrize("edit, size, field", [({}, 3, "mamba_num_heads"),
                                              (dict(num_attention_heads=16, num_key_value_heads=16), 32,
                                               "num_attention_heads")])
def test_indivisible_heads_are_named(edit, size, field):
    """A tensor_parallel_size that does not divide a head count is a ValueError naming the field."""
    from replayssm.distributed.sharding import check_shardable

    cfg = ModelConfig.from_hf(dict(PUBLISHED_12B, **edit))
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size}.*{field}"):
        check_shardable(cfg, size)


def test_shared_blocks_are_shared_and_caches_are_not():
    """Hybrid layer j runs shared block j % num_mem_blocks, and owns KV cache j and Mamba cache i."""
    path, _ = cached_checkpoint("zamba2")
    model = Zamba2ForCausalLM(ModelConfig.from_hf(path), dtype=torch.float32)
    hybrid = [i for i, t in enumerate(ZAMBA2_LAYERS) if t == "hybrid"]
    assert len(model.shared) == 2 and len(hybrid) == 3
    blocks = [model.layers[i].shared[0] for i in hybrid]
    assert blocks[0] is blocks[2] is model.shared[0] and blocks[1] is model.shared[1]
    assert [model.layers[i].attn_index for i in hybrid] == [0, 1, 2]
    assert [layer.mixer.mamba_index for layer in model.layers] == list(range(len(ZAMBA2_LAYERS)))


def test_untied_checkpoint_has_a_block_per_hybrid_layer():
    """transformers ties the shared blocks only with tie_word_embeddings; untied, each hybrid layer runs
    its own block, and so does ours."""
    path, _ = cached_checkpoint("zamba2", tie_word_embeddings=False)
    assert len(Zamba2ForCausalLM(ModelConfig.from_hf(path), dtype=torch.float32).shared) == 3


@pytest.mark.parametrize("overrides", [{}, dict(use_mem_rope=False, use_shared_attention_adapter=False,
                                                 add_bias_linear=True, hidden_act="silu",
                                                 tie_word_embeddings=False)],
                         ids=["published", "variants"])
def test_prefill_logits_match_transformers(overrides):
    """Packed varlen prefill gives transformers' logits at every position: with RoPE and attention
    adapters, and without them, with biases, SiLU and an untied lm_head."""
    path, hf = cached_checkpoint("zamba2", **overrides)
    logits, prompts = our_logits(path, Zamba2ForCausalLM)
    torch.testing.assert_close(logits, hf_logits(hf, prompts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overrides", [{}, dict(mamba_ngroups=1, use_shared_attention_adapter=False,
                                                 num_key_value_heads=2, add_bias_linear=True,
                                                 tie_word_embeddings=False)],
                         ids=["published", "gqa_spanning_group_biases_untied"])
def test_tp2_gives_transformers_tokens(overrides):
    """Tensor parallelism over 2 ranks (gloo): Mamba and shared attention split by heads, the shared
    MLP by its intermediate dimension, each adapter's B by its projection's rows; transformers' greedy
    tokens. The variant has GQA, one Mamba group spanning both ranks, biases and a block per layer."""
    path, hf = cached_checkpoint("zamba2", **overrides)
    check_tp2(path, _prompts(), hf_greedy(hf, _prompts(), NEW_TOKENS))


@requires_cuda
def test_graph_steps_equal_eager():
    """CUDA graph verify steps (ReplaySSM, q = 3, fp32) equal the eager steps' logits."""
    path, _ = cached_checkpoint("zamba2")
    check_graph_steps_equal_eager(path)
