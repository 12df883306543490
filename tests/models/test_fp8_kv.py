"""FP8 E4M3 KV cache (--kv-cache-dtype fp8): store and read ops, scales from checkpoints, the engine."""

from __future__ import annotations

import shutil

import pytest
import torch
from checkpoints import cached_checkpoint, random_prompts
from conftest import requires_cuda

from replayssm import LLM, SamplingParams
from replayssm.cache.planner import plan_cache
from replayssm.config import CacheConfig
from replayssm.engine.model_runner import ModelRunner
from replayssm.models.config import ModelConfig
from replayssm.models.layers.attention import Attention
from replayssm.models.loader import load_model
from replayssm.ops.attention import paged_attention, store_kv
from replayssm.ops.fp8 import FP8_DTYPE

KV_HEADS, HEADS, DIM, BLOCK = 2, 4, 16, 4


def _dequantized(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return cache.double() * scale


def test_store_kv_fp8_rounds_to_nearest_and_saturates():
    """store_kv into an E4M3 cache writes x / scale rounded to within half an E4M3 step (relative 2^-4,
    2^-10 among subnormals), +-448 past the range, at the given slots only."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, BLOCK, KV_HEADS, DIM, generator=gen).to(FP8_DTYPE)
    v_cache = torch.randn(6, BLOCK, KV_HEADS, DIM, generator=gen).to(FP8_DTYPE)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, 3, 22, 8, 9])
    k = 30 * torch.randn(5, KV_HEADS, DIM, generator=gen)
    v = 0.2 * torch.randn(5, KV_HEADS, DIM, generator=gen)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 448 * 0.05, 1e-5])  # saturating, exact maximum, subnormal
    store_kv(k, v, k_cache, v_cache, slots, k_scale=0.05, v_scale=0.003)
    for cache, x, scale in ((k_cache, k, 0.05), (v_cache, v, 0.003)):
        want = (x.double() / scale).clamp(-448, 448)
        got = cache.view(-1, KV_HEADS, DIM)[slots].double()
        assert ((got - want).abs() <= want.abs() * 2.0 ** -4 + 2.0 ** -10).all()
    assert k_cache.view(-1, KV_HEADS, DIM)[17, 0, :3].tolist() == [448.0, -448.0, 448.0]
    untouched = torch.ones(6 * BLOCK, dtype=torch.bool)
    untouched[slots] = False
    for cache, before in ((k_cache, before_k), (v_cache, before_v)):
        assert torch.equal(cache.view(-1, KV_HEADS, DIM)[untouched].view(torch.uint8),
                           before.view(-1, KV_HEADS, DIM)[untouched].view(torch.uint8))


def test_paged_attention_fp8_cache_equals_dequantized_reference():
    """paged_attention (PyTorch path) over an E4M3 cache with scales equals float64 causal attention
    over the dequantized K/V (cache * scale): prefill chunk, decode and verify rows, permuted blocks."""
    gen = torch.Generator().manual_seed(1)
    k_scale, v_scale = 0.02, 0.007
    k_cache = (150 * torch.randn(12, BLOCK, KV_HEADS, DIM, generator=gen)).to(FP8_DTYPE)
    v_cache = (150 * torch.randn(12, BLOCK, KV_HEADS, DIM, generator=gen)).to(FP8_DTYPE)
    tables = [[7, 2, 9], [4, 11, 0, 5], [1]]
    ctx, q_lens = [10, 15, 3], [6, 1, 3]
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=gen)
    cu = torch.tensor([0, 6, 7, 10], dtype=torch.int32)
    bt = torch.tensor([t + [-1] * (4 - len(t)) for t in tables], dtype=torch.int32)
    out = paged_attention(q, k_cache, v_cache, cu, bt, torch.tensor(ctx, dtype=torch.int32),
                          scale=DIM ** -0.5, max_query_len=6, max_context_len=15, k_scale=k_scale,
                          v_scale=v_scale)
    g = HEADS // KV_HEADS
    for i, table in enumerate(tables):
        k = _dequantized(k_cache[table].reshape(-1, KV_HEADS, DIM)[:ctx[i]], k_scale).repeat_interleave(g, 1)
        v = _dequantized(v_cache[table].reshape(-1, KV_HEADS, DIM)[:ctx[i]], v_scale).repeat_interleave(g, 1)
        qi = q[cu[i]:cu[i + 1]].double()
        s = torch.einsum("qhd,khd->hqk", qi, k) * DIM ** -0.5
        pos = torch.arange(ctx[i] - q_lens[i], ctx[i])
        s = s.masked_fill(torch.arange(ctx[i])[None, None] > pos[None, :, None], float("-inf"))
        want = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), want, rtol=1e-5, atol=1e-5)


def test_scales_belong_to_fp8_caches():
    """A scale other than 1.0 on a 16/32-bit cache, or a non-positive one on an FP8 cache, is a
    ValueError naming k_scale / v_scale."""
    k = torch.randn(2, KV_HEADS, DIM)
    fp32 = torch.zeros(2, BLOCK, KV_HEADS, DIM)
    fp8 = fp32.to(FP8_DTYPE)
    with pytest.raises(ValueError, match="k_scale"):
        store_kv(k, k, fp32, fp32.clone(), torch.tensor([0, 1]), k_scale=0.5)
    with pytest.raises(ValueError, match="v_scale"):
        store_kv(k, k, fp8, fp8.clone(), torch.tensor([0, 1]), v_scale=0.0)


def test_kv_cache_dtype_config():
    """kv_cache_dtype takes auto, fp8 and fp8_e4m3; anything else is a ValueError naming the field."""
    for value in ("auto", "fp8", "fp8_e4m3"):
        assert CacheConfig(kv_cache_dtype=value).kv_cache_dtype == value
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")


def test_fp8_block_bytes_fit_twice_the_blocks():
    """A KV block takes one byte per element with FP8: half a bf16 block's bytes, a quarter of fp32's,
    so the planner fits twice the bf16 blocks in the same budget."""
    cfg = ModelConfig.from_hf(cached_checkpoint("nemotron_h")[0])
    fp8 = ModelRunner.kv_block_bytes(cfg, dtype="bfloat16", kv_block_size=16, kv_cache_dtype="fp8")
    bf16 = ModelRunner.kv_block_bytes(cfg, dtype="bfloat16", kv_block_size=16)
    assert 2 * fp8 == bf16 == ModelRunner.kv_block_bytes(cfg, dtype="float32", kv_block_size=16) // 2
    plans = [plan_cache(4 << 20, bytes_per_slot=1000, bytes_per_kv_block=size, kv_block_size=16,
                        max_model_len=64, slots_per_request=1, max_num_seqs=4096) for size in (bf16, fp8)]
    assert plans[1].num_kv_blocks in (2 * plans[0].num_kv_blocks, 2 * plans[0].num_kv_blocks + 1)


def _with_kv_scales(tmp_path, style: str) -> str:
    """The tiny Nemotron-H checkpoint plus per-layer KV scales as published FP8 checkpoints name them."""
    from safetensors.torch import load_file, save_file

    src = cached_checkpoint("nemotron_h")[0]
    dst = tmp_path / style
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    layers = sorted({k.split(".")[2] for k in tensors if ".mixer.k_proj." in k}, key=int)
    # Ranges 448 * scale of about 50 and more: this model's K and V stay inside (nothing saturates).
    for i, layer in enumerate(layers):
        stem = f"backbone.layers.{layer}.mixer"
        if style == "llm-compressor":  # self_attn.k_scale, per tensor
            tensors[f"{stem}.k_scale"] = torch.tensor(0.11 + i / 2)
            tensors[f"{stem}.v_scale"] = torch.tensor([0.13 + i / 4])
        else:  # ModelOpt: k_proj.k_scale, v_proj.v_scale
            tensors[f"{stem}.k_proj.k_scale"] = torch.tensor(0.11 + i / 2)
            tensors[f"{stem}.v_proj.v_scale"] = torch.tensor(0.13 + i / 4)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("style", ["llm-compressor", "modelopt"])
def test_kv_scales_load_from_checkpoint(tmp_path, style):
    """Each attention layer takes its checkpoint's k_scale / v_scale (both published namings); a
    checkpoint without them leaves 1.0."""
    model, _ = load_model(_with_kv_scales(tmp_path, style))
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(attn) == 2
    for i, layer in enumerate(attn):
        assert (layer.k_scale, layer.v_scale) == pytest.approx((0.11 + i / 2, 0.13 + i / 4))
    plain, _ = load_model(cached_checkpoint("nemotron_h")[0])
    assert all((m.k_scale, m.v_scale) == (1.0, 1.0) for m in plain.modules() if isinstance(m, Attention))


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
PROMPTS = random_prompts([9, 30, 17, 41, 60, 5], seed=3)


def _llm(path=None, **kw) -> LLM:
    args = dict(device="cpu", max_model_len=128, kv_block_size=4)
    return LLM(path or cached_checkpoint("nemotron_h")[0], **{**args, **kw})


@pytest.mark.parametrize("scaled", [False, True])
def test_fp8_kv_greedy_close_to_fp32_kv(tmp_path, scaled):
    """Greedy decoding with an FP8 KV cache (scales 1.0, or from the checkpoint) against the fp32 cache:
    tokens equal up to the first step where the fp32 run's top-2 logprob margin is under 0.25, and the
    chosen tokens' logprobs over the equal steps within 0.3 each, 0.03 on average."""
    path = _with_kv_scales(tmp_path, "modelopt") if scaled else None
    ref = _llm(path).generate(PROMPTS, GREEDY, use_tqdm=False)
    got = _llm(path, kv_cache_dtype="fp8").generate(PROMPTS, GREEDY, use_tqdm=False)
    diffs = []
    for a, b in zip(ref, got):
        tight = next((i for i, t in enumerate(a.top_logprobs) if t[0][1] - t[1][1] < 0.25), len(a.token_ids))
        assert a.token_ids[:tight] == b.token_ids[:tight]
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        diffs += [abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])]
    assert max(diffs) < 0.3 and sum(diffs) / len(diffs) < 0.03, (max(diffs), sum(diffs) / len(diffs))


def _prompt_logprobs(seqs, **kw) -> list[list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = _llm(max_num_batched_tokens=16, **kw).generate(seqs, params, use_tqdm=False)
    return [o.prompt_logprobs[1:] for o in outs]


def test_fp8_kv_prompt_logprobs(monkeypatch):
    """Prefill over the same tokens (prompts + the fp32 run's outputs, chunked at 16 tokens): the FP8
    cache gives exactly the prompt logprobs of the fp32 cache holding the same K/V rounded through E4M3
    (the reads dequantize exactly), within 0.03 of the fp32 cache's on average. Single positions move
    by up to ~1 on this tiny model at scale 1.0: its small K fall among the E4M3 subnormals, and a
    perturbed attention output feeds the later Mamba layers' recurrences."""
    import replayssm.ops.attention as attention

    seqs = [o.prompt_token_ids + o.token_ids for o in _llm().generate(PROMPTS, GREEDY, use_tqdm=False)]
    ref, fp8 = _prompt_logprobs(seqs), _prompt_logprobs(seqs, kv_cache_dtype="fp8")
    diffs = torch.tensor([abs(x - y) for a, b in zip(ref, fp8) for x, y in zip(a, b)])
    assert diffs.mean() < 0.03 and diffs.max() < 1.5, (diffs.mean(), diffs.max())
    quantize = attention.quantize_kv
    rounded = lambda x, scale, dtype: quantize(x, 1.0, FP8_DTYPE).to(dtype)  # noqa: E731
    monkeypatch.setattr(attention, "quantize_kv", rounded)
    assert _prompt_logprobs(seqs) == fp8


def test_fp8_kv_prefix_hits_equal_misses():
    """With an FP8 KV cache, prompts that hit cached prefixes (shared FP8 blocks) give the tokens of the
    same engine without prefix caching."""
    shared = random_prompts([22], seed=5)[0]
    prompts = [shared + p for p in random_prompts([3, 5, 1], seed=6)] + [shared[:13]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(kv_cache_dtype="fp8", replay_window=4)
    off = _llm(**kw)
    on = _llm(enable_prefix_caching=True, **kw)
    first = on.generate([shared], params, use_tqdm=False)
    assert first[0].token_ids == off.generate([shared], params, use_tqdm=False)[0].token_ids
    outs = on.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert on.get_metrics()["prefix_cache_hit_tokens"] > 0


def test_fp8_kv_preemption_gives_the_same_tokens():
    """Too few FP8 KV blocks for the batch: preempted requests recompute their FP8 blocks and give the
    tokens of a run with room for all."""
    prompts = random_prompts([6 + 3 * i for i in range(6)], seed=30)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = _llm(kv_cache_dtype="fp8", max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    llm = _llm(kv_cache_dtype="fp8", max_num_seqs=4, num_kv_blocks=24, max_model_len=64)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.get_metrics()["num_preemptions"] > 0


@requires_cuda
def test_fp8_kv_engine_gpu():
    """On CUDA (bf16 model, Triton kernels over the E4M3 cache): greedy tokens and logprobs stay within
    the CPU test's bounds of the bf16 cache's, and twice the KV blocks fit the same budget."""
    kw = dict(device="cuda", dtype="bfloat16", memory_budget=64 << 20, max_num_seqs=8)
    ref_llm, fp8_llm = _llm(**kw), _llm(kv_cache_dtype="fp8", **kw)
    assert fp8_llm.engine.plan.bytes_per_kv_block * 2 == ref_llm.engine.plan.bytes_per_kv_block
    ref = ref_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = fp8_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    diffs = []
    for a, b in zip(ref, got):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        diffs += [abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])]
    assert sum(diffs) / max(len(diffs), 1) < 0.05
