"""The server on the real LLMEngine (built-in demo checkpoint, CPU): openai client, bad input, load."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from server_helpers import BAD_REQUESTS, random_prompts, wait_idle
from server_load import DROP_EVERY, MAX_TOKENS, check_load_results, finish_counts, run_load

from replayssm import LLM, SamplingParams
from replayssm.server.launch import BackgroundServer

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU machine

NUM_LOAD_REQUESTS = 200
NUM_DISTINCT_PROMPTS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """(server, offline greedy tokens of the load prompts, load prompts, llm) on one engine.

    Offline generate() runs first on the same engine; then the engine moves onto the loop thread."""
    from replayssm.demo import demo_checkpoint

    # One intra-op thread: on a shared 2-core CI box, OpenMP spinning costs more than it gains.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = demo_checkpoint(cache_dir=str(tmp_path_factory.mktemp("demo")))
    # 40 KV blocks of 16 tokens for 64 running requests: the load test runs into preemptions. Async
    # scheduling on (the CUDA default): streaming, client drops and aborts meet steps launched ahead.
    llm = LLM(path, device="cpu", max_model_len=128, max_num_seqs=64, num_kv_blocks=40, async_scheduling=True)
    vocab = llm.engine.model_config.vocab_size
    distinct = random_prompts(NUM_DISTINCT_PROMPTS, vocab, seed=1)
    offline = [o.token_ids for o in llm.generate(distinct, GREEDY, use_tqdm=False)]
    prompts = [distinct[i % NUM_DISTINCT_PROMPTS] for i in range(NUM_LOAD_REQUESTS)]
    expected = [offline[i % NUM_DISTINCT_PROMPTS] for i in range(NUM_LOAD_REQUESTS)]
    text_prompt = "Hello, hybrid model!"
    chat = [{"role": "user", "content": "Say something."}]
    chat_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat), add_special_tokens=False)
    greedy8 = SamplingParams(temperature=0.0, max_tokens=8)
    top3 = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    ref = {"text": llm.generate(text_prompt, greedy8, use_tqdm=False)[0],
           "top": llm.generate(text_prompt, top3, use_tqdm=False)[0], "decode": llm.tokenizer.decode,
           "chat": llm.generate(chat_ids, greedy8, use_tqdm=False)[0],
           "text_prompt": text_prompt, "chat_messages": chat}
    try:
        with BackgroundServer(llm.engine, served_model_name="tiny") as server:
            yield server, prompts, expected, ref
    finally:
        torch.set_num_threads(threads)


def assert_no_leaks(server: BackgroundServer) -> None:
    """The engine is idle, every KV block and Mamba slot is back in its pool, and the pools are sane."""
    wait_idle(server)

    def check(engine) -> None:
        sched = engine.scheduler
        sched.check_integrity()
        assert not sched.running and not sched.waiting
        assert sched.block_pool.num_used == 0
        assert sched.slot_pool.num_free == sched.slot_pool.num_slots

    server.engine_loop.call(check).result(10)
    assert server.engine_loop.num_in_flight == 0


def test_openai_client_completions_chat_streaming_usage(real):
    """The openai client gets offline generate()'s greedy text for completions and chat, streamed or not."""
    server, _, _, ref = real
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        res = client.completions.create(model="tiny", prompt=ref["text_prompt"], max_tokens=8, temperature=0)
        assert res.choices[0].text == ref["text"].text
        assert res.usage.prompt_tokens == len(ref["text"].prompt_token_ids)
        assert res.usage.completion_tokens == len(ref["text"].token_ids)
        assert res.usage.prompt_tokens_details.cached_tokens == ref["text"].num_cached_tokens
        stream = client.completions.create(model="tiny", prompt=ref["text_prompt"], max_tokens=8,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == ref["text"].text
        chat = client.chat.completions.create(model="tiny", messages=ref["chat_messages"], max_tokens=8,
                                              temperature=0)
        assert chat.choices[0].message.content == ref["chat"].text
        assert chat.usage.prompt_tokens == len(ref["chat"].prompt_token_ids)
        stream = client.chat.completions.create(model="tiny", messages=ref["chat_messages"], max_tokens=8,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref["chat"].text
        assert chunks[-1].usage.total_tokens == chat.usage.total_tokens
        sampling = dict(model="tiny", prompt="abc", max_tokens=6, temperature=1.0, seed=5, n=2)
        sampled = client.completions.create(**sampling, logprobs=0)
        again = client.completions.create(**sampling)
        assert [c.text for c in again.choices] == [c.text for c in sampled.choices]
        assert all(lp <= 0.0 for c in sampled.choices for lp in c.logprobs.token_logprobs)
        # Alternatives: offline generate()'s, by token text.
        top = client.completions.create(model="tiny", prompt=ref["text_prompt"], max_tokens=8, temperature=0,
                                        logprobs=3).choices[0].logprobs.top_logprobs
        want = [{ref["decode"]([i]): lp for i, lp in alts} for alts in ref["top"].top_logprobs]
        assert [list(t) for t in top] == [list(w) for w in want]
        assert [v for t in top for v in t.values()] == pytest.approx([v for w in want for v in w.values()],
                                                                      abs=1e-5)
    assert_no_leaks(server)


def test_tokenize_detokenize_with_the_checkpoint_tokenizer(real):
    """/tokenize gives the engine tokenizer's ids (BOS included); /detokenize turns them back into the
    prompt, special tokens spelled out."""
    server, _, _, ref = real
    text = ref["text_prompt"]
    res = httpx.post(server.base_url + "/tokenize", json={"model": "tiny", "prompt": text}, timeout=30).json()
    tokenizer = server.engine_loop.engine.tokenizer
    assert res["tokens"] == tokenizer.encode(text) and res["count"] == len(res["tokens"])
    assert res["max_model_len"] == 128
    back = httpx.post(server.base_url + "/detokenize", json={"tokens": res["tokens"]}, timeout=30).json()
    assert back == {"prompt": tokenizer.bos_token + text}


def test_bad_input_then_good_request(real):
    """On the real engine too, every bad request gets its 4xx with an OpenAI error body; serving goes on."""
    server, _, _, _ = real
    for name, path, body, status, param in BAD_REQUESTS:
        if name == "prompt too long":
            body = {**body, "prompt": "x" * 200}  # longer than max_model_len=128
        if name == "max_tokens past context":
            body = {**body, "max_tokens": 127}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server.base_url + path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, (name, r.text)
        assert r.json()["error"]["message"], name
        if param is not None and status == 400:  # the engine's own checks name the field too
            assert r.json()["error"]["param"].split(".")[0] == param.split(".")[0], (name, r.text)
        good = httpx.post(server.base_url + "/v1/completions",
                          json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 1, name
    assert_no_leaks(server)


def test_load_with_drops_real_engine(real):
    """200 concurrent greedy streams, every 5th dropped, with preemptions: tokens equal offline; no leaks."""
    server, prompts, expected, _ = real
    engine_before = dict(server.engine_loop.metrics_snapshot)
    before = finish_counts(server)
    results, seconds = asyncio.run(run_load(server.base_url, "tiny", prompts, MAX_TOKENS, DROP_EVERY,
                                            drop_max_tokens=100))
    counts = check_load_results(server, results, expected, before, MAX_TOKENS)
    assert_no_leaks(server)
    engine_after = server.engine_loop.metrics_snapshot
    aborted = engine_after["num_requests_aborted"] - engine_before["num_requests_aborted"]
    assert counts["abort"] == aborted == NUM_LOAD_REQUESTS // DROP_EVERY
    assert engine_after["num_preemptions"] > engine_before["num_preemptions"]  # recompute path exercised
    assert engine_after["num_ahead_steps"] > engine_before["num_ahead_steps"]  # async steps too
    exposition = httpx.get(server.base_url + "/metrics").text
    assert f"replayssm_num_preemptions_total {float(engine_after['num_preemptions'])}" in exposition
    assert f"replayssm_engine_ahead_steps_total {float(engine_after['num_ahead_steps'])}" in exposition
