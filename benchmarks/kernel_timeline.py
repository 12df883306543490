"""Where one decode step's time goes: the launches of a graph-replayed W-step cycle, per stream.

    python3 benchmarks/kernel_timeline.py [--shape nemotron-h-8b] [--batch 256] [--dtype fp32]
        [--qs 1,4] [--tiles auto] [--lockstep] [--out DIR]

bench_kernels.py times whole cycles; this replays the same cycle (same pools, cursors and
routes) under torch.profiler and reads each launch's device interval from the trace. A step's
launches run in a fixed order (the side stream forks after, and joins before, each step's main
launches), so the sorted kernels fall into steps of equal count. Per launch position it reports
the median start and end relative to its step's first start, and per step the span (first start
to last end) and the gap to the next step. The profiled cycle runs at the graph's own speed
(CUPTI records graph kernel nodes); the span beside bench_kernels' µs per step says how much of
the step the trace accounts for. Writes kernel-timeline.{json,md} to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_kernels import WINDOW, Bench, Case, Tile, capture_graph, git_commit, time_graph  # noqa: E402


def trace_kernels(run) -> list[dict]:
    """Device kernels of one graph replay of run(), as (name, stream, ts, dur) in µs."""
    g = capture_graph(run)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return sorted(({"name": e["name"], "stream": e.get("args", {}).get("stream"), "ts": e["ts"],
                    "dur": e["dur"]} for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def summarize(kernels: list[dict], steps: int) -> dict:
    """Per launch position of a step: median start / end from the step's first start, µs."""
    if not kernels or len(kernels) % steps:
        raise SystemExit(f"{len(kernels)} kernels do not split into {steps} equal steps")
    k = len(kernels) // steps
    # Within a step, by stream then start: launches beside each other on two streams start in either
    # order from step to step, so a position is a (stream, order on that stream) pair.
    chunks = [sorted(kernels[j * k:(j + 1) * k], key=lambda e: (str(e["stream"]), e["ts"]))
              for j in range(steps)]
    starts = [min(e["ts"] for e in c) for c in chunks]
    ends = [max(e["ts"] + e["dur"] for e in c) for c in chunks]
    launches = []
    for pos in range(k):
        names = {c[pos]["name"] for c in chunks}
        launches.append(dict(
            name=chunks[0][pos]["name"] if len(names) == 1 else " | ".join(sorted(names)),
            stream=chunks[0][pos]["stream"],
            start_us=statistics.median(c[pos]["ts"] - s for c, s in zip(chunks, starts)),
            end_us=statistics.median(c[pos]["ts"] + c[pos]["dur"] - s for c, s in zip(chunks, starts)),
            dur_us=statistics.median(c[pos]["dur"] for c in chunks)))
    gaps = [starts[j + 1] - ends[j] for j in range(steps - 1)]
    return dict(launches_per_step=k, span_us=statistics.median(e - s for s, e in zip(starts, ends)),
                gap_us=statistics.median(gaps) if gaps else 0.0,
                cycle_us=(ends[-1] - starts[0]) / steps, launches=launches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="nemotron-h-8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--qs", default="1,4")
    ap.add_argument("--tiles", default="auto",
                    help="replay tiles (bench_kernels --extra syntax), '+'-separated")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--lockstep", action="store_true", help="as bench_kernels.py --lockstep")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(commit=git_commit(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                command=" ".join([Path(sys.executable).name, *sys.argv]))
    results, lines = [], [f"# Kernel timeline ({meta['device']}, {meta['commit'][:12]})", ""]
    for q in map(int, args.qs.split(",")):
        bench = Bench(Case(args.shape, args.batch, args.dtype, q, args.lockstep))
        steps = WINDOW * bench.n_sets
        for tile in map(Tile.parse, args.tiles.split("+")):
            us, _ = time_graph(bench.body("replay", tile), steps)
            s = summarize(trace_kernels(bench.body("replay", tile)), steps)
            results.append(dict(shape=args.shape, batch=args.batch, state_dtype=args.dtype, q=q,
                                lockstep=args.lockstep, tile=tile.name, graph_us_per_step=us, **s))
            mix = " lock-step" if args.lockstep else ""
            head = (f"{args.shape} {args.dtype} b={args.batch} q={q}{mix} {tile.name}: graph {us:.1f} "
                    f"us/step; profiled span {s['span_us']:.1f} + gap {s['gap_us']:.1f} "
                    f"(cycle {s['cycle_us']:.1f})")
            print(head, flush=True)
            lines += [f"## {head}", "", "| launch | stream | start µs | end µs | µs |",
                      "|---|---|---|---|---|"]
            for la in s["launches"]:
                lines.append(f"| `{la['name'][:60]}` | {la['stream']} | {la['start_us']:.1f} "
                             f"| {la['end_us']:.1f} | {la['dur_us']:.1f} |")
                print(f"  {la['stream']!s:>4} {la['start_us']:7.1f} {la['end_us']:7.1f} {la['dur_us']:7.1f}  "
                      f"{la['name'][:70]}", flush=True)
            lines.append("")
        del bench
        torch.cuda.empty_cache()
    (out / "kernel-timeline.json").write_text(json.dumps(dict(meta=meta, rows=results), indent=1))
    (out / "kernel-timeline.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
