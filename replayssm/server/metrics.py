"""Prometheus metrics for the server: latencies from engine outputs, counters from get_metrics().

`ServingMetrics` is the EngineLoop observer: the loop thread calls it with every step's outputs,
so time-to-first-token and inter-token latency are measured where tokens appear, not where a
slow HTTP client reads them. Engine counters (running/waiting, prefix-cache hits, speculative
acceptance, preemptions) and occupancy (KV blocks, Mamba slots) are read at scrape time from the
loop's last get_metrics() snapshot; once the loop stops, the occupancy gauges read 0. The names
map onto vLLM's dashboard metrics as the table in docs/metrics.md says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Latency buckets (seconds) spanning a CPU toy model up to a loaded GPU server.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5,
                1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)


def _counter(name: str, doc: str) -> tuple[str, str, str]:
    return (f"replayssm_{name}", "counter", doc)


# get_metrics() key -> (exported name, kind, help). Other numeric keys export as
# `replayssm_engine_<key>` gauges, so a new engine counter shows up without a server change.
ENGINE_METRICS: dict[str, tuple[str, str, str]] = {
    "num_running": ("replayssm_num_requests_running", "gauge", "Requests in the running batch"),
    "num_waiting": ("replayssm_num_requests_waiting", "gauge", "Requests waiting to be scheduled"),
    "kv_blocks_used": ("replayssm_kv_blocks_used", "gauge", "KV cache blocks in use"),
    "kv_blocks_free": ("replayssm_kv_blocks_free", "gauge", "KV cache blocks free (cached prefix blocks not "
                       "counted)"),
    "num_kv_blocks": ("replayssm_kv_blocks", "gauge", "KV cache blocks in the pool"),
    "num_slots_used": ("replayssm_mamba_slots_used", "gauge", "Mamba state slots held by requests or "
                       "checkpoints being written"),
    "num_slots_free": ("replayssm_mamba_slots_free", "gauge", "Mamba state slots free (cached prefix "
                       "checkpoints not counted)"),
    "num_slots": ("replayssm_mamba_slots", "gauge", "Mamba state slots in the pool"),
    "num_preemptions": _counter("num_preemptions", "Requests preempted (dropped and recomputed)"),
    "prefix_cache_hit_tokens": _counter("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache"),
    "prefix_cache_query_tokens": _counter("prefix_cache_query_tokens", "Prompt tokens looked up"),
    "spec_draft_tokens": _counter("spec_decode_draft_tokens", "Speculative draft tokens proposed"),
    "spec_accepted_tokens": _counter("spec_decode_accepted_tokens", "Speculative draft tokens accepted"),
    "num_steps": _counter("engine_steps", "Engine steps run"),
    "num_prefill_tokens_computed": _counter("engine_prefill_tokens_computed",
                                            "Prefill tokens computed (recomputation included)"),
    "num_decode_tokens_computed": _counter("engine_decode_tokens_computed", "Decode tokens computed"),
    "num_requests_aborted": _counter("engine_requests_aborted", "Requests aborted"),
    "num_ahead_steps": _counter("engine_ahead_steps",
                                "Steps launched before the last one's tokens were read (async scheduling)"),
    "num_ahead_rows_dropped": _counter("engine_ahead_rows_dropped",
                                       "Rows of steps in flight (launched ahead or interleaved) whose "
                                       "request had finished"),
}


class EngineStatsCollector(Collector):
    """Exports the numeric entries of an engine get_metrics() snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self) -> Iterator:
        snap = self._snapshot()
        for key, value in sorted(snap.items()):
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name, kind, doc = ENGINE_METRICS.get(key, (f"replayssm_engine_{key}", "gauge", f"engine {key}"))
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, doc, value=value)
        if snap.get("num_kv_blocks"):
            yield GaugeMetricFamily("replayssm_kv_cache_usage_perc", "Fraction of KV blocks in use, 0..1",
                                    value=snap.get("kv_blocks_used", 0) / snap["num_kv_blocks"])


class ServingMetrics:
    """Per-server registry; an EngineLoop observer plus HTTP error counting."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("replayssm_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("replayssm_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=r)
        self.generation_tokens = Counter("replayssm_generation_tokens", "Generated tokens", registry=r)
        self.cached_prompt_tokens = Counter("replayssm_cached_prompt_tokens",
                                            "Prompt tokens reported as prefix-cache hits", registry=r)
        self.ttft = Histogram("replayssm_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("replayssm_inter_token_latency_seconds", "Time between generated tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("replayssm_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_E2E_BUCKETS, registry=r)
        self.http_errors = Counter("replayssm_http_errors", "Error responses by status", ["status"],
                                   registry=r)
        r.register(EngineStatsCollector(snapshot))
        # request_id -> [arrival, last token time, tokens seen]; touched only by the loop thread.
        self._live: dict[str, list] = {}

    def request_added(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        self._live[request_id] = [now, now, 0]
        self.prompt_tokens.inc(num_prompt_tokens)

    def request_aborted(self, request_id: str, now: float) -> None:
        if self._live.pop(request_id, None) is not None:
            self.requests.labels(finish_reason="abort").inc()

    def step_done(self, outputs: list, now: float) -> None:
        for out in outputs:
            state = self._live.get(out.request_id)
            if state is None:
                continue
            arrival, last, seen = state
            new = out.num_output_tokens - seen
            if new > 0:
                if seen == 0:
                    self.ttft.observe(now - arrival)
                    self.cached_prompt_tokens.inc(out.num_cached_tokens)
                else:
                    # A speculative step yields several tokens at once: spread the gap over them.
                    for _ in range(new):
                        self.itl.observe((now - last) / new)
                self.generation_tokens.inc(new)
                state[1], state[2] = now, out.num_output_tokens
            if out.finished:
                del self._live[out.request_id]
                self.requests.labels(finish_reason=out.finish_reason or "unknown").inc()
                self.e2e.observe(now - arrival)

    def render(self) -> bytes:
        """The Prometheus text exposition of this server's registry."""
        return generate_latest(self.registry)
