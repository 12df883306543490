"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

# Below this temperature a request is sampled greedily (dividing logits by ~0 overflows).
GREEDY_EPS = 1e-5
# The most alternatives `logprobs` may ask for per token (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20
# OpenAI's bounds on a logit_bias value and on presence/frequency penalties.
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
# generation_config.json fields that set a sampling default, as SamplingParams names them.
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "repetition_penalty": "repetition_penalty", "min_p": "min_p",
                       "max_new_tokens": "max_tokens"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
# The kinds of SamplingParams.structured (engine/structured.py follows them).
STRUCTURED_KINDS = ("json", "json_object", "regex")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature: 0 means greedy (argmax); > 0 scales the logits before sampling.
    top_k: keep the k most likely tokens (0 or -1 = off).
    top_p: keep the smallest set of tokens whose probability mass reaches top_p (1.0 = off).
    min_p: drop tokens whose probability is below min_p times the most likely one's (0 = off).
    repetition_penalty: tokens of the prompt or the output so far get logit / penalty when the logit
        is positive, logit * penalty otherwise (1.0 = off; transformers' definition).
    presence_penalty, frequency_penalty: subtract presence * (count > 0) + frequency * count from
        each token's logit, count = its occurrences in the output so far (OpenAI's definition, [-2, 2]).
    logit_bias: {token id: bias in [-100, 100]} added to the logits.
    min_tokens: eos (unless ignore_eos) and stop_token_ids cannot be sampled, and no stop
        condition but max_tokens applies, before this many tokens are generated.
    seed: makes the request's random draws reproducible; the draw for output position t
        depends only on (seed, t), never on batch composition or preemption.
    max_tokens: generate at most this many tokens (finish_reason "length").
    stop: strings that end generation; the text is cut before the matched string.
    stop_token_ids: token ids that end generation (kept in token_ids, finish_reason "stop").
    include_stop_str_in_output: keep the matched stop string, or the stopping token's text
        (eos, stop_token_ids), in the returned text.
    ignore_eos: keep generating past the end-of-sequence token.
    logprobs: when set (>= 0), return the log-probability of each chosen token and, when > 0, the
        `logprobs` most likely tokens at each position with theirs (at most MAX_LOGPROBS; all
        under the unmodified model distribution, before penalties, logit_bias, min_tokens,
        temperature, top-k, top-p and min-p).
    prompt_logprobs: when set (>= 0), return the log-probability of each prompt token
        (None for the first one), computed during prefill, and when > 0 (at most MAX_LOGPROBS) the
        `prompt_logprobs` most likely tokens at each of those positions with theirs.
    skip_special_tokens: drop special tokens (eos, bos, pad) from the returned text.

    The logits go through: repetition penalty, frequency and presence penalties, logit_bias, the
    min_tokens mask (`apply_logits_processors`); then greedy rows take the argmax, random rows
    apply temperature, top-k, top-p, min-p (transformers' order) and draw.
    structured: constrain the output to a grammar, one key of {"json": schema}, {"json_object": True}
        or {"regex": pattern} (engine/structured.py; needs the `structured` extra).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: dict | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int, -1 or 0 to disable or >= 1, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        self._check_logit_bias()
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if self.stop is not None:
            stop = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
                raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
            object.__setattr__(self, "stop", list(stop))
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
            object.__setattr__(self, "stop_token_ids", list(ids))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
            if (value or 0) > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}")
        if self.structured is not None:
            object.__setattr__(self, "structured", check_structured(self.structured))

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {bias!r}")
        for t, v in bias.items():
            if not _is_int(t) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
            if not _is_number(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {v!r} for token {t}")
        object.__setattr__(self, "logit_bias", {t: float(v) for t, v in bias.items()} or None)

    @property
    def top_logprobs(self) -> int:
        """How many alternatives per generated token this request wants (0: none)."""
        return self.logprobs or 0

    @property
    def greedy(self) -> bool:
        """True when this request takes the argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """True when a penalty reads the token history (repetition, presence, frequency)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processed(self) -> bool:
        """True when `apply_logits_processors` changes this request's logits on some step."""
        return self.penalized or self.logit_bias is not None or self.min_tokens > 0


def read_generation_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling defaults of model_dir/generation_config.json as SamplingParams keywords (temperature,
    top_p, top_k, repetition_penalty, min_p; max_new_tokens as max_tokens); {} without the file.
    Other fields (do_sample included) are not read, as in vLLM. ValueError for a value SamplingParams
    refuses."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    defaults = {ours: raw[theirs] for theirs, ours in GENERATION_DEFAULTS.items()
                if raw.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return defaults

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
