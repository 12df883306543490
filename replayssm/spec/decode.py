"""SpecDecoder: the engine's speculative-decoding step logic (propose -> verify -> observe).

Per engine step, for every decode request the scheduler gave lookahead room:

    propose   drafter -> Drafts (k' <= k tokens); the engine's row becomes [last] + drafts,
              num_logits = 1 + k' (baseline: spec_slots = the request's first 1 + k' slots)
    execute   one forward over the 1 + k' tokens of each row (ReplaySSM: cursor commit later,
              baseline: one state per position)
    verify    rejection_sample -> a = accepted drafts + 1 tokens per row (this file)
    commit    runner.commit(rows, a): ReplaySSM moves the cursor, the baseline keeps the state
              of spec slot a - 1; conv windows end at the last accepted token. Attention KV of
              rejected drafts is simply left behind: the request computed only c + a tokens,
              so later steps overwrite those positions.
    observe   model drafters (MTP) consume the target's hidden states of the accepted tokens
"""

from __future__ import annotations

from typing import Any

import torch

from replayssm.config import EngineConfig
from replayssm.engine.batch_inputs import to_device
from replayssm.engine.request import Request
from replayssm.sampling_params import GREEDY_EPS
from replayssm.spec.proposer import Drafts, Proposer
from replayssm.spec.stats import SpecStats
from replayssm.spec.verify import rejection_sample


def build_proposer(config: EngineConfig, runner: Any, model_dir: str) -> Proposer:
    """The drafter named by config.spec.speculative_method."""
    spec = config.spec
    method = spec.speculative_method
    if method == "ngram":
        from replayssm.spec.ngram import NgramProposer

        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if method == "synthetic":
        from replayssm.spec.synthetic import SyntheticProposer

        return SyntheticProposer(spec.synthetic_acceptance_length, spec.num_speculative_tokens,
                                 runner.model_config.vocab_size, seed=config.seed)
    if method == "mtp":
        from replayssm.spec.mtp import MTPProposer

        return MTPProposer(runner, model_dir)
    assert method == "draft", method
    from replayssm.engine.runner_setup import resolve_model_dir
    from replayssm.spec.draft_model import DraftModelProposer

    return DraftModelProposer(resolve_model_dir(spec.draft_model), runner, spec.num_speculative_tokens,
                              replay_window=config.replay_window, seed=config.seed)


class SpecDecoder:
    """Owns the drafter and the acceptance statistics; the engine calls it around each step."""

    def __init__(self, config: EngineConfig, runner: Any, model_dir: str) -> None:
        self.k = config.spec.num_speculative_tokens
        self.runner = runner
        self.proposer = build_proposer(config, runner, model_dir)
        self.stats = SpecStats(self.k, config.spec.speculative_method, self.proposer.produces_model_output)

    @property
    def produces_model_output(self) -> bool:
        return self.proposer.produces_model_output

    def propose(self, requests: list[Request], lookahead: list[int]) -> list[Drafts | None]:
        """Drafts per request (None: no lookahead room, or the drafter found nothing)."""
        out: list[Drafts | None] = [None] * len(requests)
        idx = [i for i, n in enumerate(lookahead) if n > 0]
        if not idx:
            return out
        drafts = self.proposer.propose([requests[i] for i in idx], [lookahead[i] for i in idx])
        for i, d in zip(idx, drafts):
            assert len(d.tokens) <= lookahead[i], (len(d.tokens), lookahead[i])
            if d.tokens:
                out[i] = d
        return out

    def verify(self, logits: torch.Tensor, offsets: list[int], requests: list[Request],
               drafts: list[Drafts]) -> tuple[list[list[int]], list[list[float]] | None]:
        """Verify rows: logits[offsets[i] : offsets[i] + 1 + k_i] belong to requests[i] with
        drafts[i]. Returns the emitted tokens per row (accepted drafts + one) and, when any
        request wants logprobs, their logprobs under the raw target distribution."""
        b, V = len(requests), logits.shape[-1]
        K = max(len(d.tokens) for d in drafts)
        dev = logits.device

        def up(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            # Pinned and asynchronous: a plain torch.tensor(..., device=cuda) waits for the forward.
            return to_device(values, dtype, dev)

        rows = up([[o + min(j, len(d.tokens)) for j in range(K + 1)] for o, d in zip(offsets, drafts)])
        padded = logits[rows]  # (b, K+1, V); positions past a row's drafts repeat its last logit
        tokens = up([d.tokens + [0] * (K - len(d.tokens)) for d in drafts])
        num = up([len(d.tokens) for d in drafts])
        probs = None
        if any(d.probs is not None for d in drafts):
            probs = torch.zeros(b, K, V, device=dev)
            for i, d in enumerate(drafts):
                n = len(d.tokens)
                probs[i, :n] = d.probs if d.probs is not None else \
                    torch.nn.functional.one_hot(tokens[i, :n], V).float()
        forced = None
        if any(d.forced_accepted is not None for d in drafts):
            forced = up([-1 if d.forced_accepted is None else d.forced_accepted for d in drafts])
        p = [r.params for r in requests]
        top_k = [V if x.top_k <= 0 else min(x.top_k, V) for x in p]
        out, acc = rejection_sample(
            padded, tokens, num, probs,
            up([float(x.temperature) for x in p], torch.float32),
            up(top_k),
            up([float(x.top_p) for x in p], torch.float32),
            up([((r.seed + (1 << 63)) % (1 << 64)) - (1 << 63) for r in requests]),
            up([r.num_tokens for r in requests]),
            forced=forced,
            # Known here, so the sampler reads nothing back (and skips the softmax when all greedy).
            all_greedy=all(x.temperature < GREEDY_EPS for x in p),
            any_top_k=any(k < V for k in top_k),
            any_top_p=any(x.top_p < 1.0 for x in p),
        )
        lps = None
        if any(x.logprobs is not None for x in p):
            lps = padded.log_softmax(dim=-1).gather(-1, out[..., None]).squeeze(-1).tolist()
        both = torch.cat([out, acc[:, None]], dim=-1).tolist()  # the verify step's one host sync
        out_l, acc_l = [row[:-1] for row in both], [row[-1] for row in both]
        emitted = [row[:a] for row, a in zip(out_l, acc_l)]
        for d, a in zip(drafts, acc_l):
            self.stats.record(len(d.tokens), a - 1)
        return emitted, None if lps is None else [row[:a] for row, a in zip(lps, acc_l)]

    def observe(self, requests: list[Request], row_index: list[int], starts: list[int],
                num_computed: list[int]) -> None:
        """After the step: requests[i] computed [starts[i], starts[i] + num_computed[i]) in row
        row_index[i] of the last execute (finished requests left out)."""
        if not requests:
            return
        hidden = None
        if getattr(self.proposer, "needs_hidden", False):
            hidden = [self.runner.row_hidden(i, n) for i, n in zip(row_index, num_computed)]
        self.proposer.observe(requests, starts, num_computed, hidden)

    def release(self, request: Request) -> None:
        self.proposer.release(request)

    def metrics(self) -> dict[str, Any]:
        return self.stats.as_dict()
