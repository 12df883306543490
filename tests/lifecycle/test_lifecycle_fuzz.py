"""Seeded lifecycle fuzzer: shared prefixes, tight memory (preemptions, evictions), waves of arrivals,
speculative decoding with random acceptance."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

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


def drive(llm: LLM, reqs, *, check: bool, at_once: bool = False) -> dict[str, list[int]]:
    """Add each request at its arrival step (or all at once), step until done; with `check`, pool
    integrity after every step."""
    engine, done, step, pending = llm.engine, {}, 0, list(enumerate(reqs))
    while pending or engine.has_unfinished_requests():
        while pending and (at_once or pending[0][1][0] <= step or not engine.has_unfinished_requests()):
            i, (_, prompt, max_tokens) = pending.pop(0)
            engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                              ignore_eos=True))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
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
