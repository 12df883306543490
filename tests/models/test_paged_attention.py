"""Paged attention (store_kv + paged_attention) == dense causal attention per sequence."""

from __future__ import annotations

import pytest
import torch

import replayssm.ops.attention as attention
from replayssm.ops.attention import paged_attention, store_kv

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 6, 8


def dense_reference(q, k, v, start):
    """q (L, H, D) at positions start..start+L-1 over k, v (start+L, kvH, D), causal, float64."""
    g = HEADS // KV_HEADS
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * DIM ** -0.5
    pos = torch.arange(start, start + q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, None] > pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("budget", [None, 1])
def test_chunks_with_prior_context(budget, monkeypatch):
    """Rows with prior context, prefill chunks, decode and verify rows, permuted blocks, GQA, row groups."""
    if budget is not None:
        monkeypatch.setattr(attention, "_GATHER_BUDGET_BYTES", budget)  # one row per group
    gen = torch.Generator().manual_seed(0)
    num_blocks = 40
    # Stale finite garbage everywhere (freed blocks keep old values): masked keys must not leak.
    k_cache = 100 * torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = 100 * torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    # (prior tokens, new tokens) per row: prefill from scratch, chunk after context, decode, verify.
    shapes = [(0, 9), (7, 5), (13, 1), (6, 3)]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, seqs, qs, new_k, new_v, slots = [], [], [], [], [], []
    for i, (prior, new) in enumerate(shapes):
        n_blocks = -(-(prior + new) // BLOCK)
        table = perm[8 * i: 8 * i + n_blocks]
        k = torch.randn(prior + new, KV_HEADS, DIM, generator=gen)
        v = torch.randn(prior + new, KV_HEADS, DIM, generator=gen)
        for t in range(prior):  # context written by earlier steps
            k_cache[table[t // BLOCK], t % BLOCK] = k[t]
            v_cache[table[t // BLOCK], t % BLOCK] = v[t]
        tables.append(table)
        seqs.append((k, v))
        qs.append(torch.randn(new, HEADS, DIM, generator=gen))
        new_k.append(k[prior:])
        new_v.append(v[prior:])
        slots += [table[t // BLOCK] * BLOCK + t % BLOCK for t in range(prior, prior + new)]
    store_kv(torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, torch.tensor(slots))
    width = max(len(t) for t in tables)
    out = paged_attention(
        torch.cat(qs), k_cache, v_cache,
        torch.tensor([0] + torch.cumsum(torch.tensor([n for _, n in shapes]), 0).tolist(), dtype=torch.int32),
        torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor([p + n for p, n in shapes], dtype=torch.int32),
        scale=DIM ** -0.5, max_query_len=9, max_context_len=14,
    )
    ref = torch.cat([dense_reference(q, k, v, p) for q, (k, v), (p, _) in zip(qs, seqs, shapes)])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise():
    """Mismatched K/V shapes or negative slots raise ValueError naming the argument."""
    cache = torch.zeros(2, BLOCK, KV_HEADS, DIM)
    k = torch.randn(3, KV_HEADS, DIM)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, cache, cache.clone(), torch.tensor([0, -1, 2]))
    with pytest.raises(ValueError, match="k_cache"):
        store_kv(k, k, torch.zeros(2, BLOCK, 3, DIM), torch.zeros(2, BLOCK, 3, DIM), torch.tensor([0, 1, 2]))

