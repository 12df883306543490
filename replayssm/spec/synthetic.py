"""Synthetic drafter, for benchmarks only: forces a configured mean acceptance length.

The accepted count per verify step is a seeded draw, not a comparison with the target, so the
tokens it emits are NOT the model's output: every RequestOutput carries ``synthetic_spec=True``
and get_metrics() reports ``spec_output_is_model_output = False``. It exists to time verify
steps at a realistic acceptance length (e.g. 3.1151 tokens per step with k = 3) without a
drafter that really achieves it.
"""

from __future__ import annotations

import random

from replayssm.engine.request import Request
from replayssm.spec.proposer import Drafts, Proposer


def acceptance_probability(mean_length: float, k: int) -> float:
    """Per-position acceptance probability a with 1 + a + a^2 + ... + a^k = mean_length
    (acceptance stops at the first rejection, so that is the mean tokens per step)."""
    if not 1.0 <= mean_length <= k + 1:
        raise ValueError(f"synthetic_acceptance_length must be in [1, {k + 1}], got {mean_length}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) < mean_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class SyntheticProposer(Proposer):
    """Arbitrary draft tokens with a forced, seeded number of accepted drafts."""

    produces_model_output = False

    def __init__(self, mean_length: float, k: int, vocab_size: int, seed: int = 0) -> None:
        self.k = k
        self.alpha = acceptance_probability(mean_length, k)
        self.vocab_size = vocab_size
        self.seed = seed

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Drafts]:
        out = []
        for r, n in zip(requests, num_drafts):
            # Keyed by (engine seed, request seed, position): independent of batch composition.
            rng = random.Random(hash((self.seed, r.seed, r.num_tokens)))
            tokens = [rng.randrange(self.vocab_size) for _ in range(n)]
            accepted = 0
            # Draws for all k positions, so truncating a step (near max_tokens) keeps the law.
            draws = [rng.random() for _ in range(self.k)]
            while accepted < n and draws[accepted] < self.alpha:
                accepted += 1
            out.append(Drafts(tokens, forced_accepted=accepted))
        return out
