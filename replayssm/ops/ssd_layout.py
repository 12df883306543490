"""Chunk layout of the chunked SSD scan: which token sits at which chunk position, built on the host.

The scan cuts every packed sequence into chunks of L tokens. Chunks are numbered position-major:
sequences are ranked by chunk count (most first, ties in input order) and the chunks at position
k of the m_k sequences that have one are `offsets[k] .. offsets[k] + m_k - 1`, in rank order. So
the chunk-to-chunk pass reads and writes contiguous slices (no gathers, no identity chunks):

    chunk ids    k = 0       k = 1     k = 2        (3 sequences: 3, 1 and 2 chunks)
                 [0 1 2]     [3 4]     [5]          ranks: seq 0 -> 0, seq 2 -> 1, seq 1 -> 2

Positions past a sequence's end (its last chunk's tail) repeat the sequence's own last token;
the scan zeroes Δ there, so they neither decay nor add, and no other sequence is read.
Everything depends only on cu_seqlens, the slots, has_initial_state and the boundaries, which
are read to the host once (one device read) and reused by every layer of a forward pass
(`ops.common.derived`); the index tensors go up in one copy (pinned, asynchronous on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from replayssm.ops.common import derived, upload


@dataclass(frozen=True)
class ChunkLayout:
    """Host facts and device index tensors of one scan call (see the module docstring)."""

    nc: int  # chunks
    positions: list[tuple[int, int, int]]  # per chunk position k: (offsets[k], m_k, m_{k+1})
    num_seqs: int
    idx: Tensor  # (nc, L) int64: token at each chunk position
    pad: Tensor | None  # (nc, L, 1) bool: position past its sequence's end (None: there is none)
    token_chunk: Tensor  # (T,) int64: chunk of every token
    token_offset: Tensor  # (T,) int64: its position in the chunk
    read_slots: Tensor  # (n,) int64: slot of each sequence in rank order (0 for a padding sequence)
    init_mode: str  # "none" (all start from zeros), "all" (all from their slot), "some"
    use_init: Tensor | None  # (n,) bool in rank order, when init_mode == "some"
    store_rows: Tensor | None  # (k,) int64 ranks of the valid sequences (None: all are valid)
    store_slots: Tensor  # (k,) int64: their slots
    token_valid: Tensor | None  # (T, 1, 1) bool: token of a valid sequence (None: all are)
    b_chunk: Tensor | None  # (m,) int64: chunk holding each boundary's last token (0 if none)
    b_offset: Tensor | None  # (m,) int64: that token's position in its chunk
    b_rank: Tensor | None  # (m,) int64: rank of each boundary's sequence
    b_empty: Tensor | None  # (m, 1, 1, 1) bool: zero-length boundary (None: there is none)
    # Index tensors of the Triton kernels (ops/triton/ssd.py), int64; sequences in rank order.
    chunk_len: Tensor  # (nc,): positions of each chunk inside its sequence (the rest is padding)
    chunk_valid: Tensor  # (nc,): 1 if the chunk's sequence has a slot (a padding sequence outputs 0)
    chunk_offsets: Tensor  # (width,): offsets[k], first chunk id at chunk position k
    seq_chunks: Tensor  # (n,): chunk count of each sequence
    init_slot: Tensor  # (n,): slot holding its initial state, -1 to start from zeros
    final_slot: Tensor  # (n,): slot its final state goes to, -1 for a padding sequence
    # Boundary walk (ops/triton/ssd_boundary.py), None without boundaries: one item per chunk that
    # holds boundaries (or per sequence without chunks: chunk -1), its boundaries in position order.
    w_chunk: Tensor | None  # (items,): chunk id, -1 for a sequence without chunks
    w_rank: Tensor | None  # (items,): rank of the item's sequence
    w_start: Tensor | None  # (items,): first entry of the item in b_order / b_pos
    w_count: Tensor | None  # (items,): its boundaries
    b_order: Tensor | None  # (m,): boundary ids, item by item, by position
    b_pos: Tensor | None  # (m,): their last token's position in the chunk (-1: zero-length boundary)


def chunk_layout(cu_seqlens: Tensor, state_indices: Tensor, has_initial_state: Tensor,
                 boundary_seq: Tensor | None, boundary_len: Tensor | None, L: int, T: int) -> ChunkLayout:
    """The layout of a call with these metadata tensors, built once while they live unchanged."""
    keys = [cu_seqlens, state_indices, has_initial_state]
    if boundary_seq is not None:
        keys += [boundary_seq, boundary_len]
    return derived(f"ssd-layout-{L}-{T}", keys, lambda: _build(keys, L, T))


def _build(keys: list[Tensor], L: int, T: int) -> ChunkLayout:
    dev = keys[0].device
    n = keys[1].shape[0]
    # The one device read of the layout: every metadata tensor in a single transfer.
    host = torch.cat([k.reshape(-1).long() for k in keys]).tolist()
    cu, slots, init = host[: n + 1], host[n + 1 : 2 * n + 1], host[2 * n + 1 : 3 * n + 1]
    m = (len(host) - 3 * n - 1) // 2
    bseq, blen = host[3 * n + 1 : 3 * n + 1 + m], host[3 * n + 1 + m :]
    counts = [-(-(cu[i + 1] - cu[i]) // L) for i in range(n)]
    order = sorted(range(n), key=lambda i: -counts[i])
    rank = [0] * n
    for r, i in enumerate(order):
        rank[i] = r
    width = counts[order[0]] if n else 0
    live = [sum(c > k for c in counts) for k in range(width + 1)]  # m_k
    offsets = [0]
    for k in range(width):
        offsets.append(offsets[-1] + live[k])
    nc = offsets[-1]
    # Per chunk id: first token and its sequence's end; positions from there (host tensors).
    start, end, seq = [0] * nc, [0] * nc, [0] * nc
    for i in range(n):
        for k in range(counts[i]):
            c = offsets[k] + rank[i]
            start[c], end[c], seq[c] = cu[i] + k * L, cu[i + 1], i
    pos = torch.tensor(start, dtype=torch.int64)[:, None] + torch.arange(L)
    stop = torch.tensor(end, dtype=torch.int64)[:, None]
    inside = pos < stop
    token_pos = torch.empty(T, dtype=torch.int64)  # chunk * L + offset of every token
    token_pos[pos[inside]] = torch.arange(nc * L).view(nc, L)[inside]
    valid = [slots[i] >= 0 for i in order]
    use = [valid[r] and bool(init[order[r]]) for r in range(n)]
    init_mode = "all" if all(use) else "none" if not any(use) else "some"
    rows = [r for r in range(n) if valid[r]]
    b_chunk, b_offset = [], []
    for s, length in zip(bseq, blen):
        last = max(length - 1, 0)
        b_chunk.append(offsets[last // L] + rank[s] if length > 0 else 0)
        b_offset.append(last % L)
    # Optional pieces are left out when the host already knows their answer.
    pieces = {"idx": torch.where(inside, pos, stop - 1), "token_chunk": token_pos // L,
              "token_offset": token_pos % L,
              "read_slots": [max(slots[i], 0) for i in order], "store_slots": [slots[order[r]] for r in rows]}
    if not bool(inside.all()):
        pieces["pad"] = ~inside
    if init_mode == "some":
        pieces["use_init"] = [int(u) for u in use]
    if len(rows) < n:
        lengths = torch.tensor([cu[i + 1] - cu[i] for i in range(n)])
        pieces["store_rows"] = rows
        pieces["token_valid"] = torch.tensor([s >= 0 for s in slots]).repeat_interleave(lengths)
    if m:
        pieces.update(b_chunk=b_chunk, b_offset=b_offset, b_rank=[rank[s] for s in bseq])
        pieces["b_flag"] = [int(length == 0) for length in blen]
        pieces.update(_walk_items(bseq, blen, b_chunk, b_offset, rank, counts, offsets))
    pieces.update(chunk_len=[min(e - s, L) for s, e in zip(start, end)],
                  chunk_valid=[int(slots[i] >= 0) for i in seq],
                  chunk_offsets=offsets[:width], seq_chunks=[counts[i] for i in order],
                  init_slot=[slots[order[r]] if use[r] else -1 for r in range(n)],
                  final_slot=[slots[i] for i in order])
    got = upload(pieces, dev)
    as_bool = lambda name, shape: got[name].bool().view(shape) if name in got else None  # noqa: E731
    return ChunkLayout(
        nc=nc, positions=[(offsets[k], live[k], live[k + 1]) for k in range(width)], num_seqs=n,
        idx=got["idx"].view(nc, L), pad=as_bool("pad", (nc, L, 1)), token_chunk=got["token_chunk"],
        token_offset=got["token_offset"],
        read_slots=got["read_slots"], init_mode=init_mode, use_init=as_bool("use_init", (n,)),
        store_rows=got.get("store_rows"), store_slots=got["store_slots"],
        token_valid=as_bool("token_valid", (T, 1, 1)), b_chunk=got.get("b_chunk"),
        b_offset=got.get("b_offset"), b_rank=got.get("b_rank"),
        b_empty=as_bool("b_flag", (m, 1, 1, 1)) if m and min(blen) == 0 else None,
        chunk_len=got["chunk_len"], chunk_valid=got["chunk_valid"], chunk_offsets=got["chunk_offsets"],
        seq_chunks=got["seq_chunks"], init_slot=got["init_slot"], final_slot=got["final_slot"],
        w_chunk=got.get("w_chunk"), w_rank=got.get("w_rank"), w_start=got.get("w_start"),
        w_count=got.get("w_count"), b_order=got.get("b_order"), b_pos=got.get("b_pos"),
    )


def _walk_items(bseq: list[int], blen: list[int], b_chunk: list[int], b_offset: list[int], rank: list[int],
                counts: list[int], offsets: list[int]) -> dict[str, list[int]]:
    """The boundary walk's items (ChunkLayout fields w_* and b_order / b_pos). A zero-length boundary
    sits at position -1 of its sequence's first chunk (chunk id = rank), or of an item with chunk -1
    when the sequence has no chunks."""
    items: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for j, (s, length) in enumerate(zip(bseq, blen)):
        if length > 0:
            key, pos = (b_chunk[j], rank[s]), b_offset[j]
        else:
            key, pos = (offsets[0] + rank[s] if counts[s] else -1, rank[s]), -1
        items.setdefault(key, []).append((pos, j))
    names = ("w_chunk", "w_rank", "w_start", "w_count", "b_order", "b_pos")
    out: dict[str, list[int]] = {k: [] for k in names}
    for (c, r), entries in items.items():
        entries.sort()
        out["w_chunk"].append(c)
        out["w_rank"].append(r)
        out["w_start"].append(len(out["b_order"]))
        out["w_count"].append(len(entries))
        out["b_order"] += [j for _, j in entries]
        out["b_pos"] += [pos for pos, _ in entries]
    return out
