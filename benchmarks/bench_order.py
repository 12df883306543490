"""Small ReplaySSM steps by the order of their rows: does a step end later when its flush rows' programs
start late? (benchmarks/NOTES-kernels.md, session 22; the route option ".o" of mono / mono.t.)

    PYTHONPATH=. python3 benchmarks/bench_order.py MIX/ROUTE+... SHAPE:BATCH:Q,... [--dtype fp16] [--lockstep]
    python3 benchmarks/bench_order.py --report OUT LOG:COMMIT ...

Each case builds bench_kernels' pools and cursor mix and times every MIX/ROUTE pair (µs per step,
CUDA-graph replays of whole W-step cycles, as bench_kernels). MIX is how each step's rows are ordered:
"given" (bench_kernels' random order), "first" (the flush rows moved to the front by the host, every
row keeping its slot: a diagnostic of what the order alone is worth) or "noflush" (every cursor capped
at W - q: no row flushes). One line per case on stdout; --report turns such logs (each with the commit
it ran) into OUT.json, OUT.md and OUT.png. A ROUTE "baseline:PxW" times the baseline state update on the
same pools.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

MIXES = ("given", "first", "noflush")
_CASE = re.compile(r"^(\S+) b=(\d+) q=(\d+) flush=([\d.]+): (.*)$")


def row_orders(cursors, idx_sets, q: int, window: int, mix: str) -> list[list[torch.Tensor]]:
    """Per recorded step and slot set, the slot order a step's launch reads: as given, or (mix
    "first") the rows whose cursor flushes this step (h_c + q > W) first, each part in its given order."""
    out = []
    for _, committed in cursors:
        per = []
        for idx in idx_sets:
            if mix != "first":
                per.append(idx)
                continue
            flush = committed[idx.long()] + q > window
            per.append(idx[torch.sort((~flush).to(torch.int32), stable=True).indices].contiguous())
        out.append(per)
    return out


def parse_log(text: str) -> list[dict]:
    """Rows of one log: a dict per (case, mix, route) timing."""
    rows = []
    for line in text.splitlines():
        m = _CASE.match(line.strip())
        if not m:
            continue
        shape, b, q, frac, rest = m.groups()
        for item in rest.split("; "):
            mix, route, us = item.split(" ")[:3]
            try:
                rows.append(dict(shape=shape, batch=int(b), q=int(q), flush_fraction=float(frac), mix=mix,
                                 route=route, us_per_step=float(us)))
            except ValueError:  # "failed ..."
                continue
    return rows


def _median(rows: list[dict], mix: str, route: str) -> float | None:
    v = sorted(r["us_per_step"] for r in rows if r["mix"] == mix and r["route"] == route)
    return v[len(v) // 2] if v else None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def report(out: Path, logs: list[str], device: str = "NVIDIA H200",
           title: str = "Small steps by row order") -> str:
    """OUT.json (every timing), OUT.md and OUT.png from logs given as LOG:COMMIT. Two tables: the
    ordered routes against their unordered twins (session 22's question, where a log timed both), and
    every route's median against its case's reference (route "auto" as given, else the line's first)."""
    rows = []
    for spec in logs:
        path, _, commit = spec.partition(":")
        name = Path(path).name
        dtype = "fp16" if "fp16" in name else "fp32"
        mix = "lock-step" if "lock" in name else "random"
        for r in parse_log(Path(path).read_text()):
            rows.append(dict(r, state_dtype=dtype, cursor_mix=mix, log=name, commit=commit))
    meta = dict(device=device, command=" ".join(sys.argv), commits=sorted({r["commit"] for r in rows}))
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    cases = {}
    for r in rows:
        cases.setdefault((r["log"], r["shape"], r["batch"], r["q"]), []).append(r)
    ordered_lines, ordered_bars = _ordered_table(cases)
    every_lines, every_bars = _every_table(cases)
    md = [f"# {title}", "", "µs per step, medians of the repeats in each log. Commits per log in the JSON.",
          ""]
    if ordered_lines:
        md += ["## Ordered against unordered", "",
               "`unordered` = mono / mono.t as given, `.o` = the same tile with the flush rows' programs"
               " dispatched first, `host order` = unordered with the flush rows moved to the front by the"
               " host, `no flush` = unordered with every cursor capped at W - q.", "", *ordered_lines, ""]
    md += ["## Every timing against the case's reference", "",
           "reference: route auto as given where the line timed it, else the line's first route; ratio < 1:"
           " faster than the reference.", "", *every_lines, ""]
    out.with_suffix(".md").write_text("\n".join(md))
    bars, label = ((ordered_bars, ".o time / unordered time (< 1: .o faster)") if ordered_bars
                   else (every_bars, "time / reference time (< 1: faster)"))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 0.3 * len(bars) + 1.5))
        ax.barh([n for n, _ in bars], [v for _, v in bars],
                color=["tab:green" if v < 1 else "tab:red" for _, v in bars])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel(label)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    return "\n".join(md)


def _tag(log: str, shape: str, b: int, q: int, head: dict) -> str:
    call = re.search(r"call\d+", log)
    lock = " lock" if head["cursor_mix"] == "lock-step" else ""
    name = "TP8" if "tp8" in shape else "8B"
    return f"{call.group(0) + ' ' if call else ''}{name} b{b} q{q} {head['state_dtype']}{lock}"


def _ordered_table(cases: dict) -> tuple[list[str], list]:
    """One line per (log, case, tile) that timed mono / mono.t both unordered and as .o."""
    lines, bars = [], []
    for (log, shape, b, q), rs in cases.items():
        base = "mono.t" if q > 1 else "mono"
        head = rs[0]
        for tile in sorted({r["route"].split(":")[1] for r in rs if ":" in r["route"]}):
            plain = _median(rs, "given", f"{base}:{tile}")
            ordered = _median(rs, "given", f"{base}.o:{tile}")
            if plain is None or ordered is None:
                continue
            cells = [log, f"{shape} b={b} q={q} {tile}", head["state_dtype"], head["cursor_mix"],
                     f"{head['flush_fraction']:.3f}", _fmt(_median(rs, "given", "auto")), _fmt(plain),
                     _fmt(ordered), _fmt(_median(rs, "first", f"{base}:{tile}")),
                     _fmt(_median(rs, "noflush", f"{base}:{tile}")), f"{ordered / plain:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
            bars.append((f"{_tag(log, shape, b, q, head)} {tile}", ordered / plain))
    if lines:
        lines[:0] = ["| log | case | state | cursors | flush rows | auto | unordered | .o | host order |"
                     " no flush | .o / unordered |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    return lines, bars


def _every_table(cases: dict) -> tuple[list[str], list]:
    """One line per (log, case, mix, route): its median and its ratio to the case's reference."""
    lines = ["| log | case | state | cursors | flush rows | mix | route | µs | / reference |",
             "|---|---|---|---|---|---|---|---|---|"]
    bars = []
    for (log, shape, b, q), rs in cases.items():
        head = rs[0]
        ref_key = (("given", "auto") if _median(rs, "given", "auto") is not None
                   else (head["mix"], head["route"]))
        ref = _median(rs, *ref_key)
        for mix, route in dict.fromkeys((r["mix"], r["route"]) for r in rs):
            us = _median(rs, mix, route)
            cells = [log, f"{shape} b={b} q={q}", head["state_dtype"], head["cursor_mix"],
                     f"{head['flush_fraction']:.3f}", mix, route, _fmt(us), f"{us / ref:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
            if (mix, route) != ref_key:
                bars.append((f"{_tag(log, shape, b, q, head)} {mix} {route}", us / ref))
    return lines, bars


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("combos", nargs="?", help="MIX/ROUTE pairs joined by +: given/auto+first/mono.t:64x2")
    ap.add_argument("cases", nargs="?", help="SHAPE:BATCH:Q joined by commas")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--lockstep", action="store_true", help="bench_kernels --lockstep's cursor mix")
    ap.add_argument("--report", nargs="+", metavar="OUT LOG:COMMIT", help="OUT then the logs to tabulate")
    ap.add_argument("--device", default="NVIDIA H200", help="with --report: the device the logs ran on")
    ap.add_argument("--title", default="Small steps by row order", help="with --report: the table's title")
    args = ap.parse_args()
    if args.report:
        print(report(Path(args.report[0]), args.report[1:], args.device, args.title))
        return
    if not args.combos or not args.cases:
        ap.error("give MIX/ROUTE pairs and cases, or --report")
    import bench_kernels as bk  # benchmarks/ is the script's own folder on sys.path

    combos = [tuple(c.split("/")) for c in args.combos.split("+")]
    for mix, _ in combos:
        if mix not in MIXES:
            raise SystemExit(f"unknown mix {mix!r}; one of {MIXES}")
    for case in args.cases.split(","):
        shape, b, q = case.split(":")
        b, q = int(b), int(q)
        bench = bk.Bench(bk.Case(shape, b, args.dtype, q, args.lockstep))
        frac = torch.stack([(c[bench.idx[0].long()] + q > bk.WINDOW).float().mean()
                            for _, c in bench.cursors]).mean()
        noflush = [(s, torch.clamp(c, max=bk.WINDOW - q)) for s, c in bench.cursors]
        out = []
        for mix, route in combos:
            cursors = noflush if mix == "noflush" else bench.cursors
            order = row_orders(cursors, bench.idx, q, bk.WINDOW, mix)
            try:
                impl = "baseline" if route.startswith("baseline") else "replay"
                us = bk.time_graph(bench.body(impl, bk.Tile.parse(route), order, cursors),
                                   bk.WINDOW * bench.n_sets)[0]
                out.append(f"{mix} {route} {us:.2f}")
            except Exception as e:  # a route that refuses this case: the rest still run
                out.append(f"{mix} {route} failed {type(e).__name__}: {str(e)[:120]}")
        print(f"{shape} b={b} q={q} flush={frac:.3f}: " + "; ".join(out), flush=True)
        del bench
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
