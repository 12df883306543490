"""The decode conv update with its window advance (q = 1, the 8B shape: D_conv 10,240, K = 4, bf16
windows in a 2,048-slot pool of 126 MB, x a column slice of the projection, three outputs), the window
written per channel against as contiguous runs (`flat_window`), A/B in ABBA order at 256, 512 and 64
rows: 16 calls per CUDA graph over 8 rotated slot sets, median of 30 replays. Prints a line per timing
and a JSON line. Needs CUDA.

    PYTHONPATH=. python3 benchmarks/bench_conv_update.py
"""
import json
import sys

import torch

from replayssm.ops.triton import conv1d

torch.manual_seed(0)
dev = "cuda"
D, K, S = 10240, 4, 2048
w = torch.randn(D, K, device=dev)
bias = torch.randn(D, device=dev)
pool = torch.randn(S, D, K - 1, device=dev).to(torch.bfloat16)
rows = []


def bench(b, flat, n_sets=8, calls=16, reps=30):
    proj = torch.randn(n_sets, b, 1, 18560, device=dev).to(torch.bfloat16)
    idxs = [torch.randperm(S, device=dev)[:b].to(torch.int32) for _ in range(n_sets)]
    outs = [torch.empty(b, 1, n, device=dev, dtype=torch.bfloat16) for n in (8192, 1024, 1024)]

    def step(k):
        x = proj[k % n_sets, :, :, 8192:8192 + D]
        conv1d.causal_conv1d_update_triton(x, w, bias, pool, idxs[k % n_sets], "silu", outs=outs,
                                           advance_window=True, flat_window=flat)

    for k in range(calls):
        step(k)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            for k in range(calls):
                step(k)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


nbytes = lambda b: b * (D * (K - 1) * 2 * 2 + D * 2 * 2)  # noqa: E731  windows read + written, x in, y out
for b in (256, 512, 64):
    for order in ((False, True), (True, False)):
        for flat in order:
            us = bench(b, flat)
            rows.append({"b": b, "flat": flat, "us": round(us, 2), "GB/s": round(nbytes(b) / us / 1e3, 1)})
            print(rows[-1], flush=True)
print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
sys.exit(0)
