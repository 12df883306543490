"""Online serving benchmark: ``replayssm bench serve`` streams requests to a live OpenAI-compatible server.

    replayssm serve --model demo --port 8000 &
    replayssm bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \\
        --input-len 64:256 --output-len 128 --out benchmarks/results

Arrivals are a Poisson process of `--request-rate` requests/s (inf: all at once), optionally capped at
`--max-concurrency` requests in flight. Each request streams (`stream_options.include_usage`), with
`ignore_eos` so it generates exactly its sampled output length. Per request the client records the
time of every streamed chunk that carries new tokens (text or, with `return_token_ids`, their ids):
TTFT is send to first chunk, ITL the gaps between
chunks (a chunk may carry several tokens, as with speculative decoding), E2E send to the last event,
TPOT (E2E - TTFT) / (output tokens - 1). Throughputs are over the whole run, first send to last
response. Prompts are random token ids (`--dataset random`, exact lengths) or random words
(`--dataset random-text`, lengths in words; the usage the server reports gives their token counts).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import string
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
PERCENTILES = (50, 90, 99)
PLOT_HINT = "no plot: matplotlib is not installed (pip install -e '.[bench]' adds it)"


def parse_range(text: str, flag: str, low: int = 1) -> tuple[int, int]:
    """"N" -> (N, N); "LO:HI" -> (LO, HI), a uniform range; ValueError naming the flag otherwise."""
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or lo < low or hi < lo:
        raise ValueError(f"{flag} must be an integer N or a range LO:HI with {low} <= LO <= HI, got {text!r}")
    return lo, hi


@dataclass(frozen=True)
class ServeWorkload:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the server's first /v1/models entry
    endpoint: str = "/v1/completions"
    dataset: str = "random"  # random token ids, or "random-text"
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    input_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (128, 128)
    token_ids: tuple[int, int] = (4, 99)  # the demo model's character ids; any vocabulary holds them
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0  # per request

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.endpoint not in ("/v1/completions", "/v1/chat/completions"):
            raise ValueError("--endpoint must be /v1/completions or /v1/chat/completions, "
                             f"got {self.endpoint!r}")
        if self.dataset not in ("random", "random-text"):
            raise ValueError(f"--dataset must be random or random-text, got {self.dataset!r}")
        if self.endpoint == "/v1/chat/completions" and self.dataset == "random":
            raise ValueError("--endpoint /v1/chat/completions needs --dataset random-text (messages are "
                             "text)")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout_s}")


@dataclass
class RequestResult:
    input_len: int  # asked for (tokens, or words for random-text)
    output_len: int  # max_tokens asked for
    status: int = 0
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int | None = None  # from the server's usage
    output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


def make_prompts(w: ServeWorkload) -> list[tuple[Any, int, int]]:
    """(prompt, input length, output length) per request, from `w.seed`."""
    rng = random.Random(w.seed)
    out = []
    for _ in range(w.num_prompts):
        n_in, n_out = rng.randint(*w.input_len), rng.randint(*w.output_len)
        if w.dataset == "random":
            prompt: Any = [rng.randint(*w.token_ids) for _ in range(n_in)]
        else:
            prompt = " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7)))
                              for _ in range(n_in))
        out.append((prompt, n_in, n_out))
    return out


def _body(w: ServeWorkload, model: str, prompt: Any, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": w.temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            # Every new token is an event even before it has visible text (or with no tokenizer at all).
            "return_token_ids": True}
    if w.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _carries_tokens(event: dict) -> bool:
    """Whether a streamed event brings new output: text, or token ids (`return_token_ids`)."""
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or choice.get("token_ids") or delta.get("token_ids"):
            return True
    return False


async def send(client: httpx.AsyncClient, w: ServeWorkload, model: str, prompt: Any, n_in: int,
               n_out: int) -> RequestResult:
    """Stream one request; never raises (failures are recorded in the result)."""
    result = RequestResult(n_in, n_out)
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", w.endpoint, json=_body(w, model, prompt, n_out)) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return result
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = f"stream error: {event['error'].get('message', event['error'])}"
                    continue
                if event.get("usage"):
                    result.prompt_tokens = event["usage"].get("prompt_tokens")
                    result.output_tokens = event["usage"].get("completion_tokens") or 0
                if _carries_tokens(event):
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
            if not done and result.error is None:
                result.error = "stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - start
    if not result.output_tokens:
        result.output_tokens = chunks
    return result


async def run(w: ServeWorkload, log=lambda msg: None) -> dict:
    """Send the workload; returns {"model", "duration_s", "results": [RequestResult, ...], "server"}."""
    headers = {"Authorization": f"Bearer {w.api_key}"} if w.api_key else {}
    width = w.max_concurrency or w.num_prompts
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    async with httpx.AsyncClient(base_url=w.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(w.timeout_s, connect=30.0)) as client:
        models = await client.get("/v1/models")
        if models.status_code != 200:
            raise ValueError(f"GET {w.base_url}/v1/models answered {models.status_code}: {models.text[:200]}")
        model = w.model or models.json()["data"][0]["id"]
        version = await client.get("/version")
        server = version.json() if version.status_code == 200 else None
        prompts = make_prompts(w)
        gate = asyncio.Semaphore(width)
        rng = random.Random(w.seed + 1)

        async def one(item: tuple[Any, int, int]) -> RequestResult:
            async with gate:
                return await send(client, w, model, *item)

        log(f"bench serve: {w.num_prompts} requests to {w.base_url}{w.endpoint} ({model}), rate "
            f"{w.request_rate}/s, max concurrency {w.max_concurrency or 'unbounded'}")
        start = time.perf_counter()
        tasks = []
        for item in prompts:
            tasks.append(asyncio.ensure_future(one(item)))
            if math.isfinite(w.request_rate):
                await asyncio.sleep(rng.expovariate(w.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return {"model": model, "duration_s": duration, "results": results, "server": server}


def _stats(values: list[float]) -> dict[str, float] | None:
    """Mean, median, p90 and p99 in milliseconds (linear interpolation between ranks)."""
    if not values:
        return None
    xs = sorted(v * 1000.0 for v in values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p / 100.0
        lo = math.floor(k)
        return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)

    return {"mean": sum(xs) / len(xs), **{("median" if p == 50 else f"p{p}"): pct(p) for p in PERCENTILES}}


def summarize(w: ServeWorkload, raw: dict) -> dict:
    """The result document: workload, throughputs, latency statistics, failures, per-request rows."""
    results: list[RequestResult] = raw["results"]
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"HTTP {r.status}" if r.status not in (0, 200) else (r.error or "?").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    duration = raw["duration_s"]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.output_tokens > 1]
    workload = asdict(w)
    workload["api_key"] = "***" if w.api_key else None
    workload["request_rate"] = str(w.request_rate)  # inf is not JSON
    return {
        "workload": workload, "model": raw["model"], "server": raw["server"],
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_input_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "total_output_tokens": out_tokens,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok]),
        "requests": [asdict(r) for r in results],
    }


def render(doc: dict) -> str:
    """The markdown report of a result document."""
    w = doc["workload"]
    lines = [
        "# bench serve", "",
        f"Commit {doc['meta']['commit']}; `{doc['meta']['command']}`" if "meta" in doc else "",
        f"Server {w['base_url']}{w['endpoint']}, model `{doc['model']}`"
        + (f", version {doc['server']}" if doc.get("server") else "") + ".",
        f"{w['num_prompts']} requests ({w['dataset']}, input {w['input_len'][0]}..{w['input_len'][1]}, "
        f"output {w['output_len'][0]}..{w['output_len'][1]}), request rate {w['request_rate']}/s, "
        f"max concurrency {w['max_concurrency'] or 'unbounded'}, seed {w['seed']}.", "",
        "| metric | value |", "|---|---|",
        f"| completed / failed | {doc['completed']} / {doc['failed']} |",
        f"| duration | {doc['duration_s']:.2f} s |",
        f"| request throughput | {doc['request_throughput']:.2f} req/s |",
        f"| output throughput | {doc['output_throughput']:.1f} tok/s |",
        f"| input / output tokens | {doc['total_input_tokens']} / {doc['total_output_tokens']} |", "",
        "| latency (ms) | mean | median | p90 | p99 |", "|---|---|---|---|---|",
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        s = doc[key]
        lines.append(f"| {name} | " + (" | ".join(f"{s[k]:.1f}" for k in ("mean", "median", "p90", "p99"))
                                      if s else "- | - | - | -") + " |")
    if doc["errors"]:
        lines += ["", "Failures: " + ", ".join(f"{k} x{v}" for k, v in sorted(doc["errors"].items()))]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> str | None:
    """CDFs of TTFT, ITL and E2E into `path`; returns a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return PLOT_HINT
    ok = [r for r in doc["requests"] if r["error"] is None and r["status"] == 200]
    series = {"TTFT": [r["ttft"] for r in ok if r["ttft"] is not None],
              "ITL": [x for r in ok for x in r["itl"]], "E2E": [r["e2e"] for r in ok]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (name, values) in zip(axes, series.items()):
        xs = sorted(v * 1000.0 for v in values)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))] if xs else [])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
    w = doc["workload"]
    fig.suptitle(f"bench serve: {doc['model']}, {w['num_prompts']} requests, rate {w['request_rate']}/s, "
                 f"concurrency {w['max_concurrency'] or 'unbounded'}; {doc['output_throughput']:.0f} tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run_meta(command: list[str]) -> dict:
    """The client checkout's commit and the command line (the server reports its own version)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"commit": os.environ.get("REPLAYSSM_COMMIT") or commit or "unknown", "command": " ".join(command)}


def write(doc: dict, out: str | Path) -> str | None:
    """serve.json, serve.md and serve.png into `out`; returns the plot note (None: plot written)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "serve.md").write_text(render(doc))
    return plot(doc, out / "serve.png")


def main(w: ServeWorkload, out: str | None, command: list[str], log=print) -> dict:
    doc = summarize(w, asyncio.run(run(w, log=log)))
    doc["meta"] = run_meta(command)
    if out is not None:
        note = write(doc, out)
        log(f"bench serve: {note or f'wrote {out}/serve.{{json,md,png}}'}")
    return doc
