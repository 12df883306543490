"""Turning sampled tokens into request outputs: logprobs, incremental text, stop checks."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from replayssm.engine.request import Request, RequestStatus
from replayssm.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(eq=False)  # compared by identity: compare token_ids, text, ... explicitly
class RequestOutput:
    """A request's state after a step; token_ids and text hold everything generated so far.

    A snapshot costs O(1) whatever the length: it keeps the request's append-only token and
    logprob lists with their lengths at the step, and `token_ids` / `logprobs` copy out that prefix
    on first access (later steps never change it). `num_output_tokens` is the length without a copy.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[float | None] | None = None  # per prompt token (first is None)
    # Per prompt token (first is None), its SamplingParams.prompt_logprobs most likely (id, logprob) pairs.
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # True when the synthetic drafter (benchmarks only) forced acceptances: NOT the model's output.
    synthetic_spec: bool = False
    num_output_tokens: int = 0
    _tokens: list[int] = field(default_factory=list, repr=False)
    _logprobs: list[float] | None = field(default=None, repr=False)
    _top_logprobs: list[list[tuple[int, float]]] | None = field(default=None, repr=False)

    @functools.cached_property
    def token_ids(self) -> list[int]:
        """The generated tokens at this step."""
        return self._tokens[: self.num_output_tokens]

    @functools.cached_property
    def logprobs(self) -> list[float] | None:
        """Per generated token, when SamplingParams.logprobs is set."""
        return None if self._logprobs is None else self._logprobs[: self.num_output_tokens]

    @functools.cached_property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        """Per generated token, the SamplingParams.logprobs most likely (token id, logprob) pairs,
        most likely first; None unless SamplingParams.logprobs > 0."""
        return None if self._top_logprobs is None else self._top_logprobs[: self.num_output_tokens]

    @property
    def has_logprobs(self) -> bool:
        """Whether logprobs were asked for (without copying them)."""
        return self._logprobs is not None

    def tokens_since(self, start: int) -> list[int]:
        """token_ids[start:] without copying the prefix (streaming deltas)."""
        return self._tokens[start : self.num_output_tokens]

    def logprobs_since(self, start: int) -> list[float] | None:
        """logprobs[start:] without copying the prefix; None when logprobs were not asked for."""
        return None if self._logprobs is None else self._logprobs[start : self.num_output_tokens]

    def top_logprobs_since(self, start: int) -> list[list[tuple[int, float]]] | None:
        """top_logprobs[start:] without copying the prefix; None when no alternatives were asked for."""
        return None if self._top_logprobs is None else self._top_logprobs[start : self.num_output_tokens]


def make_output(r: Request) -> RequestOutput:
    """A snapshot of ``r`` at this step (O(1): see RequestOutput)."""
    return RequestOutput(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        text=r.text,
        finished=r.status is RequestStatus.FINISHED,
        finish_reason=r.finish_reason,
        num_cached_tokens=r.num_cached_tokens,
        prompt_logprobs=list(r.prompt_logprobs) if r.prompt_logprobs is not None else None,
        prompt_top_logprobs=list(r.prompt_top_logprobs) if r.prompt_top_logprobs is not None else None,
        num_output_tokens=len(r.output_token_ids),
        _tokens=r.output_token_ids,
        _logprobs=r.output_logprobs if r.params.logprobs is not None else None,
        _top_logprobs=r.output_top_logprobs if r.params.top_logprobs else None,
    )


class OutputProcessor:
    """Appends each sampled token to its request and decides whether the request is done.

    Order of checks for a new token: stop strings (the text is cut before the match, or after it
    with include_stop_str_in_output), then eos (unless ignore_eos) and stop_token_ids ("stop"; the
    stopping token's text is left out unless include_stop_str_in_output), then max_tokens and
    max_model_len ("length"). Before params.min_tokens tokens exist only the "length" checks apply.
    Stopping tokens stay in token_ids; special tokens are left out of the text when
    skip_special_tokens is set.
    """

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, r: Request) -> None:
        if self.tokenizer is not None:
            self._detokenizers[r.request_id] = IncrementalDetokenizer(
                self.tokenizer, r.params.skip_special_tokens
            )

    def remove(self, r: Request) -> None:
        self._detokenizers.pop(r.request_id, None)

    def append_token(self, r: Request, token: int, logprob: float | None,
                     top: list[tuple[int, float]] | None = None, grammar_end: bool = False) -> str | None:
        """Append ``token`` (its logprob, and its position's most likely tokens ``top``: at least
        params.logprobs pairs when that is > 0) to ``r``; return a finish reason or None.
        grammar_end: the request's grammar ended on this (end-of-sequence) token, a stop token
        whatever ignore_eos and min_tokens say; like eos, its text is left out of the output."""
        p = r.params
        r.output_token_ids.append(token)
        if p.logprobs is not None:
            r.output_logprobs.append(logprob)
        if p.top_logprobs:
            r.output_top_logprobs.append(top[: p.top_logprobs])
        may_stop = len(r.output_token_ids) >= p.min_tokens
        stop_token = grammar_end or may_stop and ((not p.ignore_eos and token in self.eos_token_ids) or bool(
            p.stop_token_ids and token in p.stop_token_ids))
        detok = self._detokenizers.get(r.request_id)
        if detok is not None and (not stop_token or p.include_stop_str_in_output):
            new_text = detok.add(token)
            r.text += new_text
            if p.stop and may_stop and new_text and self._cut_at_stop_string(r, len(new_text)):
                return "stop"
        if stop_token:
            return "stop"
        if len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= self.max_model_len:
            if detok is not None:
                r.text += detok.flush()  # an incomplete trailing character shows as U+FFFD
            return "length"
        return None

    @staticmethod
    def _cut_at_stop_string(r: Request, new_len: int) -> bool:
        """Cut the text before (include_stop_str_in_output: after) the first stop string that the new
        text completes."""
        longest = max(len(s) for s in r.params.stop)
        window_start = max(0, len(r.text) - new_len - longest + 1)
        hits = [(i, i + len(s)) for s in r.params.stop if (i := r.text.find(s, window_start)) >= 0]
        if hits:
            start, end = min(hits)
            r.text = r.text[: end if r.params.include_stop_str_in_output else start]
        return bool(hits)
