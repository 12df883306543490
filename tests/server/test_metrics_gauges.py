"""/metrics occupancy gauges: KV blocks and Mamba slots in use, and every gauge back to 0 once the
engine loop stops (died or shut down)."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from replayssm import LLM, SamplingParams
from replayssm.server.async_engine import EngineLoop
from replayssm.server.metrics import ServingMetrics

GAUGES = ("replayssm_num_requests_running", "replayssm_num_requests_waiting", "replayssm_kv_blocks_used",
          "replayssm_mamba_slots_used", "replayssm_mamba_slots_free", "replayssm_kv_cache_usage_perc")
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


@pytest.fixture
def engine(tmp_path):
    from replayssm.demo import demo_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(demo_checkpoint(cache_dir=str(tmp_path)), device="cpu", max_model_len=128, max_num_seqs=4,
                  num_slots=6).engine
    finally:
        torch.set_num_threads(threads)


def scrape(metrics: ServingMetrics) -> dict[str, float]:
    """Sample name -> value of the text exposition (unlabelled samples only)."""
    text = metrics.render().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_slot_and_block_gauges_follow_the_pools(engine):
    """Two running requests: slots used 2 of 6, free 4; KV blocks used as the pool says; usage fraction."""
    for i in range(2):
        engine.add_request(str(i), [5, 6, 7], LONG)
    engine.step()
    values = scrape(ServingMetrics(engine.get_metrics))
    pool = engine.scheduler.block_pool
    assert values["replayssm_mamba_slots_used"] == 2 and values["replayssm_mamba_slots_free"] == 4
    assert values["replayssm_mamba_slots"] == 6
    assert values["replayssm_kv_blocks_used"] == pool.num_used > 0
    assert values["replayssm_kv_blocks_free"] == pool.num_free
    assert values["replayssm_kv_cache_usage_perc"] == pytest.approx(pool.num_used / pool.num_blocks)


def _running_loop(engine, fail: bool) -> tuple[EngineLoop, ServingMetrics, list]:
    """A loop with six long requests in flight on four seats (running and waiting gauges > 0); with
    `fail`, its steps raise from the fourth on."""
    if fail:
        step, calls = engine.step, [0]

        def failing_step():
            calls[0] += 1
            if calls[0] > 3:
                raise RuntimeError("injected step failure")
            return step()

        engine.step = failing_step
    loop = EngineLoop(engine)
    metrics = ServingMetrics(lambda: loop.metrics_snapshot)
    loop.observer = metrics
    loop.start()
    heard: list = []
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    loop.add_group([(f"r-{i}", [5, 6, 7], params, 3) for i in range(6)], [heard.append] * 6).result(10)
    deadline = time.monotonic() + 10
    while scrape(metrics).get("replayssm_mamba_slots_used", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    return loop, metrics, heard


def test_gauges_read_zero_after_the_engine_dies(engine):
    """A step that raises ends the loop; running, waiting, blocks and slots in use all read 0."""
    loop, metrics, heard = _running_loop(engine, fail=True)
    assert scrape(metrics)["replayssm_num_requests_running"] > 0
    deadline = time.monotonic() + 10
    while loop.alive and time.monotonic() < deadline:
        time.sleep(0.005)
    loop.shutdown()  # joins the loop thread, which has stopped on its own
    values = scrape(metrics)
    assert not loop.alive and any(isinstance(h, RuntimeError) for h in heard)
    assert {g: values[g] for g in GAUGES} == dict.fromkeys(GAUGES, 0.0)
    assert values["replayssm_engine_steps_total"] > 0  # counters keep their totals


def test_gauges_read_zero_after_shutdown_with_requests_in_flight(engine):
    """shutdown() with running requests: every occupancy gauge reads 0 afterwards."""
    loop, metrics, _ = _running_loop(engine, fail=False)
    assert scrape(metrics)["replayssm_num_requests_running"] > 0
    loop.shutdown()
    values = scrape(metrics)
    assert {g: values[g] for g in GAUGES} == dict.fromkeys(GAUGES, 0.0)
