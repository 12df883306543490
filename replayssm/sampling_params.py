"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Below this temperature a request is sampled greedily (dividing logits by ~0 overflows).
GREEDY_EPS = 1e-5
# The most alternatives `logprobs` may ask for per token (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20
# The kinds of SamplingParams.structured (engine/structured.py follows them).
STRUCTURED_KINDS = ("json", "json_object", "regex")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature: 0 means greedy (argmax); > 0 scales the logits before sampling.
    top_k: keep the k most likely tokens (0 or -1 = off).
    top_p: keep the smallest set of tokens whose probability mass reaches top_p (1.0 = off).
    seed: makes the request's random draws reproducible; the draw for output position t
        depends only on (seed, t), never on batch composition or preemption.
    max_tokens: generate at most this many tokens (finish_reason "length").
    stop: strings that end generation; the text is cut before the matched string.
    stop_token_ids: token ids that end generation (kept in token_ids, finish_reason "stop").
    ignore_eos: keep generating past the end-of-sequence token.
    logprobs: when set (>= 0), return the log-probability of each chosen token and, when > 0, the
        `logprobs` most likely tokens at each position with theirs (at most MAX_LOGPROBS; all
        under the unmodified model distribution, before temperature, top-k and top-p).
    prompt_logprobs: when set (>= 0), return the log-probability of each prompt token
        (None for the first one), computed during prefill, and when > 0 (at most MAX_LOGPROBS) the
        `prompt_logprobs` most likely tokens at each of those positions with theirs.
    skip_special_tokens: drop special tokens (eos, bos, pad) from the returned text.
    structured: constrain the output to a grammar, one key of {"json": schema}, {"json_object": True}
        or {"regex": pattern} (engine/structured.py; needs the `structured` extra).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an int, -1 or 0 to disable or >= 1, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.stop is not None:
            if isinstance(self.stop, str):
                object.__setattr__(self, "stop", [self.stop])
            if not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
            object.__setattr__(self, "stop", list(self.stop))
        if self.stop_token_ids is not None:
            if not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
            ):
                raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(self, name) or 0) > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {getattr(self, name)}")
        if self.structured is not None:
            object.__setattr__(self, "structured", check_structured(self.structured))

    @property
    def top_logprobs(self) -> int:
        """How many alternatives per generated token this request wants (0: none)."""
        return self.logprobs or 0

    @property
    def greedy(self) -> bool:
        """True when this request takes the argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_EPS


def check_structured(value: Any, name: str = "structured") -> dict[str, Any]:
    """SamplingParams.structured normalized to one key: {"json": schema as JSON text},
    {"json_object": True} or {"regex": pattern}; raises ValueError naming the field `name`."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in STRUCTURED_KINDS:
        raise ValueError(f"{name} must be an object with exactly one key of {list(STRUCTURED_KINDS)}, "
                         f"got {value!r}")
    (kind, spec), = value.items()
    if kind == "json_object":
        if spec is not True:
            raise ValueError(f"{name}['json_object'] must be true, got {spec!r}")
        return {kind: True}
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"{name}['regex'] must be a non-empty string, got {spec!r}")
        return {kind: spec}
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}['json'] is not valid JSON: {exc}") from exc
    if not isinstance(spec, (dict, bool)):
        raise ValueError(f"{name}['json'] must be a JSON schema (an object), got {spec!r}")
    return {kind: json.dumps(spec)}
