"""RotaryEmbedding against transformers' rotary modules and apply_rotary_pos_emb (full and partial)."""

from __future__ import annotations

import pytest
import torch

from replayssm.models.config import ModelConfig
from replayssm.models.layers.rotary import RotaryEmbedding, rotary_for

T, HEADS, KV_HEADS, D = 11, 4, 2, 16


def _hf_rotate(q, k, positions, rotary_dim, base, dtype):
    """transformers' reference: Llama's rotary module (full) or Bamba's (partial_rotary_factor)."""
    if rotary_dim == D:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

        config = LlamaConfig(hidden_size=HEADS * D, num_attention_heads=HEADS, head_dim=D,
                             rope_parameters={"rope_type": "default", "rope_theta": base})
        module = LlamaRotaryEmbedding(config)
    else:
        from transformers import BambaConfig
        from transformers.models.bamba.modeling_bamba import BambaRotaryEmbedding, apply_rotary_pos_emb

        config = BambaConfig(hidden_size=HEADS * D, num_attention_heads=HEADS,
                             rope_parameters={"rope_type": "default", "rope_theta": base,
                                              "partial_rotary_factor": rotary_dim / D})
        module = BambaRotaryEmbedding(config)
    cos, sin = module(torch.zeros(1, dtype=dtype), positions[None])
    assert cos.shape[-1] == rotary_dim
    # transformers' layout is (batch, heads, T, D)
    qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return qh[0].transpose(0, 1), kh[0].transpose(0, 1)


@pytest.mark.parametrize("rotary_dim", [D, D // 2])
def test_matches_transformers_in_float64(rotary_dim):
    """Full and partial rotary equal transformers' rotation on random q, k at scattered positions."""
    g = torch.Generator().manual_seed(rotary_dim)
    q = torch.randn(T, HEADS, D, generator=g, dtype=torch.float64)
    k = torch.randn(T, KV_HEADS, D, generator=g, dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 7, 3, 100, 511, 42, 42, 9, 250])
    rope = RotaryEmbedding(D, rotary_dim, base=500.0, max_position=512)
    q_out, k_out = rope(positions, q, k)
    q_ref, k_ref = _hf_rotate(q, k, positions, rotary_dim, 500.0, torch.float64)
    assert q_out.dtype == k_out.dtype == torch.float64
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=1e-12)
    if rotary_dim < D:
        assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])


def test_matches_transformers_in_float32():
    """In fp32 (the tiny models' dtype) the result equals transformers' to rounding."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(T, HEADS, D, generator=g), torch.randn(T, KV_HEADS, D, generator=g)
    positions = torch.arange(T) * 37
    q_out, k_out = RotaryEmbedding(D, base=10000.0, max_position=512)(positions, q, k)
    q_ref, k_ref = _hf_rotate(q, k, positions, D, 10000.0, torch.float32)
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=1e-6)


def test_bfloat16_rotates_in_fp32_and_casts_back():
    """A bf16 input comes back bf16, equal to the fp32 rotation rounded once."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(T, HEADS, D, generator=g), torch.randn(T, KV_HEADS, D, generator=g)
    qb, kb = q.bfloat16(), k.bfloat16()
    rope = RotaryEmbedding(D, 8, max_position=64)
    positions = torch.arange(T) + 3
    q_out, k_out = rope(positions, qb, kb)
    q_ref, k_ref = rope(positions, qb.float(), kb.float())
    assert q_out.dtype == torch.bfloat16
    assert torch.equal(q_out, q_ref.bfloat16()) and torch.equal(k_out, k_ref.bfloat16())


def test_position_zero_is_identity_and_layers_share_one_table():
    """Position 0 leaves q and k unchanged; two embeddings of one shape hold the same table."""
    q, k = torch.randn(3, HEADS, D), torch.randn(3, KV_HEADS, D)
    a, b = RotaryEmbedding(D, max_position=64), RotaryEmbedding(D, max_position=64)
    q_out, k_out = a(torch.zeros(3, dtype=torch.int64), q, k)
    assert torch.equal(q_out, q) and torch.equal(k_out, k)
    assert a.cos_sin(q.device) is b.cos_sin(q.device)
    assert not list(a.state_dict())


def test_bad_fields_are_value_errors():
    """Unsupported scaling and an odd or oversized rotary_dim are ValueErrors naming the field."""
    with pytest.raises(ValueError, match="rope_scaling"):
        RotaryEmbedding(D, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    RotaryEmbedding(D, rope_scaling={"rope_type": "default"})
    for bad in (7, 2 * D):
        with pytest.raises(ValueError, match="rotary_dim"):
            RotaryEmbedding(D, bad)
    base = dict(architecture="NemotronHForCausalLM", layer_types=("attention",), hidden_size=64,
                vocab_size=16, norm_eps=1e-5, tie_word_embeddings=False, dtype=torch.float32,
                max_model_len=64, mamba_num_heads=0, mamba_head_dim=0, ssm_state_size=0, mamba_n_groups=1,
                conv_kernel=4, chunk_size=8, use_conv_bias=True, mamba_proj_bias=False,
                num_attention_heads=4, num_key_value_heads=2, head_dim=D)
    with pytest.raises(ValueError, match="rotary_dim"):
        ModelConfig(**base, rope_theta=1e4, rotary_dim=D + 2)
    assert rotary_for(ModelConfig(**base)) is None
    rope = rotary_for(ModelConfig(**base, rope_theta=1e4, rotary_dim=D // 2))
    assert (rope.rotary_dim, rope.base, rope.max_position) == (D // 2, 1e4, 64)
