"""Render benchmarks/results/kernels.json into kernels.md (tables, targets) and kernels.png.

    python3 benchmarks/report.py [results_dir]

The last lines of the markdown (the headline checks) are what bench_kernels.py prints.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

HEADLINE = ("nemotron-h-8b", 256, "fp32")
FI_IMPLS = ("fi_baseline", "fi_replay")  # bench_flashinfer.py rows (--flashinfer)


def _index(rows: list[dict]) -> dict:
    by = {}
    for r in rows:
        if not r.get("sweep") and not r.get("diag") and not r.get("extra"):
            by[(r["shape"], r["batch"], r["state_dtype"], r["q"], r["impl"])] = r
    return by


def _targets(meta: dict, by: dict) -> list[str]:
    shape, b, sd = HEADLINE
    out = [f"## Targets ({shape}, batch {b}, {sd} state, W={meta['window']})", ""]
    get = lambda q, impl: by.get((shape, b, sd, q, impl))
    base1, base4 = get(1, "baseline"), get(4, "baseline")
    if base1:
        frac = base1["gbps"] / meta["copy_gbps"]
        out.append(f"- baseline plain decode: {base1['gbps']:.0f} GB/s = {frac:.0%} of copy "
                   f"{meta['copy_gbps']:.0f} GB/s (target >= 85%)")
    for q, base, goal in ((1, base1, 1.8), (4, base4, 5.5)):
        for impl in ("replay",):
            r = get(q, impl)
            if base and r:
                limit = base["bytes_per_step"] / r["bytes_per_step"]
                speedup = base["us_per_step"] / r["us_per_step"]
                out.append(f"- {impl} q={q}: {speedup:.2f}x faster than baseline "
                           f"(target >= {goal}x; byte-count limit {limit:.2f}x)")
        fi, ours = get(q, "fi_replay"), get(q, "replay")
        if fi and ours:
            out.append(f"- replay q={q} vs FlashInfer checkpointing_ssu [{fi['algorithm']}]: "
                       f"{fi['us_per_step']:.1f} / {ours['us_per_step']:.1f} us = {_ratio(fi, ours)} "
                       f"(FlashInfer us / ours; target >= 1)")
    return out + [""]


def _tables(by: dict) -> list[str]:
    out = []
    groups = defaultdict(list)
    for shape, b, sd, q, _ in by:
        groups[(shape, sd, q)].append(b)
    cell = lambda r: f"{r['us_per_step']:.1f} ({r['gbps']:.0f})" if r else "-"
    for (shape, sd, q), batches in sorted(groups.items()):
        fi = any(by.get((shape, b, sd, q, i)) for b in batches for i in FI_IMPLS)
        extra = (" FI baseline us (GB/s) | FI replay us (GB/s) | FI replay us / ours | "
                 "FI baseline us / ours |") if fi else ""
        out += [f"### {shape}, {sd} state, q={q}", "",
                "| batch | baseline us (GB/s) | replay us (GB/s) | speedup | byte limit |" + extra,
                "|---|---|---|---|---|" + ("---|" * 4 if fi else "")]
        for b in sorted(set(batches)):
            rs = {i: by.get((shape, b, sd, q, i)) for i in ("baseline", "replay", *FI_IMPLS)}
            if not (rs["baseline"] and rs["replay"]):
                continue
            base = rs["baseline"]
            sp = lambda r, base=base: f"{base['us_per_step'] / r['us_per_step']:.2f}x"
            line = (f"| {b} | {cell(base)} | {cell(rs['replay'])} | {sp(rs['replay'])} | "
                    f"{base['bytes_per_step'] / rs['replay']['bytes_per_step']:.2f}x |")
            if fi:
                fr, fb = rs["fi_replay"], rs["fi_baseline"]
                algo = f" [{fr['algorithm']}]" if fr else ""
                line += (f" {cell(fb)} | {cell(fr)}{algo} | {_ratio(fr, rs['replay'])} | "
                         f"{_ratio(fb, base)} |")
            out.append(line)
        out.append("")
    return out


def _ratio(fi: dict | None, ours: dict | None) -> str:
    """FlashInfer's time over ours: > 1 means ours is faster."""
    return f"{fi['us_per_step'] / ours['us_per_step']:.2f}x" if fi and ours else "-"


def _flashinfer(meta: dict, by: dict) -> list[str]:
    """Version, the issue's check (ReplaySSM at least as fast at every batch >= 32), cross-checks."""
    keys = sorted(k for k in by if k[4] == "fi_replay")
    if "flashinfer" not in meta:
        return []
    out = [f"## FlashInfer {meta['flashinfer']} (fp32 state; same pools, cursors and graph timing)", "",
           "Ratios are FlashInfer's us / ours (> 1: ours faster). fi_replay = checkpointing_ssu, the faster "
           "of monolith and two-kernel; fi_baseline = selective_state_update (auto).", ""]
    slow = [f"{s} q={q} b={b}: {_ratio(by[(s, b, sd, q, 'fi_replay')], by.get((s, b, sd, q, 'replay')))}"
            for s, b, sd, q, _ in keys if b >= 32 and by.get((s, b, sd, q, "replay"))
            and by[(s, b, sd, q, "fi_replay")]["us_per_step"] < by[(s, b, sd, q, "replay")]["us_per_step"]]
    measured = sum(1 for s, b, sd, q, _ in keys if b >= 32 and by.get((s, b, sd, q, "replay")))
    out.append(f"- ReplaySSM at least as fast as FlashInfer's checkpointing_ssu at every batch >= 32: "
               f"{'yes' if not slow else 'no'} ({measured - len(slow)}/{measured} cases)"
               + (f"; slower at {', '.join(slow)}" if slow else ""))
    for err in meta.get("flashinfer_errors", []):
        out.append(f"- failed: {err}")
    out += ["", "Cross-check, one step on copies of the first slot set (max abs difference vs ours; "
            "y_absmax for scale):", "", "| case | y_absmax | replay y (mono / 2k) | replay state | "
            "replay ring | baseline y | baseline states |", "|---|---|---|---|---|---|---|"]
    for s, b, sd, q, _ in keys:
        x = by[(s, b, sd, q, "fi_replay")].get("xcheck", {})
        g = lambda k, x=x: f"{x[k]:.3g}" if isinstance(x.get(k), float) else str(x.get(k, "-"))
        out.append(f"| {s} q={q} b={b} | {g('y_absmax')} | {g('fi_replay_monolith_y')} / "
                   f"{g('fi_replay_two-kernel_y')} | {g('fi_replay_monolith_state')} | "
                   f"{g('fi_replay_monolith_ring')} | {g('fi_baseline_y')} | {g('fi_baseline_states')} |")
    return out + [""]


def _routes(by: dict) -> list[str]:
    """The route the table took at each replay case."""
    out = ["### Routes taken", "", "| shape | state | q | batch | route |", "|---|---|---|---|---|"]
    for (shape, b, sd, q, impl), r in sorted(by.items()):
        if impl == "replay":
            out.append(f"| {shape} | {sd} | {q} | {b} | `{r['route']}` |")
    return out + [""]


def _plot(by: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = sorted({k[0] for k in by})
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 4 * len(shapes)), squeeze=False)
    for i, shape in enumerate(shapes):
        for j, q in enumerate((1, 4)):
            ax = axes[i][j]
            for sd in ("fp32", "fp16"):
                for impl, style in (("replay", "-o"), ("fi_replay", "--s"), ("fi_baseline", ":^")):
                    base = {b: r for (s2, b, d2, q2, i2), r in by.items()
                            if (s2, d2, q2, i2) == (shape, sd, q, "baseline")}
                    pts = sorted((b, base[b]["us_per_step"] / r["us_per_step"])
                                 for (s2, b, d2, q2, i2), r in by.items()
                                 if (s2, d2, q2, i2) == (shape, sd, q, impl) and b in base)
                    if pts:
                        ax.plot(*zip(*pts), style, label=f"{impl} {sd}")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{shape}, q={q}: speedup over baseline SSU")
            ax.set_xlabel("batch")
            ax.set_ylabel("our baseline us / impl us")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_report(results: Path) -> str:
    """Write kernels.md (and kernels.png when matplotlib imports); return the targets section."""
    data = json.loads((results / "kernels.json").read_text())
    meta, rows = data["meta"], data["rows"]
    by = _index(rows)
    head = [f"# Decode kernels on {meta['device']}", "",
            f"commit `{meta['commit']}`, torch {meta['torch']}, triton {meta['triton']}, "
            f"command `{meta['command']}`; copy bandwidth {meta['copy_gbps']:.0f} GB/s (read+write); "
            f"activations {meta['act_dtype']}, W={meta['window']}; us per step are medians over CUDA-graph "
            f"replays of whole W-step cycles (flush steps included)"
            + ("; cursors in lock-step (rows flush on the same step)" if meta.get("lockstep") else "")
            + ("; every cursor capped at W - q: no row flushes (a diagnostic)" if meta.get("noflush") else "")
            + f"; baseline tiles {meta.get('baseline_tiles', '-')}; replay takes the route table's choice "
            "(`ops.triton.replay.pick_route`).", ""]
    if meta.get("note"):  # how a merged file came together (several commands of one device call)
        commands = meta.get("commands", [])
        head += [meta["note"], ""] + [f"- commands[{k}]: `{c}`" for k, c in enumerate(commands)] + [""]
    targets = _targets(meta, by)
    plotted = _plot(by, results / "kernels.png")
    body = head + targets + (["![speedup](kernels.png)", ""] if plotted else []) + _tables(by)
    body += _flashinfer(meta, by) + _routes(by)
    (results / "kernels.md").write_text("\n".join(body))
    return "\n".join(targets)


if __name__ == "__main__":
    print(write_report(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")))
