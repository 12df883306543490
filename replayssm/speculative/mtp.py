"""MTP drafter: the checkpoint's own multi-token-prediction head proposes the drafts.

Position bookkeeping for a request with c computed tokens and pending token x_c:

    observe (after every step): MTP runs over the positions i the step computed, with the
        target's h_i and the now-known x_{i+1}; its KV at those positions is final. The MTP
        output at the last position i = c - 1 predicts d_1 (= x_{c+1}); it is kept.
    propose: d_1 from the kept logits; d_j (j >= 2) from one MTP step at position c + j - 2
        fed with the previous MTP output and d_{j-1}. Those KV entries are speculative and are
        overwritten by the next observe (positions >= c), like the target's rejected drafts.

The model runs in an MTPHead (speculative/mtp_head.py): here for one rank, on every rank under
tensor parallelism (the runner's `attach` mirrors its calls). This class, on rank 0 only, keeps
the logits and draws the drafts.
"""

from __future__ import annotations

from typing import Any

import torch

from replayssm.engine.request import Request
from replayssm.speculative.mtp_head import MTPHead
from replayssm.speculative.proposer import Drafts, Proposer, draw_drafts


class MTPProposer(Proposer):
    """Drafts from the checkpoint's MTP head, fed with the target's hidden states (module docstring)."""

    def __init__(self, runner: Any, model_dir: str) -> None:
        attach = getattr(runner, "attach", None)  # TPModelRunner: one head per rank
        self.head = attach("mtp_head", "replayssm.speculative.mtp_head:MTPHead", model_dir) \
            if attach is not None else MTPHead(runner, model_dir)
        self._last: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (computed, d_1 logits)
        self._forget: list[str] = []  # finished requests, dropped by the head at the next observe

    def observe(self, requests: list[Request], starts: list[int], num_computed: list[int],
                row_index: list[int]) -> None:
        rows, keep = [], []
        for r, s, n, index in zip(requests, starts, num_computed, row_index):
            if n and r.num_tokens >= s + n + 1:
                rows.append((r.request_id, s, r.token_slice(s + 1, s + n + 1), list(r.block_table), index, n))
                keep.append(r)
        if not rows and not self._forget:
            return
        logits = self.head.observe(rows, self._forget)
        self._forget = []
        for i, r in enumerate(keep):
            self._last[r.request_id] = (r.num_computed_tokens, logits[i])

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Drafts]:
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests)
                if self._last.get(r.request_id, (-1,))[0] == r.num_computed_tokens]
        logits = {i: self._last[requests[i].request_id][1] for i in live}
        for j in range(max(num_drafts, default=0)):
            rows = [i for i in live if num_drafts[i] > j]
            if not rows:
                break
            if j:
                new_logits = self.head.draft([
                    (requests[i].request_id, requests[i].num_computed_tokens + j - 1, tokens[i][-1],
                     list(requests[i].block_table), j == 1) for i in rows])
                for n, i in enumerate(rows):
                    logits[i] = new_logits[n]
            reqs = [requests[i] for i in rows]
            drawn, p = draw_drafts(torch.stack([logits[i] for i in rows]), reqs,
                                   [r.num_tokens + j for r in reqs])
            for n, i in enumerate(rows):
                tokens[i].append(drawn[n])
                if p is not None:
                    probs[i].append(p[n])
        # A greedy request may miss probs at some positions (all-greedy batches skip them); greedy
        # acceptance never reads q, so those drafts are passed as deterministic.
        return [Drafts(t, torch.stack(p) if p and len(p) == len(t) else None) for t, p in zip(tokens, probs)]

    def release(self, request: Request) -> None:
        if self._last.pop(request.request_id, None) is not None:
            self._forget.append(request.request_id)
