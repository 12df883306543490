"""Speculative decoding above temperature 0: seeded, batch-independent, and accepting q = p drafts."""

from spec_helpers import generate, make_llm, one_thread, target  # noqa: F401 (autouse fixture)

from replayssm import SamplingParams

PARAMS = SamplingParams(temperature=0.8, top_k=50, max_tokens=16, ignore_eos=True, seed=1234)


def test_draft_equal_to_target_is_always_accepted_when_sampling():
    """Draft model = target: q = p, so every draft is accepted (min(1, p/q) = 1) at temperature 0.8."""
    llm = make_llm(num_speculative_tokens=3, speculative_method="draft", draft_model=target())
    generate(llm, PARAMS)
    m = llm.get_metrics()
    assert m["spec_draft_tokens"] > 0
    assert min(m["spec_acceptance_rate_per_position"]) > 0.95


def test_seeded_spec_sampling_is_reproducible_and_batch_independent():
    """A seeded request samples the same tokens alone or next to another request, ReplaySSM on or off."""
    p = [[9, 8, 7, 6, 5, 4]]
    other = [[100, 101, 102]]
    outs = []
    for replayssm in (True, False):
        llm = make_llm(
            num_speculative_tokens=3, speculative_method="mtp", replayssm=replayssm, replay_window=8
        )
        outs.append(generate(llm, PARAMS, p)[0])
        outs.append(generate(llm, PARAMS, other + p)[1])
    assert all(o == outs[0] for o in outs) and len(outs[0]) == 16
