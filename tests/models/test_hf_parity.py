"""Full-sequence forward of our model == transformers' forward (fp32, tiny random checkpoints)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import cached_checkpoint
from conftest import requires_cuda

from replayssm.engine.model_runner import ModelRunner, ScheduledRow

# MoE variants: the default (2 groups, pick 1, normalized) and a latent-projection one with
# 4 groups, pick 2, unnormalized weights.
MOE_VARIANT = dict(moe_latent_size=24, n_group=4, topk_group=2, norm_topk_prob=False, num_experts_per_tok=3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
def test_prefill_logits_match_transformers(kind, device):
    """Packed varlen prefill of three prompts gives transformers' logits at every position."""
    path, hf = cached_checkpoint(kind)
    _check_prefill(path, hf, device)


def test_moe_latent_and_grouped_routing():
    """Latent-projected experts, 4 routing groups (top 2), unnormalized weights: logits match transformers."""
    path, hf = cached_checkpoint("nemotron_h", **MOE_VARIANT)
    if not isinstance(getattr(hf.model.layers[2].mixer, "fc1_latent_proj", None), torch.nn.Linear):
        pytest.skip("this transformers version has no MoE latent projection")
    _check_prefill(path, hf, "cpu")


def _check_prefill(path, hf, device):
    runner = ModelRunner(path, num_kv_blocks=24, kv_block_size=4, num_slots=6, device=device)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (21, 5, 13)]
    blocks = torch.randperm(24, generator=gen).tolist()
    rows = [ScheduledRow(p, 0, blocks[8 * i: 8 * i + 6], slot, True, num_logits=len(p))
            for i, (p, slot) in enumerate(zip(prompts, [4, 0, 2]))]
    logits = runner.execute(rows)
    runner.commit(rows, [1] * 3)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    tol = 1e-4 if device == "cpu" else 2e-3
    torch.testing.assert_close(logits.cpu(), ref, rtol=tol, atol=tol)
