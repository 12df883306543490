"""The engine on CUDA (Triton decode kernels) against transformers, fp32 and bf16."""

import pytest
import torch
from checkpoints import cached_checkpoint, hf_greedy, random_prompts
from conftest import requires_cuda

from replayssm import LLM, SamplingParams

pytestmark = requires_cuda

NEW_TOKENS = 64
PROMPT_LENS = (5, 17, 33, 9)


def _prompts():
    return random_prompts(PROMPT_LENS, seed=99)


def _generate(path, dtype, **kw):
    llm = LLM(path, device="cuda", dtype=dtype, max_model_len=128, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate(_prompts(), sp, use_tqdm=False)


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
@pytest.mark.parametrize("replayssm", [True, False])
def test_cuda_fp32_greedy_matches_transformers(kind, replayssm):
    """fp32 on CUDA (Triton decode path) gives transformers' greedy tokens, ReplaySSM on and off."""
    path, model = cached_checkpoint(kind)
    hf = hf_greedy(model.float().cpu(), _prompts(), NEW_TOKENS)
    outs = _generate(path, "float32", replayssm=replayssm, replay_window=5)
    assert [o.token_ids for o in outs] == hf


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
@pytest.mark.parametrize("replayssm", [True, False])
def test_cuda_bf16_tokens_are_transformers_choices(kind, replayssm):
    """bf16 on CUDA: every greedy token is within bf16 noise of transformers' (fp32) best choice,
    and its logprobs track transformers' logprobs of the same tokens (bf16 weights and
    activations through every layer: close on average, a few tenths at worst)."""
    path, model = cached_checkpoint(kind)
    model = model.float().cpu()
    outs = _generate(path, "bfloat16", replayssm=replayssm, replay_window=5)
    for p, out in zip(_prompts(), outs):
        seq = torch.tensor([p + out.token_ids])
        with torch.no_grad():
            ref = model(seq).logits[0, len(p) - 1 : -1].float().log_softmax(-1)
        chosen = ref.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        assert (ref.max(-1).values - chosen).max() < 0.1
        err = (torch.tensor(out.logprobs) - chosen).abs()
        assert err.mean() < 0.05 and err.max() < 0.6
