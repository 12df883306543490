"""The engine lifecycle on every Mamba-2 hybrid family (Granite 4.0-H, Bamba, Falcon-H1, Zamba2): greedy
tokens, prefix hits, speculation and preemption each give transformers' greedy tokens on the family's
tiny checkpoint (family_helpers.FAMILIES). The families' own wiring is tested in their test files."""

from __future__ import annotations

import pytest
from family_helpers import (
    FAMILIES,
    check_prefix_hit,
    check_speculation,
    check_tight_memory_preempts,
    family_case,
    family_llm,
    greedy_tokens,
)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(path, transformers model, prompts, transformers' greedy tokens) of one family."""
    return family_case(request.param)


@pytest.mark.parametrize("replayssm", [True, False])
def test_greedy_matches_transformers(family, replayssm):
    """A batch of prompts of different lengths gives transformers' greedy tokens, ReplaySSM on and off."""
    path, _, prompts, hf = family
    assert greedy_tokens(family_llm(path, replayssm=replayssm, replay_window=5), prompts) == hf


def test_prefix_cache_hit_gives_transformers_tokens(family):
    """A prompt extending a cached one hits the prefix cache and still gives transformers' tokens."""
    path, hf_model, prompts, _ = family
    check_prefix_hit(path, hf_model, prompts)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_gives_transformers_tokens(family, method):
    """k = 3 drafts (n-gram, or the model itself as draft model) give transformers' greedy tokens."""
    path, _, prompts, hf = family
    check_speculation(path, prompts, hf, method)


def test_tight_memory_preempts_with_transformers_tokens(family):
    """Tight KV memory with prefix caching preempts and resumes requests; tokens stay transformers'."""
    path, _, prompts, hf = family
    check_tight_memory_preempts(path, prompts, hf)
