"""Seeded lifecycle fuzzer: shared prefixes, tight memory (preemptions, evictions), waves of arrivals,
speculative decoding with random acceptance; then random engine configs with seeded sampling, aborts
and second turns on the first turns' outputs, tokens and logprobs against a plain run."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "prefix"))
from prefix_helpers import OracleDrafter, one_thread, small_checkpoint  # noqa: E402, F401 (autouse fixture)

from replayssm import LLM, SamplingParams  # noqa: E402

MAX_PROMPT = 30


def workload(seed: int, num_requests: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_tokens) per request: prefixes of a few shared 'system prompts',
    exact repeats and extensions of earlier prompts, random tails and lengths."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, 256) for _ in range(n)]  # noqa: E731
    systems = [tokens(rng.randint(4, 20)) for _ in range(5)]
    reqs: list[tuple[int, list[int], int]] = []
    for _ in range(num_requests):
        roll = rng.random()
        if roll < 0.15 and reqs:
            prompt = list(rng.choice(reqs)[1])
        elif roll < 0.35 and reqs:
            prompt = rng.choice(reqs)[1] + tokens(rng.randint(1, 6))
        else:
            system = rng.choice(systems)
            prompt = system[: rng.randint(1, len(system))] + tokens(rng.randint(0, 10))
        reqs.append((rng.randint(0, 250), prompt[:MAX_PROMPT] or tokens(1), rng.randint(1, 8)))
    return sorted(reqs, key=lambda r: r[0])


def greedy(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def drive(llm: LLM, reqs, *, check: bool, at_once: bool = False, params=greedy, outputs: bool = False,
          aborts: random.Random | None = None, turns: dict[int, str] | None = None) -> dict:
    """Add each request at its arrival step (or all at once), step until done; with `check`, pool
    integrity after every step; with `aborts`, abort a random request on ~8% of steps; with `turns`
    ({index: id of the request it follows}), add request `index` as soon as that one finishes.
    Returns each request's token ids, or with `outputs` its final RequestOutput."""
    turns = turns or {}
    engine, done, step, added = llm.engine, {}, 0, []
    pending = [(i, r) for i, r in enumerate(reqs) if i not in turns]
    while pending or engine.has_unfinished_requests():
        while pending and (at_once or pending[0][1][0] <= step or not engine.has_unfinished_requests()):
            i, (_, prompt, max_tokens) = pending.pop(0)
            engine.add_request(str(i), prompt, params(i, max_tokens))
            added.append(str(i))
        if aborts is not None and aborts.random() < 0.08:
            engine.abort_request(added[aborts.randrange(len(added))])  # finished ids are ignored
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out if outputs else out.token_ids
                pending[:0] = [(i, reqs[i]) for i, parent in turns.items() if parent == out.request_id]
        if check:
            engine.check_integrity()
        step += 1
    assert engine.scheduler.block_pool.num_used == 0 and not engine.scheduler.running
    return done


@pytest.mark.parametrize(("replayssm", "num_requests", "spec"),
                         [(True, 300, False), (True, 200, True), (False, 150, False), (False, 150, True)])
def test_fuzzed_lifecycles_match_a_plain_run(replayssm, num_requests, spec):
    """Hundreds of requests under tight memory with prefix caching (and k = 3 drafts with random
    acceptance; without drafts, async scheduling): tokens equal an unconstrained plain run, pool
    integrity holds after every step, and preemptions, hits and evictions all happened."""
    reqs = workload(5, num_requests)
    base = dict(device="cpu", kv_block_size=4, replay_window=4, replayssm=replayssm, max_model_len=48)
    plain = drive(LLM(small_checkpoint(), max_num_seqs=32, max_num_batched_tokens=1024, **base), reqs,
                  check=False, at_once=True)
    # 14 blocks of 4 tokens for up to 6 requests of up to 38 tokens: preemptions and evictions.
    kw = dict(num_speculative_tokens=3, speculative_method="ngram") if spec else {}
    # The baseline verify holds 1 + k slots per request.
    llm = LLM(small_checkpoint(), enable_prefix_caching=True, prefix_checkpoint_interval=4, num_kv_blocks=14,
              num_slots=12 if replayssm or not spec else 24, max_num_seqs=6, max_num_batched_tokens=14, **kw,
              async_scheduling=not spec, **base)
    if spec:
        drafter = llm.engine.spec.proposer = OracleDrafter(plain, seed=6)
    tight = drive(llm, reqs, check=True)
    assert tight == plain
    m = llm.get_metrics()
    if spec:
        assert m["spec_draft_tokens"] > m["spec_accepted_tokens"] > 0
        assert len(set(drafter.accepted)) == 4  # every acceptance count 0..k happened
    assert m["num_preemptions"] > 0 and m["prefix_cache_hit_tokens"] > 0
    assert (m["num_ahead_steps"] > 0) == (not spec)
    assert m["kv_block_evictions"] > 0 and m["prefix_checkpoint_evictions"] > 0


def random_config(seed: int) -> tuple[dict, dict]:
    """(engine kwargs, run options) drawn from seed: ReplaySSM on / off, block size, window, tight
    KV blocks and slots, prefix caching, async scheduling, k drafts, greedy or seeded sampling, aborts."""
    rng = random.Random(seed)
    replayssm, spec, block = rng.random() < 0.7, rng.random() < 0.4, rng.choice([2, 4, 8])
    window = rng.choice([2, 3, 4, 5, 8, 16])
    k = rng.randint(1, min(4, window - 1) if replayssm else 4) if spec else 0
    seqs, blocks = rng.randint(2, 8), -(-48 // block)
    kw = dict(device="cpu", kv_block_size=block, replay_window=window, replayssm=replayssm, max_model_len=48,
              num_kv_blocks=blocks + rng.randint(0, blocks), max_num_seqs=seqs,
              num_slots=seqs * (1 if replayssm else 1 + k) + rng.randint(0, 8),
              max_num_batched_tokens=max(rng.choice([8, 14, 24, 64]), (1 + k) * seqs),
              async_scheduling=rng.random() < 0.6)
    if rng.random() < 0.7:
        kw.update(enable_prefix_caching=True, prefix_checkpoint_interval=block * rng.randint(1, 3))
    if k:
        kw.update(num_speculative_tokens=k, speculative_method="ngram")
    run = dict(sampling=not k and rng.random() < 0.5, aborts=rng.random() < 0.5,
               num_requests=rng.randint(20, 80))
    return kw, run


def follow_ups(seed: int, reqs, outputs: dict, max_model_len: int) -> list[tuple[str, list[int], int]]:
    """Second turns: (the request it follows, that prompt + its output + new tokens, max_tokens).
    Sent as soon as the first turn finishes, they hit checkpoints that decode steps published."""
    rng, turns = random.Random(seed + 1), []
    for i, (_, prompt, _) in enumerate(reqs):
        history = prompt + outputs[str(i)] + [rng.randrange(3, 256) for _ in range(rng.randint(1, 4))]
        max_tokens = rng.randint(1, 8)
        if rng.random() < 0.5 and len(history) + max_tokens <= max_model_len:
            turns.append((str(i), history, max_tokens))
    return turns


def check_top(got: list, want: list, atol: float, msg: str) -> None:
    """Per token, the alternatives' logprobs within atol of want's, and each id's logprob there too
    (an id outside want's list must tie want's last entry: a near tie may swap them)."""
    assert len(got) == len(want), msg
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor([v for _, v in g]), torch.tensor([v for _, v in w]), rtol=0,
                                   atol=atol, msg=msg)
        at = dict(w)
        assert all(abs(at.get(i, w[-1][1]) - v) <= 2 * atol for i, v in g), msg


@pytest.mark.parametrize("seed", range(8))
def test_random_configs_match_a_plain_run(seed):
    """A random engine config (window, block size, tight memory, prefix caching, async, drafts, seeded
    sampling, aborts) gives every request, first turns and follow-ups on their outputs alike, the
    tokens of an unconstrained plain run (aborted ones a prefix of them), with pool integrity after
    every step."""
    kw, run = random_config(seed)
    plain_kw = {key: kw[key] for key in ("device", "kv_block_size", "replay_window", "replayssm",
                                          "max_model_len")}
    tops = [random.Random(seed + i).choice([1.0, 0.9, 0.5]) for i in range(2 * run["num_requests"])]

    def params(i: int, max_tokens: int) -> SamplingParams:
        # Logprobs too (and every third request two alternatives per token): a tiny random model's
        # tokens can survive a slightly wrong state.
        lp = 2 if i % 3 == 0 else 0
        if not run["sampling"]:
            return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=lp)
        return SamplingParams(temperature=0.9, top_p=tops[i], seed=1000 + i, max_tokens=max_tokens,
                              ignore_eos=True, logprobs=lp)

    def plain_run(reqs):
        llm = LLM(small_checkpoint(), max_num_seqs=64, max_num_batched_tokens=4096, **plain_kw)
        return drive(llm, reqs, check=False, at_once=True, params=params, outputs=True)

    reqs = workload(seed, run["num_requests"])
    first = {rid: out.token_ids for rid, out in plain_run(reqs).items()}
    turns = {}
    for parent, prompt, max_tokens in follow_ups(seed, reqs, first, kw["max_model_len"]):
        turns[len(reqs)] = parent
        reqs.append((0, prompt, max_tokens))
    plain = plain_run(reqs)
    llm = LLM(small_checkpoint(), **kw)
    if "num_speculative_tokens" in kw:
        tokens = {rid: out.token_ids for rid, out in plain.items()}
        llm.engine.spec.proposer = OracleDrafter(tokens, seed=seed)
    tight = drive(llm, reqs, check=True, params=params, outputs=True,
                  aborts=random.Random(seed) if run["aborts"] else None, turns=turns)
    for rid, want in plain.items():
        got, n = tight[rid], len(tight[rid].token_ids)
        # An aborted request's tokens are the plain run's first ones.
        assert got.finish_reason == "abort" or n == len(want.token_ids), rid
        assert got.token_ids == want.token_ids[:n], rid
        torch.testing.assert_close(got.logprobs, want.logprobs[:n], rtol=0, atol=1e-4, msg=rid)
        if want.top_logprobs is not None:
            check_top(got.top_logprobs, want.top_logprobs[:n], 1e-4, rid)
