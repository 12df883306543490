"""Small shared helpers for the server tests."""

from __future__ import annotations

import random
import time

from replayssm.server.launch import BackgroundServer


def wait_idle(server: BackgroundServer, timeout: float = 10.0) -> None:
    """Block until the engine has no unfinished requests (checked on the loop thread)."""
    deadline = time.monotonic() + timeout
    while server.engine_loop.call(lambda e: e.has_unfinished_requests()).result(timeout):
        assert time.monotonic() < deadline, "engine never went idle"
        time.sleep(0.01)


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 3..20 random token ids in [1, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 20))] for _ in range(n)]


# (name, path, body, expected status, expected error param) against a server named "tiny" whose
# max_model_len is 96; body is sent as-is when it is bytes.
BAD_REQUESTS = [
    ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("wrong type", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, 400,
     "max_tokens"),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("prompt too long", "/v1/completions", {"model": "tiny", "prompt": "x" * 500}, 400, "prompt"),
    ("max_tokens past context", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 95}, 400,
     "prompt"),
    ("max_tokens zero", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400,
     "max_tokens"),
    ("max_tokens negative", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens"),
    ("n zero", "/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, 400, "n"),
    ("n too large", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 1000}, 400, "n"),
    ("too many choices", "/v1/completions", {"model": "tiny", "prompt": ["a"] * 20, "n": 100}, 400, "n"),
    ("empty messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "x", "content": "a"}]}, 400,
     None),
    ("logit_bias value", "/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"5": 500}}, 400,
     "logit_bias"),
    ("logit_bias key", "/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"x": 1}}, 400,
     "logit_bias"),
    ("presence_penalty", "/v1/completions", {"model": "tiny", "prompt": "hi", "presence_penalty": 3.0}, 400,
     "presence_penalty"),
    ("min_tokens past max_tokens", "/v1/completions",
     {"model": "tiny", "prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("min_p", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "min_p": 1.5}, 400, "min_p"),
    ("temperature", "/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 5.0}, 400,
     "temperature"),
    ("token id out of vocab", "/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, 400, "prompt"),
    # Options the engine would otherwise ignore silently: refused, naming the parameter.
    ("too many top logprobs", "/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 21}, 400,
     "logprobs"),
    ("negative logprobs", "/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": -1}, 400,
     "logprobs"),
    ("chat top logprobs", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("suffix", "/v1/completions", {"model": "tiny", "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("best_of", "/v1/completions", {"model": "tiny", "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("tools", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tools"),
    ("unknown response_format", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "xml"}}, 400, "response_format"),
    ("negative top_k", "/v1/completions", {"model": "tiny", "prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("prompt of a wrong type", "/v1/completions", {"model": "tiny", "prompt": 5}, 400, "prompt"),
    ("user message without content", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("image content", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content"),
    ("unknown route", "/v1/nothing", {}, 404, None),
    # A lone surrogate is valid JSON but not text any tokenizer or response encoder takes.
    ("lone surrogate", "/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800"}', 400, "prompt"),
    ("lone surrogate in chat", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages.0.content"),
]
