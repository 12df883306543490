"""The server forwards the sampling fields to the engine, applies the checkpoint's generation_config.json
defaults where a request is silent, and passes chat_template_kwargs to the template (demo checkpoint,
CPU engine)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from replayssm import LLM, SamplingParams
from replayssm.server.launch import BackgroundServer

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if shout %}LOUD{% endif %}<|assistant|>\n"
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(server, llm) on a copy of the demo checkpoint with generation defaults and a kwargs template."""
    from replayssm.demo import demo_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    shutil.copytree(demo_checkpoint(cache_dir=str(tmp_path_factory.mktemp("demo"))), path)
    (path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.0,
                "top_k": 5,
                "repetition_penalty": 1.2,
                "max_new_tokens": 5,
                "do_sample": True,
            }
        )
    )
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    llm = LLM(str(path), device="cpu", max_model_len=128)
    try:
        with BackgroundServer(llm.engine, served_model_name="tiny") as server:
            yield server, llm, str(path)
    finally:
        torch.set_num_threads(threads)


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.base_url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_generation_defaults_apply_offline(setup):
    """LLM.generate without params samples with generation_config.json's fields (greedy here, 5 tokens,
    repetition_penalty 1.2)."""
    defaults = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.2, "max_tokens": 5}
    assert setup[1].engine.generation_defaults == defaults
    with LLM(setup[2], device="cpu", max_model_len=128) as llm:
        silent = llm.generate([5, 6, 7], use_tqdm=False)[0]
        spelled = llm.generate([5, 6, 7], SamplingParams(**defaults), use_tqdm=False)[0]
    assert silent.token_ids == spelled.token_ids and len(silent.token_ids) <= 5


def test_silent_request_takes_generation_defaults(setup):
    """A completion that sets no sampling field gets the checkpoint's defaults: 5 greedy tokens with the
    repetition penalty, the same as the request that spells them out; a set field wins."""
    server = setup[0]
    silent = _post(server, "/v1/completions", {"prompt": [5, 6, 7], "return_token_ids": True})["choices"][0]
    spelled = _post(
        server,
        "/v1/completions",
        {
            "prompt": [5, 6, 7],
            "return_token_ids": True,
            "temperature": 0,
            "max_tokens": 5,
            "repetition_penalty": 1.2,
        },
    )["choices"][0]
    assert len(silent["token_ids"]) == 5 and silent["token_ids"] == spelled["token_ids"]
    longer = _post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 9, "ignore_eos": True})
    assert longer["usage"]["completion_tokens"] == 9


def test_logit_bias_and_penalties_reach_the_sampler(setup):
    """logit_bias +100 on one token makes every greedy token that token; a frequency penalty then moves
    it off after the first time (both were refused with a 400 before they were implemented)."""
    server = setup[0]
    biased = _post(
        server,
        "/v1/completions",
        {
            "prompt": [5, 6, 7],
            "max_tokens": 4,
            "ignore_eos": True,
            "logit_bias": {"42": 100},
            "return_token_ids": True,
        },
    )
    assert biased["choices"][0]["token_ids"] == [42] * 4
    chat = _post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "ignore_eos": True,
            "logit_bias": {"42": 4},
            "frequency_penalty": 2.0,
            "presence_penalty": 2.0,
            "return_token_ids": True,
            "repetition_penalty": 1.0,
        },
    )
    tokens = chat["choices"][0]["token_ids"]
    assert tokens.count(42) <= 2 and len(tokens) == 4


def test_min_tokens_stop_token_ids_and_include_stop_str(setup):
    """stop_token_ids end a choice (its text left out unless include_stop_str_in_output); min_tokens holds
    the stop back."""
    server, llm, _ = setup
    base = {
        "prompt": [5, 6, 7],
        "max_tokens": 8,
        "ignore_eos": True,
        "return_token_ids": True,
        "repetition_penalty": 1.0,
    }
    full = _post(server, "/v1/completions", base)["choices"][0]
    stop = full["token_ids"][1]
    first = full["token_ids"].index(stop)
    cut = _post(server, "/v1/completions", {**base, "stop_token_ids": [stop]})["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["token_ids"] == full["token_ids"][: first + 1]
    assert cut["text"] == llm.tokenizer.decode(full["token_ids"][:first])
    kept = _post(
        server, "/v1/completions", {**base, "stop_token_ids": [stop], "include_stop_str_in_output": True}
    )
    assert kept["choices"][0]["text"] == llm.tokenizer.decode(full["token_ids"][: first + 1])
    held = _post(server, "/v1/completions", {**base, "stop_token_ids": [stop], "min_tokens": first + 2})
    assert len(held["choices"][0]["token_ids"]) > first + 1


def test_skip_special_tokens_false_keeps_special_text(setup):
    """skip_special_tokens=false keeps a special token's text (bos forced by logit_bias)."""
    server, llm, _ = setup
    bos = llm.tokenizer.bos_token_id
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True, "logit_bias": {str(bos): 100}}
    skipped = _post(server, "/v1/completions", body)["choices"][0]["text"]
    kept = _post(server, "/v1/completions", {**body, "skip_special_tokens": False})["choices"][0]["text"]
    assert skipped == "" and kept == llm.tokenizer.bos_token * 2


def test_chat_template_kwargs_reach_the_template(setup):
    """chat_template_kwargs are template variables: the prompt changes (usage counts its tokens)."""
    server = setup[0]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    plain = _post(server, "/v1/chat/completions", body)["usage"]["prompt_tokens"]
    loud = _post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"shout": True}})
    assert loud["usage"]["prompt_tokens"] > plain


def test_max_model_len_past_the_positions_is_refused():
    """max_model_len above max_position_embeddings is a ValueError naming both."""
    from replayssm.demo import demo_checkpoint

    with pytest.raises(
        ValueError, match="max_model_len=4096 exceeds the model's max_position_embeddings=2048"
    ):
        LLM(demo_checkpoint(), device="cpu", max_model_len=4096)


def test_typed_sampling_params():
    """Wrong types raise ValueError naming the field instead of a TypeError or a truthy value."""
    for kwargs, field in [
        ({"stop": 123}, "stop"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"min_p": "0.1"}, "min_p"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
