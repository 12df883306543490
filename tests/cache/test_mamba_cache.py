"""MambaCache slot copies: whole slots copied, everything else untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from replayssm.cache.mamba_cache import MambaCache


def _cache() -> MambaCache:
    cfg = SimpleNamespace(mamba_num_heads=4, mamba_head_dim=6, ssm_state_size=8, mamba_n_groups=2,
                          conv_dim=20, conv_kernel=4, num_mamba_layers=3, num_gdn_layers=0,
                          num_recurrent_layers=3)
    cache = MambaCache(cfg, num_slots=7, act_dtype=torch.bfloat16, state_dtype=torch.float16, replayssm=True,
                       window=4, q_max=2, max_num_seqs=3, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for t in cache.per_slot_tensors():
        if t.dtype == torch.int32:
            t.copy_(torch.randperm(t.numel(), generator=gen).to(torch.int32).view(t.shape))  # distinct
        else:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return cache


@pytest.mark.parametrize("ring", [True, False])
def test_copy_slots_copies_whole_slots_and_nothing_else(ring):
    """dst slots get every per-slot tensor of their src (ring rows only with ring=True); other slots
    and, without ring, dst's ring rows keep their bits."""
    cache = _cache()
    before = [t.clone() for t in cache.per_slot_tensors()]
    src, dst = [1, 5], [3, 0]
    cache.copy_slots(src, dst, ring=ring)
    ring_ids = {id(t) for t in (*cache.ring_x, *cache.ring_B, *cache.ring_dt)}
    for t, old in zip(cache.per_slot_tensors(), before):
        copied = ring or id(t) not in ring_ids
        for s, d in zip(src, dst):
            assert torch.equal(t[d], old[s] if copied else old[d])
        keep = [k for k in range(t.shape[0]) if k not in dst]
        assert torch.equal(t[keep], old[keep])


def test_gdn_ring_keeps_fp32_deltas_counted_by_the_planner():
    """A Gated DeltaNet layer's ring is (k act, e fp32 (Hv, R, Dv), g fp32) per slot whatever the
    activation dtype, and bytes_per_slot counts exactly the tensors the cache allocates."""
    cfg = SimpleNamespace(gdn_num_k_heads=2, gdn_num_v_heads=4, gdn_k_head_dim=8, gdn_v_head_dim=6,
                          gdn_conv_dim=44, conv_kernel=4, num_gdn_layers=2, num_recurrent_layers=2)
    kw = dict(act_dtype=torch.bfloat16, state_dtype=torch.bfloat16, replayssm=True, window=4, q_max=3)
    cache = MambaCache(cfg, num_slots=5, max_num_seqs=2, device=torch.device("cpu"), **kw)
    k, e, g = cache.ring(1)
    assert k.shape == (6, 2, 7, 8) and k.dtype == torch.bfloat16
    assert e.shape == (6, 4, 7, 6) and e.dtype == torch.float32
    assert g.dtype == torch.float32 and g.shape == (6, 4, 7)
    allocated = sum(t[0].numel() * t.element_size() for t in cache.per_slot_tensors())
    assert MambaCache.bytes_per_slot(cfg, **kw) == allocated
