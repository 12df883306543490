"""First call vs repeats of SDPA at the shape of a mode (c) prefix-hit prefill (8 KV heads x 4 query
heads, 1,040 queries, ~15-17k keys, bool mask), per backend, each context length new to the process.
Shows the per-shape plan cost of cuDNN attention, one reason prefill attention runs its own Triton
kernel (`ops/triton/attention.py`).

    python3 benchmarks/probe_sdpa_shapes.py     (CUDA only; results/sdpa-first-call-s7.log)
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = "cuda"
kvh, g, q, hd = 8, 4, 1040, 128
for name, backends in (("default", None), ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                       ("cudnn", [SDPBackend.CUDNN_ATTENTION])):
    for ctx in (14864 + 7 * (name == "efficient") + 13 * (name == "cudnn"), 15904 + 3, 16944 + 5):
        qq = torch.randn(1, kvh, g * q, hd, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, kvh, ctx, hd, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.ones(1, 1, g * q, ctx, dtype=torch.bool, device=dev).tril(ctx - q)
        ts = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if backends is None:
                o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask)
            else:
                with sdpa_kernel(backends):
                    o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask)
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        print(f"{name:9s} ctx {ctx}: first {ts[0]:7.1f} ms, then {ts[1]:6.2f} {ts[2]:6.2f} ms", flush=True)
