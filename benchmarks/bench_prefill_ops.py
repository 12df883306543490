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
"boundaries into slots" is the engine's call (boundary_dst). Writes prefill-ops.{json,md,png}
(png with matplotlib: the `[bench]` extra) into --out.

    python3 benchmarks/bench_prefill_ops.py [--tokens 1040 16384] [--iters 10] [--sweep] [--times]
        [--config rows=128,block_k=32,num_stages=2] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

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
# kernel at once (compare them with --times); sm_90 registers per thread (CPU compile) in comments.
# The default (ops/triton/ssd.py: CONFIG) has the 4th row's tiles, the fastest on the H200: state 134,
# outputs 135, pass 110.
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
             times: bool = False, configs: tuple[dict, ...] = ()) -> list[dict]:
    """Time and count one token count; prints one line per implementation and returns them as rows."""
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
    out = []
    for name, fn, triton_row in rows:
        ms, n = time_ms(fn, iters), launches(fn)
        print(f"T={T:6d} {name:48s} {ms:9.3f} ms  {n:5d} launches", flush=True)
        kernels = kernel_times(fn, iters) if times and triton_row else []
        for kname, us, count in kernels:
            print(f"T={T:6d}   {kname[:48]:48s} {us:9.1f} us  x{count}", flush=True)
        out.append(dict(tokens=T, name=name, ms=round(ms, 4), launches=n, max_rel_err=err,
                        kernels_us=[[k, round(us, 1), c] for k, us, c in kernels]))
    print(f"T={T:6d} triton vs reference: max rel err {err:.2e} (y and boundary states, every config)",
          flush=True)
    return out


def render(doc: dict) -> str:
    """prefill-ops.md: per token count, each implementation's ms, launches and speed-up over the reference."""
    m = doc["meta"]
    lines = ["# Chunked SSD prefill scan: PyTorch reference vs Triton", "",
             f"- commit `{m['commit']}`, device {m['device']}, command `{m['command']}`",
             f"- {m['shape']}; ms per call (CUDA events, median); speed-up = reference ms / ms", "",
             "| tokens | implementation | ms | launches | speed-up | max rel err |",
             "|---|---|---|---|---|---|"]
    for T in dict.fromkeys(r["tokens"] for r in doc["rows"]):
        rows = [r for r in doc["rows"] if r["tokens"] == T]
        ref = next((r["ms"] for r in rows if r["name"] == "reference"), None)
        for r in rows:
            up = f"{ref / r['ms']:.2f}x" if ref else "-"
            lines.append(f"| {T} | {r['name']} | {r['ms']:.3f} | {r['launches']} | {up} | "
                         f"{r['max_rel_err']:.1e} |")
    kern = [(r["tokens"], r["name"], k) for r in doc["rows"] for k in r.get("kernels_us", [])]
    if kern:
        lines += ["", "GPU µs per Triton kernel (--times):", ""]
        lines += [f"- T={T} {name}: `{k[0]}` {k[1]:.1f} µs x{k[2]}" for T, name, k in kern]
    return "\n".join(lines) + "\n"


def write(doc: dict, out_dir: Path) -> str:
    """prefill-ops.{json,md,png} under out_dir; returns the md."""
    from replayssm.cli import _load_benchmark

    report = _load_benchmark("report_e2e")

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prefill-ops.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = render(doc)
    (out_dir / "prefill-ops.md").write_text(text)
    series: dict[str, dict[str, float]] = {}
    for r in doc["rows"]:
        if r["name"] in ("reference", "triton"):
            series.setdefault(r["name"], {})[f"{r['tokens']} tokens"] = r["ms"]
    note = report.plot_parts(series, f"chunked scan, {doc['meta']['device']}", "ms per call",
                      out_dir / "prefill-ops.png")
    if note == report.PLOT_HINT:
        print(f"prefill-ops: {note}", file=sys.stderr)
    return text


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
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="write prefill-ops.{json,md,png} there (default: benchmarks/results)")
    args = ap.parse_args()
    shape = (f"8B shape H={H} P={P} N={N} G={G} chunk={CHUNK}, bf16 activations, {args.state_dtype} pool, "
             f"{args.boundaries} boundaries")
    print(f"{shape}, {torch.cuda.get_device_name()}")
    rows = []
    for T in args.tokens:
        rows += run_case(T, args.boundaries, getattr(torch, args.state_dtype), args.iters, args.sweep,
                         args.times, tuple(args.config))
    from replayssm.cli import _load_benchmark

    meta = {**_load_benchmark("report_e2e").run_meta(["python3", *sys.argv]),
            "device": torch.cuda.get_device_name(), "shape": shape}
    print(write({"meta": meta, "rows": rows}, Path(args.out)))


if __name__ == "__main__":
    main()
