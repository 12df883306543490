"""`replayssm bench serve` against a live `replayssm serve --model demo` on 127.0.0.1 (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from replayssm.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Base URL of a `replayssm serve --model demo` subprocess."""
    port = _free_port()
    env = {**os.environ, "REPLAYSSM_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONPATH": ROOT,
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "replayssm", "serve", "--model", "demo", "--device", "cpu",
                             "--port", str(port), "--max-model-len", "256"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_bench_serve_reports_and_writes_results(server, tmp_path, capsys):
    """20 requests at concurrency 4: all complete; serve.{json,md,png} hold throughput and percentiles."""
    rc = main(["bench", "serve", "--base-url", server, "--num-prompts", "20", "--max-concurrency", "4",
               "--input-len", "8:32", "--output-len", "8", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "serve.json").read_text())
    assert doc["completed"] == 20 and doc["failed"] == 0 and doc["model"] == "demo"
    assert doc["total_output_tokens"] == 20 * 8
    assert doc["output_throughput"] > 0 and doc["request_throughput"] > 0
    for key in ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms"):
        s = doc[key]
        assert 0 < s["median"] <= s["p90"] <= s["p99"], key
    # At most one gap per token after the first (several tokens may share a chunk).
    assert all(0 < len(r["itl"]) <= 7 for r in doc["requests"])
    out = capsys.readouterr()
    if importlib.util.find_spec("matplotlib") is None:  # the plot needs the [bench] extra, and says so
        assert not (tmp_path / "serve.png").exists() and "pip install -e '.[bench]'" in out.err
    else:
        assert (tmp_path / "serve.png").stat().st_size > 0
    assert "| TTFT |" in (tmp_path / "serve.md").read_text() and "| TTFT |" in out.out


def test_bench_serve_poisson_text_chat(server, tmp_path):
    """Poisson arrivals of random-text chat requests with uniform lengths all complete."""
    rc = main(["bench", "serve", "--base-url", server, "--num-prompts", "8", "--request-rate", "50",
               "--endpoint", "/v1/chat/completions", "--dataset", "random-text", "--input-len", "3:6",
               "--output-len", "2:5", "--seed", "3", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "serve.json").read_text())
    assert rc == 0 and doc["completed"] == 8
    assert [r["output_tokens"] for r in doc["requests"]] == [r["output_len"] for r in doc["requests"]]
    assert len({r["output_len"] for r in doc["requests"]}) > 1


def test_bench_serve_counts_refused_requests_as_failures(server, capsys):
    """Requests the server refuses (output past the context) are reported as failures, exit code 1."""
    rc = main(["bench", "serve", "--base-url", server, "--num-prompts", "2", "--output-len", "600"])
    assert rc == 1 and "Failures: HTTP 400 x2" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--input-len", "0"], "--input-len"), (["--output-len", "9:3"], "--output-len"),
    (["--request-rate", "0"], "--request-rate"), (["--max-concurrency", "0"], "--max-concurrency"),
    (["--endpoint", "/v1/chat/completions"], "random-text"),
])
def test_bench_serve_bad_flags_are_one_line_errors(flags, message, capsys):
    """Bad workload flags exit 2 with a message naming the flag, before any request."""
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *flags]) == 2
    assert message in capsys.readouterr().err
