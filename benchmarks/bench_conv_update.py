"""The decode conv update with its window advance (q = 1, the 8B shape: D_conv 10,240, K = 4, bf16
windows in a 2,048-slot pool of 126 MB, x a column slice of the projection, three outputs), the window
written per channel against as contiguous runs (`flat_window`), A/B in ABBA order at 256, 512 and 64
rows: 16 calls per CUDA graph over 8 rotated slot sets (`bench_kernels.time_graph`: median of its
replays). Prints a line per timing and a JSON line. Needs CUDA.

    PYTHONPATH=. python3 benchmarks/bench_conv_update.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_kernels import git_commit, time_graph  # noqa: E402

from replayssm.ops.triton import conv1d  # noqa: E402

D, K, S = 10240, 4, 2048  # conv channels, taps, pool slots (126 MB of bf16 windows)


def bench(w, bias, pool, b: int, flat: bool, n_sets: int = 8, calls: int = 16) -> float:
    """µs per update call of b rows (x a column slice of the projection, three outputs)."""
    proj = torch.randn(n_sets, b, 1, 18560, device="cuda").to(torch.bfloat16)
    idxs = [torch.randperm(S, device="cuda")[:b].to(torch.int32) for _ in range(n_sets)]
    outs = [torch.empty(b, 1, n, device="cuda", dtype=torch.bfloat16) for n in (8192, 1024, 1024)]

    def calls_once() -> None:
        for k in range(calls):
            conv1d.causal_conv1d_update_triton(proj[k % n_sets, :, :, 8192:8192 + D], w, bias, pool,
                                               idxs[k % n_sets], "silu", outs=outs, advance_window=True,
                                               flat_window=flat)

    return time_graph(calls_once, calls)[0]


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(D, K, device="cuda")
    bias = torch.randn(D, device="cuda")
    pool = torch.randn(S, D, K - 1, device="cuda").to(torch.bfloat16)
    rows = []
    for b in (256, 512, 64):
        nbytes = b * (D * (K - 1) * 2 * 2 + D * 2 * 2)  # windows read + written, x in, y out
        for flat in (False, True, True, False):
            us = bench(w, bias, pool, b, flat)
            rows.append({"b": b, "flat": flat, "us": round(us, 2), "GB/s": round(nbytes / us / 1e3, 1)})
            print(rows[-1], flush=True)
    print(json.dumps({"commit": git_commit(), "device": torch.cuda.get_device_name(),
                      "command": " ".join(["python3", *sys.argv]), "rows": rows}))


if __name__ == "__main__":
    main()
