"""The one-token step on which every row flushes (a batch decoding in lock-step), timed alone by route.

    PYTHONPATH=. python3 benchmarks/bench_flush_step.py ROUTE:PxW[+...] [--batch 256] [--shape nemotron-h-8b]
    python3 benchmarks/bench_flush_step.py --report OUT LOG:COMMIT

bench_kernels' lock-step cursor mix (every row starts at the same cursor) has one step in W where
every row folds and writes its state, and W - 1 where none does. This times each of the two alone
(CUDA-graph replays of one step over the rotated slot sets) for every route given; "baseline:PxW" times
the baseline state update, which reads and writes every state each step: the flush step's state
traffic at the copy rate. One line per route on stdout; --report turns a log into OUT.json, OUT.md and
OUT.png (benchmarks/NOTES-kernels.md, session 27).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_LINE = re.compile(r"^(\S+): flush ([\d.]+) us .*; plain ([\d.]+) us")


def parse_log(text: str) -> list[dict]:
    """One dict per route line: µs of the flush step and of a plain step."""
    return [dict(route=m.group(1), flush_us=float(m.group(2)), plain_us=float(m.group(3)))
            for m in map(_LINE.match, text.splitlines()) if m]


def report(out: Path, spec: str, device: str = "NVIDIA H200") -> str:
    """OUT.json / .md / .png from one LOG:COMMIT (every route's flush and plain step, the lock-step cycle
    they make, (W - 1) plain + 1 flush over W, against the first baseline line's step)."""
    path, _, commit = spec.partition(":")
    rows = parse_log(Path(path).read_text())
    base = next((r["flush_us"] for r in rows if r["route"].startswith("baseline")), None)
    W = 16
    for r in rows:
        r["cycle_us_per_step"] = ((W - 1) * r["plain_us"] + r["flush_us"]) / W
        r["flush_over_baseline"] = r["flush_us"] / base if base else None
    meta = dict(device=device, commit=commit, command=" ".join(sys.argv), log=Path(path).name)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = ["# The all-flush one-token step, by route", "",
          f"commit `{commit}`, {device}; log `{meta['log']}`.",
          "µs per step (8B shape unless the log says otherwise, batch 256, fp32 state, W = 16); cycle ="
          " (15 plain + 1 flush) / 16.", "",
          "| route | flush step | plain step | lock-step cycle per step | flush / baseline step |",
          "|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["flush_over_baseline"] is None else f"{r['flush_over_baseline']:.2f}"
        md.append(f"| {r['route']} | {r['flush_us']:.1f} | {r['plain_us']:.1f} |"
                  f" {r['cycle_us_per_step']:.1f} | {ratio} |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 0.3 * len(rows) + 1.5))
        names = [f"{i}: {r['route']}" for i, r in enumerate(rows)]
        ax.barh(names, [r["flush_us"] for r in rows], color="tab:red", label="flush step")
        ax.barh(names, [r["plain_us"] for r in rows], color="tab:blue", label="plain step")
        ax.set_xlabel("µs per step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    return "\n".join(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("routes", nargs="?", help="ROUTE:PxW joined by +; baseline:64x4 for the baseline")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--shape", default="nemotron-h-8b")
    ap.add_argument("--report", nargs=2, metavar=("OUT", "LOG:COMMIT"))
    a = ap.parse_args()
    if a.report:
        print(report(Path(a.report[0]), a.report[1]))
        return
    if not a.routes:
        ap.error("give routes, or --report")
    import bench_kernels as bk  # benchmarks/ is the script's own folder on sys.path

    bench = bk.Bench(bk.Case(a.shape, a.batch, "fp32", 1, lockstep=True))
    fr = [float((c[bench.idx[0].long()] + 1 > bk.WINDOW).float().mean()) for _, c in bench.cursors]
    kf = max(range(len(fr)), key=lambda k: fr[k])
    kn = min(range(len(fr)), key=lambda k: fr[k])
    print(f"flush fractions per step {fr}; flush step {kf}, plain step {kn}", flush=True)
    read = a.batch * bench.H * bench.P * bench.N * 4
    for spec in a.routes.split("+"):
        tile = bk.Tile.parse(spec)
        impl = "baseline" if tile.route == "baseline" else "replay"
        out = []
        for k in (kf, kn):
            # bench_kernels' cycle body with step k's cursors at all W steps: W replays of that step.
            run = bench.body(impl, tile, cursors=[bench.cursors[k]] * bk.WINDOW)
            try:
                us = bk.time_graph(run, bk.WINDOW * bench.n_sets)[0]
                gb = (2 if k == kf else 1) * read / us / 1e3
                out.append(f"{'flush' if k == kf else 'plain'} {us:.1f} us ({gb:.0f} GB/s state)")
            except Exception as e:  # a route that refuses this case: the rest still run
                out.append(f"failed {type(e).__name__}: {str(e)[:100]}")
        print(f"{spec}: " + "; ".join(out), flush=True)


if __name__ == "__main__":
    main()
