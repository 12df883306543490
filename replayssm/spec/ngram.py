"""N-gram prompt lookup: propose the tokens that followed the latest earlier match of the suffix."""

from __future__ import annotations

from replayssm.engine.request import Request
from replayssm.spec.proposer import Drafts, Proposer


def ngram_lookup(tokens: list[int], num_drafts: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Longest suffix n-gram (ngram_max down to ngram_min) that occurs earlier in `tokens`; return
    up to num_drafts tokens that followed its most recent earlier occurrence ([] when none)."""
    n_tokens = len(tokens)
    for n in range(min(ngram_max, n_tokens - 1), ngram_min - 1, -1):
        suffix = tokens[n_tokens - n:]
        # Latest occurrence first: recent context predicts best; it must end before the suffix.
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + num_drafts]
                if follow:
                    return follow
    return []


class NgramProposer(Proposer):
    """Deterministic drafts (q = one-hot) from the request's own prompt + output."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Drafts]:
        out = []
        for r, n in zip(requests, num_drafts):
            tokens = r.prompt_token_ids + r.output_token_ids
            out.append(Drafts(ngram_lookup(tokens, n, self.ngram_min, self.ngram_max)))
        return out
