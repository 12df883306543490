"""`serve` as a process: flags from the engine config, a live server, a clean exit on SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from replayssm.config import SchedulerConfig
from replayssm.server.launch import add_serve_parser

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU machine

REPO_ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(list(argv))


def test_serve_flags_default_from_engine_config():
    """`serve` takes --host/--port plus every engine flag, with defaults from the config dataclasses."""
    args = parse("serve", "--model", "demo", "--no-replayssm", "--max-num-seqs", "3")
    assert (args.host, args.port, args.replayssm, args.max_num_seqs) == ("127.0.0.1", 8000, False, 3)
    assert args.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens


def test_serve_port_out_of_range_is_refused_before_loading(capsys):
    """--port outside 0-65535 is an argparse error (status 2) naming the range, before any model loads."""
    for port in ("99999", "-1", "http"):
        with pytest.raises(SystemExit) as exc:
            parse("serve", "--model", "demo", "--port", port)
        assert exc.value.code == 2
        assert "--port" in capsys.readouterr().err
    assert parse("serve", "--model", "demo", "--port", "0").port == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process_answers_and_exits_cleanly(tmp_path):
    """`python -m replayssm serve --model demo` answers the openai client; SIGTERM stops it cleanly,
    within --shutdown-timeout even with a long stream still running (uvicorn alone waits for it), and
    that stream ends with a finish_reason "abort" event and [DONE], not a cut connection."""
    port = free_port()
    env = {**os.environ, "REPLAYSSM_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "replayssm", "serve", "--model", "demo", "--device", "cpu",
           "--port", str(port), "--max-model-len", "2048", "--max-num-seqs", "4", "--log-level", "warning",
           "--shutdown-timeout", "1"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as client:
            model = client.models.list().data[0].id
            res = client.completions.create(model=model, prompt="Hi", max_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert res.usage.completion_tokens == 3 and res.choices[0].finish_reason == "length"
        # A stream of 2,000 tokens (long enough here) is open when the signal comes.
        first, lines = threading.Event(), []

        def consume() -> None:
            body = dict(model=model, prompt="Hi", max_tokens=2000, stream=True, ignore_eos=True)
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as res:
                for line in res.iter_lines():
                    lines.append(line)
                    first.set()

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        assert first.wait(60)
    finally:
        stopped = time.monotonic()
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    assert time.monotonic() - stopped < 10, output
    reader.join(10)
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]", lines[-4:]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught so the parent sees it.
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in output, output


def test_serve_freezes_the_heap_before_serving(monkeypatch):
    """serve_main moves everything alive once the engine is built out of the collector's scans
    before uvicorn starts (a full collection over them is a pause every request waits through), and
    shuts the engine loop down when uvicorn returns."""
    import gc
    import types

    from replayssm.server import launch

    seen = {}
    loop = types.SimpleNamespace(shutdown=lambda: seen.setdefault("shutdown", True))
    server = types.SimpleNamespace(run=lambda: seen.setdefault("frozen", gc.get_freeze_count()))
    monkeypatch.setattr(launch, "build_engine", lambda args: "engine")
    monkeypatch.setattr(launch, "build_app", lambda engine, name, **access: ("app", loop))
    monkeypatch.setattr(launch, "make_server", lambda app, *args: server)
    gc.unfreeze()
    try:
        assert launch.serve_main(parse("serve", "--model", "demo")) == 0
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 1000 and seen["shutdown"]
    with pytest.raises(SystemExit):
        parse("serve", "--model", "demo", "--shutdown-timeout", "-1")
