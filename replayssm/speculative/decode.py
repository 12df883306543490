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
from replayssm.engine.host_pack import HostPack
from replayssm.engine.logits_inputs import build_logits_processors
from replayssm.engine.request import Request
from replayssm.engine.structured import verify_masks
from replayssm.ops.sampling import apply_logits_processors, token_logprobs, top_pairs
from replayssm.sampling_params import GREEDY_EPS
from replayssm.speculative.proposer import Drafts, Proposer
from replayssm.speculative.stats import SpecStats
from replayssm.speculative.verify import rejection_sample


def build_proposer(config: EngineConfig, runner: Any, model_dir: str) -> Proposer:
    """The drafter named by config.spec.speculative_method."""
    spec = config.spec
    method = spec.speculative_method
    if method == "ngram":
        from replayssm.speculative.ngram import NgramProposer

        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if method == "synthetic":
        from replayssm.speculative.synthetic import SyntheticProposer

        return SyntheticProposer(spec.synthetic_acceptance_length, spec.num_speculative_tokens,
                                 runner.model_config.vocab_size, seed=config.seed)
    if method == "mtp":
        from replayssm.speculative.mtp import MTPProposer

        return MTPProposer(runner, model_dir)
    assert method == "draft", method
    from replayssm.engine.runner_setup import resolve_model_dir
    from replayssm.speculative.draft_model import DraftModelProposer

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
               drafts: list[Drafts]) -> tuple[list[list[int]], list[list[float]] | None, list | None]:
        """Verify rows: logits[offsets[i] : offsets[i] + 1 + k_i] belong to requests[i] with
        drafts[i]. Returns the emitted tokens per row (accepted drafts + one) and, when any
        request wants logprobs, their logprobs under the raw target distribution, and when any
        wants alternatives, per emitted token its most likely (id, logprob) pairs (else None)."""
        out, acc, *rest = self.verify_launch(logits, offsets, requests, drafts)
        both = torch.cat([out, acc[:, None]], dim=-1).tolist()  # the verify step's one host sync
        return self.verify_finish(drafts, [row[:-1] for row in both], [row[-1] for row in both],
                                  *[t.tolist() if t is not None else None for t in rest])

    def verify_launch(self, logits: torch.Tensor, offsets: list[int], requests: list[Request],
                      drafts: list[Drafts]) -> tuple[torch.Tensor | None, ...]:
        """`verify` on the device, reading nothing back: (tokens (b, K + 1), emitted counts (b,),
        their logprobs (b, K + 1) or None, and the n most likely tokens' ids and logprobs (b, K + 1,
        n) when a request wants n > 0 alternatives, else None, None). `verify_finish` takes them once
        they are lists."""
        b, V = len(requests), logits.shape[-1]
        lens = [len(d.tokens) for d in drafts]
        K = max(lens)
        p = [r.params for r in requests]
        top_k = [V if x.top_k <= 0 else min(x.top_k, V) for x in p]
        i64, f32 = torch.int64, torch.float32
        # Every list goes up in one packed copy (pinned and asynchronous on CUDA: a plain
        # torch.tensor(..., device=cuda) would wait for the forward).
        pad = [(*d.tokens, *[0] * (K - n)) for d, n in zip(drafts, lens)]
        forced = [-1 if d.forced_accepted is None else d.forced_accepted for d in drafts]
        masks = verify_masks(requests, drafts, K, V)  # None: no structured row
        if masks is not None:  # a forced row accepts no draft its grammar refuses
            forced = [f if f < 0 else min(f, n) for f, n in zip(forced, masks.num_valid)]
        pack = HostPack()
        parts = dict(
            rows=pack.add([o + min(j, n) for o, n in zip(offsets, lens) for j in range(K + 1)], i64,
                          (b, K + 1)),
            tokens=pack.add([tok for row in pad for tok in row], i64, (b, K)),
            num=pack.add(lens, i64),
            temperature=pack.add([float(x.temperature) for x in p], f32),
            top_k=pack.add(top_k, i64),
            top_p=pack.add([float(x.top_p) for x in p], f32),
            seeds=pack.add([((r.seed + (1 << 63)) % (1 << 64)) - (1 << 63) for r in requests], i64),
            positions=pack.add([r.num_tokens for r in requests], i64),
        )
        use_min_p = any(x.min_p > 0.0 for x in p)
        if use_min_p:
            parts["min_p"] = pack.add([float(x.min_p) for x in p], f32)
        if any(f >= 0 for f in forced):
            parts["forced"] = pack.add(forced, i64)
        sent = pack.send(logits.device)
        up = {name: sent[i] for name, i in parts.items()}
        padded = logits[up["rows"]]  # (b, K+1, V); positions past a row's drafts repeat its last logit
        processed = padded
        if any(r.processed for r in requests):
            # Row (i, j) predicts the token after drafts i[:j]: the penalties count those drafts.
            proc = build_logits_processors([r for r in requests for _ in range(K + 1)], V, logits.device,
                                           extra=[list(d.tokens[:j]) for d in drafts for j in range(K + 1)])
            processed = apply_logits_processors(padded.view(b * (K + 1), V), proc).view(b, K + 1, V)
        tokens = up["tokens"]
        probs = None
        if any(d.probs is not None for d in drafts):
            probs = torch.zeros(b, K, V, device=logits.device)
            for i, d in enumerate(drafts):
                n = len(d.tokens)
                probs[i, :n] = d.probs if d.probs is not None else \
                    torch.nn.functional.one_hot(tokens[i, :n], V).float()
        target = processed if masks is None else masks.apply(processed)  # logprobs below stay the model's own
        out, acc = rejection_sample(
            target, tokens, up["num"], probs, up["temperature"], up["top_k"], up["top_p"], up["seeds"],
            up["positions"], forced=up.get("forced"),
            # Known here, so the sampler reads nothing back (and skips the softmax when all greedy).
            all_greedy=all(x.temperature < GREEDY_EPS for x in p),
            any_top_k=any(k < V for k in top_k),
            any_top_p=any(x.top_p < 1.0 for x in p),
            min_p=up.get("min_p"),
        )
        asked = [x.top_logprobs for x in p if x.logprobs is not None]
        if not asked:
            return out, acc, None, None, None
        lps, top = token_logprobs(padded, out, max(asked))
        return out, acc, lps, *(top or (None, None))

    def verify_finish(self, drafts: list[Drafts], out: list[list[int]], acc: list[int],
                      lps: list[list[float]] | None, top_ids: list | None = None,
                      top_lps: list | None = None) -> tuple[list, ...]:
        """`verify`'s result from `verify_launch`'s tensors as lists: per row, the emitted tokens,
        their logprobs and their alternatives as (id, logprob) pairs (None where not asked for);
        records the acceptance."""
        emitted = [row[:a] for row, a in zip(out, acc)]
        for d, a in zip(drafts, acc):
            self.stats.record(len(d.tokens), a - 1)
        tops = None
        if top_ids is not None:
            tops = [top_pairs(i[:a], v[:a]) for i, v, a in zip(top_ids, top_lps, acc)]
        return emitted, None if lps is None else [row[:a] for row, a in zip(lps, acc)], tops

    def observe(self, requests: list[Request], row_index: list[int], starts: list[int],
                num_computed: list[int]) -> None:
        """After the step: requests[i] computed [starts[i], starts[i] + num_computed[i]) in row
        row_index[i] of the last execute (finished requests left out)."""
        if not requests:
            return
        self.proposer.observe(requests, starts, num_computed, row_index)

    def release(self, request: Request) -> None:
        self.proposer.release(request)

    def metrics(self) -> dict[str, Any]:
        return self.stats.as_dict()
