"""Host layouts of the prefill ops (ssd scan, varlen conv): built once per metadata, never stale, no syncs."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda

from replayssm.ops.conv1d import causal_conv1d_varlen
from replayssm.ops.ssd import ssd_chunked_scan
from replayssm.ops.ssd_layout import chunk_layout

H, G, P, N, D, K = 4, 2, 8, 16, 12, 4


def _meta(lengths, slots, init, device="cpu"):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return (cu, torch.tensor(slots, dtype=torch.int32, device=device),
            torch.tensor(init, dtype=torch.bool, device=device))


def _scan_inputs(T, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    return (r(T, H, P), r(T, H) - 1, -torch.rand(H, generator=g).to(device) - 0.5, r(T, G, N) / 4, r(T, G, N),
            r(H), r(H) * 0.5)


def _scan(meta, T, pool, **kw):
    return ssd_chunked_scan(*_scan_inputs(T, pool.device), pool, *meta, chunk_size=4, **kw)


def test_chunks_are_numbered_position_major():
    """Chunk ids go by position, then sequence rank (most chunks first); every token maps back to itself."""
    cu, slots, init = _meta([12, 4, 8], [2, 0, 1], [True, True, True])
    lay = chunk_layout(cu, slots, init, None, None, 4, 24)
    assert lay.positions == [(0, 3, 2), (3, 2, 1), (5, 1, 0)]
    firsts = lay.idx[:, 0].tolist()
    assert firsts == [0, 16, 12, 4, 20, 8]  # seq 0, seq 2, seq 1 at k=0; seq 0, seq 2 at k=1; seq 0 at k=2
    assert torch.equal(lay.idx[lay.token_chunk, lay.token_offset], torch.arange(24))
    assert lay.pad is None and lay.init_mode == "all" and lay.store_rows is None


def test_layout_is_shared_while_metadata_lives_unchanged():
    """Same tensors: one layout object; an in-place change or a new tensor rebuilds it."""
    cu, slots, init = _meta([5, 3], [1, 0], [True, False])
    first = chunk_layout(cu, slots, init, None, None, 4, 8)
    assert chunk_layout(cu, slots, init, None, None, 4, 8) is first
    assert chunk_layout(cu.clone(), slots, init, None, None, 4, 8) is not first
    init[1] = True
    again = chunk_layout(cu, slots, init, None, None, 4, 8)
    assert again is not first and again.init_mode == "all"


@pytest.mark.parametrize("change", ["lengths", "slots", "init"])
def test_scan_and_conv_see_metadata_changed_in_place(change):
    """Metadata tensors edited in place between calls give the same results as fresh tensors."""
    T = 11
    meta = _meta([6, 5], [2, 0], [True, False])
    pool = torch.randn(4, H, P, N)
    conv = torch.randn(4, D, K - 1)
    x = torch.randn(T, D)
    w, b = torch.randn(D, K), torch.randn(D)
    _scan(meta, T, pool.clone())
    causal_conv1d_varlen(x, w, b, conv.clone(), *meta)
    new = {"lengths": ([3, 8], [2, 0], [True, False]), "slots": ([6, 5], [1, 3], [True, False]),
           "init": ([6, 5], [2, 0], [False, True])}[change]
    for t, v in zip(meta, _meta(*new)):
        t.copy_(v)
    pool_a, pool_b = pool.clone(), pool.clone()
    y_a, _ = _scan(meta, T, pool_a)
    y_b, _ = _scan(_meta(*new), T, pool_b)
    assert torch.equal(y_a, y_b) and torch.equal(pool_a, pool_b)
    conv_a, conv_b = conv.clone(), conv.clone()
    c_a = causal_conv1d_varlen(x, w, b, conv_a, *meta)
    assert torch.equal(c_a, causal_conv1d_varlen(x, w, b, conv_b, *_meta(*new)))
    assert torch.equal(conv_a, conv_b)


@requires_cuda
def test_second_layer_call_is_sync_free():
    """A second scan / varlen conv with the same metadata (the next layer) never waits for the device."""
    T = 37
    meta = _meta([20, 0, 17], [3, -1, 1], [True, False, True], "cuda")
    bseq = torch.tensor([0, 2, 2], dtype=torch.int32, device="cuda")
    blen = torch.tensor([16, 4, 16], dtype=torch.int32, device="cuda")
    pool = torch.randn(5, H, P, N, device="cuda")
    conv = torch.randn(5, D, K - 1, device="cuda")
    x, w = torch.randn(T, D, device="cuda"), torch.randn(D, K, device="cuda")
    inputs = _scan_inputs(T, "cuda")
    for layer in range(2):
        torch.cuda.synchronize()
        if layer:
            torch.cuda.set_sync_debug_mode("error")
        try:
            y, states = ssd_chunked_scan(*inputs, pool, *meta, chunk_size=4, boundary_seq=bseq,
                                         boundary_len=blen)
            c = causal_conv1d_varlen(x, w, None, conv, *meta)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(y).all() and torch.isfinite(states).all() and torch.isfinite(c).all()
