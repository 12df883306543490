"""The commit half of a decode step: cursors (once), conv windows (every Mamba layer), checkpoints.

Plain decode steps (one token a row, no baseline destination slots: `MambaMetadata.advance_windows`)
accept every token they compute, so their forward moved the conv windows already and only the
cursors and checkpoints are committed here.

`commit_decode` takes the accepted counts as a host list; `commit_decode_device` takes them on the
device, for a verify step whose counts are read back later (two interleaved request groups,
LLMEngine).

Host cost matters here: it runs every decode step between the forward and the step's one
device read. The slot, count and destination lists go up in one packed copy, the conv-window
commit validates its arguments once for all layers (ops/conv1d.py: causal_conv1d_commit_layers),
and the host mirror of the cursors is updated with the same rule as `replay_commit`.
"""

from __future__ import annotations

import torch

from replayssm.engine.batch_inputs import BatchInputs, RowView
from replayssm.engine.host_pack import HostPack
from replayssm.engine.publish import decode_publications, publish_conv_windows, publish_states
from replayssm.ops.conv1d import causal_conv1d_commit_layers
from replayssm.ops.replay import replay_commit


def commit_decode(runner, batch: BatchInputs, rows: list[RowView], accepted: list[int]) -> None:
    """Cursor commit and conv-window commit for `rows` (a slice of batch.decode) accepting `accepted`."""
    first = batch.decode.index(rows[0])
    q = batch.mamba.decode_q
    cache = runner.mamba_cache
    pack = HostPack()
    slot_list = [r.slot for r in rows]
    pack.add(slot_list, torch.int32)
    pack.add(accepted, torch.int32)
    has_dst = any(r.spec_slots is not None for r in rows)
    if has_dst:
        pack.add([r.spec_slots[a - 1] if r.spec_slots is not None else r.slot
                  for r, a in zip(rows, accepted)], torch.int32)
    slots, acc, *rest = pack.send(runner.device)
    dst = rest[0] if has_dst else None
    # Checkpoint windows read the live window before its commit; states need the committed cursors.
    pubs = decode_publications(rows, accepted, first)
    publish_conv_windows(cache, pubs, q, runner.device, advanced=batch.mamba.advance_windows)
    _queue_commits(runner, batch, first, len(rows), slots, acc, dst)
    runner.mirror_commit(slot_list, accepted, q)
    publish_states(runner, pubs)


def commit_decode_device(runner, batch: BatchInputs, rows: list[RowView], accepted: torch.Tensor) -> None:
    """`commit_decode` with the counts on the device (accepted[r.index] for row r, int32), reading
    nothing back: cursors and conv windows only (rows with checkpoints need `commit_decode`). The
    host mirror of the cursors is the caller's to update once the counts are known
    (`runner.mirror_commit`)."""
    first = batch.decode.index(rows[0])
    q = batch.mamba.decode_q
    pack = HostPack()
    pack.add([r.slot for r in rows], torch.int32)
    pack.add([r.index for r in rows], torch.int64)
    has_dst = any(r.spec_slots is not None for r in rows)
    if has_dst:
        # Each row's spec slots padded to q with its last one (a <= the row's own q picks a real one).
        table = []
        for r in rows:
            spec = r.spec_slots or [r.slot]
            table += spec + spec[-1:] * (q - len(spec))
        pack.add(table, torch.int32, (len(rows), q))
    slots, index, *rest = pack.send(runner.device)
    acc = accepted.index_select(0, index)
    dst = rest[0].gather(1, (acc.long() - 1)[:, None]).squeeze(1) if has_dst else None
    _queue_commits(runner, batch, first, len(rows), slots, acc, dst)


def _queue_commits(runner, batch: BatchInputs, first: int, n: int, slots: torch.Tensor, acc: torch.Tensor,
                   dst: torch.Tensor | None) -> None:
    """The device half of both commits: cursors (ReplaySSM) and every layer's conv window, for the n
    decode rows from grid row `first`, slots / counts / baseline destinations on the device. The
    windows are skipped where the forward advanced them already (MambaMetadata.advance_windows)."""
    cache = runner.mamba_cache
    q = batch.mamba.decode_q
    if runner.replayssm:
        replay_commit(cache.ring_start, cache.committed, slots, acc, q, runner.window,
                      ring_rows=cache.ring_rows)
    if batch.mamba.advance_windows:
        return
    causal_conv1d_commit_layers(cache.conv, [s[first:first + n, :q] for s in cache.conv_scratch], acc,
                                slots, dst_indices=dst)


def mirror_commit(ring_start: list[int], committed: list[int], slots: list[int], accepted: list[int], q: int,
                  window: int, ring_rows: int) -> None:
    """`replay_commit` on the host lists: flushed (h + q > window) -> start = (o + h) mod R, committed = a;
    else committed = h + a."""
    limit = window - q  # flushes when h > limit
    for s, a in zip(slots, accepted):
        h = committed[s]
        if h > limit:
            ring_start[s] = (ring_start[s] + h) % ring_rows
            committed[s] = a
        else:
            committed[s] = h + a
