"""Draining on SIGINT / SIGTERM over a live uvicorn server: new requests get 503, open requests get
the shutdown timeout to finish, and streams still open then end with an "abort" event and [DONE].

The signal is delivered by calling the server's handler directly (the server runs on a thread, where
uvicorn installs no signal handlers); test_launch.py sends a real SIGTERM to a `serve` process.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from fake_engine import FakeEngine
from server_helpers import wait_idle

from replayssm.sampling_params import SamplingParams
from replayssm.server.launch import BackgroundServer

LONG = {"model": "tiny", "prompt": "hi", "max_tokens": 90, "stream": True}  # 90 steps of 50 ms
LONG_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 70,
             "stream": True, "stream_options": {"include_usage": True}}


def server(shutdown_timeout: float) -> BackgroundServer:
    return BackgroundServer(FakeEngine(step_sleep_s=0.05), served_model_name="tiny",
                            shutdown_timeout=shutdown_timeout)


class Stream(threading.Thread):
    """Reads one streaming request to its end, keeping every SSE data line."""

    def __init__(self, base_url: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = base_url + path, body
        self.lines: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=30) as res:
                res.raise_for_status()
                for line in res.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.first.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        self.first.set()

    def events(self) -> list[dict]:
        assert self.lines and self.lines[-1] == "[DONE]", self.lines[-3:]
        return [json.loads(line) for line in self.lines[:-1]]


def open_streams(srv: BackgroundServer, *bodies: tuple[str, dict]) -> list[Stream]:
    streams = [Stream(srv.base_url, path, body) for path, body in bodies]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(30) and s.error is None, s.error
    return streams


def finish_reasons(events: list[dict]) -> list[str]:
    return [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"] is not None]


def test_open_streams_end_with_abort_and_done_at_the_timeout():
    """At the shutdown timeout every open stream (completion with n=2, chat with usage) sends a final
    finish_reason "abort" event per unfinished choice, then [DONE]; the engine is left with nothing."""
    with server(shutdown_timeout=0.5) as srv:
        streams = open_streams(srv, ("/v1/completions", {**LONG, "n": 2}),
                               ("/v1/chat/completions", LONG_CHAT))
        start = time.monotonic()
        srv.server.handle_exit(signal.SIGTERM, None)
        for s in streams:
            s.join(10)
            assert not s.is_alive() and s.error is None, s.error
        assert time.monotonic() - start < 3
        completion, chat = (s.events() for s in streams)
        assert finish_reasons(completion) == ["abort", "abort"]
        assert finish_reasons(chat) == ["abort"] and chat[-1]["usage"]["completion_tokens"] > 0
        # What was streamed is what the engine generated up to the stop, with nothing held back.
        text = "".join(c["text"] for e in completion for c in e["choices"] if c["index"] == 0)
        engine = srv.engine_loop.engine
        generated = engine.generate_offline(list(b"hi"), SamplingParams(max_tokens=len(text)))
        assert 0 < len(text) < 90 and text == engine.tokenizer.decode(generated)
        srv._thread.join(10)
        assert not srv._thread.is_alive(), "uvicorn did not exit after the drain"
        wait_idle(srv)


def test_draining_refuses_new_requests_with_503():
    """Once the signal came, new generation requests and /health get 503 while open streams finish;
    routes that generate nothing stay up."""
    with server(shutdown_timeout=5) as srv:
        (stream,) = open_streams(srv, ("/v1/completions", LONG))
        srv.server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.2)
        res = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=10)
        assert res.status_code == 503 and res.json()["error"]["type"] == "server_error"
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 503
        assert httpx.get(srv.base_url + "/version", timeout=10).status_code == 200
        srv.server.handle_exit(signal.SIGTERM, None)  # a second signal: end the streams now
        stream.join(10)
        assert finish_reasons(stream.events()) == ["abort"]


def test_requests_that_finish_in_time_are_untouched():
    """A stream that ends before the timeout ends normally, and the server exits as soon as it has."""
    with server(shutdown_timeout=30) as srv:
        short = {**LONG, "max_tokens": 10}
        (stream,) = open_streams(srv, ("/v1/completions", short))
        start = time.monotonic()
        srv.server.handle_exit(signal.SIGTERM, None)
        stream.join(10)
        assert finish_reasons(stream.events()) == ["length"]
        srv._thread.join(10)
        assert not srv._thread.is_alive() and time.monotonic() - start < 5


def test_plain_request_open_at_the_timeout_gets_503():
    """A non-streaming request still running at the timeout gets a 503 error body, not a cut connection."""
    with server(shutdown_timeout=0.5) as srv:
        result = {}

        def call() -> None:
            result["res"] = httpx.post(srv.base_url + "/v1/completions",
                                       json={**LONG, "stream": False}, timeout=30)

        caller = threading.Thread(target=call)
        caller.start()
        deadline = time.monotonic() + 10
        while srv.app.state.server.admission.num_in_flight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # admitted and running in the engine
        srv.server.handle_exit(signal.SIGTERM, None)
        caller.join(10)
        res = result["res"]
        assert res.status_code == 503 and "shutting down" in res.json()["error"]["message"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_idle_server_exits_at_once(sig):
    """With nothing in flight the drain ends immediately, whatever the timeout."""
    with server(shutdown_timeout=30) as srv:
        start = time.monotonic()
        srv.server.handle_exit(sig, None)
        srv._thread.join(10)
        assert not srv._thread.is_alive() and time.monotonic() - start < 2
