"""Translate OpenAI requests into engine requests, and engine outputs into OpenAI responses.

One HTTP request becomes k = len(prompts) * n engine requests; sub-request i serves prompt
i // n as choice i (OpenAI numbers the choices of a batched completion the same way). Token
counts in `usage` count each prompt once, however many choices it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from pydantic import BaseModel

from replayssm.sampling_params import SamplingParams
from replayssm.server.protocol import (
    APIError,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    SamplingRequest,
    TopLogprob,
    Usage,
    logit_bias_ids,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 1024  # prompts x n of one HTTP request: one client must not flood the queue


@dataclass
class EngineRequests:
    """What one HTTP request submits: engine tuples plus what usage accounting needs."""

    base_id: str
    requests: list[tuple[str, list[int], SamplingParams, int]]
    prompt_lens: list[int]
    n: int


def build_requests(
    req: SamplingRequest, base_id: str, prompts: list[list[int]], max_tokens: int | None,
    max_model_len: int, *, default_max_tokens: int | None, logprobs: int | None, param: str,
    defaults: dict | None = None,
    structured: dict | None = None,
) -> EngineRequests:
    """Check lengths against the context window and fan prompts out n times into engine requests.

    `default_max_tokens=None` means "the rest of the context window" (the chat default). defaults:
    SamplingParams keywords for the fields the request leaves unset (the checkpoint's
    generation_config.json; its max_tokens replaces default_max_tokens)."""
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n={req.n} exceeds {MAX_CHOICES} choices per request",
                       param="n")
    defaults = defaults or {}
    default_max_tokens = defaults.get("max_tokens", default_max_tokens)
    sampling = sampling_fields(req, defaults)
    requests = []
    for p, ids in enumerate(prompts):
        room = max_model_len - len(ids)
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            asked = len(ids) + (max_tokens or 1)
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the "
                           f"request needs {asked} ({len(ids)} in the prompt, {max_tokens or 1} to generate)",
                           param=param, code="context_length_exceeded")
        limit = max_tokens or min(default_max_tokens or room, room)
        for j in range(req.n):
            # Distinct seeds per choice: n identical samples would defeat the point of n.
            seed = None if req.seed is None else req.seed + j
            try:
                params = SamplingParams(**sampling, seed=seed, max_tokens=limit, logprobs=logprobs,
                                        structured=structured)
            except ValueError as exc:
                field = str(exc).split(" ", 1)[0]
                raise APIError(400, str(exc), param=field if field in SAMPLING_FIELDS else None) from exc
            requests.append((f"{base_id}-{p * req.n + j}", ids, params, len(ids)))
    return EngineRequests(base_id, requests, [len(ids) for ids in prompts], req.n)


SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
# Request fields that take the checkpoint's default when unset, with OpenAI's default otherwise.
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_fields(req: SamplingRequest, defaults: dict) -> dict:
    """The request's SamplingParams keywords but seed, max_tokens and logprobs; unset ones come from
    `defaults`, else SamplingParams' own."""
    chosen = {name: getattr(req, name) if getattr(req, name) is not None else defaults.get(name)
              for name in _DEFAULTED}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    chosen.update(
        stop=[req.stop] if isinstance(req.stop, str) else req.stop, ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logit_bias=logit_bias_ids(req), min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens)
    return chosen


def sse(payload: BaseModel) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {payload.model_dump_json()}\n\n"


def usage_of(reqs: EngineRequests, outputs: list) -> Usage:
    """Usage over all choices; cached tokens are those of each prompt's first choice."""
    prompt_tokens = sum(reqs.prompt_lens)
    completion_tokens = sum(o.num_output_tokens for o in outputs if o is not None)
    cached = sum(outputs[p * reqs.n].num_cached_tokens for p in range(len(reqs.prompt_lens))
                 if outputs[p * reqs.n] is not None)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


@dataclass
class DeltaTracker:
    """Per-choice streaming cursor: how much text and how many tokens were already sent.

    The engine cuts a stop string out of `text` only once it is complete, so while a choice
    runs, a tail that could still grow into a stop string is held back; text once sent is
    never taken back, and the streamed text always equals the final text.
    """

    stop: list[str]
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def for_choices(cls, k: int, stop: str | list[str] | None) -> DeltaTracker:
        return cls(stop=[stop] if isinstance(stop, str) else list(stop or []), text=[""] * k, tokens=[0] * k)

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)

    def advance(self, index: int, out, flush: bool = False) -> tuple[str, int]:
        """New text to send since the last call and the token offset it starts from; `flush` sends
        a held-back tail too (the choice ends here without finishing)."""
        sent = self.text[index]
        whole = out.finished or flush
        visible = out.text if whole else out.text[: len(out.text) - self._held_back(out.text)]
        delta = visible[len(sent):] if visible.startswith(sent) else ""
        start = self.tokens[index]
        self.text[index] = sent + delta
        self.tokens[index] = out.num_output_tokens
        return delta, start


def token_strings(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token's own text; `token_id:N` when the model has no tokenizer."""
    if tokenizer is None:
        return [f"token_id:{t}" for t in token_ids]
    return [tokenizer.decode([t]) for t in token_ids]


def completion_logprobs(tokenizer, out, start: int = 0, offset: int = 0) -> CompletionLogprobs | None:
    """Legacy-completions logprobs of tokens[start:]: each token's own and, when asked for, its
    position's most likely tokens as {token text: logprob} (tokens with the same text share a key)."""
    if not out.has_logprobs:
        return None
    tokens = token_strings(tokenizer, out.tokens_since(start))
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    tops = out.top_logprobs_since(start)
    if tops is not None:
        tops = [dict(zip(token_strings(tokenizer, [i for i, _ in top]), (lp for _, lp in top)))
                for top in tops]
    return CompletionLogprobs(tokens=tokens, token_logprobs=out.logprobs_since(start),
                              top_logprobs=tops, text_offset=offsets)


def chat_logprobs(tokenizer, out, start: int = 0) -> ChatLogprobs | None:
    """Chat logprobs of tokens[start:], each with its position's most likely tokens when asked for
    (`top_logprobs`; else that list stays empty)."""
    if not out.has_logprobs:
        return None
    tokens = token_strings(tokenizer, out.tokens_since(start))
    values = out.logprobs_since(start)
    tops = out.top_logprobs_since(start) or [[] for _ in tokens]
    return ChatLogprobs(content=[ChatTokenLogprob(token=t, logprob=lp, bytes=list(t.encode()),
                                                  top_logprobs=_top_entries(tokenizer, top))
                                 for t, lp, top in zip(tokens, values, tops)])


def _top_entries(tokenizer, top: list[tuple[int, float]]) -> list[TopLogprob]:
    """A position's (token id, logprob) alternatives as chat `top_logprobs` entries."""
    texts = token_strings(tokenizer, [i for i, _ in top])
    return [TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, (_, lp) in zip(texts, top)]
