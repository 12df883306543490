"""Access and input limits over a live uvicorn server: the API key, CORS, /tokenize, /detokenize,
/version, text that is not valid Unicode, and prompts too large to tokenize."""

from __future__ import annotations

import time

import httpx
import pytest
from fake_engine import FakeEngine

import replayssm
from replayssm.server import api
from replayssm.server.launch import BackgroundServer

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU machine

KEY = "sk-test-key"
ORIGIN = "http://app.example"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def open_server():
    with BackgroundServer(FakeEngine(), served_model_name="tiny") as server:
        yield server


@pytest.fixture(scope="module")
def keyed_server():
    with BackgroundServer(FakeEngine(), served_model_name="tiny", api_key=KEY,
                          allowed_origins=[ORIGIN]) as server:
        yield server


def post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        kw.setdefault("headers", {})["content-type"] = "application/json"
        return httpx.post(server.base_url + path, content=body, timeout=30, **kw)
    return httpx.post(server.base_url + path, json=body, timeout=30, **kw)


GUARDED = [("POST", "/v1/completions", COMPLETION), ("POST", "/v1/chat/completions", CHAT),
           ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "hi"}),
           ("POST", "/detokenize", {"tokens": [104, 105]})]


@pytest.mark.parametrize("method,path,body", GUARDED)
def test_guarded_routes_need_the_key(keyed_server, method, path, body):
    """/v1/*, /tokenize and /detokenize answer 401 with an OpenAI error body without the right bearer
    key, and 200 with it."""
    url = keyed_server.base_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        res = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert res.status_code == 401, (headers, res.text)
        assert res.json()["error"]["code"] == "invalid_api_key" and "Bearer" in res.json()["error"]["message"]
    res = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert res.status_code == 200, res.text


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_open_routes_need_no_key(keyed_server, path):
    """/health, /metrics and /version answer without a key."""
    assert httpx.get(keyed_server.base_url + path, timeout=30).status_code == 200


def test_openai_client_sends_the_key(keyed_server):
    """The openai client's api_key is the bearer key: the right one generates, a wrong one gets
    AuthenticationError."""
    with openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY, max_retries=0) as client:
        assert client.completions.create(**COMPLETION).usage.completion_tokens == 2
    with openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="nope", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_cors_preflight_and_headers(keyed_server):
    """With allowed origins, a preflight from one succeeds without a key, and responses (a 401 too) carry
    Access-Control-Allow-Origin; another origin gets none."""
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    res = httpx.options(keyed_server.base_url + "/v1/chat/completions", headers=preflight, timeout=30)
    assert res.status_code == 200 and res.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in res.headers["access-control-allow-methods"]
    unauthorized = post(keyed_server, "/v1/completions", COMPLETION, headers={"Origin": ORIGIN})
    assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == ORIGIN
    other = post(keyed_server, "/v1/completions", COMPLETION,
                 headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_cors_is_off_by_default(open_server):
    """Without allowed origins no response carries CORS headers and a preflight is not answered."""
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    res = httpx.options(open_server.base_url + "/v1/completions", headers=preflight, timeout=30)
    assert res.status_code == 405 and "access-control-allow-origin" not in res.headers
    res = post(open_server, "/v1/completions", COMPLETION, headers={"Origin": ORIGIN})
    assert res.status_code == 200 and "access-control-allow-origin" not in res.headers


def test_tokenize_detokenize_round_trip(open_server):
    """/tokenize returns the tokenizer's ids, their count and max_model_len; /detokenize returns the text."""
    text = "héllo wörld"
    res = post(open_server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    ids = list(text.encode())
    assert res == {"count": len(ids), "max_model_len": 96, "tokens": ids,
                   "token_strs": [bytes([t]).decode(errors="replace") for t in ids]}
    back = post(open_server, "/detokenize", {"model": "tiny", "tokens": res["tokens"]})
    assert back.json() == {"prompt": text}


def test_tokenize_chat_messages(open_server):
    """/tokenize with messages renders the chat template, with or without the generation prompt."""
    messages = [{"role": "user", "content": "hi"}]
    with_prompt = post(open_server, "/tokenize", {"messages": messages}).json()
    assert bytes(with_prompt["tokens"]).decode() == "<user>hi\n<assistant>"
    without = post(open_server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bytes(without["tokens"]).decode() == "<user>hi\n" and without["token_strs"] is None


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": "other", "prompt": "hi"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/detokenize", {"tokens": [104, 256]}, 400, "tokens"),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens"),
])
def test_tokenize_bad_input(open_server, path, body, status, param):
    """Bad /tokenize and /detokenize input is a 4xx naming the field."""
    res = post(open_server, path, body)
    assert res.status_code == status and res.json()["error"]["param"] == param, res.text


def test_version(open_server):
    """/version reports the package version."""
    assert httpx.get(open_server.base_url + "/version").json() == {"version": replayssm.__version__}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud83d"]}', "stop.0"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "hi"}', "model"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/tokenize", b'{"prompt": "\\uDBFF"}', "prompt"),
])
def test_lone_surrogate_is_a_400_naming_the_field(open_server, path, body, param):
    """A lone surrogate anywhere in the body is a 400 naming its field; the server keeps serving."""
    res = post(open_server, path, body)
    assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text
    assert "Unicode" in res.json()["error"]["message"]
    assert post(open_server, "/v1/completions", COMPLETION).status_code == 200


def test_surrogate_pairs_are_valid_text(open_server):
    """An escaped surrogate pair is one valid character, not an error."""
    res = post(open_server, "/tokenize", b'{"prompt": "\\ud83d\\ude00"}')
    assert res.status_code == 200 and bytes(res.json()["tokens"]).decode() == "\U0001f600"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 5_000_000}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["hi", "x" * 5_000_000]}, "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5_000_000}]},
     "messages"),
    ("/tokenize", {"prompt": "x" * 5_000_000}, "prompt"),
])
def test_huge_prompt_is_refused_before_tokenizing(open_server, monkeypatch, path, body, param):
    """A 5 MB prompt is a 400 (context_length_exceeded) at once, and the tokenizer never sees it."""
    tok = open_server.engine_loop.engine.tokenizer
    seen = []
    monkeypatch.setattr(tok, "encode", lambda text, **kw: seen.append(len(text)) or [])
    monkeypatch.setattr(tok, "apply_chat_template", lambda messages, **kw: seen.append(0) or "")
    start = time.monotonic()
    res = post(open_server, path, body)
    assert res.status_code == 400, res.text
    assert (res.json()["error"]["param"], res.json()["error"]["code"]) == (param, "context_length_exceeded")
    assert time.monotonic() - start < 5 and all(n < 1000 for n in seen), seen


def test_body_past_the_cap_is_a_413(open_server, monkeypatch):
    """A body larger than the cap is refused with a 413, with or without a Content-Length."""
    monkeypatch.setattr(api, "MAX_BODY_BYTES", 1000)
    body = b'{"model": "tiny", "prompt": "' + b"x" * 2000 + b'"}'
    assert post(open_server, "/v1/completions", body).status_code == 413
    chunked = httpx.post(open_server.base_url + "/v1/completions", content=iter([body[:600], body[600:]]),
                         headers={"content-type": "application/json"}, timeout=30)
    assert chunked.status_code == 413 and chunked.json()["error"]["message"].startswith("request body")
