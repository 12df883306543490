"""Engine counters, reported by ``LLMEngine.get_metrics()``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class EngineMetrics:
    """Monotonic counters since the engine started (plus a few peaks)."""

    num_requests: int = 0  # requests added
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    prompt_tokens: int = 0  # prompt tokens of added requests
    generation_tokens: int = 0  # tokens sampled and kept
    num_steps: int = 0
    num_prefill_tokens_computed: int = 0  # includes recomputed tokens after preemption
    num_decode_tokens_computed: int = 0
    num_preemptions: int = 0
    prefix_cache_query_tokens: int = 0  # with prefix caching, get_metrics() reports the cache's counters
    prefix_cache_hit_tokens: int = 0
    spec_draft_tokens: int = 0  # drafts proposed (see also the spec_* keys of get_metrics)
    spec_accepted_tokens: int = 0  # drafts accepted (bonus / corrected tokens not counted)
    peak_running_requests: int = 0
    peak_kv_blocks_used: int = 0
    num_ahead_steps: int = 0  # async scheduling: steps launched before the previous one was read back
    # rows of a step in flight (launched ahead, or an interleaved group's) whose request finished meanwhile
    num_ahead_rows_dropped: int = 0

    def as_dict(self) -> dict[str, int | float]:
        d: dict[str, int | float] = dataclasses.asdict(self)
        d["prefix_cache_hit_rate"] = (
            self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens
            if self.prefix_cache_query_tokens
            else 0.0
        )
        d["spec_acceptance_rate"] = (
            self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0
        )
        return d
