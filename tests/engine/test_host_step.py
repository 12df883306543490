"""Host-side step helpers: one packed host-to-device copy, batched block-table checks, the
multi-layer conv commit and the host cursor mirror all match what they replace."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import requires_cuda
from hypothesis import given, settings
from hypothesis import strategies as st

from replayssm.engine.block_tables import BlockTables
from replayssm.engine.decode_commit import mirror_commit
from replayssm.engine.host_pack import HostPack, host_tensor
from replayssm.engine.model_runner import ScheduledRow
from replayssm.ops.conv1d import causal_conv1d_commit, causal_conv1d_commit_layers
from replayssm.ops.replay import replay_commit_ref

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.mark.parametrize("device", DEVICES)
@settings(deadline=None, max_examples=10)
@given(seed=st.integers(0, 2**16))
def test_pack_matches_separate_tensors(device, seed):
    """Every packed part equals torch.tensor of its list (dtype, shape, values) and starts 16-byte aligned."""
    rng = random.Random(seed)
    dtypes = [torch.int64, torch.int32, torch.bool, torch.int32, torch.int64]
    lists = []
    for dt in dtypes:
        n = rng.randint(0, 7)
        lists.append([rng.random() < 0.5 for _ in range(n)] if dt is torch.bool
                     else [rng.randint(-1, 2**30) for _ in range(n)])
    pack = HostPack()
    idx = [pack.add(v, dt) for v, dt in zip(lists, dtypes)]
    table = [rng.randint(-1, 99) for _ in range(6)]
    t_idx = pack.add(table, torch.int32, (2, 3))
    sent = pack.send(torch.device(device))
    for i, v, dt in zip(idx, lists, dtypes):
        assert sent[i].dtype == dt and sent[i].device.type == device
        assert torch.equal(sent[i].cpu(), torch.tensor(v, dtype=dt))
        assert sent[i].data_ptr() % 16 == 0
    assert torch.equal(sent[t_idx].cpu(), torch.tensor(table, dtype=torch.int32).view(2, 3))


def test_host_tensor_falls_back_to_torch_conversion():
    """Lists array() cannot hold exactly (floats) convert like torch.tensor; ints go through array()."""
    cases = (([1.7, 2.2], torch.int64), ([3, -1, 2**40], torch.int64), ([5, 6], torch.int32),
             ([], torch.int32))
    for values, dt in cases:
        assert torch.equal(host_tensor(values, dt), torch.tensor(values, dtype=dt))


@settings(deadline=None, max_examples=15)
@given(seed=st.integers(0, 2**16))
def test_block_tables_match_padded_tables(seed):
    """Over steps of growing, shrinking and replaced tables, BlockTables equals the nested -1-padded
    tensor; a bad id (out of range, not an int) or a repeated slot gives None and changes nothing."""
    rng = random.Random(seed)
    S, N = 6, 40
    bt = BlockTables(S, N)
    tables = {s: [rng.randrange(N) for _ in range(rng.randint(1, 3))] for s in range(S)}
    for _ in range(8):
        for s in tables:
            r = rng.random()
            if r < 0.4:
                tables[s] = tables[s] + [rng.randrange(N) for _ in range(rng.randint(1, 12))]
            elif r < 0.5:
                tables[s] = [rng.randrange(N) for _ in range(rng.randint(1, 4))]  # a new request
            elif r < 0.6:
                tables[s] = tables[s][:rng.randint(1, len(tables[s]))]
        slots = rng.sample(range(S), rng.randint(1, S))
        rows = [list(tables[s]) for s in slots]
        if rng.random() < 0.3:
            bad = [list(t) for t in rows]
            bad[rng.randrange(len(bad))].append(rng.choice([-1, N, 2**40, 1.5]))
            assert bt.tensor(slots, bad) is None
            assert bt.tensor(slots + slots[:1], rows + rows[:1]) is None
        width = max(len(t) for t in rows)
        want = torch.tensor([t + [-1] * (width - len(t)) for t in rows], dtype=torch.int32)
        assert torch.equal(bt.tensor(slots, rows), want)


@settings(deadline=None, max_examples=20)
@given(seed=st.integers(0, 2**16), q=st.integers(1, 5), window=st.integers(1, 6))
def test_mirror_commit_matches_replay_commit(seed, q, window):
    """The host cursor mirror moves exactly as replay_commit moves the device cursors."""
    rng = random.Random(seed)
    S, R = 12, window + 5
    start = [rng.randrange(R) for _ in range(S)]
    committed = [rng.randrange(window + 1) for _ in range(S)]
    slots = rng.sample(range(S), rng.randint(1, S))
    accepted = [rng.randint(1, q) for _ in slots]
    dev_start, dev_comm = torch.tensor(start, dtype=torch.int32), torch.tensor(committed, dtype=torch.int32)
    replay_commit_ref(dev_start, dev_comm, torch.tensor(slots, dtype=torch.int32),
                      torch.tensor(accepted, dtype=torch.int32), q, window, ring_rows=R)
    mirror_commit(start, committed, slots, accepted, q, window, R)
    assert start == dev_start.tolist() and committed == dev_comm.tolist()


@pytest.mark.parametrize("use_dst", [False, True])
def test_commit_layers_matches_per_layer(use_dst):
    """causal_conv1d_commit_layers == causal_conv1d_commit per layer (two layouts, padding row, dst)."""
    S, b, q = 9, 4, 3
    shapes = [(S, 8, 3), (S, 8, 3), (S, 16, 3), (S, 8, 3)]
    pools = [torch.randn(*s) for s in shapes]
    xs = [torch.randn(b, q, s[1]) for s in shapes]
    slots = torch.tensor([3, -1, 0, 7], dtype=torch.int32)
    acc = torch.tensor([1, 2, 3, 2], dtype=torch.int32)
    dst = torch.tensor([5, -1, 1, 8], dtype=torch.int32) if use_dst else None
    want = [p.clone() for p in pools]
    for p, x in zip(want, xs):
        causal_conv1d_commit(p, x, acc, slots, dst)
    causal_conv1d_commit_layers(pools, xs, acc, slots, dst)
    for p, w in zip(pools, want):
        assert torch.equal(p, w)


def test_commit_layers_validates_every_layout():
    """A layer whose layout differs from the first is validated too (bad width raises naming conv_state)."""
    slots = torch.tensor([0, 1], dtype=torch.int32)
    acc = torch.ones(2, dtype=torch.int32)
    pools = [torch.randn(4, 8, 3), torch.randn(4, 7, 3)]
    xs = [torch.randn(2, 1, 8), torch.randn(2, 1, 8)]
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_commit_layers(pools, xs, acc, slots)
    with pytest.raises(ValueError, match="state_indices"):
        causal_conv1d_commit_layers(pools[:1], xs[:1], acc, torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="layers"):
        causal_conv1d_commit_layers(pools, xs[:1], acc, slots)


def test_block_errors_keep_their_precedence():
    """With batched block checks, the first bad row is still named, before any whole-batch error."""
    from test_model_runner import make_runner

    runner = make_runner("nemotron_h")
    rows = [ScheduledRow([1, 2], 0, [3], 0, True), ScheduledRow([1], 0, [runner.num_kv_blocks], 0, True),
            ScheduledRow([1], 0, [-1], 1, True)]
    with pytest.raises(ValueError, match=r"rows\[1\]\.block_table has ids outside"):
        runner.execute(rows)  # rows 0 and 1 also share slot 0: a batch check, after every row check
    rows[1] = ScheduledRow([1], 0, [4], 0, True, num_logits=2)
    with pytest.raises(ValueError, match=r"rows\[1\]\.num_logits"):
        runner.execute(rows)  # row 1's own error comes before row 2's block ids
