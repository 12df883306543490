"""Turn the engine's rows into packed device inputs: token ids, ForwardContext metadata, logit rows.

Built from Python lists on the host, then copied to the device in one packed copy; nothing
here reads device memory. On CUDA the copy goes through pinned staging memory without
blocking, so preparing a step never waits for the previous step's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from replayssm.engine.context import AttentionMetadata, MambaMetadata
from replayssm.engine.host_pack import HostPack


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
    positions: torch.Tensor  # (T,) int64 absolute position of each packed token in its request
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
                 baseline: bool, tables: torch.Tensor | None = None) -> BatchInputs:
    """Pack rows (prefill first, then decode: engine decode rows, then forced) into device inputs.

    Every list goes up in one host-to-device copy (engine/host_pack.py); the tensors are views of it.
    tables: the rows' block tables already packed (engine/block_tables.py), in `rows` order.
    """
    prefill = [r for r in rows if not r.decode]
    decode = [r for r in rows if r.decode and not r.forced] + [r for r in rows if r.forced]
    ordered = prefill + decode
    ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_q, context_lens = [0], []
    offset_of: dict[int, int] = {}
    max_blocks = max(len(r.block_table) for r in ordered)
    flat: list[int] = []  # (rows, max_blocks) flattened, padded with -1 (when `tables` is not given)
    for r in ordered:
        offset_of[r.index] = len(ids)
        ids.extend(r.token_ids)
        table = r.block_table
        span = range(r.start_pos, r.start_pos + len(r.token_ids))
        positions.extend(span)
        for pos in span:
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        cu_q.append(len(ids))
        context_lens.append(r.start_pos + len(r.token_ids))
        if tables is None:
            flat.extend(table)
            flat.extend([-1] * (max_blocks - len(table)))
    if tables is not None:
        assert tables.shape == (len(rows), max_blocks), (tables.shape, len(rows), max_blocks)
        if any(a is not b for a, b in zip(ordered, rows)):
            position = {id(r): k for k, r in enumerate(rows)}
            tables = tables[torch.tensor([position[id(r)] for r in ordered])]
    pack = HostPack()
    i64, i32 = torch.int64, torch.int32
    parts = dict(ids=pack.add(ids, i64), positions=pack.add(positions, i64),
                 slot_mapping=pack.add(slot_mapping, i64), cu_q=pack.add(cu_q, i32),
                 tables=pack.add(flat if tables is None else tables, i32, (len(ordered), max_blocks)),
                 context_lens=pack.add(context_lens, i32))

    p_cu = [0]
    for r in prefill:
        p_cu.append(p_cu[-1] + len(r.token_ids))
    q = max((len(r.token_ids) for r in decode), default=1)
    if any(len(r.token_ids) != q for r in decode):
        grid = [i * q + t for i, r in enumerate(decode) for t in range(len(r.token_ids))]
        parts["token_index"] = pack.add(grid, i64)
    if baseline and any(r.spec_slots is not None for r in decode):
        # Plain decode rows next to verify rows keep their state in place after their one token.
        dst = []
        for r in decode:
            dst.extend(r.spec_slots if r.spec_slots is not None else [r.slot])
            dst.extend([-1] * (q - len(r.token_ids)))
        parts["dst"] = pack.add(dst, i32, (len(decode), q))
    # Prefill checkpoints: the mixer writes the state and conv window after b tokens of the row.
    pub = [(i, b, d) for i, r in enumerate(prefill) for b, d in r.checkpoints]
    if pub:
        parts.update(publish_seq=pack.add([p[0] for p in pub], i32),
                     publish_len=pack.add([p[1] for p in pub], i32),
                     publish_dst=pack.add([p[2] for p in pub], i32))
    parts.update(p_cu=pack.add(p_cu, i32), prefill_slots=pack.add([r.slot for r in prefill], i32),
                 has_initial_state=pack.add([r.start_pos > 0 for r in prefill], torch.bool),
                 decode_slots=pack.add([r.slot for r in decode], i32))
    logit_index: list[int] = []
    for r in sorted(rows, key=lambda r: r.index):
        end = offset_of[r.index] + len(r.token_ids)
        logit_index.extend(range(end - r.num_logits, end))
    parts["logit_index"] = pack.add(logit_index, i64)
    sent = pack.send(device)
    t = {name: sent[i] for name, i in parts.items()}

    attn = AttentionMetadata(
        slot_mapping=t["slot_mapping"],
        cu_seqlens_q=t["cu_q"],
        block_tables=t["tables"],
        context_lens=t["context_lens"],
        max_query_len=max(len(r.token_ids) for r in ordered),
        max_context_len=max(context_lens),
    )
    mamba = MambaMetadata(
        num_prefill_tokens=p_cu[-1],
        prefill_cu_seqlens=t["p_cu"],
        prefill_slots=t["prefill_slots"],
        has_initial_state=t["has_initial_state"],
        num_decode_rows=len(decode),
        decode_q=q,
        decode_slots=t["decode_slots"],
        decode_token_index=t.get("token_index"),
        decode_dst_slots=t.get("dst"),
        publish_seq=t.get("publish_seq"),
        publish_len=t.get("publish_len"),
        publish_dst=t.get("publish_dst"),
    )
    return BatchInputs(t["ids"], attn, mamba, t["logit_index"], t["positions"], prefill, decode, offset_of)
