"""Shared pieces of the speculative-decoding tests: one tiny MTP checkpoint, prompts, runs."""

from __future__ import annotations

import functools

import torch
from checkpoints import cached_checkpoint
from threads import one_thread  # noqa: F401 (autouse fixture, re-exported to test modules)

from replayssm import LLM, SamplingParams

MAX_LEN = 96
NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def target() -> str:
    """A tiny Nemotron-H (Mamba, attention, MLP, MoE) that also carries mtp.* weights."""
    return cached_checkpoint("nemotron_h", mtp=True)[0]


def prompts() -> list[list[int]]:
    """A short random prompt and a long one with many distinct tokens (n-gram matches happen)."""
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, 256, (6,), generator=g).tolist(),
        torch.randperm(253, generator=g)[:60].add(3).tolist(),
    ]


def make_llm(path: str | None = None, **kw) -> LLM:
    return LLM(path or target(), device="cpu", max_model_len=MAX_LEN, **kw)


def generate(llm: LLM, params: SamplingParams = GREEDY, ps: list[list[int]] | None = None) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(ps or prompts(), params, use_tqdm=False)]


@functools.cache
def plain_greedy() -> tuple[tuple[int, ...], ...]:
    """Plain (non-speculative) greedy outputs of prompts(): the reference every spec run must equal."""
    return tuple(tuple(t) for t in generate(make_llm()))
