"""MTP drafter: the checkpoint's own multi-token-prediction head proposes the drafts.

Position bookkeeping for a request with c computed tokens and pending token x_c:

    observe (after every step): MTP runs over the positions i the step computed, with the
        target's h_i and the now-known x_{i+1}; its KV at those positions is final. The MTP
        output at the last position i = c - 1 predicts d_1 (= x_{c+1}); it is kept.
    propose: d_1 from the kept logits; d_j (j >= 2) from one MTP step at position c + j - 2
        fed with the previous MTP output and d_{j-1}. Those KV entries are speculative and are
        overwritten by the next observe (positions >= c), like the target's rejected drafts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from replayssm.cache.mamba_cache import KVCache
from replayssm.engine.batch_inputs import RowView, build_inputs
from replayssm.engine.context import ForwardContext
from replayssm.engine.request import Request
from replayssm.speculative.mtp_model import load_mtp
from replayssm.speculative.proposer import Drafts, Proposer, draw_drafts


class MTPProposer(Proposer):
    """Drafts from the checkpoint's MTP head, fed with the target's hidden states (module docstring)."""

    needs_hidden = True  # the engine passes each row's target hidden states to observe()

    def __init__(self, runner: Any, model_dir: str) -> None:
        cfg = runner.model_config
        self.target = runner.model
        self.device, self.block_size = runner.device, runner.kv_block_size
        self.mtp = load_mtp(cfg, model_dir, device=runner.device, dtype=runner.dtype)
        # The MTP attention KV uses the target's block ids: same count and size as its cache.
        self.kv = KVCache(dataclasses.replace(cfg, layer_types=cfg.mtp_layer_types),
                          num_blocks=runner.num_kv_blocks, block_size=runner.kv_block_size,
                          dtype=runner.dtype, device=runner.device)
        self._last: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def _forward(self, rows: list[tuple[int, list[int], torch.Tensor, list[int]]]):
        """rows: (start position, next tokens, normed hidden (n, hidden), block table). Returns
        the MTP output and logits at each row's last position: (b, hidden), (b, V) fp32."""
        views = [RowView(i, toks, start, table, 0, 1, None, False, False)
                 for i, (start, toks, _, table) in enumerate(rows)]
        batch = build_inputs(views, block_size=self.block_size, device=self.device, baseline=False)
        ctx = ForwardContext(attn=batch.attn, mamba=batch.mamba, kv_cache=self.kv, mamba_cache=None,
                             replayssm=True, window=1, rand_seed=0, positions=batch.positions)
        hidden = torch.cat([h for _, _, h, _ in rows])
        out = self.mtp(self.target.embeddings(batch.input_ids), hidden, ctx)[batch.logit_index]
        lm = self.target.lm_head
        weight = self.target.embeddings.weight if lm is None else lm.weight
        return out, torch.nn.functional.linear(out.to(weight.dtype), weight).float()

    def observe(self, requests: list[Request], starts: list[int], num_computed: list[int],
                row_hidden: list[torch.Tensor] | None) -> None:
        assert row_hidden is not None
        rows, keep = [], []
        for r, s, n, h in zip(requests, starts, num_computed, row_hidden):
            if n and r.num_tokens >= s + n + 1:
                rows.append((s, r.token_slice(s + 1, s + n + 1), self.target.norm_f(h), r.block_table))
                keep.append(r)
        if not rows:
            return
        out, logits = self._forward(rows)
        for i, r in enumerate(keep):
            self._last[r.request_id] = (r.num_computed_tokens, out[i], logits[i])

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Drafts]:
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests)
                if self._last.get(r.request_id, (-1,))[0] == r.num_computed_tokens]
        hidden = {i: self._last[requests[i].request_id][1] for i in live}
        logits = {i: self._last[requests[i].request_id][2] for i in live}
        for j in range(max(num_drafts, default=0)):
            rows = [i for i in live if num_drafts[i] > j]
            if not rows:
                break
            if j:
                c = [requests[i].num_computed_tokens for i in rows]
                out, new_logits = self._forward([(c_i + j - 1, [tokens[i][-1]], hidden[i][None],
                                                  requests[i].block_table) for i, c_i in zip(rows, c)])
                for n, i in enumerate(rows):
                    hidden[i], logits[i] = out[n], new_logits[n]
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
        self._last.pop(request.request_id, None)
