"""The OpenAI API over a live uvicorn server on loopback, driven by the official openai client."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from fake_engine import FakeEngine
from server_helpers import BAD_REQUESTS, wait_idle

from replayssm.sampling_params import SamplingParams
from replayssm.server.async_engine import EngineLoop
from replayssm.server.launch import BackgroundServer

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU machine


@pytest.fixture(scope="module")
def fake_server():
    with BackgroundServer(FakeEngine(step_sleep_s=0.002), served_model_name="tiny") as server:
        yield server


@pytest.fixture(scope="module")
def client(fake_server):
    with openai.OpenAI(base_url=fake_server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def offline(engine: FakeEngine, prompt: str, max_tokens: int) -> str:
    ids = engine.generate_offline(engine.tokenizer.encode(prompt), SamplingParams(temperature=0.0,
                                                                                   max_tokens=max_tokens))
    return engine.tokenizer.decode(ids)


def test_models_and_health(client, fake_server):
    """/v1/models lists the served name with its context length; /health answers ok."""
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx.get(fake_server.base_url + "/health").json() == {"status": "ok"}


def test_prompts_are_tokenized_off_the_event_loop(client, fake_server, monkeypatch):
    """Completions and chat build their requests (chat template, tokenizing) in a worker thread, not on
    the server's event loop: a huge prompt's seconds of tokenizing do not stall the other clients."""
    tok = fake_server.engine_loop.engine.tokenizer
    plain_encode, threads = tok.encode, []

    def encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return plain_encode(*args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    client.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    loop_thread = fake_server._thread.name  # uvicorn's event loop runs on the server's thread
    assert len(threads) == 2 and loop_thread not in threads, (threads, loop_thread)


def test_completion_matches_offline_and_reports_usage(client, fake_server):
    """A greedy completion returns offline generate()'s text; a repeated prompt reports cached tokens."""
    prompt = "The quick brown fox jumps over the lazy dog"
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0)
    engine = fake_server.engine_loop.engine
    assert first.choices[0].text == offline(engine, prompt, 7)
    assert first.choices[0].finish_reason == "length"
    n_prompt = len(prompt.encode())
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (
        n_prompt, 7, n_prompt + 7)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completion_batch_n_stop_seed_logprobs(client):
    """Prompts fan out n choices in prompt-major order; stop trims; seeds reproduce; logprobs align."""
    res = client.completions.create(model="tiny", prompt=["ab", "cd"], n=3, max_tokens=5, temperature=0.8,
                                    seed=11, logprobs=0)
    assert [c.index for c in res.choices] == list(range(6))
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 5 for c in res.choices)
    again = client.completions.create(model="tiny", prompt=["ab", "cd"], n=3, max_tokens=5, temperature=0.8,
                                      seed=11)
    assert [c.text for c in again.choices] == [c.text for c in res.choices]
    assert res.usage.prompt_tokens == 4 and res.usage.completion_tokens == 30
    full = res.choices[0].text
    stopped = client.completions.create(model="tiny", prompt="ab", max_tokens=5, temperature=0.8, seed=11,
                                        stop=[full[2:4]])
    assert stopped.choices[0].finish_reason == "stop" and full.startswith(stopped.choices[0].text)
    # Streaming holds back what may become a stop string, so it never sends text that gets cut.
    kw = dict(model="tiny", prompt="ab", max_tokens=5, temperature=0.8, seed=11)
    for stop in ([full[2:4]], [full[2:5], "zz" + full[3]], full[1:3]):
        streamed = client.completions.create(**kw, stop=stop, stream=True)
        whole = client.completions.create(**kw, stop=stop)
        assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text, stop


def test_chat_uses_template_and_streams(client, fake_server):
    """Chat prompts come from the tokenizer's template; streamed deltas concatenate to the full reply."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    res = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    engine = fake_server.engine_loop.engine
    templated = engine.tokenizer.apply_chat_template(messages)
    assert res.choices[0].message.content == offline(engine, templated, 6)
    assert res.usage.prompt_tokens == len(templated.encode())
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == res.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == res.usage.prompt_tokens


def test_chat_stream_with_n_choices(client):
    """With n > 1, streamed chat deltas regroup by choice index into the non-streamed choices."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "two"}], n=3, max_tokens=5, temperature=0.9,
              seed=3)
    full = client.chat.completions.create(**kw)
    parts: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + (choice.delta.content or "")
    assert parts == {c.index: c.message.content for c in full.choices}
    assert len(set(parts.values())) > 1  # per-choice seeds differ
    stopped = client.chat.completions.create(**{**kw, "n": 1}, stop=full.choices[0].message.content[1:3])
    assert stopped.choices[0].finish_reason == "stop"


def test_completion_stream_with_logprobs(client):
    """Streamed completion chunks carry each new token's logprob exactly once."""
    stream = client.completions.create(model="tiny", prompt="xyz", max_tokens=8, temperature=0, stream=True,
                                       logprobs=0)
    chunks = list(stream)
    lps = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert len(lps) == 8
    assert "".join(c.choices[0].text for c in chunks) == client.completions.create(
        model="tiny", prompt="xyz", max_tokens=8, temperature=0).choices[0].text


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_is_4xx_and_server_keeps_serving(fake_server, client, name, path, body, status, param):
    """Each bad request gets its 4xx with an OpenAI error body, and the next good request succeeds."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(fake_server.base_url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:  # a dotted param names the exact field, a plain one the top-level field
        assert error["param"] == param if "." in param else error["param"].split(".")[0] == param, error
        assert "[" not in error["param"] and ".str" not in error["message"], error  # no pydantic type tags
    good = client.completions.create(model="tiny", prompt="ok", max_tokens=2)
    assert good.choices[0].finish_reason == "length"


def test_top_logprobs_completions_and_chat(client):
    """logprobs = N (completions) and top_logprobs = N (chat) return each token's N alternatives with
    their text, streamed or not."""
    res = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0, logprobs=3)
    lp = res.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 4
    for tok, own, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[tok] == own  # the fake engine's chosen token comes first
        assert sorted(top.values(), reverse=True) == list(top.values())
    stream = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0, logprobs=3,
                                       stream=True)
    assert [t for c in stream if c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs] == \
        lp.top_logprobs
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == [entry.logprob, entry.logprob - 1]
        assert entry.top_logprobs[0].token == entry.token
        assert all(bytes(t.bytes).decode() == t.token for t in entry.top_logprobs)


def test_refused_options_pass_at_their_no_op_values(client):
    """best_of = n, tool_choice "none", a text response_format and top_logprobs 0 are served as usual."""
    res = client.completions.create(model="tiny", prompt="hi", max_tokens=2, n=2, best_of=2)
    assert len(res.choices) == 2
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, tool_choice="none", response_format={"type": "text"},
                                          logprobs=True, top_logprobs=0)
    assert len(chat.choices[0].logprobs.content) == 2


def test_openai_client_raises_typed_errors(client):
    """The openai client maps our error bodies to its typed exceptions."""
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_disconnect_aborts_and_frees(fake_server):
    """A client that drops a stream, or a non-streaming request, aborts it; memory comes back."""
    engine = fake_server.engine_loop.engine
    aborted = engine.num_aborted
    body = {"model": "tiny", "prompt": "long one", "max_tokens": 80, "stream": True}
    with httpx.stream("POST", fake_server.base_url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    wait_idle(fake_server)
    assert engine.num_aborted == aborted + 1
    # Non-streaming: hang up once the engine holds the request (80 tokens take ~0.2 s here).
    payload = json.dumps({**body, "stream": False}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
           f"Content-Length: {len(payload)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", fake_server.port)) as sock:
        sock.sendall(head.encode() + payload)
        deadline = time.monotonic() + 5
        while fake_server.engine_loop.num_in_flight == 0:
            assert time.monotonic() < deadline, "request never reached the engine"
            time.sleep(0.002)
    wait_idle(fake_server)
    assert engine.num_aborted == aborted + 2
    fake_server.engine_loop.call(lambda e: e.check_integrity()).result(5)
    assert engine.free_blocks == engine.num_blocks


def test_metrics_exposition(client, fake_server):
    """/metrics exposes request, token, latency and engine-state series in Prometheus text format."""
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3)
    text = httpx.get(fake_server.base_url + "/metrics").text
    for name in ("replayssm_requests_total", "replayssm_generation_tokens_total",
                 "replayssm_time_to_first_token_seconds_bucket",
                 "replayssm_inter_token_latency_seconds_bucket",
                 "replayssm_num_requests_running", "replayssm_num_requests_waiting",
                 "replayssm_num_preemptions_total", "replayssm_cached_prompt_tokens_total",
                 'replayssm_http_errors_total{status="400"}'):
        assert name in text, name


class BrokenEngine(FakeEngine):
    """A fake engine whose step() fails once a request has produced a few tokens."""

    def step(self):
        if self.num_steps >= 3:
            raise RuntimeError("simulated device failure")
        return super().step()


def test_engine_failure_is_reported_not_hung():
    """If a step raises, in-flight and later requests get 503 / an SSE error event, and /health says 503."""
    with BackgroundServer(BrokenEngine(), served_model_name="tiny") as server:
        body = {"model": "tiny", "prompt": "doomed", "max_tokens": 20, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=10) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "error" in json.loads(events[-2][6:]) and events[-1] == "data: [DONE]"
        r = httpx.post(server.base_url + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert httpx.get(server.base_url + "/health").status_code == 503


def test_engine_loop_offline_generate():
    """EngineLoop.generate() (offline use of the loop) matches a direct run; a failing command spares it."""
    engine = FakeEngine()
    loop = EngineLoop(engine).start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5)
        futures = [loop.generate(f"r{i}", [7, 8, i + 1], params) for i in range(10)]
        for i, future in enumerate(futures):
            assert future.result(10).token_ids == engine.generate_offline([7, 8, i + 1], params)
        with pytest.raises(ValueError):
            loop.generate("bad", [], params).result(10)

        def failing_check(engine) -> None:
            raise AssertionError("a failed check belongs to its caller")

        with pytest.raises(AssertionError):
            loop.call(failing_check).result(10)
        assert loop.alive and loop.generate("after", [9], params).result(10).finished
    finally:
        loop.shutdown()
    assert not loop.alive
