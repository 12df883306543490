"""Greedy speculative decoding equals plain greedy decoding, for every drafter, ReplaySSM on and off."""

import pytest
from spec_helpers import generate, make_llm, one_thread, plain_greedy, target  # noqa: F401 (autouse fixture)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("replayssm", [True, False])
@pytest.mark.parametrize("method", ["ngram", "mtp", "draft"])
def test_greedy_spec_equals_plain(method, replayssm, k):
    """Every drafter, k in {1, 3, 5}, ReplaySSM on/off (window 8): same tokens as plain greedy."""
    kw = {"draft_model": target()} if method == "draft" else {}
    llm = make_llm(
        replayssm=replayssm, replay_window=8, num_speculative_tokens=k, speculative_method=method, **kw
    )
    out = generate(llm)
    assert [tuple(t) for t in out] == list(plain_greedy())
    m = llm.get_metrics()
    assert m["spec_verify_steps"] > 0 and m["spec_draft_tokens"] > 0
    assert m["spec_output_is_model_output"] is True
    assert m["slots_per_request"] == (1 if replayssm else 1 + k)
    if method == "draft":
        # The draft model is the target itself: every draft is the target's argmax.
        assert m["spec_accepted_tokens"] == m["spec_draft_tokens"]
        assert m["spec_acceptance_rate_per_position"] == [1.0] * k
    llm.engine.scheduler.check_integrity()
