"""Index layout of the varlen causal conv reference, built on the host once per set of metadata.

The reference lays the packed sequences out with each one's K-1 window rows in front of its tokens
(`ext`), so every token's K taps are contiguous rows and never cross sequences:

    ext rows:  [window 0 | tokens 0 | window 1 | tokens 1 | ...]   (K-1 + len_i rows per sequence)

Which rows these are depends only on cu_seqlens, the slots and has_initial_state; they are read to
the host once (one device read) and shared by every layer of a forward pass (`ops.common.derived`),
so a layer's conv reads nothing back: the host knows which sequences are padding (-1 slots) or start
from zeros, and no boolean-mask indexing (a device-to-host sync each) is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from replayssm.ops.common import derived, upload


@dataclass(frozen=True)
class VarlenConvLayout:
    rows: int  # rows of ext: T + n (K-1)
    token_row: Tensor  # (T,) int64: ext row of every token
    taps: list[Tensor]  # K tensors (T,) int64: ext row of tap k of every token (token_row - (K-1) + k)
    init_mode: str  # "none" (every window starts as zeros), "all" (from its slot), "some"
    read_slots: Tensor  # (n,) int64 slot of each sequence (0 for padding)
    use_init: Tensor | None  # (n, 1, 1) bool, when init_mode == "some"
    window_rows: Tensor  # (n * (K-1),) int64: ext rows of the windows
    final_rows: Tensor  # (k * (K-1),) int64: ext rows of the last K-1 rows of each valid sequence
    store_slots: Tensor  # (k,) int64: their slots
    token_valid: Tensor | None  # (T, 1) bool: token of a non-padding sequence (None: all are)


def varlen_conv_layout(cu_seqlens: Tensor, state_indices: Tensor, has_initial_state: Tensor,
                       K: int, T: int) -> VarlenConvLayout:
    """The layout for these metadata tensors (built once while they live unchanged)."""
    keys = [cu_seqlens, state_indices, has_initial_state]
    return derived(f"conv-varlen-{K}-{T}", keys, lambda: _build(keys, K, T))


def _build(keys: list[Tensor], K: int, T: int) -> VarlenConvLayout:
    n = keys[1].shape[0]
    host = torch.cat([k.reshape(-1).long() for k in keys]).tolist()  # the one device read
    cu, slots, init = host[: n + 1], host[n + 1 : 2 * n + 1], host[2 * n + 1 :]
    K1 = K - 1
    lengths = torch.tensor([cu[i + 1] - cu[i] for i in range(n)], dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(n), lengths, output_size=T)
    token_row = torch.arange(T) + (seq_of_token + 1) * K1
    window_start = torch.tensor(cu[:-1], dtype=torch.int64) + torch.arange(n) * K1  # (n,)
    window_rows = window_start[:, None] + torch.arange(K1)
    valid = [s >= 0 for s in slots]
    use = [v and bool(h) for v, h in zip(valid, init)]
    init_mode = "all" if all(use) else "none" if not any(use) else "some"
    keep = torch.tensor(valid, dtype=torch.bool)
    pieces = {"token_row": token_row, "read_slots": [max(s, 0) for s in slots],
              "window_rows": window_rows, "final_rows": (window_rows + lengths[:, None])[keep],
              "store_slots": [s for s in slots if s >= 0]}
    pieces.update({f"tap{k}": token_row - K1 + k for k in range(K)})
    if init_mode == "some":
        pieces["use_init"] = use
    if not all(valid):
        pieces["token_valid"] = keep[seq_of_token]
    got = upload(pieces, keys[0].device)
    return VarlenConvLayout(
        rows=T + n * K1, token_row=got["token_row"], taps=[got[f"tap{k}"] for k in range(K)],
        init_mode=init_mode, read_slots=got["read_slots"],
        use_init=got["use_init"].bool().view(n, 1, 1) if "use_init" in got else None,
        window_rows=got["window_rows"], final_rows=got["final_rows"], store_slots=got["store_slots"],
        token_valid=got["token_valid"].bool().view(T, 1) if "token_valid" in got else None,
    )
