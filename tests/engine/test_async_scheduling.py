"""Async scheduling (LLMEngine.step launches the next decode step before reading tokens back): the
same tokens, logprobs, texts and finish reasons as synchronous steps, through stops, aborts, prefix
hits and sampling; the pools stay consistent while a step is in flight."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_HYBRID_BF16, requires_cuda
from engine_drive import drive

sys.path.insert(0, str(Path(__file__).parents[1] / "prefix"))
from prefix_helpers import one_thread, small_checkpoint  # noqa: E402, F401 (autouse fixture)

from replayssm import LLM, SamplingParams  # noqa: E402
from replayssm.cli import build_parser  # noqa: E402
from replayssm.config import EngineConfig  # noqa: E402
from replayssm.engine.model_runner import ScheduledRow  # noqa: E402

BASE = dict(device="cpu", kv_block_size=4, replay_window=4, max_model_len=64, max_num_seqs=8)


def prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 240 + 3 for j in range(3 + (i * 7) % 9)] for i in range(n)]


def same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for rid in a:
        x, y = a[rid], b[rid]
        assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason), rid
        if x.logprobs is not None:
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5), rid
        assert (x.top_logprobs is None) == (y.top_logprobs is None), rid
        if x.top_logprobs is not None:
            ids = [[[i for i, _ in t] for t in z.top_logprobs] for z in (x, y)]
            assert ids[0] == ids[1], rid
            assert [v for t in x.top_logprobs for _, v in t] == pytest.approx(
                [v for t in y.top_logprobs for _, v in t], abs=1e-5), rid


def workload(stop_at: dict[int, int]) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded random rows, logprobs on some, stop tokens that end some rows early."""
    reqs = []
    for i, p in enumerate(prompts(7)):
        kw = dict(max_tokens=4 + 3 * i, ignore_eos=True, seed=100 + i)
        if i % 2:
            kw.update(temperature=0.8, top_p=0.9)
        if i % 3 == 0:
            kw.update(logprobs=i % 2 + 1)  # the chosen token's logprob and 1 or 2 alternatives
        if i in stop_at:
            kw.update(stop_token_ids=[stop_at[i]])
        reqs.append((p, SamplingParams(**kw)))
    return reqs


@pytest.mark.parametrize("replayssm", [True, False])
def test_async_equals_sync_with_stops(replayssm):
    """Stop tokens mid-run (rows dropped from the step launched ahead), max_tokens, seeded sampling and
    logprobs: async outputs equal synchronous ones, and steps did run ahead."""
    ckpt = small_checkpoint()
    plain = drive(LLM(ckpt, replayssm=replayssm, async_scheduling=False, **BASE), workload({}))
    # Stop three requests at a token they emit in the middle of their run.
    stop_at = {i: plain[str(i)].token_ids[2 + i % 3] for i in (1, 2, 4)}
    reqs = workload(stop_at)
    sync = drive(LLM(ckpt, replayssm=replayssm, async_scheduling=False, **BASE), reqs)
    llm = LLM(ckpt, replayssm=replayssm, async_scheduling=True, **BASE)
    assert llm.engine.async_scheduling
    same(drive(llm, reqs), sync)
    assert all(sync[str(i)].finish_reason == "stop" for i in stop_at)
    m = llm.get_metrics()
    assert m["num_ahead_steps"] > 10 and m["num_ahead_rows_dropped"] >= len(stop_at)
    assert m["generation_tokens"] == sum(len(o.token_ids) for o in sync.values())


def test_async_with_aborts_arrivals_and_prefix_hits():
    """Requests arriving mid-run (prefix hits on earlier prompts), aborts while a step is in flight:
    every request not aborted equals a synchronous run, aborted ones hold a prefix of it."""
    ckpt = small_checkpoint()
    base = prompts(3)
    reqs = [(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in base]
    # A second turn of each conversation: its first prompt, then more tokens.
    turn = SamplingParams(max_tokens=10, ignore_eos=True)
    reqs += [(p + [7, 8, 9, 10, 11, 12, 13, 14], turn) for p in base]
    arrivals = {0: [0, 1, 2], 6: [3], 9: [4, 5]}
    kw = dict(enable_prefix_caching=True, prefix_checkpoint_interval=4, **BASE)
    sync = drive(LLM(ckpt, async_scheduling=False, **kw), reqs, arrivals=arrivals)
    llm = LLM(ckpt, async_scheduling=True, **kw)
    got = drive(llm, reqs, aborts={8: ["1"], 12: ["5"]}, arrivals=arrivals)
    for rid in ("1", "5"):
        assert got[rid].finish_reason == "abort"
        assert got[rid].token_ids == sync[rid].token_ids[: len(got[rid].token_ids)]
    same({k: v for k, v in got.items() if k not in ("1", "5")},
         {k: v for k, v in sync.items() if k not in ("1", "5")})
    m = llm.get_metrics()
    assert m["num_ahead_steps"] > 5 and m["prefix_cache_hit_tokens"] > 0


def test_async_runs_ahead_while_requests_wait_for_a_seat():
    """A full engine (max_num_seqs running, more waiting) keeps launching ahead; a waiting request is
    admitted once a seat frees, and every output equals a synchronous run."""
    ckpt = small_checkpoint()
    reqs = [(p, SamplingParams(max_tokens=6 + 4 * (i % 3), ignore_eos=True, seed=i, temperature=0.5))
            for i, p in enumerate(prompts(6))]
    kw = dict(BASE, max_num_seqs=2)
    sync = drive(LLM(ckpt, async_scheduling=False, **kw), reqs)
    engine = LLM(ckpt, async_scheduling=True, **kw).engine
    for i, r in enumerate(reqs):
        engine.add_request(str(i), *r)
    got, ahead_while_waiting = {}, 0
    while engine.has_unfinished_requests():
        waiting, before = len(engine.scheduler.waiting), engine.metrics.num_ahead_steps
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out
        engine.check_integrity()
        ahead_while_waiting += waiting > 0 and engine.metrics.num_ahead_steps > before
    same(got, sync)
    assert ahead_while_waiting > 5


def test_async_default_and_when_it_is_off():
    """Auto is off on CPU (nothing to overlap), on when asked; speculative decoding turns it off;
    the config rejects a non-bool; the CLI flag leaves None (auto) unless given."""
    ckpt = small_checkpoint()
    assert not LLM(ckpt, **BASE).engine.async_scheduling
    assert LLM(ckpt, async_scheduling=True, **BASE).engine.async_scheduling
    spec = LLM(ckpt, async_scheduling=True, num_speculative_tokens=2, speculative_method="ngram", **BASE)
    assert not spec.engine.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model="x", async_scheduling=1)
    parser = build_parser()
    for flag, value in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        args = parser.parse_args(["generate", "--model", "demo", "--prompt", "hi", *flag])
        assert args.async_scheduling is value


def test_feed_needs_one_token_decode_rows():
    """ModelRunner.execute(feed=...) refuses rows it cannot feed (a prefill row, a wrong index count)."""
    llm = LLM(small_checkpoint(), **BASE)
    runner = llm.engine.runner
    tokens = torch.tensor([5, 6])
    with pytest.raises(ValueError, match="feed"):
        runner.execute([ScheduledRow([3, 4, 5], 0, [0], 0, True)], feed=(tokens, [0]))
    runner.execute([ScheduledRow([3, 4, 5], 0, [0], 0, True)])
    runner.commit([ScheduledRow([3, 4, 5], 0, [0], 0, True)], [1])
    with pytest.raises(ValueError, match="feed"):
        runner.execute([ScheduledRow([0], 3, [0], 0, False)], feed=(tokens, [0, 1]))


def test_fed_token_is_the_sampled_one():
    """A decode row fed on the device computes what the same row with the token on the host does."""
    llm = LLM(small_checkpoint(), **BASE)
    runner = llm.engine.runner
    prefill = [ScheduledRow([3, 4, 5], 0, [0], 0, True), ScheduledRow([9, 8], 0, [1], 1, True)]
    runner.execute(prefill)
    runner.commit(prefill, [1, 1])
    host = runner.execute([ScheduledRow([17], 3, [0], 0, False), ScheduledRow([42], 2, [1], 1, False)])
    runner.commit([ScheduledRow([17], 3, [0], 0, False), ScheduledRow([42], 2, [1], 1, False)], [1, 1])
    rows = [ScheduledRow([0], 3, [2], 2, False), ScheduledRow([0], 2, [3], 3, False)]
    # The same prompts again on slots 2, 3 and blocks of their own.
    runner.execute([ScheduledRow([3, 4, 5], 0, [2], 2, True), ScheduledRow([9, 8], 0, [3], 3, True)])
    runner.commit([ScheduledRow([3, 4, 5], 0, [2], 2, True), ScheduledRow([9, 8], 0, [3], 3, True)], [1, 1])
    fed = runner.execute(rows, feed=(torch.tensor([42, 99, 17]), [2, 0]))
    runner.commit(rows, [1, 1])
    torch.testing.assert_close(fed, host, rtol=0, atol=0)


@requires_cuda
def test_async_equals_sync_cuda_graphs(tmp_path):
    """On CUDA with graph replay (the configuration async scheduling is for): same tokens as
    synchronous steps, steps ran ahead, and the auto default turned it on."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_HYBRID_BF16))
    kw = dict(device="cuda", load_format="dummy", cuda_graphs=True, kv_block_size=4, replay_window=4,
              max_model_len=96, max_num_seqs=8)
    plain = drive(LLM(str(tmp_path), async_scheduling=False, **kw), workload({}))
    stop_at = {i: plain[str(i)].token_ids[2 + i % 3] for i in (1, 2, 4)}
    reqs = workload(stop_at)
    sync = drive(LLM(str(tmp_path), async_scheduling=False, **kw), reqs)
    llm = LLM(str(tmp_path), **kw)
    assert llm.engine.async_scheduling
    same(drive(llm, reqs), sync)
    m = llm.get_metrics()
    assert m["num_ahead_steps"] > 10 and m["num_ahead_rows_dropped"] >= len(stop_at)
    assert llm.engine.runner.graphs.num_replays > 0
