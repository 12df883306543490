"""Chunked SSD prefill scan on the GPU: PyTorch reference vs Triton, ms and launches per call.

One Mamba layer's scan at the Nemotron-H-8B head shape (H=128, P=64, N=128, G=8, chunk 128),
bf16 activations, one sequence from an initial state with 65 boundary states (the prefix-hit
checkpoints: one per 16 tokens at 1,040 tokens), at 1,040 and 16,384 tokens. The chunk layout is
built once per case, as the layers of one forward pass share it. Prints per case: ms per call
(CUDA events, median of `--iters`), kernel launches per call (torch.profiler), and the Triton
result's largest error relative to the reference's largest magnitude. `--sweep` also times
Triton scan configs (tiles of the state, pass and output kernels) and the boundary walk's alone;
`--config k=v,k=v` (repeatable) times any `LaunchConfig`; `--times` prints the GPU time of each
Triton kernel of every scan config's row.
"boundaries into slots" is the engine's call (boundary_dst).

    python3 benchmarks/bench_prefill_ops.py [--tokens 1040 16384] [--iters 10] [--sweep] [--times]
        [--config rows=128,block_k=32,num_stages=2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable

import torch

from replayssm.ops.ssd import ssd_chunked_scan_ref
from replayssm.ops.ssd_layout import chunk_layout
from replayssm.ops.triton.ssd_boundary import BoundaryConfig

H, P, N, G, CHUNK = 128, 64, 128, 8, 128


def problem(T: int, boundaries: int, state_dtype: torch.dtype, seed: int = 0, device: str = "cuda") -> dict:
    """One sequence of T tokens from its slot's state, `boundaries` evenly spaced boundary lengths."""
    g = torch.Generator(device=device).manual_seed(seed)
    dev = dict(device=device)
    return dict(
        x=torch.randn(T, H, P, generator=g, **dev).bfloat16(),
        dt=torch.randn(T, H, generator=g, **dev) - 2.0,
        A=-torch.rand(H, generator=g, **dev) * 8 - 0.5,
        B=(torch.randn(T, G, N, generator=g, **dev) / N**0.5).bfloat16(),
        C=torch.randn(T, G, N, generator=g, **dev).bfloat16(),
        D=torch.randn(H, generator=g, **dev),
        dt_bias=torch.randn(H, generator=g, **dev) * 0.5,
        state=torch.randn(4, H, P, N, generator=g, **dev).to(state_dtype),
        cu_seqlens=torch.tensor([0, T], dtype=torch.int32, **dev),
        state_indices=torch.tensor([2], dtype=torch.int32, **dev),
        has_initial_state=torch.tensor([True], **dev),
        boundary_seq=torch.zeros(boundaries, dtype=torch.int32, **dev),
        boundary_len=torch.tensor([round((k + 1) * T / boundaries) for k in range(boundaries)],
                                  dtype=torch.int32, **dev),
    )


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Median ms of one call over `iters` calls after two warm-up calls (compiles Triton)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def launches(fn: Callable[[], object]) -> int:
    """Kernels one call launches (device-side events under torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_times(fn: Callable[[], object], iters: int) -> list[tuple[str, float, int]]:
    """(kernel name, mean GPU µs per call, launches per call) over `iters` profiled calls, slowest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    acc: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc.setdefault(e.name, []).append(e.device_time_total)
    rows = [(name, sum(t) / iters, len(t) // iters) for name, t in acc.items()]
    return sorted(rows, key=lambda r: -r[1])


# Scan configs of --sweep (LaunchConfig overrides). Each row varies the state and the output
# kernel at once (compare them with --times); sm_90 registers per thread (CPU compile) in comments,
# the default (the 4th row's tiles, fastest on the H200 in call 5): state 134, outputs 135, pass 110.
# The first row is the previous default.
SWEEP = (
    dict(state_block_k=0, num_warps=8, rows=64, out_warps=8),  # state 216, outputs 188
    dict(state_block_p=32, rows=32),  # state 100 (mma.sync), outputs 106: two programs per SM each
    dict(state_block_p=32, num_warps=4, rows=128),  # state 168, outputs 223
    dict(state_block_k=16, num_warps=4, rows=32, out_warps=4),  # state 134, outputs 135
    dict(state_block_k=64, block_k=64, rows=128),  # state 230, outputs 255 + spills
    dict(state_block_k=16, rows=64, block_k=64),  # state 173, outputs 215
    dict(num_stages=2),
    dict(num_stages=4),
    dict(nb=64),
    dict(pass_block_p=16),
    dict(pass_block_p=16, pass_block_n=64),
    dict(pass_block_p=64, pass_warps=8),
)


def parse_config(text: str) -> dict:
    """'rows=128,block_k=32' -> LaunchConfig overrides."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, val = item.partition("=")
        out[key.strip()] = int(val)
    return out


def run_case(T: int, boundaries: int, state_dtype: torch.dtype, iters: int, sweep: bool,
             times: bool = False, configs: tuple[dict, ...] = ()) -> None:
    """Time and count one token count; prints one line per implementation."""
    from replayssm.ops.triton import ssd as tssd

    pb = problem(T, boundaries, state_dtype)
    pristine = pb["state"].clone()
    names = ("cu_seqlens", "state_indices", "has_initial_state", "boundary_seq", "boundary_len")
    meta = [pb[k] for k in names]
    lay = chunk_layout(*meta, CHUNK, T)
    ops = [pb[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "state")]
    kw = dict(boundary_seq=pb["boundary_seq"], boundary_len=pb["boundary_len"], chunk_size=CHUNK)

    def ref() -> tuple:
        return ssd_chunked_scan_ref(*ops, *meta[:3], **kw)

    def tri(config: tssd.LaunchConfig = tssd.CONFIG) -> tuple:
        y, s_in = tssd.launch_scan(*ops, lay, CHUNK, True, 0, config)
        return y, tssd.launch_boundaries(*ops[:4], ops[6], ops[7], lay, s_in, True)

    # The engine's call: boundary states straight into free pool slots (boundary_dst).
    m = pb["boundary_seq"].shape[0]
    big = torch.cat([pb["state"], torch.zeros(m, *pb["state"].shape[1:], dtype=state_dtype, device="cuda")])
    dst = torch.arange(pb["state"].shape[0], big.shape[0], dtype=torch.int32, device="cuda")

    def into_slots() -> tuple:
        return tssd.ssd_chunked_scan_triton(*ops[:7], big, *meta[:3], boundary_dst=dst, **kw)

    y_ref, b_ref = ref()
    pb["state"].copy_(pristine)
    y_tri, b_tri = tri()
    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
              for a, b in ((y_tri, y_ref), (b_tri, b_ref)))
    rows = [("reference", ref, False), ("triton", tri, True),
            ("triton, boundaries into slots", into_slots, False)]
    if sweep:
        s_in = tssd.launch_scan(*ops, lay, CHUNK, True, 0)[1]
        for bp, bk, w in ((32, 16, 4), (16, 16, 4), (64, 16, 4), (32, 32, 4), (64, 32, 8), (64, 16, 8)):
            bcfg = BoundaryConfig(block_p=bp, block_k=bk, num_warps=w)
            rows.append((f"boundary walk only {bp}x{bk} warps={w}", lambda c=bcfg: tssd.launch_boundaries(
                *ops[:4], ops[6], big, lay, s_in, True, dst=dst.long(), config=c), False))
    for over in (SWEEP if sweep else ()) + tuple(configs):
        cfg = dataclasses.replace(tssd.CONFIG, **over)
        label = "triton " + ",".join(f"{k}={v}" for k, v in over.items())
        rows.append((label, lambda c=cfg: tri(c), True))
        pb["state"].copy_(pristine)
        y_c, b_c = tri(cfg)
        err = max(err, *(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                         for a, b in ((y_c, y_ref), (b_c, b_ref))))
    for name, fn, triton_row in rows:
        ms = time_ms(fn, iters)
        print(f"T={T:6d} {name:48s} {ms:9.3f} ms  {launches(fn):5d} launches", flush=True)
        if times and triton_row:
            for kname, us, count in kernel_times(fn, iters):
                print(f"T={T:6d}   {kname[:48]:48s} {us:9.1f} us  x{count}", flush=True)
    print(f"T={T:6d} triton vs reference: max rel err {err:.2e} (y and boundary states, every config)",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1040, 16384])
    ap.add_argument("--boundaries", type=int, default=65)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--state-dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--times", action="store_true", help="GPU time per Triton kernel")
    ap.add_argument("--config", action="append", default=[], type=parse_config,
                    help="time this LaunchConfig too: k=v,k=v (fields of ops/triton/ssd.py: LaunchConfig)")
    args = ap.parse_args()
    print(f"8B shape H={H} P={P} N={N} G={G} chunk={CHUNK}, bf16 activations, {args.state_dtype} pool, "
          f"{args.boundaries} boundaries, {torch.cuda.get_device_name()}")
    for T in args.tokens:
        run_case(T, args.boundaries, getattr(torch, args.state_dtype), args.iters, args.sweep, args.times,
                 tuple(args.config))


if __name__ == "__main__":
    main()
