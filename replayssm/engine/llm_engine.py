"""LLMEngine: requests in, one engine step at a time, outputs out (shared by LLM and the server)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from replayssm.config import EngineConfig
from replayssm.engine.batch_inputs import to_device
from replayssm.engine.metrics import EngineMetrics
from replayssm.engine.model_runner import ScheduledRow
from replayssm.engine.output import OutputProcessor, RequestOutput, make_output
from replayssm.engine.request import Request
from replayssm.engine.runner_setup import RunnerSetup, build_runner
from replayssm.engine.scheduler import ScheduledChunk, Scheduler
from replayssm.ops.sampling import SamplingTensors, sample
from replayssm.sampling_params import SamplingParams


@dataclass
class _Launched:
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
    emitted: dict[int, tuple[list[int], list[float] | None]] = field(default_factory=dict)
    num_accepted: list[int] = field(default_factory=list)
    live: list[int] = field(default_factory=list)  # each row's live slot after the commit
    _host: list[torch.Tensor | None] | None = None
    _ready: Any = None  # CUDA event after the copies to `_host`

    def read_back(self) -> None:
        """Queue the sampled tokens' (and logprobs') copy to pinned host memory; no wait.

        A later `results()` waits for this copy only, not for work queued after it (a step
        launched ahead), which a plain `.tolist()` would.
        """
        if self.tokens is None or self.tokens.device.type != "cuda":
            return
        self._host = []
        for t in (self.tokens, self.logprobs):
            if t is not None:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t = h
            self._host.append(t)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def results(self) -> tuple[list[int], list[float] | None]:
        """The sampled tokens and logprobs as lists (waits for `read_back`'s copy)."""
        tokens, logprobs = self.tokens, self.logprobs
        if self._host is not None:
            self._ready.synchronize()
            tokens, logprobs = self._host
        return (tokens.tolist() if tokens is not None else [],
                logprobs.tolist() if logprobs is not None else None)


class LLMEngine:
    """Continuous-batching engine over one ModelRunner.

    ``step()``: process aborts -> schedule -> prefix-hit slot copies -> plan checkpoints ->
    runner.execute -> sample -> runner.commit (writes the checkpoints) -> append tokens,
    detokenize, check stops -> publish checkpoints + hash full KV blocks -> release finished
    requests. Sampling is keyed by (request seed, position), so outputs do not depend on
    batching, preemption or prefix hits.

    Async scheduling (`step`) splits a step into `_launch` (schedule .. commit, all queued on the
    device) and `_complete` (read back .. release) and queues step N+1's launch before step N's
    completion. DESIGN.md section 3's order then holds on the device but not on the host: step
    N's publication and releases run after step N+1 was queued. That is safe because the ahead
    step holds only one-token decode rows (no checkpoint is read, no request admitted), the
    checkpoint states of step N were written by step N's commit, queued first, and a block or slot
    released after N+1 was queued is reused only by work queued after N+1.
    """

    def __init__(self, config: EngineConfig, runner_cls: Any = None) -> None:
        setup: RunnerSetup = build_runner(config, runner_cls)
        self.config = config
        self.runner = setup.runner
        self.model_config = setup.model_config
        self.plan = setup.plan
        self.tokenizer = setup.tokenizer
        self.max_model_len = setup.max_model_len
        self.model_name = setup.model_name
        self.output = OutputProcessor(self.tokenizer, set(setup.eos_token_ids), self.max_model_len)
        self.scheduler = Scheduler(
            setup.block_pool,
            setup.slot_pool,
            kv_block_size=config.cache.kv_block_size,
            max_num_seqs=min(config.scheduler.max_num_seqs, self.plan.num_requests_fit),
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            prefix_cache=setup.prefix_cache,
            num_lookahead_tokens=config.spec.num_speculative_tokens,
            max_model_len=self.max_model_len,
        )
        self.prefix_cache = setup.prefix_cache
        self.spec = None
        if config.spec.num_speculative_tokens:
            from replayssm.engine.runner_setup import resolve_model_dir
            from replayssm.spec.decode import SpecDecoder

            model_dir = resolve_model_dir(config.model, need_weights=config.load_format != "dummy")
            self.spec = SpecDecoder(config, self.runner, model_dir)
        self.metrics = EngineMetrics()
        self._requests: dict[str, Request] = {}
        self._pending_aborts: list[str] = []
        self._seed_rng = random.Random(config.seed)
        self._arrivals = 0
        # Async scheduling (see `step`): the default on CUDA; it needs a runner that feeds tokens
        # on the device (not the tensor-parallel wrapper) and no speculative decoding.
        wanted = config.async_scheduling
        if wanted is None:
            wanted = getattr(self.runner, "device", torch.device("cpu")).type == "cuda"
        self.async_scheduling = bool(wanted) and getattr(type(self.runner), "feeds_tokens", False) \
            and self.spec is None
        self._ahead: _Launched | None = None

    # ---- requests -------------------------------------------------------------------------

    def prepare_prompt(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Validate a prompt and its params; return the prompt token ids (raises ValueError)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_name} has no tokenizer.json: pass prompts as token-id lists")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room to generate"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request; raises ValueError (and adds nothing) for bad input."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.prepare_prompt(prompt, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        request = Request(request_id, ids, params, seed=seed, arrival=self._arrivals)
        self._arrivals += 1
        self._requests[request_id] = request
        self.output.add(request)
        self.scheduler.add(request)
        self.metrics.num_requests += 1
        self.metrics.prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> None:
        """Finish a request with reason "abort" at the next step boundary (unknown ids are ignored)."""
        if request_id in self._requests:
            self._pending_aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return outputs of requests that got a token or finished.

        With async scheduling, a step whose successor is predictable (every running request
        decodes one token, no waiting request could be admitted, no drafts) launches that
        successor before reading its own tokens back: the next forward takes its input tokens
        from this step's samples on the device, and this step's host work (stop checks, outputs,
        prefix publication) runs while the GPU computes. The successor is completed by the next
        call. A request that stops here has computed one extra row there, which is dropped.
        """
        outputs = [
            self._finish(self._requests[rid], "abort")
            for rid in dict.fromkeys(self._pending_aborts)
            if rid in self._requests
        ]
        self._pending_aborts.clear()
        launched, self._ahead = self._ahead, None
        if launched is None:
            sched = self.scheduler.schedule()
            self.metrics.num_preemptions += len(sched.preempted)
            if not sched.chunks:
                return outputs
            if sched.copies:
                self.runner.copy_slots([s for s, _ in sched.copies], [d for _, d in sched.copies])
                self.scheduler.copies_done(sched)
            launched = self._launch(sched.chunks)
        if self.async_scheduling:
            self._ahead = self._launch_ahead(launched)
        outputs += self._complete(launched)
        if self._ahead is not None and all(c.request.finished for c in self._ahead.chunks):
            # Every row's request stopped in `launched`: nothing to wait for (it computed nothing kept).
            self._complete(self._ahead)
            self._ahead = None
        return outputs

    def _launch(self, chunks: list[ScheduledChunk], feed: tuple[torch.Tensor, list[int]] | None = None
                ) -> _Launched:
        """Queue one step on the device: forward, sampling, verify, commit. Reads nothing back except
        for verify rows (their acceptance decides the commit). feed: (device tokens, index per row),
        the rows' input tokens (one per row) taken on the device from an earlier step's samples."""
        self.metrics.num_steps += 1
        drafts = [None] * len(chunks)
        if self.spec is not None:
            drafts = self.spec.propose([c.request for c in chunks], [c.num_lookahead for c in chunks])
        rows = [self._row(c, d) for c, d in zip(chunks, drafts)]
        plans = None
        if self.prefix_cache is not None:
            # A verify row may cross boundaries up to its last draft; only accepted ones publish.
            plans = self.prefix_cache.plan(
                [(c.request, c.start, len(row.token_ids)) for c, row in zip(chunks, rows)]
            )
            for row, plan in zip(rows, plans):
                row.checkpoints = [(p.offset, p.slot) for p in plan] or None
        logits = self.runner.execute(rows) if feed is None else self.runner.execute(rows, feed=feed)
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
        # Logits are kept for prompt logprobs only (a step's logits are ~0.5 GB at 256 x 128k vocab).
        keep = any(c.request.wants_prompt_logprobs() for c in chunks)
        step = _Launched(chunks, rows, drafts, plans, logits if keep else None, offsets, sampled, verified)
        if sampled:
            # A device index (pinned, asynchronous): a Python list index would copy and sync.
            rows_idx = to_device(sample_rows, torch.int64, logits.device)
            step.tokens, step.logprobs = self._sample(logits[rows_idx], [chunks[i] for i in sampled])
        if verified:
            out, lps = self.spec.verify(logits, [offsets[i] for i in verified],
                                        [chunks[i].request for i in verified], [drafts[i] for i in verified])
            step.emitted = {i: (out[j], lps[j] if lps is not None else None) for j, i in enumerate(verified)}
        step.num_accepted = [len(step.emitted[i][0]) if i in step.emitted else 1 for i in range(len(rows))]
        # Queue the commit before reading tokens back, so it overlaps the device-to-host copy.
        step.live = self.runner.commit(rows, step.num_accepted) or [row.slot for row in rows]
        step.read_back()
        return step

    def _launch_ahead(self, prev: _Launched) -> _Launched | None:
        """Launch the step after `prev` before prev's tokens are read (see `step`), or None when that
        step is not known yet: drafts, prompt logprobs, a waiting request that could be admitted,
        unscheduled requests, a row that does not sample, no KV room. Requests waiting for a seat
        (max_num_seqs running, or no free slot group) do not stop it: schedule() would not admit
        them either, and once a request finishes the next step is scheduled normally."""
        if (self.spec is not None or prev.verified or self.scheduler.could_admit() or self._pending_aborts
                or len(prev.sampled) != len(prev.chunks)):
            return None
        alive = [(j, c) for j, c in enumerate(prev.chunks) if not c.request.finished]
        if len(alive) != len(self.scheduler.running) or len(alive) > self.scheduler.max_num_batched_tokens:
            return None
        bs = self.scheduler.kv_block_size
        chunks, feed, need = [], [], []
        for j, c in alive:
            r, p = c.request, c.start + c.num_tokens  # p: position of the token prev samples
            if r.wants_prompt_logprobs():
                return None
            # After prev, r holds p + 1 tokens; it stops for length there, whatever the token.
            if p + 1 - r.num_prompt_tokens >= r.params.max_tokens or p + 1 >= self.max_model_len:
                continue
            chunks.append(ScheduledChunk(r, p, 1, fed=True))
            feed.append(j)
            need.append(max(0, -(-(p + 1) // bs) - len(r.block_table)))
        if not chunks or not self.scheduler.block_pool.can_allocate(sum(need)):
            return None
        for c, n in zip(chunks, need):
            if n:
                c.request.block_table.extend(self.scheduler.block_pool.allocate(n))
        self.metrics.num_ahead_steps += 1
        return self._launch(chunks, feed=(prev.tokens, feed))

    def _complete(self, step: _Launched) -> list[RequestOutput]:
        """Read a launched step's tokens back and apply them: append, detokenize, stop checks,
        prefix publication, outputs. Rows of requests finished since the launch are dropped."""
        chunks, rows, drafts, plans = step.chunks, step.rows, step.drafts, step.plans
        tokens_list, logprobs_list = step.results()  # the step's one wait
        emitted = step.emitted
        for j, i in enumerate(step.sampled):
            emitted[i] = ([tokens_list[j]], [logprobs_list[j]] if logprobs_list is not None else None)
        verified_set = set(step.verified)  # membership per row: a list made that O(rows^2) (~0.5 ms at 256)
        dropped = [i for i, c in enumerate(chunks) if c.request.finished]
        if dropped:
            self.metrics.num_ahead_rows_dropped += len(dropped)
            for i in dropped:
                emitted.pop(i, None)
                if plans is not None:
                    self.prefix_cache.discard(plans[i])
        kept = [i for i, c in enumerate(chunks) if not c.request.finished]
        for i in kept:
            chunk, row, off, slot = chunks[i], rows[i], step.offsets[i], step.live[i]
            if row.num_logits and drafts[i] is None and chunk.request.wants_prompt_logprobs():
                self._record_prompt_logprobs(chunk, step.logits[off : off + row.num_logits])
            if chunk.request.slots and chunk.request.slots[0] != slot:
                # Baseline verify: the state at the last accepted token lives in that spec slot.
                chunk.request.slots.remove(slot)
                chunk.request.slots.insert(0, slot)
        for i in kept:
            chunk = chunks[i]
            computed = step.num_accepted[i] if i in verified_set else chunk.num_tokens
            chunk.request.num_computed_tokens += computed
            if chunk.num_tokens == 1 and chunk.start > 0:
                self.metrics.num_decode_tokens_computed += len(rows[i].token_ids)
            else:
                self.metrics.num_prefill_tokens_computed += chunk.num_tokens
        reasons: dict[int, str | None] = {}
        for i in sorted(emitted):
            r = chunks[i].request
            toks, lps = emitted[i]
            if i in verified_set:
                self.metrics.spec_draft_tokens += len(drafts[i].tokens)
                self.metrics.spec_accepted_tokens += len(toks) - 1
            for j, t in enumerate(toks):
                reason = self.output.append_token(r, t, lps[j] if lps is not None else None)
                self.metrics.generation_tokens += 1
                if reason is not None:
                    # Tokens after a stop are dropped: computed positions end before the last token.
                    r.num_computed_tokens = min(r.num_computed_tokens, r.num_tokens - 1)
                    break
            reasons[i] = reason
        advanced = {i: chunks[i].request.num_computed_tokens - chunks[i].start for i in kept}
        if plans is not None:
            # Publication happens before any block of this step is released.
            for i in kept:
                self.prefix_cache.finish(chunks[i].request, chunks[i].start, advanced[i], plans[i])
        if self.spec is not None:
            alive = [i for i in kept if reasons.get(i) is None]
            self.spec.observe([chunks[i].request for i in alive], alive, [chunks[i].start for i in alive],
                              [advanced[i] for i in alive])
        outputs = []
        for i, reason in reasons.items():
            r = chunks[i].request
            out = self._finish(r, reason) if reason is not None else make_output(r)
            out.synthetic_spec = self.spec is not None and not self.spec.produces_model_output
            outputs.append(out)
        self.metrics.peak_running_requests = max(
            self.metrics.peak_running_requests, len(self.scheduler.running)
        )
        self.metrics.peak_kv_blocks_used = max(
            self.metrics.peak_kv_blocks_used, self.scheduler.block_pool.num_used
        )
        return outputs

    def _row(self, chunk: ScheduledChunk, drafts: Any = None) -> ScheduledRow:
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
                spec_slots=None if self.config.replayssm else list(r.slots[:q]),
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

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, Any]:
        reqs = [c.request for c in chunks]
        params = SamplingTensors.build(
            temperature=[r.params.temperature for r in reqs],
            top_k=[r.params.top_k for r in reqs],
            top_p=[r.params.top_p for r in reqs],
            seeds=[r.seed for r in reqs],
            positions=[c.start + c.num_tokens for c in chunks],  # the sampled token's position
            vocab_size=logits.shape[-1],
            device=logits.device,
        )
        return sample(logits, params, need_logprobs=any(r.params.logprobs is not None for r in reqs))

    def _record_prompt_logprobs(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Logits at positions p predict token p + 1; keep those that land inside the prompt."""
        r = chunk.request
        first = chunk.start + chunk.num_tokens - logits.shape[0]
        stop = min(chunk.start + chunk.num_tokens, r.num_prompt_tokens - 1)
        if stop <= first:
            return
        targets = torch.tensor(r.prompt_token_ids[first + 1 : stop + 1], device=logits.device)
        lp = logits[: stop - first].log_softmax(dim=-1).gather(-1, targets[:, None]).squeeze(-1).tolist()
        # Chunks arrive in order; a recompute after preemption starts over and overwrites.
        r.prompt_logprobs = (r.prompt_logprobs or [None])[: first + 1]
        assert len(r.prompt_logprobs) == first + 1, "prompt logprobs must arrive in order"
        r.prompt_logprobs.extend(lp)

    def _finish(self, r: Request, reason: str) -> RequestOutput:
        self.scheduler.finish(r, reason)
        if self.spec is not None:
            self.spec.release(r)
        del self._requests[r.request_id]
        self.output.remove(r)
        self.metrics.num_requests_finished += 1
        if reason == "abort":
            self.metrics.num_requests_aborted += 1
        return make_output(r)

    def check_integrity(self) -> None:
        """Assert the scheduler's pool accounting, counting the checkpoints of a step in flight."""
        plans = self._ahead.plans if self._ahead is not None else None
        self.scheduler.check_integrity(lent_slots=sum(len(p) for p in plans) if plans else 0)

    def close(self) -> None:
        """Release the runner's resources (tensor-parallel workers drop their shard); idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def get_metrics(self) -> dict[str, Any]:
        """Counters since start plus current occupancy and the cache plan."""
        m: dict[str, Any] = self.metrics.as_dict()
        m.update(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.scheduler.block_pool.num_used,
            num_kv_blocks=self.plan.num_kv_blocks,
            num_slots=self.plan.num_slots,
            slots_per_request=self.plan.slots_per_request,
            num_requests_fit=self.plan.num_requests_fit,
            cache_bytes=self.plan.total_bytes,
        )
        pc = self.prefix_cache
        if pc is not None:
            m.update(
                prefix_cache_query_tokens=pc.num_query_tokens,
                prefix_cache_hit_tokens=pc.num_hit_tokens,
                prefix_cache_hit_rate=pc.num_hit_tokens / max(1, pc.num_query_tokens),
                prefix_checkpoints_published=pc.num_published,
                prefix_checkpoints_cached=self.scheduler.slot_pool.num_cached,
                prefix_checkpoint_evictions=self.scheduler.slot_pool.num_evictions,
                kv_blocks_cached=self.scheduler.block_pool.num_cached,
                kv_block_evictions=self.scheduler.block_pool.num_evictions,
            )
        if self.spec is not None:
            m.update(self.spec.metrics())
        return m
