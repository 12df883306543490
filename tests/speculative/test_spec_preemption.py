"""Speculative decoding under memory pressure: preempted requests recompute and keep their tokens."""

import functools

import pytest
import torch
from spec_helpers import generate, make_llm, one_thread, target  # noqa: F401 (autouse fixture)

from replayssm import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 14, 26, 9, 22, 16)]


@functools.cache
def _reference():
    return generate(make_llm(kv_block_size=4), PARAMS, _prompts())


@pytest.mark.parametrize("replayssm", [True, False])
@pytest.mark.parametrize("method", ["ngram", "mtp", "draft"])
def test_preemptions_keep_spec_output_equal_to_plain(method, replayssm):
    """24 KV blocks of 4, 3 running of 6 requests of ~45 tokens: preemptions happen (drafters restart
    recomputed requests), tokens stay the plain ones."""
    ref = _reference()
    kw = {"draft_model": target()} if method == "draft" else {}
    llm = make_llm(
        kv_block_size=4,
        num_kv_blocks=24,
        max_num_seqs=3,
        replayssm=replayssm,
        replay_window=8,
        num_speculative_tokens=3,
        speculative_method=method,
        **kw,
    )
    assert generate(llm, PARAMS, _prompts()) == ref
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["spec_verify_steps"] > 0
    llm.engine.scheduler.check_integrity()
