"""The Mamba-2 mixer's A = -exp(A_log) is computed once and follows every change to A_log."""

import torch
from checkpoints import cached_checkpoint

from replayssm.models.config import ModelConfig
from replayssm.models.layers.mamba2 import Mamba2Mixer


def _mixer(**kw) -> Mamba2Mixer:
    m = Mamba2Mixer(ModelConfig.from_hf(cached_checkpoint("nemotron_h")[0]), 0, **kw)
    with torch.no_grad():
        m.A_log.uniform_(-1.0, 2.0)
    return m


def test_decay_cached_and_rewritten_in_place():
    """One tensor per mixer: equal to -exp(A_log); an in-place write to A_log (as a weight load
    makes) rewrites that same tensor, so a CUDA graph holding it reads the new values."""
    m = _mixer()
    a = m.decay_A()
    assert torch.equal(a, -torch.exp(m.A_log.float()))
    assert m.decay_A() is a
    with torch.no_grad():
        m.A_log.copy_(torch.randn_like(m.A_log))
    b = m.decay_A()
    assert b is a and torch.equal(b, -torch.exp(m.A_log.float()))


def test_decay_follows_a_replaced_parameter_and_inference_tensors():
    """A new A_log tensor gets a new A; parameters made under inference_mode (no version counter)
    get A computed on every call."""
    m = _mixer()
    a = m.decay_A()
    m.A_log.data = torch.randn_like(m.A_log)
    assert torch.equal(m.decay_A(), -torch.exp(m.A_log.float())) and not torch.equal(m.decay_A(), a)
    with torch.inference_mode():
        m = _mixer()
        first = m.decay_A()
        m.A_log.copy_(torch.randn_like(m.A_log))
        assert torch.equal(m.decay_A(), -torch.exp(m.A_log.float())) and not torch.equal(m.decay_A(), first)
