"""A deterministic stand-in for ModelRunner, for scheduler / engine tests without a model.

The "model" maps a token sequence to logits through a rolling hash: the slot holds the hash
of the tokens it has seen (like a Mamba state) and the KV blocks hold the tokens themselves
(like attention). Every position that needs logits re-reads its whole prefix from the KV
blocks and checks it against the slot, so a wrong block table, a reused slot or a prefill
that continues from the wrong state fails loudly instead of silently changing the output.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from replayssm.demo import write_demo_tokenizer

VOCAB = 100  # the demo tokenizer's size, so tests can use text prompts and stop strings
SLOT_BYTES = 1000
KV_BLOCK_BYTES = 100


def fold(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 1) % (1 << 61)


def reference_logits(tokens: list[int]) -> torch.Tensor:
    """Logits after `tokens` (the same function the fake runner computes), shape (VOCAB,)."""
    h = 0
    for t in tokens:
        h = fold(h, t)
    return 3.0 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(h))


def write_fake_checkpoint(path: str, with_tokenizer: bool = True) -> str:
    """A tiny Mamba-2 config.json, a dummy weights file and (optionally) the demo tokenizer."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = {
        "architectures": ["Mamba2ForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "num_heads": 2,
        "head_dim": 16,
        "state_size": 8,
        "num_hidden_layers": 1,
        "expand": 2,
        "eos_token_id": 2,
        "max_position_embeddings": 4096,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({"dummy": torch.zeros(1)}, os.path.join(path, "model.safetensors"))
    if with_tokenizer:
        write_demo_tokenizer(path)
    return path


class FakeRunner:
    """Implements the ModelRunner surface the engine uses, with invariant checks."""

    @staticmethod
    def slot_bytes(model_config, **kwargs) -> int:
        return SLOT_BYTES

    @staticmethod
    def kv_block_bytes(model_config, **kwargs) -> int:
        return KV_BLOCK_BYTES

    def __init__(
        self,
        model_dir,
        *,
        num_kv_blocks,
        kv_block_size,
        num_slots,
        max_num_seqs,
        max_num_batched_tokens,
        **kwargs,
    ) -> None:
        self.block_size = kv_block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = [[None] * kv_block_size for _ in range(num_kv_blocks)]
        self.slot_len: list[int | None] = [None] * num_slots
        self.slot_hash = [0] * num_slots
        self.steps: list[list] = []  # rows of every execute call
        self.uncommitted = False

    def _kv_prefix_hash(self, table: list[int], n: int) -> int:
        h = 0
        for p in range(n):
            t = self.kv[table[p // self.block_size]][p % self.block_size]
            assert t is not None, f"position {p} was never written"
            h = fold(h, t)
        return h

    feeds_tokens = True  # execute(rows, feed=...): async scheduling runs on the fake too

    def execute(self, rows, feed=None) -> torch.Tensor:
        assert not self.uncommitted, "execute twice without commit"
        if feed is not None:  # one-token decode rows whose token is an earlier step's sample
            tokens, index = feed
            assert len(index) == len(rows) and all(not r.is_prefill and len(r.token_ids) == 1 for r in rows)
            rows = [dataclasses.replace(r, token_ids=[int(tokens[i])]) for r, i in zip(rows, index)]
        assert rows and len(rows) <= self.max_num_seqs
        assert sum(len(r.token_ids) for r in rows) <= self.max_num_batched_tokens
        assert len({r.slot for r in rows}) == len(rows), "two rows share a slot"
        blocks = [b for r in rows for b in r.block_table]
        assert len(set(blocks)) == len(blocks), "two rows share a KV block"
        self.steps.append(rows)
        out = []
        for r in rows:
            n = len(r.token_ids)
            assert n >= 1 and 0 <= r.num_logits <= n
            assert r.is_prefill == (not (n == 1 and r.start_pos > 0))
            assert len(r.block_table) * self.block_size >= r.start_pos + n
            if r.start_pos == 0:
                self.slot_len[r.slot], self.slot_hash[r.slot] = 0, 0
            assert self.slot_len[r.slot] == r.start_pos, "continuing from a slot at the wrong position"
            for i, t in enumerate(r.token_ids):
                p = r.start_pos + i
                self.kv[r.block_table[p // self.block_size]][p % self.block_size] = t
                self.slot_hash[r.slot] = fold(self.slot_hash[r.slot], t)
                self.slot_len[r.slot] = p + 1
                if i >= n - r.num_logits:
                    h = self._kv_prefix_hash(r.block_table, p + 1)
                    assert h == self.slot_hash[r.slot], "KV blocks disagree with the slot state"
                    out.append(3.0 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(h)))
        self.uncommitted = True
        return torch.stack(out) if out else torch.empty(0, VOCAB)

    def commit(self, rows, num_accepted) -> None:
        assert len(num_accepted) == len(rows) and all(a == 1 for a in num_accepted)
        self.uncommitted = False


def greedy_reference(prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation under the fake model."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(reference_logits(tokens).argmax()))
    return tokens[len(prompt) :]
