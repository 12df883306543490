"""Paged decode and prefill attention cases shared by the interpreter run (subprocess) and the GPU tests.

    python3 tests/ops/attention_cases.py      (with TRITON_INTERPRET=1: CPU tensors, tiny shapes)
"""

from __future__ import annotations

import sys

import torch

from replayssm.ops.attention import paged_attention_ref, quantize_kv
from replayssm.ops.fp8 import FP8_DTYPE
from replayssm.ops.triton.attention import paged_attention_triton, paged_prefill_attention_triton


def make_case(device, dtype, q_lens, ctx_lens, heads, kv_heads, D, block_size, gen, kv_scales=None):
    """Random cache with spare blocks, permuted block tables padded with -1, packed queries.
    kv_scales (k_scale, v_scale): the cache is E4M3, K and V drawn at a spread of ~150 x their scale
    (large values saturate at 448)."""
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(need) + 1
    tables, at = [], 0
    for k in need:
        tables.append(perm[at:at + k] + [-1] * (max_blocks - k))
        at += k
    k_cache = torch.randn(num_blocks, block_size, kv_heads, D, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, D, generator=gen).to(device, dtype)
    if kv_scales is not None:
        k_cache = quantize_kv(k_cache * (150 * kv_scales[0]), kv_scales[0], FP8_DTYPE)
        v_cache = quantize_kv(v_cache * (150 * kv_scales[1]), kv_scales[1], FP8_DTYPE)
    T = sum(q_lens)
    q = torch.randn(T, heads, D, generator=gen).to(device, dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    bt = torch.tensor(tables, dtype=torch.int32, device=device)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, cu, bt, ctx


def reference(case, kv_scales=None, **kw):
    """paged_attention_ref in float64 over the case, an FP8 cache dequantized (cache * scale) first."""
    q, k_cache, v_cache, cu, bt, ctx = case
    ks, vs = kv_scales or (1.0, 1.0)
    k_cache, v_cache = k_cache.cpu().double() * ks, v_cache.cpu().double() * vs
    return paged_attention_ref(q.cpu().double(), k_cache, v_cache, cu.cpu(), bt.cpu(), ctx.cpu(), **kw)


def check_decode(device: str, dtype: torch.dtype, *, heads=4, kv_heads=2, D=16, block_size=4,
                 q_lens=(1, 3, 1, 4, 2), ctx_lens=(1, 9, 17, 4, 30), tol=None, splits=None,
                 kv_scales=None) -> None:
    """Triton paged decode attention vs the float64 PyTorch reference: rel. error under tol, all finite.
    splits: the kernel's key splits (default: its own choice); the output buffer starts as NaN.
    kv_scales: an E4M3 cache with these scales, against the reference over its dequantized K/V."""
    gen = torch.Generator().manual_seed(len(q_lens) * 7 + heads)
    case = make_case(device, dtype, list(q_lens), list(ctx_lens), heads, kv_heads, D, block_size, gen,
                     kv_scales)
    q, k_cache, v_cache, cu, bt, ctx = case
    scale = D ** -0.5
    kw = dict(scale=scale, max_query_len=max(q_lens), max_context_len=max(ctx_lens))
    scales = dict(zip(("k_scale", "v_scale"), kv_scales)) if kv_scales else {}
    torch.full_like(q, float("nan"))  # the kernel allocates its output: poison the allocator's next block
    got = paged_attention_triton(q, k_cache, v_cache, cu, bt, ctx, splits=splits, **kw, **scales)
    want = reference(case, kv_scales, **kw)
    assert got.shape == q.shape and got.dtype == dtype
    assert torch.isfinite(got).all(), "unwritten or NaN output"
    err = ((got.cpu().double() - want).norm() / want.norm()).item()
    tol = tol if tol is not None else (1e-5 if dtype == torch.float32 else 2e-2)
    assert err < tol, (dtype, q_lens, ctx_lens, err)


def check_prefill(device: str, dtype: torch.dtype, *, heads=4, kv_heads=2, D=16, block_size=4,
                  q_lens=(37, 1, 16, 5, 70), ctx_lens=(37, 9, 50, 5, 93), tol=None, poison=True,
                  kv_scales=None) -> None:
    """Triton paged prefill attention vs the float64 PyTorch reference on a mixed batch (whole
    prompts, chunks after cached context, decode rows); the output buffer starts as NaN.
    kv_scales: an E4M3 cache with these scales, against the reference over its dequantized K/V."""
    gen = torch.Generator().manual_seed(sum(q_lens) + heads)
    case = make_case(device, dtype, list(q_lens), list(ctx_lens), heads, kv_heads, D, block_size, gen,
                     kv_scales)
    q, k_cache, v_cache, cu, bt, ctx = case
    scale = D ** -0.5
    kw = dict(scale=scale, max_query_len=max(q_lens), max_context_len=max(ctx_lens))
    if kv_scales:
        kw.update(k_scale=kv_scales[0], v_scale=kv_scales[1])
    if poison:  # the kernel allocates its output: poison the allocator's next block of that size
        torch.full_like(q, float("nan"))
    got = paged_prefill_attention_triton(q, k_cache, v_cache, cu, bt, ctx, **kw)
    ref_kw = {key: kw[key] for key in ("scale", "max_query_len", "max_context_len")}
    want = reference(case, kv_scales, **ref_kw)
    assert got.shape == q.shape and got.dtype == dtype
    assert torch.isfinite(got).all(), "unwritten or NaN output"
    err = ((got.cpu().double() - want).norm() / want.norm()).item()
    tol = tol if tol is not None else (1e-5 if dtype == torch.float32 else 2e-2)
    assert err < tol, (dtype, q_lens, ctx_lens, err)
    again = paged_prefill_attention_triton(q, k_cache, v_cache, cu, bt, ctx, **kw)
    assert torch.equal(got, again), "two identical calls differ"


def main() -> None:
    check_decode("cpu", torch.float32)
    # Plain decode, GQA group of 4, block size 16 (the engine default), one long-ish row.
    check_decode("cpu", torch.float32, heads=8, kv_heads=2, block_size=16, q_lens=(1, 1, 1),
                 ctx_lens=(5, 70, 16))
    check_decode("cpu", torch.float16, q_lens=(4, 4), ctx_lens=(4, 21))
    # Keys split into 4, 8 and 2 runs of whole 64-key tiles, then merged: runs past a row's last key
    # (empty), a row with one key, verify rows.
    check_decode("cpu", torch.float32, q_lens=(1, 3, 1, 4, 2), ctx_lens=(1, 300, 17, 64, 130), splits=4)
    check_decode("cpu", torch.float32, heads=8, kv_heads=2, block_size=16, q_lens=(1, 2),
                 ctx_lens=(700, 5), splits=8)
    check_decode("cpu", torch.float16, q_lens=(4, 4), ctx_lens=(4, 521), splits=2)
    # Prefill tiles are 16 x 16 here: rows cross query and key tile edges, block size 4 and 16.
    check_prefill("cpu", torch.float32)
    check_prefill("cpu", torch.float32, heads=8, kv_heads=2, D=20, block_size=16, q_lens=(33, 17),
                  ctx_lens=(33, 60))
    check_prefill("cpu", torch.float16, heads=2, kv_heads=2, q_lens=(48,), ctx_lens=(80,))
    # A block size that is not a power of two (the engine allows any).
    check_prefill("cpu", torch.float32, block_size=12, q_lens=(30, 1), ctx_lens=(41, 13))
    # FP8 E4M3 caches with per-tensor scales: decode (one pass and split), verify and prefill rows.
    check_decode("cpu", torch.float32, kv_scales=(0.02, 0.005))
    check_decode("cpu", torch.float16, heads=8, kv_heads=2, q_lens=(1, 4), ctx_lens=(300, 9), splits=4,
                 kv_scales=(0.3, 0.07))
    check_prefill("cpu", torch.float32, kv_scales=(0.02, 0.005))
    check_prefill("cpu", torch.float16, heads=2, kv_heads=2, q_lens=(48,), ctx_lens=(80,),
                  kv_scales=(0.3, 0.07))


if __name__ == "__main__":
    main()
    sys.exit(0)
