"""N-gram prompt lookup: propose the tokens that followed the latest earlier match of the suffix."""

from __future__ import annotations

from replayssm.engine.request import Request
from replayssm.speculative.proposer import Drafts, Proposer


def ngram_lookup(tokens: list[int], num_drafts: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Longest suffix n-gram (ngram_max down to ngram_min) that occurs earlier in `tokens`; return
    up to num_drafts tokens that followed its most recent earlier occurrence ([] when none).
    The plain scan, O(len) per n: the reference for NgramProposer's incremental index."""
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
    """Deterministic drafts (q = one-hot) from the request's own prompt + output.

    Same result as ngram_lookup, from a per-request index {n-gram: end of its latest occurrence}
    that grows with the tokens (they are only ever appended), so a step costs O(new tokens).
    """

    host_only = True

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._index: dict[str, tuple[list[int], int, dict[tuple[int, ...], int]]] = {}

    def _lookup(self, r: Request, num_drafts: int) -> list[int]:
        tokens, done, index = self._index.get(r.request_id, ([], 0, {}))
        tokens.extend(r.token_slice(len(tokens), r.num_tokens))
        # Index n-grams ending at e <= len - 1: an occurrence must end before the suffix does.
        for end in range(max(done, 1), len(tokens)):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                index[tuple(tokens[end - n:end])] = end
        self._index[r.request_id] = (tokens, max(done, len(tokens)), index)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            end = index.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return tokens[end:end + num_drafts]
        return []

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Drafts]:
        return [Drafts(self._lookup(r, n)) for r, n in zip(requests, num_drafts)]

    def release(self, request: Request) -> None:
        self._index.pop(request.request_id, None)
