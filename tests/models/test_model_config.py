"""ModelConfig.from_hf: every supported spelling normalizes to the same fields; bad configs name the field."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import cached_checkpoint

from replayssm.models.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig


def _raw(kind: str) -> dict:
    path, _ = cached_checkpoint(kind)
    with open(f"{path}/config.json") as f:
        return json.load(f)


def test_nemotron_h_fields():
    """A transformers-written Nemotron-H config yields layer kinds, Mamba, attention and MoE sizes."""
    cfg = ModelConfig.from_hf(cached_checkpoint("nemotron_h")[0])
    assert cfg.layer_types == (MAMBA, ATTENTION, MOE, MAMBA, MLP, ATTENTION, MAMBA, MOE)
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.mamba_n_groups) == (8, 16, 16, 2)
    assert cfg.conv_dim == 8 * 16 + 2 * 2 * 16 and cfg.chunk_size == 8 and cfg.conv_kernel == 4
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (8, 2, 2, 1)
    assert cfg.routed_scaling_factor == 2.5 and cfg.moe_shared_intermediate_size == 48
    assert cfg.dtype == torch.float32 and not cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)


def test_pattern_and_legacy_spellings_agree():
    """hybrid_override_pattern, legacy layer names and remote-code field names give the same config."""
    raw = _raw("nemotron_h")
    base = ModelConfig.from_hf(raw)
    old = dict(raw)
    del old["layers_block_type"]
    old["hybrid_override_pattern"] = "M*EM-*ME"
    for new, legacy in (("n_groups", "mamba_n_groups"), ("conv_kernel", "mamba_d_conv"),
                        ("chunk_size", "mamba_chunk_size"), ("head_dim", "attention_head_dim")):
        old[legacy] = old.pop(new)
    assert ModelConfig.from_hf(old) == base
    legacy_names = dict(raw, layers_block_type=["mamba", "attention", "moe", "mamba", "mlp", "attention",
                                                "mamba", "moe"])
    assert ModelConfig.from_hf(legacy_names) == base


def test_mamba2_fields():
    """A pure Mamba-2 config becomes all-Mamba layers with an fp32 residual (the transformers default)."""
    cfg = ModelConfig.from_hf(cached_checkpoint("mamba2")[0])
    assert cfg.layer_types == (MAMBA,) * 3 and cfg.residual_in_fp32
    assert cfg.num_attention_layers == 0 and cfg.mamba_intermediate_size == 128


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.update(architectures=["LlamaForCausalLM"]), "architectures"),
    (lambda r: r.pop("architectures"), "architectures"),
    (lambda r: r.pop("hidden_size"), "hidden_size"),
    (lambda r: r.pop("layers_block_type"), "layers_block_type"),
    (lambda r: r.update(layers_block_type=["mamba", "conv"]), "layers_block_type"),
    (lambda r: r.update(mamba_num_heads="eight"), "mamba_num_heads"),
    (lambda r: r.update(dtype="int8"), "dtype"),
    (lambda r: r.update(mamba_hidden_act="gelu"), "mamba_hidden_act"),
])
def test_bad_config_names_field(edit, field, tmp_path):
    """A malformed config.json raises ValueError naming the file and the field."""
    raw = _raw("nemotron_h")
    edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=field) as err:
        ModelConfig.from_hf(tmp_path)
    assert "config.json" in str(err.value)


def test_missing_config_json(tmp_path):
    """A directory without config.json raises ValueError naming the path."""
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_hf(tmp_path)
