"""Per-token outputs of speculative steps: logprobs and stops inside an accepted run of drafts."""

import torch
from spec_helpers import make_llm, one_thread, plain_greedy, prompts, target  # noqa: F401 (autouse fixture)

from replayssm import SamplingParams

SPEC = dict(num_speculative_tokens=3, speculative_method="draft")


def test_logprobs_of_spec_tokens_match_plain():
    """Each emitted token of a verify step carries the target's logprob and its position's most
    likely tokens, as in plain decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    plain = make_llm().generate(prompts(), params, use_tqdm=False)
    spec = make_llm(draft_model=target(), **SPEC).generate(prompts(), params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and len(b.logprobs) == 12
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-4, atol=1e-4)
        assert len(b.top_logprobs) == 12 and all(len(top) == 3 for top in b.top_logprobs)
        got, want = torch.tensor(b.top_logprobs), torch.tensor(a.top_logprobs)  # (12, 3, [id, logprob])
        assert torch.equal(got[..., 0], want[..., 0])
        torch.testing.assert_close(got[..., 1], want[..., 1], rtol=1e-4, atol=1e-4)


def test_stop_token_inside_accepted_drafts_truncates_like_plain():
    """A stop token accepted mid-step ends the request there: later accepted tokens are dropped."""
    ref = list(plain_greedy()[0])
    stop = ref[6]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])
    llm = make_llm(draft_model=target(), **SPEC)
    out = llm.generate(prompts()[:1], params, use_tqdm=False)[0]
    assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    llm.engine.scheduler.check_integrity()
    assert llm.get_metrics()["num_running"] == 0
