"""Varlen causal conv of the Mamba-2 prefill on the GPU: PyTorch reference vs Triton, ms and launches.

One Mamba layer's conv at the Nemotron-H-8B shape (conv dim 8192 + 2*8*128 = 10,240, K = 4), bf16
x as the model passes it (a column slice of the in_proj output, rows 18,560 wide) and a bf16 window
pool of 64 slots. Cases: one sequence from its window (the prefix-hit step: 1,040 tokens; a long
prompt: 8,192), and a batch of 64 sequences of random lengths (some padding, mixed initial windows).
The reference's host layout is built once per case, as the layers of one forward pass share it.
Prints per case: ms per call (CUDA events, median of `--iters`), kernel launches per call
(torch.profiler), and the Triton output's largest error relative to the reference's magnitude.

    python3 benchmarks/bench_conv_varlen.py [--iters 20] [--block-t 32] [--block-d 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefill_ops import launches, time_ms  # noqa: E402

from replayssm.ops.conv1d import causal_conv1d_varlen_ref  # noqa: E402

I, CONV_DIM, H, K, SLOTS = 8192, 10240, 128, 4, 64


def problem(lengths: list[int], seed: int = 0) -> dict:
    """Packed sequences of `lengths` in permuted slots: every 8th is padding, every 3rd starts from zeros."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, T = len(lengths), sum(lengths)
    proj = torch.randn(T, I + CONV_DIM + H, generator=g, device="cuda").bfloat16()
    slots = torch.randperm(SLOTS)[:n].to(torch.int32)
    if n > 1:
        slots[::8] = -1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        x=proj[:, I : I + CONV_DIM],
        weight=torch.randn(CONV_DIM, 1, K, generator=g, device="cuda").bfloat16()[:, 0, :],
        bias=torch.randn(CONV_DIM, generator=g, device="cuda").bfloat16(),
        conv_state=torch.randn(SLOTS, CONV_DIM, K - 1, generator=g, device="cuda").bfloat16(),
        cu_seqlens=cu.cuda(),
        state_indices=slots.cuda(),
        has_initial_state=(torch.arange(n) % 3 != 2).cuda(),
    )


def run_case(name: str, lengths: list[int], iters: int, block_t: int, block_d: int) -> None:
    """Time and count one case; prints one line per implementation and the error."""
    from replayssm.ops.triton.conv1d import causal_conv1d_varlen_triton

    pb = problem(lengths)
    pristine = pb["conv_state"].clone()
    args = list(pb.values())

    def ref() -> torch.Tensor:
        return causal_conv1d_varlen_ref(*args)

    def ref_contiguous() -> torch.Tensor:  # the model's call: x.contiguous() first
        return causal_conv1d_varlen_ref(args[0].contiguous(), *args[1:])

    def tri() -> torch.Tensor:
        return causal_conv1d_varlen_triton(*args, block_t=block_t, block_d=block_d)

    y_ref = ref()
    pb["conv_state"].copy_(pristine)
    y_tri = tri()
    err = ((y_tri.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
    for label, fn in (("reference", ref), ("reference + contiguous x", ref_contiguous), ("triton", tri)):
        ms = time_ms(fn, iters)
        print(f"{name:16s} T={sum(lengths):6d} n={len(lengths):3d} {label:26s} {ms:8.3f} ms "
              f"{launches(fn):4d} launches", flush=True)
    print(f"{name:16s} triton vs reference: max rel err {err:.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--block-t", type=int, default=32)
    ap.add_argument("--block-d", type=int, default=128)
    args = ap.parse_args()
    print(f"8B conv shape D={CONV_DIM} K={K}, bf16 x (strided) and pool, {torch.cuda.get_device_name()}")
    batch = torch.randint(1, 400, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    for name, lengths in (("prefix-hit", [1040]), ("long prompt", [8192]), ("batch of 64", batch)):
        run_case(name, lengths, args.iters, args.block_t, args.block_d)


if __name__ == "__main__":
    main()
