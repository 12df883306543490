"""Helpers shared by the model-family tests (Granite 4.0-H, Bamba, Falcon-H1, Zamba2): an engine on the
CPU, its greedy tokens, one varlen prefill's logits beside transformers', and the engine lifecycle checks
(prefix hit, speculation, preemption, tensor parallelism, CUDA graphs) every family runs."""

from __future__ import annotations

import torch
from checkpoints import cached_checkpoint, hf_greedy, random_prompts

from replayssm import LLM, SamplingParams
from replayssm.engine.model_runner import ModelRunner, ScheduledRow
from replayssm.models.loader import load_weights

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


# Each family's tiny checkpoint (a tests/checkpoints.py kind and its overrides) and its prompts' seed.
# Granite: tokens stay diverse under tied embeddings when the residual branch outweighs the embedding.
FAMILIES = {
    "granite": ("granite_hybrid", dict(embedding_multiplier=0.5, residual_multiplier=1.5), 1234),
    "bamba": ("bamba", {}, 4321),
    "falcon_h1": ("falcon_h1", {}, 1234),
    "zamba2": ("zamba2", {}, 1234),
}


def family_prompts(family: str) -> list[list[int]]:
    """Four prompts of different lengths (5, 17, 33, 9 tokens)."""
    return random_prompts((5, 17, 33, 9), seed=FAMILIES[family][2])


def family_case(family: str, **overrides):
    """(path, transformers model, prompts, transformers' greedy tokens) of the family's tiny checkpoint."""
    kind, base, _ = FAMILIES[family]
    path, hf = cached_checkpoint(kind, **{**base, **overrides})
    prompts = family_prompts(family)
    return path, hf, prompts, hf_greedy(hf, prompts, NEW_TOKENS)


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


def decode_schedule(runner, q):
    """Prefill 5 requests on permuted slots, then 6 decode/verify steps of q tokens over a shrinking,
    reordered batch with varying acceptance; the logits of every step."""
    slots, tables = [9, 2, 7, 0, 11], [[i * 8 + j for j in range(8)] for i in range(5)]
    prompts = [[(7 * i + j) % 250 + 3 for j in range(3 + 2 * i)] for i in range(5)]
    rows = [ScheduledRow(p, 0, t, s, True) for p, t, s in zip(prompts, tables, slots)]
    runner.execute(rows)
    runner.commit(rows, [1] * 5)
    pos, out = [len(p) for p in prompts], []
    for step in range(6):
        live = [i for i in (4, 0, 3, 1, 2) if i < 5 - step // 2]
        rows = [ScheduledRow([(step * 13 + i) % 250 + 3] * q, pos[i], tables[i], slots[i], False,
                             num_logits=q) for i in live]
        out.append(runner.execute(rows).float().cpu())
        accepted = [1 + (step + i) % q for i in live]
        runner.commit(rows, accepted)
        for i, a in zip(live, accepted):
            pos[i] += a
    return out


def check_graph_steps_equal_eager(path, dtype: str = "float32", tol: float = 1e-3) -> None:
    """On CUDA: the 6 verify steps (ReplaySSM, q = 3) of `decode_schedule` replayed as CUDA graphs give
    the eager steps' logits within `tol` (relative norm)."""
    kw = dict(device="cuda", dtype=dtype, num_slots=12, max_num_seqs=6, num_kv_blocks=40, kv_block_size=4,
              num_speculative_tokens=2)
    graph, eager = (ModelRunner(path, cuda_graphs=g, **kw) for g in (True, False))
    got, want = decode_schedule(graph, 3), decode_schedule(eager, 3)
    assert graph.graphs.num_replays == 6
    for g, w in zip(got, want):
        assert (g - w).norm() / w.norm() < tol


def check_prefix_hit(path, hf_model, prompts, **kw) -> None:
    """A prompt extending a cached one hits the prefix cache (whole blocks of the first) and still gives
    transformers' greedy tokens (`kw`: more engine arguments)."""
    from checkpoints import hf_greedy

    llm = family_llm(path, enable_prefix_caching=True, prefix_checkpoint_interval=4, kv_block_size=4, **kw)
    first, second = prompts[2], prompts[2] + prompts[0]
    llm.generate([first], GREEDY, use_tqdm=False)
    out = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == len(first) // 4 * 4 > 0
    assert out.token_ids == hf_greedy(hf_model, [second], NEW_TOKENS)[0]


def check_speculation(path, prompts, want, method: str) -> None:
    """k = 3 drafts (n-gram, or the model itself as draft model) give the greedy tokens `want`, with
    drafts proposed and some accepted."""
    kw = {"draft_model": path} if method == "draft" else {}
    llm = family_llm(path, num_speculative_tokens=3, speculative_method=method, **kw)
    assert greedy_tokens(llm, prompts) == want
    m = llm.get_metrics()
    assert m["spec_draft_tokens"] > 0 and m["spec_accepted_tokens"] > 0


def check_tight_memory_preempts(path, prompts, want) -> None:
    """20 KV blocks of 4 tokens for 4 requests of up to 65 tokens, prefix caching on: requests are
    preempted and resumed, and the greedy tokens are still `want`."""
    llm = LLM(path, device="cpu", max_model_len=72, kv_block_size=4, num_kv_blocks=20, num_slots=8,
              max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=True,
              prefix_checkpoint_interval=4)
    assert greedy_tokens(llm, prompts) == want
    assert llm.get_metrics()["num_preemptions"] > 0


def check_tp2(path, prompts, want, **kw) -> None:
    """Tensor parallelism over 2 ranks (gloo, fp32; `kw` more engine arguments) gives the greedy tokens
    `want`."""
    with LLM(path, device="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=2, **kw) as llm:
        assert greedy_tokens(llm, prompts) == want
