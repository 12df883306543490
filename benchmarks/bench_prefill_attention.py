"""Prefill attention on the GPU: the Triton paged prefill kernel vs SDPA on gathered K/V.

Nemotron-H-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16, KV block 16), one
sequence per case, its context in randomly permuted cache blocks. Cases are the prefills of the
e2e modes: a prefix-hit turn of mode (c) (1,040 new tokens after ~17k cached) and the 8,192-token
chunks of a long prompt. Per case: ms per call (CUDA events, median of `--iters`, after warm-up
calls, so cuDNN's per-shape plan is not in it), TFLOP/s over the causal FLOPs (4 * queries * keys
seen * head dim * heads), and the Triton result's error relative to the reference's norm.

    ref (cuDNN) / ref (efficient): `paged_attention_ref` (gathers each row's K/V, then SDPA) on
        that SDPA backend;
    triton: `paged_prefill_attention_triton` at its default tiles; `--tiles M,N,warps,stages`
        (repeatable) times others.

    python3 benchmarks/bench_prefill_attention.py [--iters 10] [--tiles 128,64,8,3 ...]
"""

from __future__ import annotations

import argparse

import torch
from bench_prefill_ops import time_ms  # this folder is on the path when the script runs
from torch.nn.attention import SDPBackend, sdpa_kernel

from replayssm.ops.attention import paged_attention_ref
from replayssm.ops.triton.attention import paged_prefill_attention_triton, prefill_tiles

HEADS, KV_HEADS, D, BLOCK = 32, 8, 128, 16
CASES = ((1040, 17984), (1040, 1040), (8192, 8192), (8192, 16384))  # (queries, context incl. them)


def case(q_len: int, ctx: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache, cu_seqlens, block_table, context_lens for one row; blocks permuted."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = -(-ctx // BLOCK)
    k_cache = torch.randn(blocks + 8, BLOCK, KV_HEADS, D, generator=g, device="cuda").bfloat16()
    v_cache = torch.randn(blocks + 8, BLOCK, KV_HEADS, D, generator=g, device="cuda").bfloat16()
    q = torch.randn(q_len, HEADS, D, generator=g, device="cuda").bfloat16()
    table = torch.randperm(blocks + 8, generator=g, device="cuda")[:blocks].int()[None]
    cu = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    ctx_t = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, cu, table, ctx_t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiles", action="append", default=[], help="BLOCK_M,BLOCK_N,num_warps,num_stages")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}: heads {HEADS}, KV heads {KV_HEADS}, head dim {D}, bf16, "
          f"KV block {BLOCK}; default tiles {prefill_tiles(torch.bfloat16, D, False)}", flush=True)
    for q_len, ctx in CASES:
        args_ = case(q_len, ctx)
        kw = dict(scale=D ** -0.5, max_query_len=q_len, max_context_len=ctx)
        seen = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2  # (query, key) pairs under the causal mask
        flops = 4 * seen * D * HEADS
        ref = paged_attention_ref(*args_, **kw).float()
        rows = []
        for name, backend in (("ref (cuDNN)", SDPBackend.CUDNN_ATTENTION),
                              ("ref (efficient)", SDPBackend.EFFICIENT_ATTENTION)):
            def fn(backend=backend, a=args_, kw=kw):
                with sdpa_kernel([backend]):
                    return paged_attention_ref(*a, **kw)
            rows.append((name, time_ms(fn, args.iters), None))
        for tiles in [None] + [tuple(int(v) for v in t.split(",")) for t in args.tiles]:
            def fn(tiles=tiles, a=args_, kw=kw):
                return paged_prefill_attention_triton(*a, **kw, tiles=tiles)
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            rows.append((f"triton {tiles or 'default'}", time_ms(fn, args.iters), err))
        for name, ms, err in rows:
            extra = f"   rel err {err:.2e}" if err is not None else ""
            print(f"q {q_len:5d} ctx {ctx:5d}  {name:34s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s"
                  f"{extra}", flush=True)


if __name__ == "__main__":
    main()
