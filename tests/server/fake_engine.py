"""A deterministic stand-in for LLMEngine that follows the ENGINE.md interface exactly.

Byte-level tokenizer; the token at output position t is a letter chosen by hashing (prompt,
t, seed), so the same request always yields the same tokens whatever the batch around it.
It keeps a slot pool (max_num_seqs) and a block pool so tests can prove nothing leaked, a
waiting queue, a toy prefix cache (a prompt seen before reports its whole blocks as cached),
and aborts that free memory at the next step boundary.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from replayssm.engine.request import InputError
from replayssm.sampling_params import SamplingParams


@dataclass
class FakeOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    # RequestOutput's copy-free accessors.
    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def has_logprobs(self) -> bool:
        return self.logprobs is not None

    def tokens_since(self, start: int) -> list[int]:
        return self.token_ids[start:]

    def logprobs_since(self, start: int) -> list[float] | None:
        return None if self.logprobs is None else self.logprobs[start:]

    def top_logprobs_since(self, start: int) -> list[list[tuple[int, float]]] | None:
        return None if self.top_logprobs is None else self.top_logprobs[start:]


class ByteTokenizer:
    vocab_size = 256
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + "<assistant>" if add_generation_prompt else text


def fake_token(prompt: list[int], position: int, seed: int | None) -> int:
    """Letters and spaces only, so text deltas are plain ASCII."""
    digest = hashlib.blake2b(bytes(prompt) + f"|{position}|{seed}".encode(), digest_size=2).digest()
    alphabet = b"abcdefghijklmnopqrstuvwxyz "
    return alphabet[int.from_bytes(digest, "little") % len(alphabet)]


@dataclass
class _Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    out: list[int] = field(default_factory=list)
    blocks: int = 0
    cached: int = 0
    aborted: bool = False


class FakeEngine:
    def __init__(self, max_model_len: int = 96, max_num_seqs: int = 8, num_blocks: int = 256,
                 block_size: int = 8, step_sleep_s: float = 0.0):
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.model_name = "fake"
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.free_blocks = num_blocks
        self.block_size = block_size
        self.step_sleep_s = step_sleep_s
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.seen_prompts: set[tuple[int, ...]] = set()
        self.num_steps = 0
        self.num_aborted = 0

    def add_request(self, request_id: str, prompt, params: SamplingParams, parent_id=None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InputError("prompt must be non-empty", "prompt")
        if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise InputError(f"prompt token ids must be in [0, {self.tokenizer.vocab_size})", "prompt")
        if len(ids) >= self.max_model_len:
            raise InputError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}", "prompt")
        if any(r.request_id == request_id for r in self.waiting + self.running):
            raise ValueError(f"request_id {request_id!r} already exists")
        self.waiting.append(_Req(request_id, ids, params))

    def abort_request(self, request_id: str) -> None:
        for r in self.waiting + self.running:
            if r.request_id == request_id:
                r.aborted = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _need_blocks(self, r: _Req) -> int:
        return -(-(len(r.prompt) + len(r.out) + 1) // self.block_size)

    def step(self) -> list[FakeOutput]:
        self.num_steps += 1
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        outputs = []
        for r in [r for r in self.waiting + self.running if r.aborted]:
            (self.waiting if r in self.waiting else self.running).remove(r)
            self.free_blocks += r.blocks
            self.num_aborted += 1
            outputs.append(self._output(r, True, "abort"))
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            key = tuple(r.prompt)
            whole_blocks = (len(r.prompt) - 1) // self.block_size * self.block_size
            r.cached = whole_blocks if key in self.seen_prompts else 0
            self.seen_prompts.add(key)
            self.running.append(r)
        for r in list(self.running):
            grow = self._need_blocks(r) - r.blocks
            assert grow <= self.free_blocks, "fake engine ran out of blocks"
            self.free_blocks -= grow
            r.blocks += grow
            seed = None if r.params.greedy else r.params.seed
            r.out.append(fake_token(r.prompt, len(r.out), seed))
            text = self.tokenizer.decode(r.out)
            reason = None
            for s in r.params.stop or []:
                if s in text:
                    text, reason = text[: text.index(s)], "stop"
            if reason is None and len(r.out) >= r.params.max_tokens:
                reason = "length"
            if reason is not None:
                self.running.remove(r)
                self.free_blocks += r.blocks
            outputs.append(self._output(r, reason is not None, reason, text))
        return outputs

    def _output(self, r: _Req, finished: bool, reason: str | None, text: str | None = None) -> FakeOutput:
        logprobs = [-0.25 - 0.01 * i for i in range(len(r.out))] if r.params.logprobs is not None else None
        # Alternatives: the chosen token first, then the next byte values, each 1 nat less likely.
        n = r.params.top_logprobs
        tops = [[((t + k) % 256, lp - k) for k in range(n)] for t, lp in zip(r.out, logprobs)] if n else None
        text = self.tokenizer.decode(r.out) if text is None else text
        return FakeOutput(r.request_id, r.prompt, list(r.out), text, finished, reason, r.cached, logprobs,
                          tops)

    def get_metrics(self) -> dict:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting), "num_preemptions": 0,
                "num_steps": self.num_steps}

    def check_integrity(self) -> None:
        used = sum(r.blocks for r in self.running)
        assert self.free_blocks + used == self.num_blocks, (self.free_blocks, used, self.num_blocks)

    def generate_offline(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """What an offline generate() of one request returns (tokens), computed directly."""
        seed = None if params.greedy else params.seed
        return [fake_token(prompt, t, seed) for t in range(params.max_tokens)]
