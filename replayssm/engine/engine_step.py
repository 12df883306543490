"""One engine step in two halves: `launch` queues it on the device, `complete` reads it back and applies it.

    launch    propose drafts -> rows -> plan checkpoints -> runner.execute -> sample (or verify)
              -> runner.commit -> queue the sampled tokens' copy to the host      (no wait, except
              verify rows: their accepted counts decide the commit; with defer_verify the commit
              takes them on the device and they come back with the tokens)
    complete  wait for that copy -> append tokens, detokenize, stop checks -> publish checkpoints
              + hash full KV blocks -> release finished requests -> outputs

`LLMEngine.step` runs both for one step; with async scheduling it queues the next step with
`launch_ahead` between them (its input tokens are this step's samples, on the device), so the
host's `complete` overlaps the GPU's next step. With speculative decoding it alternates two request
groups instead: one group's `complete` and next `launch` (deferred verify) overlap the GPU's step of
the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from replayssm.engine.batch_inputs import to_device
from replayssm.engine.model_runner import ScheduledRow
from replayssm.engine.output import RequestOutput, make_output
from replayssm.engine.scheduler import ScheduledChunk
from replayssm.ops.sampling import top_pairs

if TYPE_CHECKING:
    from replayssm.engine.llm_engine import LLMEngine


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
    # A deferred verify (`launch(defer_verify=True)`): its tokens, emitted counts, logprobs and
    # alternatives' (ids, logprobs) on the device (`SpecDecoder.verify_launch`), and the runner's
    # commit_async handle; `complete` reads them back and finishes both.
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


def _row_of(results: tuple, j: int) -> tuple:
    """Row j of a verify's (tokens, logprobs or None, alternatives or None) per-row lists."""
    return tuple(x[j] if x is not None else None for x in results)


def launch(engine: LLMEngine, chunks: list[ScheduledChunk],
           feed: tuple[torch.Tensor, list[int]] | None = None, defer_verify: bool = False) -> LaunchedStep:
    """Queue one step on the device: forward, sampling, verify, commit. Reads nothing back except
    for verify rows (their acceptance decides the commit), unless defer_verify: then the verify and
    the commit run on the device with the counts there (`runner.commit_async`) and `complete`
    reads everything back. feed: (device tokens, index per row), the rows' input tokens (one per
    row) taken on the device from an earlier step's samples."""
    engine.metrics.num_steps += 1
    drafts = [None] * len(chunks)
    if engine.spec is not None:
        drafts = engine.spec.propose([c.request for c in chunks], [c.num_lookahead for c in chunks])
    rows = [engine._row(c, d) for c, d in zip(chunks, drafts)]
    plans = None
    if engine.prefix_cache is not None:
        # A verify row may cross boundaries up to its last draft; only accepted ones publish.
        plans = engine.prefix_cache.plan(
            [(c.request, c.start, len(row.token_ids)) for c, row in zip(chunks, rows)]
        )
        for row, plan in zip(rows, plans):
            row.checkpoints = [(p.offset, p.slot) for p in plan] or None
    logits = engine.runner.execute(rows) if feed is None else engine.runner.execute(rows, feed=feed)
    offsets, sample_rows, sampled = [], [], []
    offset = 0
    for i, (chunk, row, d) in enumerate(zip(chunks, rows, drafts)):
        offsets.append(offset)
        if d is None and chunk.samples:
            sample_rows.append(offset + row.num_logits - 1)
            sampled.append(i)
        offset += row.num_logits
    assert logits.shape[0] == offset, (logits.shape, offset)
    verified = [i for i, d in enumerate(drafts) if d is not None]
    # Logits are kept for prompt logprobs only (fp32: 134 MB for 256 rows x 128k vocab, 4x that to verify).
    keep = any(c.request.wants_prompt_logprobs() for c in chunks)
    step = LaunchedStep(chunks, rows, drafts, plans, logits if keep else None, offsets, sampled, verified)
    if sampled:
        # A device index (pinned, asynchronous): a Python list index would copy and sync.
        rows_idx = to_device(sample_rows, torch.int64, logits.device)
        step.tokens, step.logprobs, step.top = engine._sample(logits[rows_idx], [chunks[i] for i in sampled])
    args = ([offsets[i] for i in verified], [chunks[i].request for i in verified],
            [drafts[i] for i in verified])
    if verified and defer_verify:
        step.verify = engine.spec.verify_launch(logits, *args)
        # Every row accepts 1 but the verify rows, which accept their emitted counts.
        accepted = torch.ones(len(rows), dtype=torch.int32, device=logits.device)
        accepted[to_device(verified, torch.int64, logits.device)] = step.verify[1].to(torch.int32)
        step.commit = engine.runner.commit_async(rows, accepted)
        step.read_back()
        return step
    if verified:
        results = engine.spec.verify(logits, *args)
        step.emitted = {i: _row_of(results, j) for j, i in enumerate(verified)}
    step.num_accepted = [len(step.emitted[i][0]) if i in step.emitted else 1 for i in range(len(rows))]
    # Queue the commit before reading tokens back, so it overlaps the device-to-host copy.
    step.live = engine.runner.commit(rows, step.num_accepted) or [row.slot for row in rows]
    step.read_back()
    return step


def launch_ahead(engine: LLMEngine, prev: LaunchedStep) -> LaunchedStep | None:
    """Launch the step after `prev` before prev's tokens are read (see `LLMEngine.step`), or None
    when that step is not known yet: drafts, prompt logprobs, a waiting request that could be admitted,
    unscheduled requests, a row that does not sample, no KV room. Requests waiting for a seat
    (max_num_seqs running, or no free slot group) do not stop it: schedule() would not admit
    them either, and once a request finishes the next step is scheduled normally."""
    if (engine.spec is not None or prev.verified or engine.scheduler.could_admit() or engine._pending_aborts
            or len(prev.sampled) != len(prev.chunks)):
        return None
    alive = [(j, c) for j, c in enumerate(prev.chunks) if not c.request.finished]
    if len(alive) != len(engine.scheduler.running) or len(alive) > engine.scheduler.max_num_batched_tokens:
        return None
    bs = engine.scheduler.kv_block_size
    chunks, feed, need = [], [], []
    for j, c in alive:
        r, p = c.request, c.start + c.num_tokens  # p: position of the token prev samples
        if r.wants_prompt_logprobs():
            return None
        # After prev, r holds p + 1 tokens; it stops for length there, whatever the token.
        if p + 1 - r.num_prompt_tokens >= r.params.max_tokens or p + 1 >= engine.max_model_len:
            continue
        chunks.append(ScheduledChunk(r, p, 1, fed=True))
        feed.append(j)
        need.append(max(0, -(-(p + 1) // bs) - len(r.block_table)))
    if not chunks or not engine.scheduler.block_pool.can_allocate(sum(need)):
        return None
    for c, n in zip(chunks, need):
        if n:
            c.request.block_table.extend(engine.scheduler.block_pool.allocate(n))
    engine.metrics.num_ahead_steps += 1
    return launch(engine, chunks, feed=(prev.tokens, feed))


def complete(engine: LLMEngine, step: LaunchedStep) -> list[RequestOutput]:
    """Read a launched step's tokens back and apply them: append, detokenize, stop checks,
    prefix publication, outputs. Rows of requests finished since the launch are dropped."""
    chunks, rows, drafts, plans = step.chunks, step.rows, step.drafts, step.plans
    tokens_list, logprobs_list, top_list = step.results()  # the step's one wait
    emitted = step.emitted
    for j, i in enumerate(step.sampled):
        emitted[i] = ([tokens_list[j]], [logprobs_list[j]] if logprobs_list is not None else None,
                      [top_list[j]] if top_list is not None else None)
    verified_set = set(step.verified)  # membership per row: a list made that O(rows^2) (~0.5 ms at 256)
    kept, dropped = [], []  # dropped: rows of requests finished since the launch (a step launched ahead)
    for i, c in enumerate(chunks):
        (dropped if c.request.finished else kept).append(i)
    if step.verify is not None:
        results = engine.spec.verify_finish([drafts[i] for i in step.verified], *step.verify_results())
        for j, i in enumerate(step.verified):
            emitted[i] = _row_of(results, j)
        step.num_accepted = [len(emitted[i][0]) if i in verified_set else 1 for i in range(len(rows))]
        keep = [not c.request.finished for c in chunks]
        step.live = engine.runner.finish_commit(step.commit, rows, step.num_accepted, keep)
    for i in dropped:
        engine.metrics.num_ahead_rows_dropped += 1
        emitted.pop(i, None)
        if plans is not None:
            engine.prefix_cache.discard(plans[i])
    for i in kept:
        chunk, row, off, slot = chunks[i], rows[i], step.offsets[i], step.live[i]
        if row.num_logits and drafts[i] is None and chunk.request.wants_prompt_logprobs():
            engine._record_prompt_logprobs(chunk, step.logits[off : off + row.num_logits])
        if chunk.request.slots and chunk.request.slots[0] != slot:
            # Baseline verify: the state at the last accepted token lives in that spec slot.
            chunk.request.slots.remove(slot)
            chunk.request.slots.insert(0, slot)
    for i in kept:
        chunk = chunks[i]
        computed = step.num_accepted[i] if i in verified_set else chunk.num_tokens
        chunk.request.num_computed_tokens += computed
        if chunk.num_tokens == 1 and chunk.start > 0:
            engine.metrics.num_decode_tokens_computed += len(rows[i].token_ids)
        else:
            engine.metrics.num_prefill_tokens_computed += chunk.num_tokens
    reasons: dict[int, str | None] = {}
    for i in sorted(emitted):
        r = chunks[i].request
        toks, lps, tops = emitted[i]
        if i in verified_set:
            engine.metrics.spec_draft_tokens += len(drafts[i].tokens)
            engine.metrics.spec_accepted_tokens += len(toks) - 1
        for j, t in enumerate(toks):
            reason = engine.output.append_token(r, t, lps[j] if lps is not None else None,
                                                tops[j] if tops is not None else None)
            engine.metrics.generation_tokens += 1
            if reason is not None:
                # Tokens after a stop are dropped: computed positions end before the last token.
                r.num_computed_tokens = min(r.num_computed_tokens, r.num_tokens - 1)
                break
        reasons[i] = reason
    advanced = {i: chunks[i].request.num_computed_tokens - chunks[i].start for i in kept}
    if plans is not None:
        # Publication happens before any block of this step is released.
        for i in kept:
            engine.prefix_cache.finish(chunks[i].request, chunks[i].start, advanced[i], plans[i])
    if engine.spec is not None:
        alive = [i for i in kept if reasons.get(i) is None]
        engine.spec.observe([chunks[i].request for i in alive], alive, [chunks[i].start for i in alive],
                            [advanced[i] for i in alive])
    outputs = []
    for i, reason in reasons.items():
        r = chunks[i].request
        out = engine._finish(r, reason) if reason is not None else make_output(r)
        out.synthetic_spec = engine.spec is not None and not engine.spec.produces_model_output
        outputs.append(out)
    engine.metrics.peak_running_requests = max(
        engine.metrics.peak_running_requests, len(engine.scheduler.running)
    )
    engine.metrics.peak_kv_blocks_used = max(
        engine.metrics.peak_kv_blocks_used, engine.scheduler.block_pool.num_used
    )
    return outputs
