"""Structured output through the server on the real engine (demo checkpoint, CPU, n-gram speculative
decoding with k = 3 and async scheduling): response_format json_object / json_schema and
structured_outputs regex, plain and streamed, on both endpoints; bad specs are 400s naming the field."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from server_helpers import wait_idle

from replayssm import LLM
from replayssm.server.launch import BackgroundServer

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU machine
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
REGEX = r"(yes|no), [0-9]{2}"
CHAT = [{"role": "user", "content": "Name a city."}]


def follows_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"city", "rank"} and isinstance(value["city"], str) and len(value["city"]) <= 8
            and type(value["rank"]) is int and 1 <= value["rank"] <= 9)


@pytest.fixture(scope="module")
def server():
    llm = LLM("demo", device="cpu", max_model_len=256, max_num_seqs=16, num_speculative_tokens=3,
              speculative_method="ngram", async_scheduling=True)
    with BackgroundServer(llm.engine, served_model_name="tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_chat_json_schema_parses_and_validates(client):
    """Chat with a json_schema response_format: every choice (n = 4, sampled) parses and validates."""
    res = client.chat.completions.create(model="tiny", messages=CHAT, n=4, seed=3, max_tokens=100,
                                         response_format=JSON_SCHEMA)
    for choice in res.choices:
        assert choice.finish_reason == "stop" and follows_schema(choice.message.content), choice


def test_completions_json_object_and_streaming(client):
    """Completions with json_object, greedy, plain and streamed: the same text, a JSON object; the
    same request without response_format is not JSON."""
    kw = dict(model="tiny", prompt="{", max_tokens=60, temperature=0, seed=1)
    nameless = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    plain = client.completions.create(**kw, extra_body={"response_format": nameless})
    assert follows_schema(plain.choices[0].text)
    stream = client.completions.create(**kw, stream=True, extra_body={"response_format": JSON_SCHEMA})
    assert "".join(c.choices[0].text for c in stream if c.choices) == plain.choices[0].text
    free = client.completions.create(**kw)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].text)
    obj = client.completions.create(model="tiny", prompt="x", max_tokens=100, seed=1, n=4,
                                    extra_body={"response_format": {"type": "json_object"}})
    finished = [c.text for c in obj.choices if c.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(t), dict) for t in finished)


def test_structured_outputs_regex(client):
    """structured_outputs {"regex": ...} on chat, streamed: the text fullmatches the regex."""
    stream = client.chat.completions.create(model="tiny", messages=CHAT, n=3, seed=5, max_tokens=30,
                                            stream=True, extra_body={"structured_outputs": {"regex": REGEX}})
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(re.fullmatch(REGEX, t) for t in texts), texts


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
])
def test_bad_specs_are_400s(server, client, body, param):
    """A spec the server cannot follow is a 400 naming its field, and the server keeps serving."""
    for path, extra in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = httpx.post(server.base_url + path, json={"model": "tiny", **extra, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    ok = client.completions.create(model="tiny", prompt="ok", max_tokens=3,
                                   extra_body={"structured_outputs": {"regex": "[0-9]+"}})
    assert ok.choices[0].text.isdigit()
    wait_idle(server)
