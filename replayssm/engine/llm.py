"""LLM: the offline entry object, ``LLM(path, **kw).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from typing import Any

from replayssm.config import EngineConfig
from replayssm.engine.llm_engine import LLMEngine, RequestOutput
from replayssm.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Builds one LLMEngine from a checkpoint path and flat engine arguments.

    ``LLM("path", device="cpu", replayssm=True, replay_window=16, max_num_seqs=8, ...)``:
    every keyword is a field of EngineConfig or of its cache / scheduler / spec sub-configs.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        runner_cls = kwargs.pop("runner_cls", None)  # tests inject a fake runner here
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs), runner_cls=runner_cls)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._closed = False

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come back in prompt
        order. One SamplingParams applies to all prompts, or pass one per prompt; without any, the
        checkpoint's generation_config.json sampling defaults apply (`LLMEngine.generation_defaults`)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        if sampling_params is None:
            sampling_params = SamplingParams(**self.engine.generation_defaults)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        # Validate everything before adding anything, so a bad prompt leaves the engine untouched.
        token_ids = [self.engine.prepare_prompt(p, sp) for p, sp in zip(prompts, params)]
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, toks, sp in zip(ids, token_ids, params):
            self.engine.add_request(rid, toks, sp)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
                bar.set_postfix(tokens=self.engine.metrics.generation_tokens, refresh=False)
        return [finished[rid] for rid in ids]

    def close(self) -> None:
        """Free the engine (with tensor_parallel_size > 1: the workers' shards); also on ``with`` exit.
        Idempotent: a second call does nothing."""
        if not self._closed:
            self._closed = True
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_metrics(self) -> dict[str, Any]:
        """Engine counters: preemptions, prefix-cache and spec counts, tokens generated, ..."""
        return self.engine.get_metrics()
