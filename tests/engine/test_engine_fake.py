"""Scheduler and LLMEngine behaviour on the deterministic fake runner (no model)."""

import random

import pytest
import torch
from fake_runner import FakeRunner, greedy_reference, reference_logits, write_fake_checkpoint

from replayssm import LLM, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_fake_checkpoint(str(tmp_path_factory.mktemp("fake")))


@pytest.fixture(scope="module")
def ckpt_no_tokenizer(tmp_path_factory):
    return write_fake_checkpoint(str(tmp_path_factory.mktemp("fake_notok")), with_tokenizer=False)


def make_llm(path, **kw):
    kw = {"device": "cpu", "max_model_len": 96, "kv_block_size": 4, **kw}
    return LLM(path, runner_cls=FakeRunner, **kw)


def prompts(n, seed=0, lo=3, hi=30):
    rng = random.Random(seed)
    return [[rng.randrange(3, 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(llm, prompt_list, params):
    """Drive the engine step by step, checking pool integrity after every step."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompt_list)
    for i, (p, sp) in enumerate(zip(prompt_list, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_integrity()
    assert engine.scheduler.block_pool.num_used == 0
    return [done[str(i)] for i in range(len(prompt_list))]


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(6)
]


def test_greedy_matches_reference_model(ckpt):
    """Greedy outputs of a batch of different-length prompts equal the fake model's greedy continuation."""
    ps = prompts(5)
    outs = run(make_llm(ckpt), ps, GREEDY)
    for p, out in zip(ps, outs):
        assert out.token_ids == greedy_reference(p, 40)
        assert out.finish_reason == "length"


def test_chunked_prefill_respects_budget_and_matches_one_shot(ckpt):
    """A budget of 8 tokens chunks every long prompt (the fake runner asserts it) without changing outputs."""
    ps = prompts(4, seed=1, lo=20, hi=40)
    chunked = make_llm(ckpt, max_num_batched_tokens=8)
    outs = run(chunked, ps, SEEDED[:4])
    steps = chunked.engine.runner.steps
    assert max(sum(len(r.token_ids) for r in rows) for rows in steps) <= 8
    assert any(r.is_prefill and r.start_pos > 0 for rows in steps for r in rows), "no prefill was chunked"
    one_shot = run(make_llm(ckpt), ps, SEEDED[:4])
    assert [o.token_ids for o in outs] == [o.token_ids for o in one_shot]


@pytest.mark.parametrize(
    "params",
    [GREEDY, SEEDED, SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)],
    ids=["greedy", "seeded", "unseeded"],
)
def test_tiny_memory_preempts_and_matches_unconstrained(ckpt, params):
    """A budget that holds ~1.3 full requests of KV forces preemptions; every output equals the roomy run."""
    ps = prompts(6, seed=2, lo=10, hi=30)
    tight = make_llm(ckpt, memory_budget=7000)  # 4 slots, 30 KV blocks of 4 tokens
    assert tight.engine.plan.num_slots == 4 and tight.engine.plan.num_kv_blocks == 30
    outs = run(tight, ps, params)
    assert tight.get_metrics()["num_preemptions"] > 0
    roomy = run(make_llm(ckpt), ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_batched_equals_one_at_a_time(ckpt):
    """Seeded sampling gives each request the same tokens whether it runs alone or in a batch."""
    ps = prompts(6, seed=3)
    batched = run(make_llm(ckpt), ps, SEEDED)
    for p, sp, out in zip(ps, SEEDED, batched):
        assert run(make_llm(ckpt), [p], sp)[0].token_ids == out.token_ids


def test_logprobs_and_prompt_logprobs(ckpt):
    """Generated and prompt logprobs equal log_softmax of the model's logits, chunked or not."""
    p = prompts(1, seed=4, lo=25, hi=25)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = [run(make_llm(ckpt, max_num_batched_tokens=b), [p], sp)[0] for b in (7, 512)]
    seq = p + outs[0].token_ids
    ref = [reference_logits(seq[:i]).log_softmax(-1)[seq[i]].item() for i in range(1, len(seq))]
    for out in outs:
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:] + out.logprobs), torch.tensor(ref))


def test_stop_conditions(ckpt):
    """eos stops unless ignore_eos; stop_token_ids stop; stop strings are cut from the text."""
    llm = make_llm(ckpt)
    p = prompts(1, seed=5)[0]
    full = run(llm, [p], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    stop_tok = full.token_ids[10]
    out = run(llm, [p], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok]))[0]
    first = full.token_ids.index(stop_tok)
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    stop_str = full.text[12:15]
    out = run(llm, [p], SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_str, "\x00never"]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop_str)]
    llm.engine.output.eos_token_ids = {stop_tok}
    out = run(llm, [p], SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_tok
    out = run(llm, [p], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    assert out.token_ids == full.token_ids


def test_max_model_len_ends_with_length(ckpt):
    """Generation stops at max_model_len tokens in total with finish_reason 'length'."""
    out = run(make_llm(ckpt, max_model_len=40), [list(range(3, 33))], SamplingParams(max_tokens=100))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_abort_frees_memory(ckpt):
    """An aborted request finishes with reason 'abort' at the next step and gives its memory back."""
    engine = make_llm(ckpt).engine
    for i, p in enumerate(prompts(3, seed=6)):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    engine.abort_request("r1")
    engine.abort_request("nope")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["r1"].finished and outs["r1"].finish_reason == "abort"
    engine.scheduler.check_integrity()
    assert len(engine.scheduler.running) == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_metrics()["num_requests_aborted"] == 1


def test_bad_requests_are_clear_errors_and_add_nothing(ckpt, ckpt_no_tokenizer):
    """Bad prompts and params raise ValueError with a clear message and leave no request behind."""
    llm = make_llm(ckpt)
    cases = [
        ([[]], GREEDY, "empty"),
        ([list(range(3, 99))], GREEDY, "max_model_len"),
        ([[5, 100]], GREEDY, r"token ids must be ints in \[0, 100\)"),
        ([[5], 7], GREEDY, "prompt must be a string or a list"),
        ([[5]], {"temperature": 0}, "SamplingParams"),
    ]
    for ps, sp, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llm.generate(ps, sp, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request("x", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("x", [5, 6], GREEDY)
    bare = make_llm(ckpt_no_tokenizer)
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.generate(["hello"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        bare.generate([[5, 6]], SamplingParams(stop=["a"]), use_tqdm=False)
    assert bare.generate([[5, 6]], SamplingParams(max_tokens=3), use_tqdm=False)[0].text == ""


def test_generate_order_text_prompts_and_metrics(ckpt):
    """generate() returns outputs in prompt order for text prompts, and the metrics count the work."""
    llm = make_llm(ckpt, max_num_seqs=2)
    texts = ["hello there", "a", "the quick brown fox jumps"]
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for t, o in zip(texts, outs):
        assert o.prompt_token_ids == llm.tokenizer.encode(t) and len(o.token_ids) == 8
        assert o.text == llm.tokenizer.decode(o.token_ids)
    m = llm.get_metrics()
    assert m["generation_tokens"] == 24 and m["num_requests"] == 3 and m["peak_running_requests"] == 2
    assert m["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert m["prefix_cache_hit_tokens"] == 0 and m["spec_accepted_tokens"] == 0


def test_prompt_logprobs_survive_preemption_mid_prefill(ckpt):
    """Preempted in the middle of a chunked prompt, a request still returns exact prompt logprobs."""
    ps = prompts(6, seed=7, lo=30, hi=60)
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    tight = make_llm(ckpt, memory_budget=7000, max_num_batched_tokens=8)
    sched, mid_prompt = tight.engine.scheduler, []
    preempt = sched._preempt

    def spy(r):
        mid_prompt.append(0 < r.num_computed_tokens < r.num_prompt_tokens)
        preempt(r)

    sched._preempt = spy
    outs = run(tight, ps, sp)
    assert any(mid_prompt), "no request was preempted mid-prompt"
    for p, out in zip(ps, outs):
        ref = [reference_logits(p[:i]).log_softmax(-1)[p[i]].item() for i in range(1, len(p))]
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), torch.tensor(ref))
        assert out.token_ids == greedy_reference(p, 30)


def test_step_outputs_are_snapshots_that_cost_no_copy(ckpt):
    """Each step's RequestOutput keeps the tokens and logprobs of that step (later steps do not
    change it) and is built without copying them: its lists are read on access, from the request's
    own append-only lists."""
    llm = make_llm(ckpt)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    engine.add_request("a", [3, 4, 5], params)
    snaps = []
    while engine.has_unfinished_requests():
        snaps += [o for o in engine.step() if o.request_id == "a"]
    final = snaps[-1]
    assert final.finished and len(final.token_ids) == 6 == final.num_output_tokens
    for k, o in enumerate(snaps):  # one token per step: the k-th snapshot holds k + 1 tokens
        assert o.token_ids == final.token_ids[: k + 1] and o.num_output_tokens == k + 1
        assert o.logprobs == final.logprobs[: k + 1] and o.has_logprobs
        assert o.tokens_since(k) == [final.token_ids[k]] and o.logprobs_since(k) == [final.logprobs[k]]
    assert all(o._tokens is snaps[0]._tokens for o in snaps), "a snapshot copied the token list"


def test_async_scheduling_stop_strings_eos_and_texts(ckpt):
    """Async scheduling on the fake model: stop strings (text cut), eos, stop tokens and length end
    requests at the same tokens and texts as synchronous steps; dropped rows are counted."""
    ps = prompts(8, seed=11)
    full = run(make_llm(ckpt), ps, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    params = []
    for i in range(len(ps)):
        f = full[i]
        kind = i % 4
        params.append(SamplingParams(temperature=0.0, max_tokens=12 + i, ignore_eos=kind != 1,
                                     stop=[f.text[6:9]] if kind == 0 else None,
                                     stop_token_ids=[f.token_ids[5]] if kind == 2 else None))
    sync = run(make_llm(ckpt, async_scheduling=False), ps, params)
    llm = make_llm(ckpt, async_scheduling=True)
    got = run(llm, ps, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason) for o in sync]
    assert {o.finish_reason for o in sync} >= {"stop", "length"}
    m = llm.get_metrics()
    assert m["num_ahead_steps"] > 5 and m["num_ahead_rows_dropped"] > 0
