"""Driving an engine step by step in tests: arrivals, aborts, the pool check after every step."""

from __future__ import annotations

from replayssm import LLM, SamplingParams


def drive(llm: LLM, reqs: list[tuple[list[int], SamplingParams]], aborts: dict[int, list[str]] | None = None,
          arrivals: dict[int, list[int]] | None = None) -> dict:
    """Add requests (all at step 0 unless `arrivals` says at which step), abort some at given steps,
    step until done with the pool check after every step; returns the finished outputs by id."""
    engine, done, step = llm.engine, {}, 0
    pending = dict(arrivals or {0: list(range(len(reqs)))})
    while pending or engine.has_unfinished_requests():
        for i in pending.pop(step, ()):
            engine.add_request(str(i), *reqs[i])
        for rid in (aborts or {}).get(step, ()):
            engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        step += 1
    sched = engine.scheduler
    assert sched.block_pool.num_used == 0 and not sched.running and engine._ahead is None
    return done
