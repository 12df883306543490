"""Forced acceptance patterns: a drafter that proposes the true greedy continuation with chosen
positions corrupted, so each verify step accepts exactly the number of drafts the pattern says."""

import random
from collections import Counter

import pytest
from spec_helpers import generate, make_llm, one_thread, plain_greedy, prompts  # noqa: F401 (autouse fixture)

from replayssm.speculative.proposer import Drafts, Proposer


class ForcedDrafter(Proposer):
    """Drafts = reference continuation, first `pattern(step, n)` correct, the next one corrupted.

    Records ReplaySSM ring events from the runner's exact cursor mirror: a verify step flushes
    iff committed + q > W; "straddle" = its accepted tokens cross the window (h < W < h + a).
    """

    def __init__(self, llm, pattern, window: int):
        self.runner = llm.engine.runner
        self.replayssm = llm.engine.config.replayssm
        self.reference = {tuple(p): list(t) for p, t in zip(prompts(), plain_greedy())}
        self.pattern, self.window = pattern, window
        self.steps: Counter = Counter()
        self.pending: dict[str, tuple[int, bool, int]] = {}
        self.flushed_last: dict[str, bool] = {}
        self.events: Counter = Counter()
        self.drafts_past_end = 0
        self.drafts_in_range = 0  # draft tokens at positions the reference covers

    def propose(self, requests, num_drafts):
        out = []
        for r, n in zip(requests, num_drafts):
            done = len(r.output_token_ids)
            reference = self.reference[tuple(r.prompt_token_ids)]
            # Drafts may run past max_tokens (the step keeps one q per row): pad the reference.
            true = (reference + [0] * n)[done : done + n]
            self.drafts_past_end += done + n > len(reference)
            self.drafts_in_range += min(n, len(reference) - done)
            m = min(self.pattern(r.request_id, self.steps[r.request_id], n), n)
            self.steps[r.request_id] += 1
            drafts = true[:m] + ([(true[m] + 1) % 256] + true[m + 1 :] if m < n else [])
            h = self.runner.cursors(r.slots[0])[1] if self.replayssm else 0
            self.pending[r.request_id] = (min(m + 1, len(reference) - done), h + 1 + n > self.window, h)
            out.append(Drafts(drafts))
        return out

    def observe(self, requests, starts, num_computed, row_index):
        for r, n in zip(requests, num_computed):
            if r.request_id not in self.pending:
                continue
            kept, flush, h = self.pending.pop(r.request_id)
            # Exactly the forced drafts were accepted, plus one token, up to max_tokens.
            assert n == kept, (n, kept)
            m = kept - 1
            if self.flushed_last.get(r.request_id) and m == 0:
                self.events["reject_after_flush"] += 1
            if h < self.window < h + m + 1:
                self.events["straddle"] += 1
            self.events["flush"] += flush
            self.flushed_last[r.request_id] = flush


def _random(rid, step, n):
    return random.Random(f"{rid}-{step}").randint(0, n)


PATTERNS = {
    "all_rejected": lambda rid, step, n: 0,
    "all_accepted": lambda rid, step, n: n,
    "alternating": lambda rid, step, n: n if step % 2 == 0 else 0,
    "random": _random,
}


@pytest.mark.parametrize("replayssm,k,window", [(True, 3, 4), (True, 5, 7), (False, 3, 2)])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_forced_pattern_equals_plain(pattern, replayssm, k, window):
    """Any acceptance pattern gives the plain greedy output; ReplaySSM runs flush right before a
    full rejection and accept tokens straddling the window (seen on the cursor mirror)."""
    llm = make_llm(replayssm=replayssm, replay_window=window, num_speculative_tokens=k)
    drafter = ForcedDrafter(llm, PATTERNS[pattern], window)
    llm.engine.spec.proposer = drafter
    assert [tuple(t) for t in generate(llm)] == list(plain_greedy())
    m = llm.get_metrics()
    assert m["spec_verify_steps"] == sum(drafter.steps.values()) > 0
    if replayssm and pattern in ("random", "all_rejected"):
        assert drafter.events["flush"] > 0 and drafter.events["reject_after_flush"] > 0
    if replayssm and pattern == "random":
        assert drafter.events["straddle"] > 0
    if pattern == "all_accepted":
        # Every draft the reference covers is accepted; the padding past max_tokens may not be.
        assert drafter.drafts_in_range <= m["spec_accepted_tokens"] <= m["spec_draft_tokens"]
    if pattern in ("all_rejected", "random"):
        # Rows near max_tokens still drafted k tokens (past their end, dropped at output).
        assert drafter.drafts_past_end > 0
    if pattern == "all_rejected":
        assert m["spec_accepted_tokens"] == 0 and m["spec_mean_acceptance_length"] == 1.0
