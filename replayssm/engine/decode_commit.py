"""The commit half of a decode step: cursors (once), conv windows (every Mamba layer), checkpoints.

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
    publish_conv_windows(cache, pubs, q, runner.device)
    if runner.replayssm:
        replay_commit(cache.ring_start, cache.committed, slots, acc, q, runner.window,
                      ring_rows=cache.ring_rows)
        mirror_commit(runner._ring_start, runner._committed, slot_list, accepted, q, runner.window,
                      cache.ring_rows)
    causal_conv1d_commit_layers(cache.conv, [s[first:first + len(rows), :q] for s in cache.conv_scratch], acc,
                                slots, dst_indices=dst)
    publish_states(runner, pubs, runner._next_seed())


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
