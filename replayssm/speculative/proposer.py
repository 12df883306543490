"""The drafter interface shared by every speculative method, and the per-step draft record."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayssm.engine.request import Request
from replayssm.speculative.verify import DRAFT_SALT, gumbel_pick, salted, target_probs


@dataclass
class Drafts:
    """Draft tokens for one request's next verify step.

    tokens: the k' <= k proposed tokens (may be empty: the step is then a plain decode).
    probs: (k', V) fp32 draft distribution each token was sampled from, or None when the
        drafter is deterministic (q = one-hot; n-gram, greedy model drafts).
    forced_accepted: synthetic drafter only: how many drafts the step accepts regardless of
        the target (so the output is NOT the model's); None for real drafters.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    forced_accepted: int | None = None


class Proposer:
    """Proposes draft tokens for requests in decode.

    Engine protocol per step: ``propose`` (after scheduling, for requests that got lookahead
    room), execute + verify + commit, then ``observe`` (every computed chunk, after its sampled
    tokens were appended), and ``release`` when a request finishes. Drafts only change speed,
    never output, except for the synthetic drafter (``produces_model_output = False``).
    """

    produces_model_output = True
    # Drafts come from host work only (no device state of its own, no target hidden states): the
    # engine may then interleave two request groups' verify steps (LLMEngine, async scheduling).
    host_only = False

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Drafts]:
        """At most num_drafts[i] drafts for requests[i] (each has exactly one uncomputed token)."""
        raise NotImplementedError

    def observe(self, requests: list[Request], starts: list[int], num_computed: list[int],
                row_index: list[int]) -> None:
        """requests[i] just computed tokens [starts[i], starts[i] + num_computed[i]) in row
        row_index[i] of the last execute (a model drafter reads the target's hidden states there
        with the runner's `row_hidden`)."""

    def release(self, request: Request) -> None:
        """Forget a finished request."""


def draw_drafts(logits: torch.Tensor, requests: list[Request],
                positions: list[int]) -> tuple[list[int], torch.Tensor | None]:
    """One draft token per row from draft logits (n, V): argmax for greedy requests, else a draw
    from the request's sampling distribution keyed by (seed, position). Returns the tokens and
    the (n, V) probabilities (None when every request is greedy)."""
    tokens = logits.argmax(dim=-1)
    if all(r.params.greedy for r in requests):
        return tokens.tolist(), None
    dev = logits.device
    V = logits.shape[-1]
    temp = torch.tensor([max(r.params.temperature, 1e-5) for r in requests], device=dev)
    top_k = torch.tensor([V if r.params.top_k <= 0 else min(r.params.top_k, V) for r in requests], device=dev)
    top_p = torch.tensor([float(r.params.top_p) for r in requests], device=dev)
    probs = target_probs(logits.float(), temp, top_k, top_p)
    seeds = torch.tensor([((r.seed + (1 << 63)) % (1 << 64)) - (1 << 63) for r in requests], device=dev)
    drawn = gumbel_pick(probs, salted(seeds, DRAFT_SALT), torch.tensor(positions, device=dev))
    greedy = torch.tensor([r.params.greedy for r in requests], device=dev)
    # Greedy rows keep one-hot probabilities: their acceptance never uses q anyway.
    probs = torch.where(greedy[:, None], torch.nn.functional.one_hot(tokens, V).float(), probs)
    return torch.where(greedy, tokens, drawn).tolist(), probs
