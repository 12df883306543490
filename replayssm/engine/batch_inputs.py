"""Turn the engine's rows into packed device inputs: token ids, ForwardContext metadata, logit rows.

Built from Python lists on the host, then copied to the device once per tensor; nothing here
reads device memory. On CUDA the copies go through pinned staging memory without blocking, so
preparing a step never waits for the previous step's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from replayssm.engine.context import AttentionMetadata, MambaMetadata


@dataclass
class RowView:
    """One engine row as the runner sees it (the engine's fields plus where it landed in the batch)."""

    index: int  # position in the engine's row list
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    slot: int
    num_logits: int
    spec_slots: list[int] | None
    decode: bool  # takes the Mamba decode path
    forced: bool  # a one-token prefill chunk on prior state: decode path, committed with a=1 at once
    checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (offset b, checkpoint slot)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # (T,) int64 packed (prefill rows, then decode rows)
    attn: AttentionMetadata
    mamba: MambaMetadata
    logit_index: torch.Tensor  # (num_logits_total,) int64 packed positions, in the engine's row order
    prefill: list[RowView]
    decode: list[RowView]  # engine decode rows first, then forced rows
    row_offsets: dict[int, int] | None = None  # engine row index -> its first packed token


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor; on CUDA an asynchronous copy from pinned memory (no host sync)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t if device.type == "cpu" else t.to(device)
    # The caching host allocator keeps the pinned block alive until the copy has run.
    return t.pin_memory().to(device, non_blocking=True)


def build_inputs(rows: list[RowView], *, block_size: int, device: torch.device,
                 baseline: bool) -> BatchInputs:
    """Pack rows (prefill first, then decode: engine decode rows, then forced) into device inputs."""
    prefill = [r for r in rows if not r.decode]
    decode = [r for r in rows if r.decode and not r.forced] + [r for r in rows if r.forced]
    ordered = prefill + decode
    ids: list[int] = []
    slot_mapping: list[int] = []
    cu_q, context_lens, tables = [0], [], []
    offset_of: dict[int, int] = {}
    for r in ordered:
        offset_of[r.index] = len(ids)
        ids.extend(r.token_ids)
        for pos in range(r.start_pos, r.start_pos + len(r.token_ids)):
            slot_mapping.append(r.block_table[pos // block_size] * block_size + pos % block_size)
        cu_q.append(len(ids))
        context_lens.append(r.start_pos + len(r.token_ids))
        tables.append(r.block_table)
    max_blocks = max(len(t) for t in tables)
    padded_tables = [t + [-1] * (max_blocks - len(t)) for t in tables]

    def dev(values, dtype):
        return to_device(values, dtype, device)

    attn = AttentionMetadata(
        slot_mapping=dev(slot_mapping, torch.int64),
        cu_seqlens_q=dev(cu_q, torch.int32),
        block_tables=dev(padded_tables, torch.int32),
        context_lens=dev(context_lens, torch.int32),
        max_query_len=max(len(r.token_ids) for r in ordered),
        max_context_len=max(context_lens),
    )

    p_cu = [0]
    for r in prefill:
        p_cu.append(p_cu[-1] + len(r.token_ids))
    q = max((len(r.token_ids) for r in decode), default=1)
    token_index = None
    if any(len(r.token_ids) != q for r in decode):
        grid = [i * q + t for i, r in enumerate(decode) for t in range(len(r.token_ids))]
        token_index = dev(grid, torch.int64)
    dst = None
    if baseline and any(r.spec_slots is not None for r in decode):
        # Plain decode rows next to verify rows keep their state in place after their one token.
        dst = dev([(r.spec_slots if r.spec_slots is not None else [r.slot])
                   + [-1] * (q - len(r.token_ids)) for r in decode], torch.int32)
    # Prefill checkpoints: the mixer writes the state and conv window after b tokens of the row.
    pub = [(i, b, d) for i, r in enumerate(prefill) for b, d in r.checkpoints]
    mamba = MambaMetadata(
        num_prefill_tokens=p_cu[-1],
        prefill_cu_seqlens=dev(p_cu, torch.int32),
        prefill_slots=dev([r.slot for r in prefill], torch.int32),
        has_initial_state=dev([r.start_pos > 0 for r in prefill], torch.bool),
        num_decode_rows=len(decode),
        decode_q=q,
        decode_slots=dev([r.slot for r in decode], torch.int32),
        decode_token_index=token_index,
        decode_dst_slots=dst,
        publish_seq=dev([p[0] for p in pub], torch.int32) if pub else None,
        publish_len=dev([p[1] for p in pub], torch.int32) if pub else None,
        publish_dst=dev([p[2] for p in pub], torch.int64) if pub else None,
    )

    logit_index: list[int] = []
    for r in sorted(rows, key=lambda r: r.index):
        end = offset_of[r.index] + len(r.token_ids)
        logit_index.extend(range(end - r.num_logits, end))
    return BatchInputs(dev(ids, torch.int64), attn, mamba, dev(logit_index, torch.int64), prefill, decode,
                       offset_of)
