"""The whole engine on tiny random checkpoints, with Hugging Face transformers as the oracle."""

import json
import shutil

import pytest
import torch
from checkpoints import hf_greedy, random_prompts, tiny_mamba2, tiny_nemotron_h

from replayssm import LLM, SamplingParams
from replayssm.engine.model_runner import ModelRunner
from replayssm.models.config import ModelConfig

PROMPT_LENS = (5, 17, 33, 9)
NEW_TOKENS = 64
MAX_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts():
    return random_prompts(PROMPT_LENS, seed=1234)


def _hf_greedy(model, prompts):
    return hf_greedy(model, prompts, NEW_TOKENS)


@pytest.fixture(scope="module", params=["nemotron_h", "mamba2"])
def oracle(request, tmp_path_factory):
    """(checkpoint path, transformers model, prompts, transformers greedy outputs)."""
    path = tmp_path_factory.mktemp(request.param)
    model = (tiny_nemotron_h if request.param == "nemotron_h" else tiny_mamba2)(path)
    prompts = _prompts()
    return str(path), model, prompts, _hf_greedy(model, prompts)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_engine")
    tiny_nemotron_h(path)
    return str(path)


def _llm(path, **kw):
    return LLM(path, device="cpu", max_model_len=MAX_LEN, **kw)


def _tokens(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_matches_transformers(oracle):
    """A batch of prompts of different lengths gives transformers' greedy tokens, 64 new tokens each."""
    path, _, prompts, hf = oracle
    assert _tokens(_llm(path), prompts) == hf


def test_logprobs_close_to_transformers(oracle):
    """Prompt and generated-token logprobs, and each generated position's 5 most likely tokens, match
    log_softmax of transformers' logits."""
    path, model, prompts, hf = oracle
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=4)
    outs = _llm(path, max_num_batched_tokens=24).generate(prompts, sp, use_tqdm=False)
    for p, out in zip(prompts, outs):
        seq = torch.tensor([p + out.token_ids])
        with torch.no_grad():
            full = model(seq).logits[0].float().log_softmax(-1)
        ref = full[:-1].gather(-1, seq[0, 1:, None]).squeeze(-1)
        got = torch.tensor(out.prompt_logprobs[1:] + out.logprobs)
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
        # Prompt token t (t >= 1) was predicted at position t - 1 (prompts past 24 tokens span steps).
        values, ids = full[: len(p) - 1].topk(4, dim=-1)
        tops = out.prompt_top_logprobs[1:]
        assert [[i for i, _ in top] for top in tops] == ids.tolist()
        torch.testing.assert_close(torch.tensor([[v for _, v in top] for top in tops]), values, atol=2e-4,
                                   rtol=1e-4)
        # Generated token t was predicted at position len(p) - 1 + t.
        values, ids = full[len(p) - 1 : -1].topk(5, dim=-1)
        assert [[i for i, _ in top] for top in out.top_logprobs] == ids.tolist()
        torch.testing.assert_close(torch.tensor([[v for _, v in top] for top in out.top_logprobs]), values,
                                   atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [16, 5])
def test_replayssm_on_equals_off(nemotron, window):
    """ReplaySSM decoding (windows 16 and 5) gives the same greedy tokens as the baseline state update."""
    prompts = _prompts()
    on = _tokens(_llm(nemotron, replayssm=True, replay_window=window), prompts)
    assert on == _tokens(_llm(nemotron, replayssm=False), prompts)


def test_chunked_prefill_equals_one_shot(nemotron):
    """Prefill chunked by a 7-token budget (misaligned with blocks and scan chunks) equals one shot."""
    prompts = _prompts()
    assert _tokens(_llm(nemotron, max_num_batched_tokens=7), prompts) == _tokens(_llm(nemotron), prompts)


def test_batched_equals_one_at_a_time(nemotron):
    """Seeded sampling: each request's tokens are the same in a batch and alone."""
    prompts = _prompts()
    params = [
        SamplingParams(temperature=1.0, top_k=50, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)
    ]
    llm = _llm(nemotron)
    batched = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    assert batched == alone


def test_tiny_memory_budget_preempts_with_same_output(nemotron):
    """A budget of 4 slots and 48 KV blocks forces preemptions; greedy and seeded outputs are unchanged."""
    sizes = dict(
        dtype="float32",
        state_dtype="float32",
        replayssm=True,
        replay_window=16,
        num_speculative_tokens=0,
        kv_block_size=4,
    )
    cfg = ModelConfig.from_hf(nemotron)
    slot, block = ModelRunner.slot_bytes(cfg, **sizes), ModelRunner.kv_block_bytes(cfg, **sizes)
    budget = 4 * slot + 48 * block  # blocks per max-length request: 128 / 4 = 32
    prompts = _prompts()
    params = [
        GREEDY,
        GREEDY,
        SamplingParams(temperature=0.9, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.8, seed=8, max_tokens=NEW_TOKENS, ignore_eos=True),
    ]
    tight = _llm(nemotron, memory_budget=budget, kv_block_size=4)
    assert (tight.engine.plan.num_slots, tight.engine.plan.num_kv_blocks) == (4, 48)
    got = [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.get_metrics()["num_preemptions"] > 0
    assert got == [o.token_ids for o in _llm(nemotron).generate(prompts, params, use_tqdm=False)]


def test_budget_below_one_request_is_a_clear_error(nemotron):
    """A memory budget that cannot hold one max-length request names memory_budget and the bytes needed."""
    with pytest.raises(ValueError, match=r"memory_budget=1000 bytes cannot hold one request"):
        _llm(nemotron, memory_budget=1000)


def test_bad_checkpoints_are_clear_errors(nemotron, tmp_path):
    """Missing directory, config, weights or tensors, or an unknown architecture: ValueError saying so."""
    with pytest.raises(ValueError, match="is not a directory"):
        _llm(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        _llm(str(empty))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(f"{nemotron}/config.json", no_weights)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        _llm(str(no_weights))
    other = tmp_path / "other_arch"
    shutil.copytree(nemotron, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        _llm(str(other))
    bad = tmp_path / "missing_tensor"
    shutil.copytree(nemotron, bad)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(bad / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor"):
        _llm(str(bad))


def test_replayssm_admits_more_requests_than_baseline_with_drafts(nemotron):
    """Same budget: ReplaySSM (1 slot per request) fits more requests than the baseline with k = 3 drafts."""
    budget = 4 << 20
    replay = _llm(nemotron, memory_budget=budget, num_speculative_tokens=3)
    base = _llm(nemotron, memory_budget=budget, num_speculative_tokens=3, replayssm=False)
    r, b = replay.get_metrics(), base.get_metrics()
    assert (r["slots_per_request"], b["slots_per_request"]) == (1, 4)
    assert r["num_requests_fit"] > b["num_requests_fit"] >= 1
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert _tokens(replay, prompts, params) == _tokens(base, prompts, params)
