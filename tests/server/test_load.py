"""Hundreds of concurrent streams, some dropped mid-stream: nothing lost, nothing leaked, tokens exact."""

from __future__ import annotations

import asyncio
import random

from replayssm.sampling_params import SamplingParams
from replayssm.server.launch import BackgroundServer
from tests.server.fake_engine import FakeEngine
from tests.server.test_api import wait_idle

NUM_REQUESTS = 300
MAX_TOKENS = 6
DROP_EVERY = 5


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def finish_counts(server: BackgroundServer) -> dict[str, int]:
    """Finished requests by finish reason, from the server's Prometheus registry."""
    registry = server.app.state.server.metrics.registry
    return {r: int(registry.get_sample_value("replayssm_requests_total", {"finish_reason": r}) or 0)
            for r in ("length", "stop", "abort")}


def check_load_results(server: BackgroundServer, results, expected_tokens, before: dict[str, int]) -> dict:
    """Undropped streams end with [DONE] and exactly the offline tokens; returns finish-reason counts."""
    assert all(r.status == 200 for r in results)
    for r in results:
        if not r.aborted_by_client:
            assert r.done and r.finish_reason == "length", r
            assert r.token_ids == expected_tokens[r.index], r.index
            assert r.usage["completion_tokens"] == MAX_TOKENS
    wait_idle(server)
    assert server.engine_loop.num_in_flight == 0
    counts = {r: n - before[r] for r, n in finish_counts(server).items()}
    # No request lost: each one finished exactly once, by running out of tokens or by abort.
    assert sum(counts.values()) == len(results)
    assert counts["length"] >= sum(not r.aborted_by_client for r in results)
    return counts


def test_load_with_drops_fake_engine():
    """300 concurrent greedy streams (every 5th dropped) on the fake engine: exact tokens, no leaks."""
    # Dropped streams ask for 900 tokens (about a second of steps), so only an abort ends them early.
    engine = FakeEngine(max_model_len=1024, max_num_seqs=32, num_blocks=32 * 128, step_sleep_s=0.001)
    prompts = random_prompts(NUM_REQUESTS, 256)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [engine.generate_offline(p, greedy) for p in prompts]
    from tests.server.load import run_load

    with BackgroundServer(engine, served_model_name="tiny") as server:
        before = finish_counts(server)
        results, _ = asyncio.run(run_load(server.base_url, "tiny", prompts, MAX_TOKENS, DROP_EVERY,
                                             drop_max_tokens=900))
        counts = check_load_results(server, results, expected, before)
        server.engine_loop.call(lambda e: e.check_integrity()).result(5)
        assert engine.free_blocks == engine.num_blocks and not engine.running and not engine.waiting
        assert counts["abort"] == engine.num_aborted == NUM_REQUESTS // DROP_EVERY
