"""FP8 routed experts (ops/moe.py: expert_mlp_fp8 and its reference) against float64 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, requires_cuda, sync_forbidden

from replayssm.models.layers.mlp import Experts, gated
from replayssm.ops.fp8 import quantize_fp8
from replayssm.ops.moe import expert_mlp_fp8, expert_mlp_fp8_ref, fp8_experts_path


def relu2(v: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(v))


def stacks(E, in_dim, inter, per_channel, device="cpu", gated_act=False):
    """Random E4M3 expert stacks with their scales; per-expert magnitudes differ by 10x."""
    mag = torch.tensor([0.1, 1.0, 10.0, 0.5] * E, device=device)[:E].view(E, 1, 1)
    rows = 2 * inter if gated_act else inter
    up_q, up_s = quantize_fp8(torch.randn(E, rows, in_dim, device=device) * mag * in_dim ** -0.5, per_channel)
    down_q, down_s = quantize_fp8(torch.randn(E, in_dim, inter, device=device) * inter ** -0.5, per_channel)
    return up_q, up_s, down_q, down_s


def ref64(x, up_q, up_s, down_q, down_s, ends, act):
    """float64, per row: down_e @ act(up_e @ x) with the dequantized stacks and exact activations."""
    up, down = up_q.double() * up_s.double(), down_q.double() * down_s.double()
    out = torch.empty(x.shape, dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = act(x[start:end].double() @ up[e].T) @ down[e].T
        start = end
    return out


ACT_ROUNDING = 0.08  # norm-relative error of per-token E4M3 activations in the two GEMMs (see below)


def rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("gated_act", [False, True])
def test_fp8_reference_within_e4m3_activation_rounding(per_channel, gated_act):
    """The FP8 experts' reference (per-token E4M3 activations) is the float64 dequantized MLP up to the
    activations' E4M3 rounding: 2^-4 relative per element at most (~3.6% rms), in two GEMMs, the first
    doubled by relu2's square; measured 4-6% in norm, bound 8%."""
    E, in_dim, inter = 4, 32, 48
    up_q, up_s, down_q, down_s = stacks(E, in_dim, inter, per_channel, gated_act=gated_act)
    x = torch.randn(29, in_dim) * torch.rand(29, 1) * 4
    ends = torch.tensor([6, 6, 20, 29])  # expert 1 gets no rows
    act = gated(F.silu) if gated_act else relu2
    got = expert_mlp_fp8_ref(x, up_q, up_s, down_q, down_s, ends, act)
    assert got.dtype == x.dtype
    assert rel_err(got, ref64(x, up_q, up_s, down_q, down_s, ends, act)) < ACT_ROUNDING


def test_cpu_experts_take_the_dequantized_path():
    """On the CPU (and for weight-only checkpoints) the FP8 experts run the dequantized grouped GEMM."""
    up_q, _, down_q, _ = stacks(2, 16, 16, True)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    for activation in ("dynamic", "static", "none"):
        assert fp8_experts_path(x, up_q, down_q, activation) == "dequant"


def test_bad_scale_shape_is_a_value_error():
    """A scale that is neither per channel nor per expert is a ValueError naming it."""
    up_q, up_s, down_q, down_s = stacks(2, 16, 16, True)
    with pytest.raises(ValueError, match="up_scale"):
        expert_mlp_fp8_ref(torch.randn(3, 16), up_q, up_s[:, :4], down_q, down_s, torch.tensor([1, 3]), relu2)


def _cap() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if HAS_CUDA else (0, 0)


hopper = pytest.mark.skipif(_cap() < (9, 0), reason="the FP8 grouped GEMM needs compute capability >= 9.0")


@requires_cuda
@hopper
@pytest.mark.parametrize("per_channel", [True, False])
def test_scaled_grouped_mm_matches_reference(per_channel):
    """On Hopper the FP8 grouped GEMM is taken and equals its per-expert reference within bf16 rounding,
    and the float64 dequantized MLP within the activations' E4M3 rounding."""
    E, in_dim, inter = 4, 128, 256
    up_q, up_s, down_q, down_s = stacks(E, in_dim, inter, per_channel, device="cuda")
    x = torch.randn(77, in_dim, device="cuda").to(torch.bfloat16)
    ends = torch.tensor([10, 10, 60, 77], device="cuda")
    assert fp8_experts_path(x, up_q, down_q, "dynamic") == "scaled_grouped_mm"
    got = expert_mlp_fp8(x, up_q, up_s, down_q, down_s, ends, relu2)
    want = expert_mlp_fp8_ref(x, up_q, up_s, down_q, down_s, ends, relu2)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-2
    cpu = [t.cpu() for t in (x, up_q, up_s, down_q, down_s, ends)]
    assert rel_err(got.cpu(), ref64(*cpu, relu2)) < ACT_ROUNDING


def fp8_experts(E, in_dim, inter, device):
    ex = Experts(E, in_dim, inter, "relu2", device=device, dtype=torch.bfloat16)
    up_q, up_s, down_q, down_s = stacks(E, in_dim, inter, True, device=device)
    for name, t in (("up_proj", up_q), ("down_proj", down_q), ("up_proj_scale", up_s),
                    ("down_proj_scale", down_s)):
        setattr(ex, name, torch.nn.Parameter(t, requires_grad=False))
    ex.fp8_activation = "dynamic"
    return ex


@requires_cuda
@hopper
def test_fp8_experts_sync_free_and_graph_capturable():
    """FP8 experts on Hopper run with syncs forbidden, replay in a CUDA graph with new routing, and stay
    within the activations' E4M3 rounding of the dequantized experts."""
    T, E, k, in_dim, inter = 64, 8, 2, 128, 256
    ex = fp8_experts(E, in_dim, inter, "cuda")
    x = torch.randn(T, in_dim, device="cuda").to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :k]
    weights = torch.rand(T, k, device="cuda")
    with torch.no_grad():
        ex(x, weights, ids)  # probes the op outside capture
        torch.cuda.synchronize()
        with sync_forbidden():
            got = ex(x, weights, ids)
        dequant = Experts(E, in_dim, inter, "relu2", device="cuda", dtype=torch.bfloat16)
        up, down = ex.expert_weights(torch.bfloat16)
        dequant.up_proj, dequant.down_proj = torch.nn.Parameter(up), torch.nn.Parameter(down)
        assert rel_err(got, dequant(x, weights, ids)) < ACT_ROUNDING
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ex(x, weights, ids)
        ids.copy_(torch.rand(T, E, device="cuda").argsort(dim=1)[:, :k])
        graph.replay()
        torch.testing.assert_close(out, ex(x, weights, ids), rtol=0, atol=0)
