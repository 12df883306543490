"""MTPHead: the MTP model, its KV cache and its latest outputs on one tensor-parallel rank.

Under tensor parallelism every rank holds one (TPModelRunner.attach builds it on each rank and
mirrors each call with the same arguments), so the collectives inside the MTP blocks pair up.
The calls take plain, picklable rows; the target's hidden states come from the rank's own
runner (`row_hidden` of the last execute, identical on every rank after each block's
all-reduce). Every rank gets the full logits from the LM head's all-gather; rank 0 uses them.

    observe(rows, forget)  rows: (request id, start, next tokens, block table, row index, n)
                           -> logits (b, V) fp32 at each row's last position; keeps that MTP
                           output per request (`observed`); forget: finished request ids
    draft(rows)            rows: (request id, position, token, block table, first)
                           -> logits (b, V); the input hidden state is the observed output
                           (first) or the previous draft step's (`drafted`)
"""

from __future__ import annotations

from typing import Any

import torch

from replayssm.cache.mamba_cache import KVCache
from replayssm.engine.batch_inputs import RowView, build_inputs
from replayssm.engine.context import ForwardContext
from replayssm.models.layers.vocab import parallel_logits
from replayssm.speculative.mtp_model import load_mtp, mtp_config


class MTPHead:
    """One rank's MTP head (module docstring); built from the rank's ModelRunner."""

    def __init__(self, runner: Any, model_dir: str) -> None:
        self.runner = runner
        self.target = runner.model
        self.tp = runner.tp
        self.device, self.block_size = runner.device, runner.kv_block_size
        self.mtp = load_mtp(runner.model_config, model_dir, device=runner.device, dtype=runner.dtype,
                            tp=self.tp)
        # The MTP attention KV uses the target's block ids: same count and size as its cache, this
        # rank's heads only.
        self.kv = KVCache(mtp_config(runner.shard_config), num_blocks=runner.num_kv_blocks,
                          block_size=runner.kv_block_size, dtype=runner.kv_dtype, device=runner.device)
        self.observed: dict[str, torch.Tensor] = {}
        self.drafted: dict[str, torch.Tensor] = {}

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
        head = self.target.embeddings.weight if lm is None else lm
        return out, parallel_logits(out, head, self.runner.model_config.vocab_size, self.tp)

    def observe(self, rows: list[tuple[str, int, list[int], list[int], int, int]],
                forget: list[str]) -> torch.Tensor | None:
        for request_id in forget:
            self.observed.pop(request_id, None)
            self.drafted.pop(request_id, None)
        if not rows:
            return None
        norm_f = self.target.norm_f
        out, logits = self._forward([(start, toks, norm_f(self.runner.row_hidden(index, n)), table)
                                     for _, start, toks, table, index, n in rows])
        for (request_id, *_), o in zip(rows, out):
            self.observed[request_id] = o
        return logits

    def draft(self, rows: list[tuple[str, int, int, list[int], bool]]) -> torch.Tensor:
        source = [self.observed if first else self.drafted for *_, first in rows]
        out, logits = self._forward([(pos, [tok], src[rid][None], table)
                                     for (rid, pos, tok, table, _), src in zip(rows, source)])
        for (request_id, *_), o in zip(rows, out):
            self.drafted[request_id] = o
        return logits
