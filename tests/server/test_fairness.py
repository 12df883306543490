"""Fair share of admission between client requests: a large n does not starve later requests."""

from __future__ import annotations

import pytest
import torch

from replayssm import LLM, SamplingParams
from replayssm.cache.block_pool import BlockPool
from replayssm.cache.slot_pool import SlotPool
from replayssm.engine.request import Request
from replayssm.engine.scheduler import Scheduler

MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from replayssm.demo import demo_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = demo_checkpoint(cache_dir=str(tmp_path_factory.mktemp("demo")))
    try:
        yield LLM(path, device="cpu", max_model_len=128, max_num_seqs=MAX_NUM_SEQS, async_scheduling=True)
    finally:
        torch.set_num_threads(threads)


def _steps_until_small_finishes(llm: LLM, parents: bool) -> int:
    """A request of 64 choices, then (one step later) a 4-token request; steps until the small one ends."""
    engine = llm.engine
    big = SamplingParams(temperature=1.0, seed=0, max_tokens=32, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"big-{i}", [5, 6, 7, 8], big, parent_id="big" if parents else None)
    engine.step()
    small = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("small", [9, 10, 11], small, parent_id="small" if parents else None)
    steps, small_done = 0, None
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.request_id == "small" and out.finished:
                small_done = steps
                for i in range(64):  # the rest is not needed
                    engine.abort_request(f"big-{i}")
        engine.check_integrity()
    return small_done


def test_small_request_after_big_n_finishes_within_a_few_steps(llm):
    """With parents, a 4-token request sent after 64 choices finishes within 10 steps (FCFS: over 200)."""
    assert _steps_until_small_finishes(llm, parents=True) <= 10


def test_without_parents_admission_stays_first_come_first_served(llm):
    """Requests added without a parent share one group: the small one waits behind every big choice."""
    assert _steps_until_small_finishes(llm, parents=False) > 200


def _scheduler(max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(BlockPool(64), SlotPool(16), kv_block_size=4, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=64)


def _request(rid: str, parent: str, arrival: int) -> Request:
    return Request(rid, [7, 7, 7], SamplingParams(max_tokens=100), seed=0, arrival=arrival, parent_id=parent)


def _step(sched: Scheduler) -> None:
    for c in sched.schedule().chunks:
        c.request.num_computed_tokens += c.num_tokens
        if c.samples:
            c.request.output_token_ids.append(1)
    sched.check_integrity()


def test_two_large_parents_converge_to_equal_shares():
    """Two parents of many choices each end up with half the seats, and stay there (no ping-pong)."""
    sched = _scheduler()
    for i in range(8):
        sched.add(_request(f"a{i}", "a", i))
    _step(sched)
    for i in range(8):
        sched.add(_request(f"b{i}", "b", 100 + i))
    shares = []
    for _ in range(6):
        _step(sched)
        shares.append(dict(sched.num_running_by_parent))
    assert shares[-3:] == [{"a": 2, "b": 2}] * 3


def test_parent_within_its_share_is_not_preempted():
    """Four one-choice parents fill four seats; a fifth waits for a seat without preempting anyone."""
    sched = _scheduler()
    for i in range(5):
        sched.add(_request(f"r{i}", f"p{i}", i))
    for _ in range(3):
        _step(sched)
    assert sched.num_running_by_parent == {"p0": 1, "p1": 1, "p2": 1, "p3": 1}
    assert not sched.could_admit() and [r.num_preemptions for r in sched.running] == [0] * 4


def test_engine_loop_adds_a_client_request_under_one_parent(llm):
    """EngineLoop.add_group gives every sub-request of one client request the same parent_id."""
    from replayssm.server.async_engine import EngineLoop

    loop = EngineLoop(llm.engine).start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        for rid in ("x", "y"):
            loop.add_group([(f"{rid}-{i}", [5, 6, 7], params, 3) for i in range(3)],
                           [lambda _: None] * 3).result(10)

        def parents(engine) -> dict[str, str]:
            sched = engine.scheduler
            return {r.request_id: r.parent_id for r in [*sched.running, *sched.waiting]}

        seen = loop.call(parents).result(10)
        loop.abort([f"{rid}-{i}" for rid in "xy" for i in range(3)])
    finally:
        loop.shutdown()
    assert seen == {f"{rid}-{i}": f"{rid}-0" for rid in "xy" for i in range(3)}
