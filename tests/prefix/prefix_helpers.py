"""Shared helpers for the prefix-caching tests: NaN-poisoned runners and fresh-prefill references."""

from __future__ import annotations

import random

import torch
from checkpoints import cached_checkpoint
from threads import one_thread  # noqa: F401 (autouse fixture, re-exported to test modules)

from replayssm.engine.model_runner import ModelRunner, ScheduledRow
from replayssm.speculative.proposer import Drafts, Proposer

BLOCK = 4
SMALL = dict(hybrid_override_pattern="M*M-M", hidden_size=32, mamba_num_heads=4, mamba_head_dim=8,
             ssm_state_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             intermediate_size=32, chunk_size=4)


class OracleDrafter(Proposer):
    """Drafts the plain run's continuation, keeps a seeded random number of them correct and
    corrupts the next: each verify step accepts a random count (greedy stays lossless)."""

    def __init__(self, reference: dict[str, list[int]], seed: int) -> None:
        self.reference, self.rng = reference, random.Random(seed)
        self.accepted: list[int] = []

    def propose(self, requests, num_drafts):
        out = []
        for r, n in zip(requests, num_drafts):
            done = len(r.output_token_ids)
            true = self.reference[r.request_id][done : done + n]
            m = self.rng.randint(0, len(true))
            self.accepted.append(m)
            out.append(Drafts(true[:m] + [(t + 1) % 256 for t in true[m : m + 1]]))
        return out


def small_checkpoint(seed: int = 0) -> str:
    """A tiny Nemotron-H (Mamba, attention, MLP) directory, written once per process."""
    return cached_checkpoint("nemotron_h", seed, **SMALL)[0]


def make_runner(path: str | None = None, **kw) -> ModelRunner:
    """A runner whose Mamba slots start as NaN: nothing may read a slot it did not write."""
    args = dict(num_kv_blocks=64, kv_block_size=BLOCK, num_slots=16, max_num_seqs=6, replay_window=4)
    args.update(kw)
    runner = ModelRunner(path or small_checkpoint(), **args)
    for t in runner.mamba_cache.per_slot_tensors() + runner.mamba_cache.conv_scratch:
        if t.is_floating_point():
            t.fill_(float("nan"))
    return runner


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def blocks_for(n: int, first: int) -> list[int]:
    return list(range(first, first + -(-n // BLOCK)))


def fresh_prefill_state(path: str, ids: list[int], **kw) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(state, conv window) per Mamba layer after prefilling `ids` in one chunk on a new runner."""
    runner = make_runner(path, **kw)
    row = ScheduledRow(ids, 0, blocks_for(len(ids), 0), 0, True, num_logits=1)
    runner.execute([row])
    runner.commit([row], [1])
    cache = runner.mamba_cache
    return [s[0].clone() for s in cache.state], [c[0].clone() for c in cache.conv]


def assert_checkpoint(runner: ModelRunner, slot: int, ref: tuple[list[torch.Tensor], list[torch.Tensor]],
                      tol: float = 1e-5) -> None:
    """The checkpoint slot holds the reference state and conv window (every layer) with cursors 0."""
    cache = runner.mamba_cache
    for state, conv, ref_state, ref_conv in zip(cache.state, cache.conv, *ref):
        torch.testing.assert_close(state[slot].float(), ref_state.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(conv[slot], ref_conv, rtol=tol, atol=tol)
    assert runner.cursors(slot) == (0, 0)
    assert int(cache.committed[slot]) == 0 and int(cache.ring_start[slot]) == 0
