"""Qwen3-Next and Qwen3.5 (Gated DeltaNet hybrids) on the engine, against transformers on tiny checkpoints."""

from __future__ import annotations

import atexit
import shutil
import tempfile

import pytest
import torch
from checkpoints import hf_greedy, random_prompts
from family_helpers import (
    GREEDY,
    NEW_TOKENS,
    check_prefix_hit,
    family_llm,
    greedy_tokens,
    hf_logits,
    our_logits,
)

from replayssm.models.config import ModelConfig
from replayssm.models.qwen3_next import Qwen3NextForCausalLM

LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
# (model type, linear key heads, linear value heads): dense and MoE, value heads 1x, 2x and 4x the key heads.
VARIANTS = [("qwen3_next", 2, 4), ("qwen3_5", 2, 2), ("qwen3_5", 1, 4), ("qwen3_5_moe", 2, 4)]
_CACHE: dict = {}


def _tiny(kind: str, hk: int, hv: int):
    """A 4-layer random-weight checkpoint written by transformers (weights redrawn at scale 0.3 so that
    norms, gates and decays all matter); (directory, transformers model)."""
    import transformers as tf

    common = dict(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=4,
        layer_types=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24
    )
    if kind == "qwen3_next":
        cfg = tf.Qwen3NextConfig(intermediate_size=40, decoder_sparse_step=2, **moe, **common)
        cls = tf.Qwen3NextForCausalLM
    elif kind == "qwen3_5":
        cfg = tf.Qwen3_5TextConfig(intermediate_size=40, **common)
        cls = tf.Qwen3_5ForCausalLM
    else:
        cfg = tf.Qwen3_5MoeTextConfig(**moe, **common)
        cls = tf.Qwen3_5MoeForCausalLM
    torch.manual_seed(hk * 10 + hv)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    root = tempfile.mkdtemp(prefix=f"replayssm-{kind}-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    model.save_pretrained(root)
    return root, model


def tiny(variant) -> tuple[str, torch.nn.Module]:
    if variant not in _CACHE:
        _CACHE[variant] = _tiny(*variant)
    return _CACHE[variant]


def _want(variant, prompts):
    key = ("want", variant)
    if key not in _CACHE:
        _CACHE[key] = hf_greedy(tiny(variant)[1], prompts, NEW_TOKENS)
    return _CACHE[key]


PROMPTS = random_prompts([9, 17, 4], seed=5)
IDS = [f"{k}-hk{hk}-hv{hv}" for k, hk, hv in VARIANTS]


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_prefill_logits_match_transformers(variant):
    """A varlen prefill of three prompts gives transformers' logits."""
    path, hf = tiny(variant)
    got, prompts = our_logits(path, Qwen3NextForCausalLM)
    want = hf_logits(hf, prompts)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


@pytest.mark.parametrize("replayssm", [True, False], ids=["replayssm", "baseline"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_greedy_tokens_match_transformers(variant, replayssm):
    """Greedy decoding equals transformers' generate(), ReplaySSM on (W = 4: the ring flushes) and off."""
    path, _ = tiny(variant)
    llm = family_llm(path, replayssm=replayssm, replay_window=4)
    assert greedy_tokens(llm, PROMPTS) == _want(variant, PROMPTS)


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[2]], ids=[IDS[0], IDS[2]])
def test_prefix_hit_equals_miss(variant):
    """A prompt extending a cached one starts from a published checkpoint and gives transformers' tokens."""
    path, hf = tiny(variant)
    check_prefix_hit(path, hf, PROMPTS)


@pytest.mark.parametrize("replayssm", [True, False], ids=["replayssm", "baseline"])
@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[2]], ids=[IDS[0], IDS[2]])
def test_ngram_speculation_is_lossless(variant, replayssm):
    """k = 3 n-gram drafts give the greedy tokens, with drafts accepted (ReplaySSM: cursor rollback; baseline:
    1 + k slots per request)."""
    path, _ = tiny(variant)
    prompts = [p + p for p in PROMPTS]  # repeats give the n-gram drafter matches
    llm = family_llm(
        path, replayssm=replayssm, replay_window=8, num_speculative_tokens=3, speculative_method="ngram"
    )
    assert greedy_tokens(llm, prompts, GREEDY) == hf_greedy(tiny(variant)[1], prompts, NEW_TOKENS)
    m = llm.get_metrics()
    assert m["spec_draft_tokens"] > 0 and m["spec_accepted_tokens"] > 0


def test_unsupported_rope_and_tensor_parallelism_are_refused():
    """A scaled RoPE config and tensor_parallel_size > 1 raise ValueErrors naming the field."""
    path, _ = tiny(VARIANTS[1])
    raw = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "layer_types": ["linear_attention"],
        "num_attention_heads": 1,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 1,
        "linear_key_head_dim": 4,
        "linear_value_head_dim": 4,
        "intermediate_size": 8,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4},
    }
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_hf(raw)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        family_llm(path, tensor_parallel_size=2)
