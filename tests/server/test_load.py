"""Hundreds of concurrent streams, some dropped mid-stream: nothing lost, nothing leaked, tokens exact."""

from __future__ import annotations

import asyncio

from fake_engine import FakeEngine
from server_helpers import random_prompts
from server_load import DROP_EVERY, MAX_TOKENS, check_load_results, finish_counts, run_load

from replayssm.sampling_params import SamplingParams
from replayssm.server.launch import BackgroundServer

NUM_REQUESTS = 300


def test_load_with_drops_fake_engine():
    """300 concurrent greedy streams (every 5th dropped) on the fake engine: exact tokens, no leaks."""
    # Dropped streams ask for 900 tokens (about a second of steps), so only an abort ends them early.
    engine = FakeEngine(max_model_len=1024, max_num_seqs=32, num_blocks=32 * 128, step_sleep_s=0.001)
    prompts = random_prompts(NUM_REQUESTS, 256)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [engine.generate_offline(p, greedy) for p in prompts]

    with BackgroundServer(engine, served_model_name="tiny") as server:
        before = finish_counts(server)
        results, _ = asyncio.run(run_load(server.base_url, "tiny", prompts, MAX_TOKENS, DROP_EVERY,
                                             drop_max_tokens=900))
        counts = check_load_results(server, results, expected, before, MAX_TOKENS)
        server.engine_loop.call(lambda e: e.check_integrity()).result(5)
        assert engine.free_blocks == engine.num_blocks and not engine.running and not engine.waiting
        assert counts["abort"] == engine.num_aborted == NUM_REQUESTS // DROP_EVERY
