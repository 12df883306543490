"""A bounded streaming load generator: many concurrent SSE requests, some dropped mid-stream."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
from server_helpers import wait_idle

from replayssm.server.launch import BackgroundServer

MAX_TOKENS = 6  # per undropped stream
DROP_EVERY = 5  # every 5th stream is dropped by its client mid-stream


@dataclass
class StreamResult:
    index: int
    aborted_by_client: bool
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False  # saw `data: [DONE]`
    usage: dict | None = None
    status: int = 0
    error: dict | None = None  # an SSE error event (the engine loop died)


async def _one(client: httpx.AsyncClient, index: int, body: dict, drop_after: int | None) -> StreamResult:
    """Stream one completion; close the connection after `drop_after` token chunks when set."""
    result = StreamResult(index, drop_after is not None)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        result.status = r.status_code
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result.done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                result.error = event["error"]
                continue
            if event.get("usage"):
                result.usage = event["usage"]
            for choice in event["choices"]:
                result.text += choice["text"]
                result.token_ids += choice.get("token_ids") or []
                result.finish_reason = choice["finish_reason"] or result.finish_reason
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                break  # leaving the context manager closes the connection mid-stream
    return result


async def run_load(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, drop_every: int,
                   drop_after: int = 2, drop_max_tokens: int = 64) -> tuple[list[StreamResult], float]:
    """All prompts at once as greedy ignore-eos streams, every `drop_every`-th dropped; (results, seconds).

    Dropped streams ask for `drop_max_tokens`, so they are still running when the client leaves."""
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=0)
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            drop = i % drop_every == drop_every - 1
            body = {"model": model, "prompt": prompt, "max_tokens": drop_max_tokens if drop else max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}
            tasks.append(_one(client, i, body, drop_after if drop else None))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def finish_counts(server: BackgroundServer) -> dict[str, int]:
    """Finished requests by finish reason, from the server's Prometheus registry."""
    registry = server.app.state.server.metrics.registry
    return {r: int(registry.get_sample_value("replayssm_requests_total", {"finish_reason": r}) or 0)
            for r in ("length", "stop", "abort")}


def check_load_results(server: BackgroundServer, results, expected_tokens, before: dict[str, int],
                       max_tokens: int) -> dict:
    """Undropped streams end with [DONE] and exactly the offline tokens; returns finish-reason counts."""
    assert all(r.status == 200 and r.error is None for r in results)
    for r in results:
        if not r.aborted_by_client:
            assert r.done and r.finish_reason == "length", r
            assert r.token_ids == expected_tokens[r.index], r.index
            assert r.usage["completion_tokens"] == max_tokens
    wait_idle(server)
    assert server.engine_loop.num_in_flight == 0
    counts = {r: n - before[r] for r, n in finish_counts(server).items()}
    # No request lost: each one finished exactly once, by running out of tokens or by abort.
    assert sum(counts.values()) == len(results)
    assert counts["length"] >= sum(not r.aborted_by_client for r in results)
    return counts
