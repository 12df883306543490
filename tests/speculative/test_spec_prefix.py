"""Speculative decoding with prefix caching: verify rows publish checkpoints that later turns hit."""

import pytest
import torch
from spec_helpers import make_llm, one_thread, plain_greedy, target  # noqa: F401 (autouse fixture)

from replayssm import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)


@pytest.mark.parametrize("replayssm", [True, False])
@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_multi_turn_chat_with_spec_hits_and_matches_plain(method, replayssm):
    """Each turn extends the last prompt + output: with k = 3 drafts (accepted ones crossing block
    boundaries) the turns hit checkpoints published by verify rows and give the plain tokens."""
    kw = dict(kv_block_size=4, replay_window=4, replayssm=replayssm)
    ref = make_llm(**kw)
    spec = dict(num_speculative_tokens=3, speculative_method=method)
    if method == "draft":
        spec["draft_model"] = target()
    llm = make_llm(enable_prefix_caching=True, **spec, **kw)
    prompt = torch.randint(3, 256, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    computed = prev_prompt = 0
    for turn in range(3):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == ref.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
        if turn:
            # All the last turn computed, to a block boundary that its verify rows crossed.
            assert out.num_cached_tokens == computed // 4 * 4 > prev_prompt // 4 * 4
        computed, prev_prompt = len(prompt) + len(out.token_ids) - 1, len(prompt)
        prompt = prompt + out.token_ids + [7, 8, 9]
    m = llm.get_metrics()
    assert m["spec_verify_steps"] > 0 and m["prefix_checkpoints_published"] > 0
    llm.engine.scheduler.check_integrity()
