"""Synthetic drafter, for benchmarks only: forces a configured mean acceptance length.

The accepted count per verify step is a seeded draw, not a comparison with the target, so the
tokens it emits are NOT the model's output: every RequestOutput carries ``synthetic_spec=True``
and get_metrics() reports ``spec_output_is_model_output = False``. It exists to time verify
steps at a realistic acceptance length (e.g. 3.1151 tokens per step with k = 3) without a
drafter that really achieves it.
"""

from __future__ import annotations

from replayssm.engine.request import Request
from replayssm.speculative.proposer import Drafts, Proposer


def acceptance_probability(mean_length: float, k: int) -> float:
    """Per-position acceptance probability a with 1 + a + a^2 + ... + a^k = mean_length
    (acceptance stops at the first rejection, so that is the mean tokens per step)."""
    assert 1.0 <= mean_length <= k + 1, (mean_length, k)  # SpecConfig checks the user's value
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) < mean_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's output function: a well-spread 64-bit hash of a 64-bit x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class SyntheticProposer(Proposer):
    """Arbitrary draft tokens with a forced, seeded number of accepted drafts."""

    host_only = True
    produces_model_output = False

    def __init__(self, mean_length: float, k: int, vocab_size: int, seed: int = 0) -> None:
        self.k = k
        self.alpha = acceptance_probability(mean_length, k)
        self.vocab_size = vocab_size
        self.seed = seed

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Drafts]:
        # Keyed by (engine seed, request seed, position): independent of batch composition. Draft
        # position j's token and acceptance draw are hashes of (key, j), so a step truncated near
        # max_tokens keeps the law. Hashing takes half the host time of seeding a random.Random per
        # request (1.1 against 2.1 ms per verify step at 256 rows, k = 3).
        head = _mix64(self.seed & _MASK)
        threshold = int(self.alpha * (1 << 53))  # draw < alpha  <=>  top 53 bits < alpha * 2^53
        out = []
        for r, n in zip(requests, num_drafts):
            key = _mix64(head ^ _mix64((r.seed & _MASK) ^ _mix64(r.num_tokens)))
            tokens = [_mix64(key + 2 * j) % self.vocab_size for j in range(n)]
            accepted = 0
            while accepted < n and (_mix64(key + 2 * accepted + 1) >> 11) < threshold:
                accepted += 1
            out.append(Drafts(tokens, forced_accepted=accepted))
        return out
