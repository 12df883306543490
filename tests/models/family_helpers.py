"""Helpers shared by the model-family tests (Granite 4.0-H, Bamba, Falcon-H1): an engine on the CPU,
its greedy tokens, and one varlen prefill's logits beside transformers'."""

from __future__ import annotations

import torch

from replayssm import LLM, SamplingParams
from replayssm.engine.model_runner import ModelRunner, ScheduledRow
from replayssm.models.loader import load_weights

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def family_llm(path, **kw):
    return LLM(path, device="cpu", max_model_len=128, **kw)


def greedy_tokens(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def our_logits(path, model_cls, cfg=None):
    """Our model's full-sequence logits for three prompts, packed in one varlen prefill; with `cfg`, the
    same weights under an edited config."""
    runner = ModelRunner(path, num_kv_blocks=24, kv_block_size=4, num_slots=6, device="cpu")
    if cfg is not None:
        model = model_cls(cfg, dtype=torch.float32)
        load_weights(model, path, rename=model.checkpoint_name)
        runner.model = model.eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (21, 5, 13)]
    rows = [ScheduledRow(p, 0, list(range(8 * i, 8 * i + 6)), slot, True, num_logits=len(p))
            for i, (p, slot) in enumerate(zip(prompts, [4, 0, 2]))]
    logits = runner.execute(rows)
    runner.commit(rows, [1] * 3)
    return logits, prompts


def hf_logits(hf, prompts):
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
