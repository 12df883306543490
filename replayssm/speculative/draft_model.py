"""Draft-model drafter: a separate small checkpoint (same vocabulary) proposes the drafts.

The draft model runs in its own ModelRunner (ReplaySSM on, its own Mamba slots and KV cache;
the KV cache reuses the target's block ids, so the request's block table addresses both).
Per request it keeps one real slot, exact at `done` tokens (never past the target's tokens):

    propose: 1. catch up: run tokens [done, c + 1) (the newly accepted ones and the pending
                x_c) on the real slot, committing all of them; its last logits give d_1.
             2. copy the real slot to a per-row scratch slot and run d_1 .. d_{k'-1} there one
                at a time (committed on the scratch only) for d_2 .. d_{k'}.
    The real slot therefore never holds a draft that the target may reject; the scratch is
    discarded. KV written at rejected positions is overwritten by the next catch-up.

Its caches are allocated on top of the planned budget (the planner sizes the target only).
"""

from __future__ import annotations

from typing import Any

import torch

from replayssm.engine.model_runner import ModelRunner, ScheduledRow
from replayssm.engine.request import Request, RequestStatus
from replayssm.speculative.proposer import Drafts, Proposer, draw_drafts


class DraftModelProposer(Proposer):
    """Drafts from a small checkpoint run in its own ModelRunner (see the module docstring)."""

    def __init__(self, draft_dir: str, target: Any, k: int, *, replay_window: int, seed: int = 0) -> None:
        self.max_num_seqs = target.max_num_seqs
        self.budget = target.max_num_batched_tokens + self.max_num_seqs * (k + 1)
        self.runner = ModelRunner(
            draft_dir, device=target.device, dtype=target.dtype, replayssm=True, replay_window=replay_window,
            num_speculative_tokens=k, num_kv_blocks=target.num_kv_blocks, kv_block_size=target.kv_block_size,
            num_slots=2 * self.max_num_seqs, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.budget, seed=seed,
        )
        if self.runner.model_config.vocab_size != target.model_config.vocab_size:
            raise ValueError(f"draft_model vocab_size {self.runner.model_config.vocab_size} differs from the "
                             f"target's {target.model_config.vocab_size}")
        self.q_max = 1 + k
        self._free = list(range(self.max_num_seqs))
        # request_id -> (request, slot, preemptions seen, tokens the slot is exact at)
        self._state: dict[str, tuple[Request, int, int, int]] = {}

    def _slot(self, r: Request) -> tuple[int, int]:
        """The request's real slot and how many of its tokens it holds (0 after a preemption)."""
        _, slot, preempted, done = self._state.get(r.request_id, (r, None, -1, 0))
        if slot is None:
            if not self._free:
                # Preempted requests (waiting again) give their slot back; they start over.
                rid = next(k for k, v in self._state.items() if v[0].status is RequestStatus.WAITING)
                self._free.append(self._state.pop(rid)[1])
            slot = self._free.pop()
        if preempted != r.num_preemptions or done > r.num_computed_tokens + 1:
            done = 0  # its KV blocks were freed and re-allocated: start over
        return slot, done

    def _catch_up(self, requests: list[Request]) -> torch.Tensor:
        """Run every request's uncommitted tokens through [0, c + 1); logits (b, V) of token c."""
        todo = []
        for r in requests:
            slot, done = self._slot(r)
            todo.append([slot, done, r.num_computed_tokens + 1])
        last = [None] * len(requests)
        while any(done < end for _, done, end in todo):
            rows, which, used = [], [], 0
            for i, (slot, done, end) in enumerate(todo):
                n = min(end - done, self.budget - used)
                if done >= end or n <= 0:
                    continue
                r = requests[i]
                prefill = done == 0 or n > self.q_max
                rows.append(ScheduledRow(r.token_slice(done, done + n), done, list(r.block_table), slot,
                                         is_prefill=prefill, num_logits=1))
                which.append(i)
                used += n
            logits = self.runner.execute(rows)
            self.runner.commit(rows, [len(row.token_ids) for row in rows])
            for n, (i, row) in enumerate(zip(which, rows)):
                todo[i][1] += len(row.token_ids)
                last[i] = logits[n]
        for r, (slot, done, _) in zip(requests, todo):
            self._state[r.request_id] = (r, slot, r.num_preemptions, done)
        return torch.stack(last)

    @torch.no_grad()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Drafts]:
        logits = self._catch_up(requests)
        tokens, p = draw_drafts(logits, requests, [r.num_tokens for r in requests])
        drafts = [[t] for t in tokens]
        probs = [[p[i]] if p is not None else [] for i in range(len(requests))]
        more = [i for i, n in enumerate(num_drafts) if n > 1]
        if more:
            scratch = {i: self.max_num_seqs + n for n, i in enumerate(more)}
            self.runner.copy_slots([self._state[requests[i].request_id][1] for i in more],
                                   [scratch[i] for i in more])
            for j in range(1, max(num_drafts)):
                rows_i = [i for i in more if num_drafts[i] > j]
                rows = [ScheduledRow([drafts[i][-1]], requests[i].num_computed_tokens + j,
                                     list(requests[i].block_table), scratch[i], is_prefill=False)
                        for i in rows_i]
                logits = self.runner.execute(rows)
                self.runner.commit(rows, [1] * len(rows))
                reqs = [requests[i] for i in rows_i]
                tokens, p = draw_drafts(logits, reqs, [r.num_tokens + j for r in reqs])
                for n, i in enumerate(rows_i):
                    drafts[i].append(tokens[n])
                    if p is not None:
                        probs[i].append(p[n])
        return [Drafts(d, torch.stack(q) if q and len(q) == len(d) else None) for d, q in zip(drafts, probs)]

    def release(self, request: Request) -> None:
        state = self._state.pop(request.request_id, None)
        if state is not None:
            self._free.append(state[1])
