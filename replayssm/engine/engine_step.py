"""The pieces of one engine step that need no engine state: the launched step's record and
read-back, each chunk's model row, sampling, and prompt logprobs.

`LLMEngine` (llm_engine.py) runs a step in two halves on them:

    _launch    propose drafts -> rows -> plan checkpoints -> runner.execute -> sample (or verify)
               -> runner.commit -> queue the sampled tokens' copy to the host      (no wait, except
               verify rows: their accepted counts decide the commit; with defer_verify the commit
               takes them on the device and they come back with the tokens)
    _complete  wait for that copy -> append tokens, detokenize, stop checks -> publish checkpoints
               + hash full KV blocks -> release finished requests -> outputs
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from replayssm.engine.logits_inputs import build_logits_processors
from replayssm.engine.model_runner import ScheduledRow
from replayssm.engine.scheduler import ScheduledChunk
from replayssm.engine.structured import mask_logits
from replayssm.ops.sampling import SamplingTensors, apply_logits_processors, sample, token_logprobs, top_pairs


@dataclass
class LaunchedStep:
    """One engine step queued on the device whose results the engine has not applied yet."""

    chunks: list[ScheduledChunk]
    rows: list[ScheduledRow]
    drafts: list[Any]
    plans: list[Any] | None  # prefix-cache checkpoints planned per row
    logits: torch.Tensor | None  # kept only when a row records prompt logprobs
    offsets: list[int]  # each row's first logit
    sampled: list[int]  # rows that sample one token (in `tokens` order)
    verified: list[int]  # verify rows
    tokens: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, logprobs) (rows, n): alternatives
    # Per row: (tokens, their logprobs or None, per token its most likely (id, logprob) pairs or None).
    emitted: dict[int, tuple[list[int], list[float] | None, list[Any] | None]] = field(default_factory=dict)
    num_accepted: list[int] = field(default_factory=list)
    live: list[int] = field(default_factory=list)  # each row's live slot after the commit
    # A deferred verify (`LLMEngine._launch(defer_verify=True)`): its tokens, emitted counts, logprobs and
    # alternatives' (ids, logprobs) on the device (`SpecDecoder.verify_launch`), and the runner's
    # commit_async handle; `LLMEngine._complete` reads them back and finishes both.
    verify: tuple[torch.Tensor | None, ...] | None = None
    commit: Any = None
    _host: list[torch.Tensor | None] | None = None
    _ready: Any = None  # CUDA event after the copies to `_host`
    _verify_lists: list[Any] = field(default_factory=list)

    def _device_results(self) -> list[torch.Tensor | None]:
        return [self.tokens, self.logprobs, *(self.top or (None, None)), *(self.verify or ())]

    def read_back(self) -> None:
        """Queue the sampled tokens' (logprobs', a deferred verify's) copy to pinned host memory;
        no wait.

        A later `results()` waits for this copy only, not for work queued after it (a step
        launched ahead, the other group's step), which a plain `.tolist()` would.
        """
        tensors = self._device_results()
        if not any(t is not None and t.device.type == "cuda" for t in tensors):
            return
        self._host = []
        for t in tensors:
            if t is not None:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t = h
            self._host.append(t)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def results(self) -> tuple[list[int], list[float] | None, list[list[tuple[int, float]]] | None]:
        """The sampled tokens, their logprobs and alternatives as lists (waits for `read_back`'s
        copy); with a deferred verify, also its results as lists (`verify_results`)."""
        host = self._device_results()
        if self._host is not None:
            self._ready.synchronize()
            host = self._host
        lists = [t.tolist() if t is not None else None for t in host]
        self._verify_lists = lists[4:]
        top = top_pairs(lists[2], lists[3]) if lists[2] is not None else None
        return lists[0] if lists[0] is not None else [], lists[1], top

    def verify_results(self) -> tuple[Any, ...]:
        """A deferred verify's (tokens, emitted counts, logprobs, alternatives' ids, their logprobs)
        as lists; after `results()`."""
        return tuple(self._verify_lists)


def row_of(results: tuple, j: int) -> tuple:
    """Row j of a verify's (tokens, logprobs or None, alternatives or None) per-row lists."""
    return tuple(x[j] if x is not None else None for x in results)


def build_row(chunk: ScheduledChunk, drafts: Any, replayssm: bool) -> ScheduledRow:
    """The model row of one scheduled chunk (a verify row when it carries drafts)."""
    r = chunk.request
    if drafts is not None:
        # Verify row: [last] + drafts; the baseline writes one state per token into spec slots.
        q = 1 + len(drafts.tokens)
        return ScheduledRow(
            token_ids=r.token_slice(chunk.start, chunk.start + 1) + list(drafts.tokens),
            start_pos=chunk.start,
            block_table=r.block_table,  # read during this step only: no copy
            slot=r.slots[0],
            is_prefill=False,
            num_logits=q,
            spec_slots=None if replayssm else list(r.slots[:q]),
        )
    # A one-token chunk on top of existing state is a decode row (ReplaySSM path + commit).
    is_prefill = not (chunk.num_tokens == 1 and chunk.start > 0)
    if not is_prefill:
        num_logits = 1
    elif r.wants_prompt_logprobs() and chunk.start < r.num_prompt_tokens - 1:
        num_logits = chunk.num_tokens
    else:
        num_logits = 1 if chunk.samples else 0
    return ScheduledRow(
        token_ids=[0] if chunk.fed else r.token_slice(chunk.start, chunk.start + chunk.num_tokens),
        start_pos=chunk.start,
        block_table=r.block_table,  # read during this step only: no copy
        slot=r.slots[0],
        is_prefill=is_prefill,
        num_logits=num_logits,
    )


def sample_chunks(logits: torch.Tensor, chunks: list[ScheduledChunk],
                  fed: tuple[torch.Tensor, list[int | None]] | None = None) -> tuple[torch.Tensor, Any, Any]:
    """(tokens (b,), their logprobs (b,) or None, and (ids, logprobs) (b, n) of the n most likely
    tokens when a request wants n > 0 alternatives, else None) for the rows' last logits.

    The tokens come from the processed logits (`apply_logits_processors`), the logprobs from the raw
    ones. fed: (device tokens, per row the index of its last input token there), for rows whose last
    token the host has not read back yet (the penalties count it)."""
    reqs = [c.request for c in chunks]
    temperature, top_k, top_p, min_p, seeds = [], [], [], [], []
    for r in reqs:
        p = r.params
        temperature.append(p.temperature)
        top_k.append(p.top_k)
        top_p.append(p.top_p)
        min_p.append(p.min_p)
        seeds.append(r.seed)
    params = SamplingTensors.build(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seeds=seeds,
        positions=[c.start + c.num_tokens for c in chunks],  # the sampled token's position
        vocab_size=logits.shape[-1],
        device=logits.device,
        min_p=min_p,
    )
    processors = build_logits_processors(reqs, logits.shape[-1], logits.device, fed=fed)
    # The processed, then grammar-masked logits are sampled; logprobs below stay the model's own.
    tokens = sample(mask_logits(apply_logits_processors(logits, processors), reqs), params)
    asked = [r.params.top_logprobs for r in reqs if r.params.logprobs is not None]
    if not asked:
        return tokens, None, None
    return tokens, *token_logprobs(logits, tokens, max(asked))


def record_prompt_logprobs(chunk: ScheduledChunk, logits: torch.Tensor) -> None:
    """Logits at positions p predict token p + 1; keep those that land inside the prompt."""
    r = chunk.request
    first = chunk.start + chunk.num_tokens - logits.shape[0]
    stop = min(chunk.start + chunk.num_tokens, r.num_prompt_tokens - 1)
    if stop <= first:
        return
    targets = torch.tensor(r.prompt_token_ids[first + 1 : stop + 1], device=logits.device)
    lp, top = token_logprobs(logits[: stop - first], targets, r.params.prompt_logprobs)
    # Chunks arrive in order; a recompute after preemption starts over and overwrites.
    r.prompt_logprobs = (r.prompt_logprobs or [None])[: first + 1]
    assert len(r.prompt_logprobs) == first + 1, "prompt logprobs must arrive in order"
    r.prompt_logprobs.extend(lp.tolist())
    if top is not None:
        r.prompt_top_logprobs = (r.prompt_top_logprobs or [None])[: first + 1]
        r.prompt_top_logprobs.extend(top_pairs(top[0].tolist(), top[1].tolist()))
