"""Qwen3-Next and Qwen3.5 (Gated DeltaNet hybrids) on the engine, against transformers on tiny checkpoints."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from checkpoints import hf_greedy, random_prompts
from conftest import check_decode_step_has_no_host_sync, requires_cuda
from family_helpers import (
    GREEDY,
    NEW_TOKENS,
    check_graph_steps_equal_eager,
    check_prefix_hit,
    check_tp2,
    family_llm,
    greedy_tokens,
    hf_logits,
    our_logits,
)

from replayssm import LLM, SamplingParams
from replayssm.engine.model_runner import ModelRunner, ScheduledRow
from replayssm.models.config import ModelConfig
from replayssm.models.qwen3_next import OffsetRMSNorm, Qwen3NextForCausalLM

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


@pytest.mark.parametrize("replayssm", [True, False], ids=["replayssm", "baseline"])
@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[2]], ids=[IDS[0], IDS[2]])
def test_prefix_hit_equals_miss(variant, replayssm):
    """A prompt extending a cached one starts from a published checkpoint and gives transformers' tokens,
    ReplaySSM on (checkpoints materialized from the ring) and off (state copies)."""
    path, hf = tiny(variant)
    check_prefix_hit(path, hf, PROMPTS, replayssm=replayssm)


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


@pytest.mark.parametrize("kw, on", [
    ({}, True),
    ({"num_speculative_tokens": 3, "speculative_method": "ngram"}, True),
    ({"replayssm": False}, False),
    ({"replayssm": False, "num_speculative_tokens": 3, "speculative_method": "ngram"}, False),
], ids=["plain", "ngram", "explicit-off", "explicit-off-ngram"])
def test_replayssm_is_the_default_and_false_is_kept(kw, on):
    """replayssm unset is on for a Gated DeltaNet model, with and without speculative decoding; an explicit
    False is kept. The runner, the slot plan and the metrics all see the config's value."""
    path, _ = tiny(VARIANTS[0])
    llm = family_llm(path, replay_window=8, **kw)
    k = kw.get("num_speculative_tokens", 0)
    assert llm.engine.config.replayssm is on and llm.engine.runner.replayssm is on
    assert llm.engine.plan.slots_per_request == (1 if on else 1 + k)
    assert llm.get_metrics()["replayssm"] == int(on)


def test_default_decodes_like_replayssm():
    """generate() with replayssm unset gives the replayssm=True run's tokens and logprobs exactly (sampled,
    seeded), where the baseline run's logprobs differ in their rounding."""
    path, _ = tiny(VARIANTS[1])
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, logprobs=0)

    def run(**kw):
        outs = family_llm(path, replay_window=4, **kw).generate(PROMPTS, params, use_tqdm=False)
        return [(o.token_ids, o.logprobs) for o in outs]

    default, baseline, replay = run(), run(replayssm=False), run(replayssm=True)
    assert default == replay
    assert baseline != replay


def test_unsupported_rope_is_refused():
    """A scaled RoPE config raises a ValueError naming the field."""
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


# qwen3_next: fused projections and MoE; qwen3_5: split projections, value heads 1x and 4x the key heads
# (each rank keeps one key head and its value heads).
TP_VARIANTS = [VARIANTS[0], VARIANTS[1], ("qwen3_5", 2, 8)]


@pytest.mark.parametrize("replayssm", [True, False], ids=["replayssm", "baseline"])
@pytest.mark.parametrize("variant", TP_VARIANTS, ids=[f"{k}-hk{hk}-hv{hv}" for k, hk, hv in TP_VARIANTS])
def test_tensor_parallel_matches_transformers(variant, replayssm):
    """Over 2 ranks (Gated DeltaNet by key heads, attention by heads, MLP / experts by the intermediate
    dimension) greedy decoding gives transformers' tokens, ReplaySSM on (W = 4) and off."""
    path, _ = tiny(variant)
    check_tp2(path, PROMPTS, _want(variant, PROMPTS), replayssm=replayssm, replay_window=4)


def test_tensor_parallel_refuses_key_heads_that_do_not_divide():
    """One linear key head over 2 ranks is a ValueError naming linear_num_key_heads."""
    path, _ = tiny(VARIANTS[2])
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        family_llm(path, tensor_parallel_size=2)


def _config_only(variant, tmp_path, **fields) -> str:
    """A directory holding only the variant's config.json (for load_format="dummy")."""
    raw = json.loads((Path(tiny(variant)[0]) / "config.json").read_text())
    raw.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[1], VARIANTS[3]], ids=[IDS[0], IDS[1], IDS[3]])
def test_dummy_weights_give_sane_logits(variant, tmp_path):
    """load_format="dummy" builds the model from config.json alone: the (1 + w) norms get weights near 0,
    the decays stay in (0, 1), and a prefill gives finite logits that vary across the vocabulary."""
    runner = ModelRunner(_config_only(variant, tmp_path), device="cpu", load_format="dummy", num_slots=4,
                         num_kv_blocks=16, kv_block_size=4)
    offset = [m.weight for m in runner.model.modules() if isinstance(m, OffsetRMSNorm)]
    assert offset and all(w.abs().mean() < 0.2 for w in offset)
    for m in runner.model.modules():
        if hasattr(m, "A_log"):
            decay = torch.exp(-m.A_log.exp() * torch.nn.functional.softplus(m.dt_bias))
            assert ((decay > 0.3) & (decay < 1)).all()
    prompt = random_prompts([12], seed=3)[0]
    logits = runner.execute([ScheduledRow(prompt, 0, [0, 1, 2], 0, True, num_logits=len(prompt))])
    assert torch.isfinite(logits).all() and (logits.std(-1) > 0.1).all()


def test_bf16_state_keeps_greedy_tokens_close():
    """state_dtype="bfloat16" keeps 16-bit state pools and its greedy tokens agree with the fp32-state
    run's at (almost) every step of a short generation (ReplaySSM, W = 4: the ring flushes)."""
    path, _ = tiny(VARIANTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm16 = family_llm(path, replayssm=True, replay_window=4, state_dtype="bfloat16")
    cache = llm16.engine.runner.mamba_cache
    assert cache.state and all(s.dtype == torch.bfloat16 for s in cache.state)
    got = greedy_tokens(llm16, PROMPTS, params)
    want = greedy_tokens(family_llm(path, replayssm=True, replay_window=4), PROMPTS, params)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.9 * sum(len(w) for w in want)


@requires_cuda
def test_graph_steps_equal_eager():
    """On CUDA, verify steps (q = 3, ReplaySSM) of a tiny Qwen3.5 replayed as CUDA graphs equal the eager
    steps (Gated DeltaNet decode on its Triton kernels)."""
    check_graph_steps_equal_eager(tiny(VARIANTS[2])[0])


@requires_cuda
@pytest.mark.parametrize("replayssm", [True, False], ids=["replayssm", "baseline"])
def test_decode_step_has_no_host_sync(tmp_path, replayssm):
    """On CUDA, with torch.cuda.set_sync_debug_mode("error"), a warm Qwen3.5 decode step's execute and
    commit raise nothing (dummy bf16 weights)."""
    check_decode_step_has_no_host_sync(_config_only(VARIANTS[1], tmp_path, dtype="bfloat16"), replayssm)


def _mtp_checkpoint(tmp_path) -> str:
    """The tiny Qwen3.5 with its mixer and MLP outputs scaled by 0.02 (so the next token mostly follows
    the current one) plus an MTP layer: fc passes the normed embedding (and a little of the hidden
    state), the block is a copy of the attention layer 1, the closing norm is the model's. Its drafts
    then often guess x_{i+2} from x_{i+1}, and not always."""
    from safetensors.torch import load_file, save_file

    src, _ = tiny(VARIANTS[1])
    root = tmp_path / "mtp"
    shutil.copytree(src, root)
    w = load_file(str(root / "model.safetensors"))
    for name in w:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            w[name] = w[name] * 0.02
    H = w["model.embed_tokens.weight"].shape[1]
    gen = torch.Generator().manual_seed(7)
    w["mtp.fc.weight"] = torch.cat([torch.eye(H), 0.05 * torch.randn(H, H, generator=gen)], dim=1)
    w["mtp.pre_fc_norm_embedding.weight"] = 0.05 * torch.randn(H, generator=gen)
    w["mtp.pre_fc_norm_hidden.weight"] = 0.05 * torch.randn(H, generator=gen)
    w["mtp.norm.weight"] = w["model.norm.weight"].clone()
    for name in list(w):
        if name.startswith("model.layers.1."):
            w["mtp.layers.0." + name[len("model.layers.1.") :]] = w[name].clone()
    save_file(w, str(root / "model.safetensors"))
    raw = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**raw, "mtp_num_hidden_layers": 1}))
    return str(root)


@pytest.mark.parametrize("replayssm", [True, False], ids=["replayssm", "baseline"])
def test_mtp_speculation_is_lossless(tmp_path, replayssm):
    """k = 3 drafts from the checkpoint's mtp.* layer give the non-speculative greedy tokens, with drafts
    both accepted and rejected."""
    path = _mtp_checkpoint(tmp_path)
    want = greedy_tokens(family_llm(path, replayssm=replayssm, replay_window=8), PROMPTS)
    llm = family_llm(path, replayssm=replayssm, replay_window=8, num_speculative_tokens=3,
                     speculative_method="mtp")
    assert type(llm.engine.spec.proposer.head.mtp).__name__ == "Qwen3NextMTP"
    assert greedy_tokens(llm, PROMPTS) == want
    m = llm.get_metrics()
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]


def test_mtp_speculation_is_lossless_over_two_ranks(tmp_path):
    """With tensor_parallel_size=2 the MTP drafter's blocks shard like the target's: k = 3 drafts give the
    one-rank greedy tokens, with drafts accepted."""
    path = _mtp_checkpoint(tmp_path)
    want = greedy_tokens(family_llm(path, replay_window=8), PROMPTS)
    with LLM(path, device="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=2, replay_window=8,
             num_speculative_tokens=3, speculative_method="mtp") as llm:
        assert greedy_tokens(llm, PROMPTS) == want
        assert llm.get_metrics()["spec_accepted_tokens"] > 0


def test_tensor_parallel_rank_caches_hold_its_heads():
    """A TP=2 rank's Gated DeltaNet state and ring hold half the key and value heads; conv channels halve."""
    from replayssm.cache.mamba_cache import mixer_cache_spec
    from replayssm.distributed.sharding import local_config

    cfg = ModelConfig.from_hf(json.loads((Path(tiny(TP_VARIANTS[2])[0]) / "config.json").read_text()))
    whole, half = mixer_cache_spec(cfg), mixer_cache_spec(local_config(cfg, 2))
    assert half.state_shape == (4, 8, 6) and whole.state_shape == (8, 8, 6)
    assert 2 * half.conv_dim == whole.conv_dim
    assert [f.heads for f in half.ring] == [f.heads // 2 for f in whole.ring]


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("replayssm", [True, False], ids=["replayssm", "baseline"])
def test_tensor_parallel_cuda_tokens_equal_one_gpu(replayssm):
    """On two GPUs (NCCL, the Gated DeltaNet Triton kernels, fp32) Qwen3-Next's TP=2 greedy tokens equal
    one GPU's."""
    path, _ = tiny(VARIANTS[0])
    kw = dict(device="cuda", dtype="float32", max_model_len=128, replayssm=replayssm, replay_window=4)
    with LLM(path, **kw) as llm:
        want = greedy_tokens(llm, PROMPTS)
    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        assert greedy_tokens(llm, PROMPTS) == want
