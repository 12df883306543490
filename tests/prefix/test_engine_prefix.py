"""Engine prefix caching: hits give the tokens of misses, multi-turn chat reuses each turn, preemption too."""

from __future__ import annotations

import pytest
from prefix_helpers import OracleDrafter, one_thread, random_ids, small_checkpoint  # noqa: F401 (autouse fixture)

from replayssm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)


def make_llm(**kw) -> LLM:
    args = dict(device="cpu", kv_block_size=4, max_num_seqs=4, replay_window=4, max_model_len=96)
    args.update(kw)
    return LLM(small_checkpoint(), **args)


def run(llm: LLM, batches: list[list[list[int]]], params=GREEDY):
    """Generate batch after batch (later batches can hit what earlier ones cached)."""
    outs = [o for prompts in batches for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.scheduler.check_integrity()
    return outs


@pytest.mark.parametrize("replayssm", [True, False])
@pytest.mark.parametrize(("interval", "spec"), [(4, False), (8, False), (4, True)])
def test_hits_equal_misses(replayssm, interval, spec):
    """Prompts sharing prefixes give the same greedy tokens with the cache on (hits counted) and off,
    also with k = 3 drafts accepted at random."""
    shared = random_ids(22, seed=1)
    other = random_ids(9, seed=2)
    batches = [[shared + random_ids(3, 3)],
               [shared + random_ids(5, 4), shared[:13] + other, shared, shared + random_ids(1, 5)],
               [shared[:17] + other + random_ids(6, 6)]]
    off = run(make_llm(replayssm=replayssm), batches)
    kw = dict(num_speculative_tokens=3, num_slots=40) if spec else {}
    llm = make_llm(replayssm=replayssm, enable_prefix_caching=True, prefix_checkpoint_interval=interval, **kw)
    if spec:
        llm.engine.spec.proposer = OracleDrafter({o.request_id: o.token_ids for o in off}, seed=interval)
    on = run(llm, batches)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    cached = [o.num_cached_tokens for o in on]
    assert cached[0] == 0 and all(c % interval == 0 for c in cached)
    assert cached[1:4] == [20 // interval * interval, 12 // interval * interval, 20 // interval * interval]
    m = llm.get_metrics()
    assert m["prefix_cache_hit_tokens"] == sum(cached) > 0
    assert m["prefix_cache_query_tokens"] == sum(len(o.prompt_token_ids) for o in on)
    assert not spec or m["spec_accepted_tokens"] > 0


def test_multi_turn_chat_hits_previous_turn():
    """Each turn's prompt extends the last prompt and output; it hits all that the last turn computed."""
    llm = make_llm(enable_prefix_caching=True, max_model_len=128)
    ref = make_llm(max_model_len=128)
    prompt, computed = random_ids(11, seed=7), 0
    for turn in range(5):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == ref.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
        if turn:
            # The last turn computed its prompt and all but its last sampled token.
            assert out.num_cached_tokens == min(computed, len(prompt) - 1) // 4 * 4 > 0
        computed = len(prompt) + len(out.token_ids) - 1
        prompt = prompt + out.token_ids + random_ids(5, seed=20 + turn)
    llm.engine.scheduler.check_integrity()


def test_preemption_resumes_from_the_prefix_cache():
    """Under tight memory, preempted requests resume from their own published checkpoints; same tokens."""
    prompts = [random_ids(6 + 3 * i, seed=30 + i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = run(make_llm(), [prompts], params)
    llm = make_llm(enable_prefix_caching=True, num_kv_blocks=24, num_slots=24, max_model_len=64)
    outs = run(llm, [prompts], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hit_tokens"] > 0
    assert all(o.num_cached_tokens == 0 for o in outs)  # distinct prompts: every hit was a resume


def test_prompt_logprobs_requests_do_not_hit():
    """A request asking for prompt logprobs computes its whole prompt (no hit) and gets them all."""
    llm = make_llm(enable_prefix_caching=True)
    prompt = random_ids(14, seed=40)
    run(llm, [[prompt]])
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
