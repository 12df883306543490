"""LLMEngine: requests in, one engine step at a time, outputs out (shared by LLM and the server)."""

from __future__ import annotations

import random
from typing import Any

import torch

from replayssm.config import EngineConfig
from replayssm.engine.engine_step import LaunchedStep, complete, launch, launch_ahead
from replayssm.engine.metrics import EngineMetrics
from replayssm.engine.model_runner import ScheduledRow
from replayssm.engine.output import OutputProcessor, RequestOutput, make_output
from replayssm.engine.request import InputError, Request
from replayssm.engine.runner_setup import RunnerSetup, build_runner
from replayssm.engine.scheduler import ScheduledChunk, Scheduler
from replayssm.ops.sampling import SamplingTensors, sample, token_logprobs, top_pairs
from replayssm.sampling_params import SamplingParams


class LLMEngine:
    """Continuous-batching engine over one ModelRunner.

    ``step()``: process aborts -> schedule -> prefix-hit slot copies -> plan checkpoints ->
    runner.execute -> sample -> runner.commit (writes the checkpoints) -> append tokens,
    detokenize, check stops -> publish checkpoints + hash full KV blocks -> release finished
    requests. Sampling is keyed by (request seed, position), so outputs do not depend on
    batching, preemption or prefix hits.

    Async scheduling (`step`) queues step N+1's launch (engine_step.py: schedule .. commit, all
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
        if params.stop and self.tokenizer is None:
            raise InputError("stop strings need a tokenizer; this model has none (use stop_token_ids)",
                             "stop")
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
            launched = launch(self, sched.chunks)
        if self.async_scheduling:
            self._ahead = launch_ahead(self, launched)
        outputs += complete(self, launched)
        if self._ahead is not None and all(c.request.finished for c in self._ahead.chunks):
            # Every row's request stopped in `launched`: nothing to wait for (it computed nothing kept).
            complete(self, self._ahead)
            self._ahead = None
        return outputs

    def _step_group(self) -> list[RequestOutput]:
        """One step of one of two request groups, taking turns: complete the group's step in flight,
        then schedule and launch its next one with a deferred verify (engine_step.launch), which
        reads nothing back. The other group's step, queued before, keeps the GPU busy meanwhile:
        one group's host work (read back, stop checks, outputs, scheduling, drafting, inputs)
        overlaps the other's forward. Each group's steps stay in order on the device, and the two
        never share a request, a slot or a KV block (preemption stays inside the group)."""
        g, self._turn = self._turn, self._turn ^ 1
        outputs = []
        launched, self._inflight[g] = self._inflight[g], None
        if launched is not None:
            outputs += complete(self, launched)
        sched = self.scheduler.schedule(group=g)
        self.metrics.num_preemptions += len(sched.preempted)
        if sched.chunks:
            self._inflight[g] = launch(self, sched.chunks, defer_verify=True)
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

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, Any, Any]:
        """(tokens (b,), their logprobs (b,) or None, and (ids, logprobs) (b, n) of the n most likely
        tokens when a request wants n > 0 alternatives, else None) for the rows' last logits."""
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
        tokens = sample(logits, params)
        asked = [r.params.top_logprobs for r in reqs if r.params.logprobs is not None]
        if not asked:
            return tokens, None, None
        return tokens, *token_logprobs(logits, tokens, max(asked))

    def _record_prompt_logprobs(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
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
