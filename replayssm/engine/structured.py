"""Structured output: decoding constrained to a JSON schema, any JSON object, or a regex (xgrammar).

A request asks with ``SamplingParams(structured=...)``, one key of:

    {"json": schema}         a JSON schema (dict or JSON text): the output parses and validates
    {"json_object": True}    any JSON object
    {"regex": pattern}       the output fullmatches the regular expression

The engine compiles the grammar once per distinct spec (`StructuredOutputs.compile`, cached) and
gives the request a matcher (`Request.grammar`) that follows its emitted tokens (`accept_token`).
Right before sampling, a structured row's logits outside the grammar's allowed set become -inf
(`apply_token_bitmask`, one int32 bit per token id):

    plain rows    `mask_logits`: one mask per row, from the matcher's state
    verify rows   `verify_masks`: position j of [last] + d_1..d_k is masked by the state after
                  d_1..d_j; the matcher advances along the drafts while the grammar allows them
                  (num_valid), then rolls back to the emitted state. A draft the grammar refuses
                  has target probability 0, so rejection sampling rejects it, and the corrected or
                  bonus token is drawn from the masked target distribution.

Once the grammar is complete only end-of-sequence tokens are allowed, and a matcher that accepted
one has terminated: the request finishes ("stop", also with ignore_eos), so a finished output
always parses (one cut by max_tokens or a stop string does not). Rows without a grammar take no
part: no mask, no copy, no host sync. Logprobs stay those of the unmodified model distribution.

JSON is compiled without free whitespace (`any_whitespace=False`): the output is compact JSON,
and a model cannot spend its budget on an unbounded run of spaces and newlines.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

from replayssm.engine.request import InputError

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class StructuredOutputs:
    """The engine's grammar compiler over its tokenizer; xgrammar is imported on first use.

    `compile` is thread-safe (the server compiles in its handlers' worker threads, so the engine
    thread later hits the cache)."""

    # xgrammar caches compiled grammars without a bound by default: many distinct schemas would grow it.
    CACHE_BYTES = 256 << 20

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise InputError("structured output needs the model's tokenizer.json", "structured")
                if not self.eos_token_ids:
                    raise InputError("structured output needs an end-of-sequence token id", "structured")
                try:
                    import xgrammar
                except ImportError as exc:
                    raise InputError("structured output needs xgrammar: pip install 'replayssm[structured]'",
                                     "structured") from exc
                info = tokenizer_info(xgrammar, self.tokenizer, self.vocab_size, self.eos_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=self.CACHE_BYTES)
            return self._compiler

    def compile(self, spec: dict[str, Any]) -> Any:
        """The compiled grammar of a normalized spec (`sampling_params.check_structured`); raises InputError
        (param "structured") for a schema or regex the compiler refuses."""
        compiler = self._get_compiler()
        (kind, value), = spec.items()
        try:
            if kind == "regex":
                return compiler.compile_regex(value)
            schema = '{"type": "object"}' if kind == "json_object" else value
            return compiler.compile_json_schema(schema, any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as exc:
            name = "regex" if kind == "regex" else "JSON schema"
            reason = _LOG_PREFIX.sub("", str(exc).strip())  # xgrammar's messages start with a log prefix
            raise InputError(f"structured output: invalid {name}: {reason}", "structured") from exc

    def matcher(self, spec: dict[str, Any]) -> Any:
        """A fresh matcher for one request (its grammar from the cache)."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec))


def tokenizer_info(xgrammar: Any, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """xgrammar's view of a `tokenizers` tokenizer.json: its vocabulary in id order with the special
    tokens blanked (they decode to nothing, so the grammar must never count them as text), and the
    vocabulary type detected as xgrammar does for Hugging Face fast tokenizers."""
    from transformers import PreTrainedTokenizerFast

    tok = tokenizer.backend
    detected = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=vocab_size, stop_token_ids=eos_token_ids)
    vocab = [""] * vocab_size
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = text
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            vocab[i] = ""
    return xgrammar.TokenizerInfo.from_vocab_and_metadata(vocab, detected.dump_metadata())


def accept_token(matcher: Any, token: int) -> bool:
    """Advance a request's matcher along one emitted token; True once the grammar has ended (the
    request finishes). Every emitted token was sampled under the mask, so the matcher accepts it."""
    accepted = matcher.accept_token(token)
    assert accepted, f"token {token} was emitted outside its request's grammar"
    return matcher.is_terminated()


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (n, V) with every token whose bit is 0 in bitmask (n, ceil(V / 32)) int32 (token t:
    bit t % 32 of word t // 32) set to -inf; a new tensor."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`apply_token_bitmask` one token at a time (the tests' reference)."""
    out = logits.clone()
    for i in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[i, t] = float("-inf")
    return out


def _masked_rows(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """logits (n, V) with rows[i] masked by bitmask[i] (host int32); a new tensor."""
    dev = logits.device
    pin = dev.type == "cuda"
    # Pinned and asynchronous: the copy queues behind the forward without a host sync.
    bitmask = (bitmask.pin_memory() if pin else bitmask).to(dev, non_blocking=True)
    if len(rows) == logits.shape[0]:
        return apply_token_bitmask(logits, bitmask)
    idx = torch.tensor(rows, dtype=torch.int64)
    idx = (idx.pin_memory() if pin else idx).to(dev, non_blocking=True)
    return logits.index_copy(0, idx, apply_token_bitmask(logits[idx], bitmask))


def mask_logits(logits: torch.Tensor, requests: list[Any]) -> torch.Tensor:
    """The last logits (b, V) of rows sampling for `requests`, structured rows masked by their
    grammar's next allowed tokens; `logits` itself when no request has a grammar."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return logits
    bitmask = torch.empty(len(rows), bitmask_width(logits.shape[-1]), dtype=torch.int32)
    for k, i in enumerate(rows):
        requests[i].grammar.fill_next_token_bitmask(bitmask, k)
    return _masked_rows(logits, rows, bitmask)


@dataclass
class VerifyMasks:
    """Grammar masks of a verify step's structured rows; see `verify_masks`."""

    rows: list[int]  # structured rows' indices in the step's verify rows
    bitmask: torch.Tensor  # (len(rows) * (K + 1), W) int32 on the host: row-major (row, position)
    num_valid: list[int]  # per verify row, its drafts the grammar accepts in order (all for the others)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The verify logits (b, K + 1, V) with the structured rows' positions masked (a new tensor)."""
        b, K1, V = logits.shape
        flat = [i * K1 + j for i in self.rows for j in range(K1)]
        return _masked_rows(logits.reshape(b * K1, V), flat, self.bitmask).reshape(b, K1, V)


def verify_masks(requests: list[Any], drafts: list[Any], K: int, vocab_size: int) -> VerifyMasks | None:
    """Masks for verify rows [last] + drafts[i].tokens padded to K drafts, or None when no request has a
    grammar. Position j's mask is the grammar's state after drafts[i][:j]; past the first draft the
    grammar refuses (or an end-of-sequence draft) positions repeat the last valid state's mask, as
    they are never sampled from. Each matcher ends where it started."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return None
    K1 = K + 1
    bitmask = torch.full((len(rows) * K1, bitmask_width(vocab_size)), -1, dtype=torch.int32)
    num_valid = [len(d.tokens) for d in drafts]
    for k, i in enumerate(rows):
        g, d, base = requests[i].grammar, drafts[i].tokens, k * K1
        n = 0
        while True:
            g.fill_next_token_bitmask(bitmask, base + n)
            if n == len(d) or not (int(bitmask[base + n, d[n] >> 5]) >> (d[n] & 31)) & 1:
                break
            accepted = g.accept_token(d[n])
            assert accepted, "a token allowed by the grammar's mask must be accepted"
            n += 1
            if g.is_terminated():
                break  # an end-of-sequence draft: nothing is sampled after it
        if not g.is_terminated():
            bitmask[base + n + 1 : base + K1] = bitmask[base + n]
        g.rollback(n)
        num_valid[i] = n
    return VerifyMasks(rows, bitmask, num_valid)
