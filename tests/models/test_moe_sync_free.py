"""Routed experts: the sync-free grouped formulation equals the per-expert loop it replaced."""

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda, sync_forbidden

from replayssm.models.layers.mlp import Experts
from replayssm.ops.moe import expert_mlp, expert_mlp_ref


def loop_experts(ex: Experts, x, weights, ids):
    """The previous formulation: per-expert loop over host-read token counts, fp32 accumulation."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=ex.up_proj.shape[0]).tolist()
    tokens = order // ids.shape[1]
    token_w = weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        t = tokens[start:start + n]
        h = ex.act(F.linear(x[t], ex.up_proj[e]))
        h = F.linear(h, ex.down_proj[e]) * token_w[start:start + n, None]
        out[t] += h.float()
        start += n
    return out.to(x.dtype)


def make(T, E, k, in_dim, inter, dtype, device="cpu"):
    ex = Experts(E, in_dim, inter, "relu2", device=device, dtype=dtype)
    with torch.no_grad():
        ex.up_proj.normal_(0, in_dim ** -0.5)
        ex.down_proj.normal_(0, inter ** -0.5)
    x = torch.randn(T, in_dim, device=device).to(dtype)
    # Distinct experts per token, in random (unsorted) order, a few experts unused.
    ids = torch.rand(T, E, device=device)[:, : max(k, E - 2)].argsort(dim=1)[:, :k]
    weights = torch.rand(T, k, device=device)
    return ex, x, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k", [(1, 4, 2), (13, 8, 3), (40, 6, 6)])
def test_grouped_experts_bitwise_equal_loop(dtype, T, E, k):
    """Sorted-group forward == the old per-expert loop, bit for bit, fp32 and bf16."""
    ex, x, weights, ids = make(T, E, k, 24, 40, dtype)
    with torch.no_grad():
        got = ex(x, weights, ids)
        want = loop_experts(ex, x, weights, ids)
    assert got.dtype == dtype and torch.equal(got, want)


@requires_cuda
def test_grouped_experts_cuda_sync_free_and_close():
    """On CUDA (bf16) the forward runs with syncs forbidden and matches the CPU loop within bf16 rounding."""
    ex, x, weights, ids = make(64, 8, 2, 128, 256, torch.bfloat16, "cuda")
    with torch.no_grad():
        torch.cuda.synchronize()
        with sync_forbidden():
            got = ex(x, weights, ids)
        want = loop_experts(ex, x, weights, ids)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, err


@requires_cuda
def test_expert_mlp_cuda_matches_ref():
    """The dispatching expert_mlp equals its per-expert reference on CUDA within bf16 rounding."""
    E, in_dim, inter = 4, 64, 96
    up = torch.randn(E, inter, in_dim, device="cuda", dtype=torch.bfloat16) * in_dim ** -0.5
    down = torch.randn(E, in_dim, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
    x = torch.randn(37, in_dim, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor([5, 5, 30, 37], device="cuda")
    act = lambda v: torch.square(F.relu(v))  # noqa: E731
    got, want = expert_mlp(x, up, down, ends, act), expert_mlp_ref(x, up, down, ends, act)
    assert ((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
