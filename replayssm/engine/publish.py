"""Publishing exact recurrent checkpoints (state + conv window) for decode and verify rows.

A decode row of q tokens that starts after c0 computed tokens and accepts a of them asks
for checkpoints at offsets b (boundary t = c0 + b); those with b <= a are written into their
checkpoint slot (see replayssm/cache/prefix_cache.py for the whole step). Two halves, because
the live slot changes in between:

    | half          | when                              | writes checkpoint slot d                    |
    |---------------|-----------------------------------|---------------------------------------------|
    | conv windows  | before the live window commits    | conv[d] = last K-1 of [window, inputs[:b]]  |
    | states        | after the cursor commit           | ReplaySSM: materialize(live, n, d),         |
    |               |                                   |   n = b - a + committed'[live] in [0, c'] |
    |               |                                   | baseline: state after token b, which the    |
    |               |                                   |   forward wrote (spec slot b-1, or live)    |

Each mixer materializes its own states (`mixer.materialize`). Prefill rows publish inside the
recurrent mixer instead (the chunked scan returns the state at b).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayssm.engine.batch_inputs import to_device
from replayssm.ops.conv1d import causal_conv1d_commit


@dataclass
class Publication:
    grid_row: int  # row of the step's decode grid (index into the conv scratch)
    live: int  # the row's live slot before the commit
    source: int  # baseline: slot holding the state after token b (ReplaySSM: = live)
    offset: int  # b
    accepted: int  # a
    dst: int


def decode_publications(rows, accepted: list[int], first: int) -> list[Publication]:
    """The checkpoints of decode RowViews `rows` (grid rows first.. first+len) reached with `accepted`."""
    out = []
    for i, (r, a) in enumerate(zip(rows, accepted)):
        for b, dst in r.checkpoints or ():
            if b <= a:
                source = r.spec_slots[b - 1] if r.spec_slots is not None else r.slot
                out.append(Publication(first + i, r.slot, source, b, a, dst))
    return out


def publish_conv_windows(cache, pubs: list[Publication], q: int, device: torch.device, *,
                         advanced: bool = False) -> None:
    """conv[dst] = the window at each boundary, from the (uncommitted) live window + step inputs.

    advanced: the forward moved the live windows past its one token already (q = 1, so every
    boundary is b = a = 1): the boundary window is the live window.
    """
    if not pubs:
        return
    if advanced:
        assert q == 1 and all(p.offset == 1 for p in pubs), pubs
        src = to_device([p.live for p in pubs], torch.int64, device)
        dst = to_device([p.dst for p in pubs], torch.int64, device)
        for conv in cache.conv:
            conv[dst] = conv[src]
        return
    idx = lambda v: to_device(v, torch.int32, device)  # noqa: E731
    grid = to_device([p.grid_row for p in pubs], torch.int64, device)
    b, src, dst = idx([p.offset for p in pubs]), idx([p.live for p in pubs]), idx([p.dst for p in pubs])
    for conv, scratch in zip(cache.conv, cache.conv_scratch):
        causal_conv1d_commit(conv, scratch[grid, :q], b, src, dst_indices=dst)


def publish_states(runner, pubs: list[Publication]) -> None:
    """state[dst] = the exact state after each boundary (call after the cursor commit). ReplaySSM
    materializes them with the runner's device seeds (layer l: runner.rand_seed[l]), one draw."""
    if not pubs:
        return
    cache, device = runner.mamba_cache, runner.device
    dst = to_device([p.dst for p in pubs], torch.int64, device)
    if not runner.replayssm:
        src = to_device([p.source for p in pubs], torch.int64, device)
        for state in cache.state:
            state[dst] = state[src]
        return
    # Post-commit the live slot holds S_0 after c - committed' tokens; the boundary is
    # c0 + b = c - a + b, so n = b - a + committed' entries past S_0 (never negative: see
    # cache/prefix_cache.py).
    n = [p.offset - p.accepted + runner.cursors(p.live)[1] for p in pubs]
    assert all(0 <= k <= runner.cursors(p.live)[1] for k, p in zip(n, pubs)), n
    src = to_device([p.live for p in pubs], torch.int32, device)
    num = to_device(n, torch.int32, device)
    for layer, mixer in enumerate(runner.mixers):
        mixer.materialize(cache, layer, src, num, dst.to(torch.int32), rand_seed=runner.rand_seed[layer])
    runner.rand_seed.advance()
