"""LLMEngine: requests in, one engine step at a time, outputs out (shared by LLM and the server)."""

from __future__ import annotations

import random
from typing import Any

import torch

from replayssm.config import EngineConfig
from replayssm.engine.batch_inputs import to_device
from replayssm.engine.engine_step import (
    LaunchedStep,
    build_row,
    record_prompt_logprobs,
    row_of,
    sample_chunks,
)
from replayssm.engine.metrics import EngineMetrics
from replayssm.engine.output import OutputProcessor, RequestOutput, make_output
from replayssm.engine.request import InputError, Request
from replayssm.engine.runner_setup import RunnerSetup, build_runner
from replayssm.engine.scheduler import ScheduledChunk, Scheduler
from replayssm.engine.structured import StructuredOutputs, accept_token
from replayssm.sampling_params import SamplingParams


class LLMEngine:
    """Continuous-batching engine over one ModelRunner.

    ``step()``: process aborts -> schedule -> prefix-hit slot copies -> plan checkpoints ->
    runner.execute -> sample -> runner.commit (writes the checkpoints) -> append tokens,
    detokenize, check stops -> publish checkpoints + hash full KV blocks -> release finished
    requests. Sampling is keyed by (request seed, position), so outputs do not depend on
    batching, preemption or prefix hits.

    Async scheduling (`step`) queues step N+1's launch (`_launch`: schedule .. commit, all
    queued on the device) before step N's completion (read back .. release). DESIGN.md section 3's
    order then holds on the device but not on the host: step N's publication and releases run
    after step N+1 was queued. That is safe because the ahead step holds only one-token decode rows
    (no checkpoint is read, no request admitted), the checkpoint states of step N were written by
    step N's commit, queued first, and a block or slot released after N+1 was queued is reused
    only by work queued after N+1.

    With speculative decoding, async scheduling interleaves two request groups instead
    (`_step_group`): the next verify step of a group depends on its accepted counts, so it cannot
    be launched ahead, but the other group's step can run meanwhile. Each group's own steps keep
    section 3's order (its commit takes the counts on the device and the host mirror follows when
    they are read back); the scheduler preempts only inside the group it schedules, since the other
    group's step may be in flight (DESIGN.md says "the newest running request"; here it is the
    newest of the group). Prefix caching keeps synchronous steps: its publications read the
    counts before the commit.
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
        # The checkpoint's generation_config.json sampling defaults (SamplingParams field names): what a
        # request that leaves a field unset gets (LLM.generate without params, the server).
        self.generation_defaults = dict(setup.generation_defaults)
        self.output = OutputProcessor(self.tokenizer, set(setup.eos_token_ids), self.max_model_len)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, setup.eos_token_ids)
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
            from replayssm.speculative.decode import SpecDecoder

            model_dir = resolve_model_dir(config.model, need_weights=config.load_format != "dummy")
            self.spec = SpecDecoder(config, self.runner, model_dir)
        self.metrics = EngineMetrics()
        self._requests: dict[str, Request] = {}
        self._pending_aborts: list[str] = []
        self._seed_rng = random.Random(config.seed)
        self._arrivals = 0
        # Async scheduling (see `step`): the default on CUDA; it needs a runner that feeds tokens
        # on the device (not the tensor-parallel wrapper) and no speculative decoding. With
        # speculative decoding it interleaves two request groups instead (`_step_group`), where the
        # commit can take the accepted counts on the device (no checkpoints to publish: no prefix
        # caching) and the drafter keeps no device state (ngram, synthetic).
        wanted = config.async_scheduling
        if wanted is None:
            wanted = getattr(self.runner, "device", torch.device("cpu")).type == "cuda"
        self.async_scheduling = bool(wanted) and getattr(type(self.runner), "feeds_tokens", False) \
            and self.spec is None
        self.interleave = bool(wanted) and self.spec is not None and self.spec.proposer.host_only \
            and self.prefix_cache is None and hasattr(self.runner, "commit_async")
        self._ahead: LaunchedStep | None = None
        self._inflight: list[LaunchedStep | None] = [None, None]  # per request group (interleave)
        self._turn = 0

    # ---- requests -------------------------------------------------------------------------

    def prepare_prompt(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Validate a prompt and its params; return the prompt token ids (raises ValueError)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise InputError("prompt is empty", "prompt")
            if self.tokenizer is None:
                raise InputError(f"{self.model_name} has no tokenizer.json: pass prompts as token-id lists",
                                 "prompt")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise InputError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}", "prompt")
        else:
            raise InputError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                             "prompt")
        if not ids:
            raise InputError("prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise InputError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no "
                             f"room to generate", "prompt")
        vocab = self.model_config.vocab_size
        if params.logit_bias is not None and max(params.logit_bias) >= vocab:
            raise InputError(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}",
                             "logit_bias")
        if params.stop and self.tokenizer is None:
            raise InputError("stop strings need a tokenizer; this model has none (use stop_token_ids)",
                             "stop")
        if params.structured is not None:
            self.structured.compile(params.structured)  # a bad schema or regex is refused here
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    parent_id: str | None = None) -> None:
        """Queue a request; raises ValueError (and adds nothing) for bad input. parent_id: the client
        request it belongs to, for the scheduler's fair share between client requests."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.prepare_prompt(prompt, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        request = Request(request_id, ids, params, seed=seed, arrival=self._arrivals, parent_id=parent_id)
        if params.min_tokens:
            eos = () if params.ignore_eos else self.output.eos_token_ids
            vocab = self.model_config.vocab_size
            stop_ids = {*eos, *(params.stop_token_ids or ())}
            request.min_tokens_stop_ids = sorted(t for t in stop_ids if t < vocab)
        if params.structured is not None:
            request.grammar = self.structured.matcher(params.structured)
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
        if self.interleave:
            return outputs + self._step_group()
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

    def _step_group(self) -> list[RequestOutput]:
        """One step of one of two request groups, taking turns: complete the group's step in flight,
        then schedule and launch its next one with a deferred verify (`_launch`), which
        reads nothing back. The other group's step, queued before, keeps the GPU busy meanwhile:
        one group's host work (read back, stop checks, outputs, scheduling, drafting, inputs)
        overlaps the other's forward. Each group's steps stay in order on the device, and the two
        never share a request, a slot or a KV block (preemption stays inside the group)."""
        g, self._turn = self._turn, self._turn ^ 1
        outputs = []
        launched, self._inflight[g] = self._inflight[g], None
        if launched is not None:
            outputs += self._complete(launched)
        sched = self.scheduler.schedule(group=g)
        self.metrics.num_preemptions += len(sched.preempted)
        if sched.chunks:
            self._inflight[g] = self._launch(sched.chunks, defer_verify=True)
        return outputs

    def _launch(self, chunks: list[ScheduledChunk], feed: tuple[torch.Tensor, list[int]] | None = None,
                defer_verify: bool = False) -> LaunchedStep:
        """Queue one step on the device: forward, sampling, verify, commit. Reads nothing back except
        for verify rows (their acceptance decides the commit), unless defer_verify: then the verify and
        the commit run on the device with the counts there (`runner.commit_async`) and `_complete`
        reads everything back. feed: (device tokens, index per row), the rows' input tokens (one per
        row) taken on the device from an earlier step's samples."""
        self.metrics.num_steps += 1
        drafts = [None] * len(chunks)
        if self.spec is not None:
            drafts = self.spec.propose([c.request for c in chunks], [c.num_lookahead for c in chunks])
        rows = [build_row(c, d, self.config.replayssm) for c, d in zip(chunks, drafts)]
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
        # Logits are kept for prompt logprobs only (fp32: 134 MB for 256 rows x 128k vocab, 4x that
        # to verify).
        keep = any(c.request.wants_prompt_logprobs() for c in chunks)
        step = LaunchedStep(chunks, rows, drafts, plans, logits if keep else None, offsets, sampled, verified)
        if sampled:
            # A device index (pinned, asynchronous): a Python list index would copy and sync.
            rows_idx = to_device(sample_rows, torch.int64, logits.device)
            fed = None if feed is None else (feed[0], [feed[1][i] for i in sampled])
            step.tokens, step.logprobs, step.top = sample_chunks(logits[rows_idx],
                                                                 [chunks[i] for i in sampled], fed)
        args = ([offsets[i] for i in verified], [chunks[i].request for i in verified],
                [drafts[i] for i in verified])
        if verified and defer_verify:
            step.verify = self.spec.verify_launch(logits, *args)
            # Every row accepts 1 but the verify rows, which accept their emitted counts.
            accepted = torch.ones(len(rows), dtype=torch.int32, device=logits.device)
            accepted[to_device(verified, torch.int64, logits.device)] = step.verify[1].to(torch.int32)
            step.commit = self.runner.commit_async(rows, accepted)
            step.read_back()
            return step
        if verified:
            results = self.spec.verify(logits, *args)
            step.emitted = {i: row_of(results, j) for j, i in enumerate(verified)}
        step.num_accepted = [len(step.emitted[i][0]) if i in step.emitted else 1 for i in range(len(rows))]
        # Queue the commit before reading tokens back, so it overlaps the device-to-host copy.
        step.live = self.runner.commit(rows, step.num_accepted) or [row.slot for row in rows]
        step.read_back()
        return step


    def _launch_ahead(self, prev: LaunchedStep) -> LaunchedStep | None:
        """Launch the step after `prev` before prev's tokens are read (see `step`), or None
        when that step is not known yet: drafts, prompt logprobs, a waiting request that could be admitted,
        unscheduled requests, a row that does not sample, no KV room. Requests waiting for a seat
        (max_num_seqs running, or no free slot group) do not stop it: schedule() would not admit
        them either, and once a request finishes the next step is scheduled normally."""
        if (self.spec is not None or prev.verified or self.scheduler.could_admit() or self._pending_aborts
                or len(prev.sampled) != len(prev.chunks)):
            return None
        alive = [(j, c) for j, c in enumerate(prev.chunks) if not c.request.finished]
        # A grammar's next mask needs prev's tokens on the host.
        if any(c.request.grammar is not None for _, c in alive):
            return None
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


    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens back and apply them: append, detokenize, stop checks,
        prefix publication, outputs. Rows of requests finished since the launch are dropped."""
        chunks, rows, drafts, plans = step.chunks, step.rows, step.drafts, step.plans
        tokens_list, logprobs_list, top_list = step.results()  # the step's one wait
        emitted = step.emitted
        for j, i in enumerate(step.sampled):
            emitted[i] = ([tokens_list[j]], [logprobs_list[j]] if logprobs_list is not None else None,
                          [top_list[j]] if top_list is not None else None)
        verified_set = set(step.verified)  # membership per row: a list would be O(rows^2) (~0.5 ms at 256)
        kept, dropped = [], []  # dropped: rows of requests finished since the launch (a step launched ahead)
        for i, c in enumerate(chunks):
            (dropped if c.request.finished else kept).append(i)
        if step.verify is not None:
            results = self.spec.verify_finish([drafts[i] for i in step.verified], *step.verify_results())
            for j, i in enumerate(step.verified):
                emitted[i] = row_of(results, j)
            step.num_accepted = [len(emitted[i][0]) if i in verified_set else 1 for i in range(len(rows))]
            keep = [not c.request.finished for c in chunks]
            step.live = self.runner.finish_commit(step.commit, rows, step.num_accepted, keep)
        for i in dropped:
            self.metrics.num_ahead_rows_dropped += 1
            emitted.pop(i, None)
            if plans is not None:
                self.prefix_cache.discard(plans[i])
        for i in kept:
            chunk, row, off, slot = chunks[i], rows[i], step.offsets[i], step.live[i]
            if row.num_logits and drafts[i] is None and chunk.request.wants_prompt_logprobs():
                record_prompt_logprobs(chunk, step.logits[off : off + row.num_logits])
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
            toks, lps, tops = emitted[i]
            if i in verified_set:
                self.metrics.spec_draft_tokens += len(drafts[i].tokens)
                self.metrics.spec_accepted_tokens += len(toks) - 1
            for j, t in enumerate(toks):
                # The grammar ends on an end-of-sequence token (also with ignore_eos): a stop token.
                grammar_end = r.grammar is not None and accept_token(r.grammar, t)
                reason = self.output.append_token(r, t, lps[j] if lps is not None else None,
                                                  tops[j] if tops is not None else None, grammar_end)
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
        slots = self.scheduler.slot_pool
        m.update(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.scheduler.block_pool.num_used,
            kv_blocks_free=self.scheduler.block_pool.num_free,
            num_kv_blocks=self.plan.num_kv_blocks,
            num_slots=self.plan.num_slots,
            # Used: held by requests (live and draft slots) or checkpoints being written; free excludes
            # cached prefix checkpoints (prefix_checkpoints_cached), which are evicted on demand.
            num_slots_used=slots.num_slots - slots.num_free - getattr(slots, "num_cached", 0),
            num_slots_free=slots.num_free,
            slots_per_request=self.plan.slots_per_request,
            num_requests_fit=self.plan.num_requests_fit,
            cache_bytes=self.plan.total_bytes,
            replayssm=int(self.config.replayssm),  # 1 ReplaySSM, 0 the baseline state update
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
