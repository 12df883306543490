"""One generation request and its bookkeeping."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from replayssm.sampling_params import SamplingParams


class InputError(ValueError):
    """A ValueError about one field of a request: `param` is "prompt" or "stop" (the server's 400s
    name it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted (nothing computed, no memory held)
    RUNNING = "running"  # holds a Mamba slot group and the KV blocks of its computed tokens
    FINISHED = "finished"


@dataclass
class Request:
    """A request's tokens and the memory it holds.

    Token bookkeeping (n = num_tokens = prompt + output):

        | computed: KV + Mamba state cover [0, num_computed_tokens) | to compute  |
        0                                                     num_computed        n

    A step computes a chunk of ``[num_computed_tokens, n)``; when the chunk reaches n the
    last position's logits sample token n. In steady decode exactly one token (the last
    sampled one) is uncomputed. Preemption drops everything computed (num_computed_tokens = 0,
    blocks and slots freed); on resume the prompt *and* the output so far are prefilled again.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one the engine drew at add time so recompute replays the same draws
    arrival: int  # admission order key: lower is older
    # Append-only (RequestOutput snapshots keep them with their length at the step).
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # Per generated token, its params.logprobs most likely (token id, logprob) pairs (when > 0).
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    # Per prompt token (None for the first), its params.prompt_logprobs most likely (id, logprob) pairs.
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # [live] + per-draft slots (baseline spec)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    group: int = 0  # which of two interleaved request groups steps it (Scheduler.schedule(group))
    # The client request it belongs to (one HTTP request's prompts x n choices): the scheduler shares
    # admission fairly between parents. None: the shared group of requests added without one.
    parent_id: str | None = None
    text: str = ""
    # Prefix caching: hashes of the full blocks of known tokens (tokens never change, so these
    # survive preemption), how many of block_table's blocks carry theirs, and the prompt tokens
    # served from the cache at first admission.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    # Tokens the sampler masks until params.min_tokens are generated: eos (unless ignore_eos) and
    # stop_token_ids (LLMEngine.add_request fills it).
    min_tokens_stop_ids: list[int] = field(default_factory=list)
    # params.processed, read per step by the sampler (a field read, not a property call, per row).
    processed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.processed = self.params.processed
    grammar: Any = None  # structured output: the matcher following the output (engine/structured.py)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:  # decode: never copy the whole sequence
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    def wants_prompt_logprobs(self) -> bool:
        """True until the prompt's logprobs have been collected once (not again on recompute)."""
        return self.params.prompt_logprobs is not None and (
            self.prompt_logprobs is None or len(self.prompt_logprobs) < self.num_prompt_tokens
        )
