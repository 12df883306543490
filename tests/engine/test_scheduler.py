"""The scheduler alone: budgets, admission, preemption order (no runner, no model)."""

import random

import pytest

from replayssm.cache.block_pool import BlockPool
from replayssm.cache.slot_pool import SlotPool
from replayssm.engine.request import Request
from replayssm.engine.scheduler import Scheduler
from replayssm.sampling_params import SamplingParams


def _simulate(num_blocks, num_slots, budget, lens, max_tokens, block_size=4, max_num_seqs=8):
    """Run the scheduler to completion, appending a dummy token whenever a chunk samples."""
    sched = Scheduler(
        BlockPool(num_blocks),
        SlotPool(num_slots),
        kv_block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
    )
    reqs = [
        Request(str(i), [7] * n, SamplingParams(max_tokens=max_tokens), seed=0, arrival=i)
        for i, n in enumerate(lens)
    ]
    for r in reqs:
        sched.add(r)
    preempted, steps = [], 0
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += [r.arrival for r in out.preempted]
        assert out.num_tokens <= budget and len(sched.running) <= min(max_num_seqs, num_slots)
        assert out.chunks or out.preempted
        for c in out.chunks:
            assert c.start == c.request.num_computed_tokens
            c.request.num_computed_tokens += c.num_tokens
        for c in out.chunks:
            if c.samples:
                c.request.output_token_ids.append(1)
                if len(c.request.output_token_ids) == max_tokens:
                    sched.finish(c.request, "length")
        sched.check_integrity()
        steps += 1
        assert steps < 10_000
    assert all(r.finished and len(r.output_token_ids) == max_tokens for r in reqs)
    assert sched.block_pool.num_free == num_blocks and sched.slot_pool.num_free == num_slots
    return preempted


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_finish_under_tight_memory(seed):
    """Random prompt lengths with too few KV blocks: all finish, budgets hold, pools balance every step."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 40) for _ in range(10)]
    # One max-length request (40 + 20 tokens = 15 blocks) fits; several at once do not.
    preempted = _simulate(num_blocks=22, num_slots=5, budget=rng.choice([3, 8, 64]), lens=lens, max_tokens=20)
    assert preempted, "the workload was meant to preempt"


def test_oldest_request_is_never_preempted():
    """Preemption takes the newest running request, so the oldest always progresses."""
    preempted = _simulate(num_blocks=16, num_slots=4, budget=64, lens=[30, 30, 30, 30], max_tokens=30)
    assert preempted and 0 not in preempted


def test_chunked_prefill_then_decode_in_one_budget():
    """A long prompt is split into budget-sized chunks and a running decode keeps its token each step."""
    sched = Scheduler(BlockPool(64), SlotPool(4), kv_block_size=4, max_num_seqs=4, max_num_batched_tokens=10)
    short = Request("a", [1, 2], SamplingParams(), seed=0, arrival=0)
    long = Request("b", list(range(25)), SamplingParams(), seed=0, arrival=1)
    sched.add(short)
    sched.add(long)
    out = sched.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 0, 2), ("b", 0, 8)]
    for c in out.chunks:
        c.request.num_computed_tokens += c.num_tokens
    short.output_token_ids.append(5)
    out = sched.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 2, 1), ("b", 8, 9)]
    assert out.chunks[0].samples and not out.chunks[1].samples
