"""Gated RMSNorm vs transformers' Nemotron-H module and a float64 formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replayssm.ops.norm import rms_norm_gated

nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")


def _hf_norm(weight: torch.Tensor, group_size: int, eps: float) -> torch.nn.Module:
    mod = nemotron_h.NemotronHRMSNormGated(weight.shape[0], group_size=group_size, eps=eps)
    with torch.no_grad():
        mod.weight = torch.nn.Parameter(weight.clone())
    return mod


@pytest.mark.parametrize(
    "x_dtype, w_dtype, C, group_size",
    [
        (torch.float32, torch.float32, 256, 64),
        (torch.bfloat16, torch.bfloat16, 512, 128),
        (torch.bfloat16, torch.float32, 96, 96),
        (torch.float16, torch.float16, 64, 8),
    ],
)
def test_matches_transformers_nemotron_h(x_dtype, w_dtype, C, group_size):
    """Output equals transformers' NemotronHRMSNormGated bit for bit (values and dtype), gated or not."""
    eps = 1e-5
    x = (torch.randn(3, 5, C) * 2).to(x_dtype)
    z = torch.randn(3, 5, C).to(x_dtype)
    weight = (1 + 0.5 * torch.randn(C)).to(w_dtype)
    mod = _hf_norm(weight, group_size, eps)
    with torch.no_grad():
        for gate in (z, None):
            want = mod(x, gate)
            got = rms_norm_gated(x, gate, weight, eps, group_size)
            assert got.dtype == want.dtype
            assert torch.equal(got, want)


def test_matches_float64_formula():
    """fp32 output matches g / rms(g per group) * weight with g = x * silu(z), computed in float64."""
    C, gs, eps = 128, 32, 1e-6
    x, z, w = torch.randn(7, C), torch.randn(7, C), torch.randn(C)
    g = x.double() * F.silu(z.double())
    g = g.view(7, C // gs, gs)
    want = (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(7, C) * w.double()
    torch.testing.assert_close(rms_norm_gated(x, z, w, eps, gs).double(), want, atol=1e-5, rtol=1e-5)


def test_non_contiguous_input():
    """A non-contiguous (transposed) input gives the same result as its contiguous copy."""
    x, z, w = torch.randn(64, 6).t(), torch.randn(6, 64), torch.randn(64)
    torch.testing.assert_close(
        rms_norm_gated(x, z, w, 1e-5, 16), rms_norm_gated(x.contiguous(), z, w, 1e-5, 16)
    )


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("z", dict(z=torch.randn(4, 31))),
        ("weight", dict(weight=torch.randn(16))),
        ("group_size", dict(group_size=5)),
        ("group_size", dict(group_size=0)),
        ("eps", dict(eps=0.0)),
        ("x", dict(x=torch.randint(0, 3, (4, 32)))),
    ],
)
def test_bad_arguments_raise(name, kwargs):
    """Bad arguments raise ValueError naming the argument."""
    args = dict(x=torch.randn(4, 32), z=torch.randn(4, 32), weight=torch.randn(32), eps=1e-5, group_size=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        rms_norm_gated(**args)
