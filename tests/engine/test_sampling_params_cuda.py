"""The logits processors on CUDA: a warm step that uses them still syncs once, and CUDA graphs, async
scheduling and speculative verify give the tokens of eager synchronous steps."""

import json
import warnings

import pytest
import torch
from conftest import TINY_HYBRID_BF16, requires_cuda

from replayssm.config import EngineConfig
from replayssm.engine.llm_engine import LLMEngine
from replayssm.sampling_params import SamplingParams

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5,
                   frequency_penalty=0.5, presence_penalty=0.3, logit_bias={7: 3.0}),
    SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, seed=3, min_p=0.05, top_k=40,
                   repetition_penalty=1.2, min_tokens=6),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
]


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(path), device="cuda", dtype="bfloat16", load_format="dummy",
                                              max_num_seqs=4, memory_budget=1 << 28, **kw))


def _run(engine: LLMEngine) -> list[list[int]]:
    for i, p in enumerate(PARAMS):
        engine.add_request(f"r{i}", [3 + (i * 5 + j) % 200 for j in range(5 + i)], p)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[f"r{i}"] for i in range(len(PARAMS))]


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_HYBRID_BF16))
    return tmp_path


@requires_cuda
@pytest.mark.parametrize("kw", [dict(cuda_graphs=True), dict(async_scheduling=True),
                                dict(num_speculative_tokens=3, speculative_method="ngram")])
def test_processed_tokens_do_not_depend_on_the_step_path(ckpt, kw):
    """Graph replays, steps launched ahead and ngram verify steps give eager synchronous steps' tokens."""
    want = _run(_engine(ckpt, cuda_graphs=False, async_scheduling=False))
    assert _run(_engine(ckpt, **{"cuda_graphs": False, "async_scheduling": False, **kw})) == want


@requires_cuda
def test_warm_processed_step_syncs_once(ckpt):
    """A warm decode step whose rows use penalties, logit_bias, min_tokens and min_p waits for the device
    once (reading the tokens back), with async scheduling and without."""
    for async_scheduling in (False, True):
        engine = _engine(ckpt, cuda_graphs=False, async_scheduling=async_scheduling)
        for i, p in enumerate(PARAMS):
            engine.add_request(f"r{i}", [3 + (i * 5 + j) % 200 for j in range(5 + i)], p)
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
        assert len(syncs) <= 1, syncs
