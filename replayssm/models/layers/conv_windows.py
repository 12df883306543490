"""Where the conv window of each prefill checkpoint comes from: index tensors shared by every layer.

A prefill row that publishes a checkpoint after b of its tokens needs the K-1 raw conv inputs
before token b: the row's own tokens b-K+1 .. b-1, or, for b < K-1, the tail of the slot's
window before them (zeros when the row starts without one). Which one depends only on the step's
metadata, so it is worked out once per step on the host (`ops.common.derived`: one device read
for all Mamba layers) and each layer only gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayssm.ops.common import derived


@dataclass(frozen=True)
class ConvWindowSources:
    token: torch.Tensor  # (m, K-1) int64: packed prefill token of each window column (clamped to the row)
    window_col: torch.Tensor | None  # (m, 1, K-1) int64: column of the slot's window (None: all from tokens)
    window_slot: torch.Tensor | None  # (m,) int64: the row's slot
    has_window: torch.Tensor | None  # (m, 1, 1) bool: the row starts from its slot's window
    from_token: torch.Tensor | None  # (m, 1, K-1) bool: the column comes from the row's tokens


def conv_window_sources(md, K1: int) -> ConvWindowSources:
    """The sources for the prefill checkpoints of MambaMetadata `md` (publish_* set), conv width K1 + 1."""
    keys = [md.publish_seq, md.publish_len, md.prefill_cu_seqlens, md.prefill_slots, md.has_initial_state]
    return derived(f"conv-windows-{K1}", keys, lambda: _build(keys, K1))


def _build(keys: list[torch.Tensor], K1: int) -> ConvWindowSources:
    seq_t, len_t, cu_t, slots_t, init_t = keys
    m, n = seq_t.shape[0], slots_t.shape[0]
    host = torch.cat([seq_t.long(), len_t.long(), cu_t.long(), slots_t.long(), init_t.long()]).tolist()
    seq, length, cu = host[:m], host[m : 2 * m], host[2 * m : 2 * m + n + 1]
    slots, init = host[2 * m + n + 1 : 2 * m + 2 * n + 1], host[2 * m + 2 * n + 1 :]
    pos = [[b - K1 + k for k in range(K1)] for b in length]  # row positions of the window, oldest first
    token = [[cu[s] + max(p, 0) for p in ps] for s, ps in zip(seq, pos)]
    pieces = [token]
    partial = any(p < 0 for ps in pos for p in ps)
    if partial:
        pieces += [[[min(max(p + K1, 0), K1 - 1) for p in ps] for ps in pos], [slots[s] for s in seq],
                   [init[s] for s in seq], [[int(p >= 0) for p in ps] for ps in pos]]
    flat = torch.cat([torch.tensor(v, dtype=torch.int64).reshape(-1) for v in pieces])
    dev = seq_t.device
    flat = flat.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else flat.to(dev)
    token_t = flat[: m * K1].view(m, K1)
    if not partial:
        return ConvWindowSources(token_t, None, None, None, None)
    rest = flat[m * K1 :]
    col, slot = rest[: m * K1].view(m, 1, K1), rest[m * K1 : m * K1 + m]
    has, frm = rest[m * K1 + m : m * K1 + 2 * m], rest[m * K1 + 2 * m :]
    return ConvWindowSources(token_t, col, slot, has.bool().view(m, 1, 1), frm.bool().view(m, 1, K1))
