"""Plain decode steps of mode (a), graph-replayed: wall per step over windows of several lengths, and
one device-gap trace (no host labels).

    PYTHONPATH=. python3 benchmarks/step_windows.py [--context 900] [--settings on,off] [--no-gc]

Builds the mode (a) engine (Nemotron-H-8B shape, batch 256, 32-token prompts, fp32 state, W = 16,
CUDA graphs, async scheduling) per setting, decodes to --context (per --bucket steps of that ramp: wall,
the wait for the sampled tokens and the launch of the next step), then times windows of 16, 64, 16
and 128 steps (each after a device sync), 64 steps without a sync before them, and 32 steps under
torch.profiler: from that trace, the device's busy time (union of kernels and copies), its gaps of
20 µs or more (the longest listed with the launches around them), all its gaps by size and by the
launches around them, and the host ops' time; with --cprofile N, N more steps under cProfile; with
--spec-k K, mode (b)'s verify steps instead. Answers whether a step's wall above its GPU work depends
on the window (a pipeline fill after a sync), on host pauses (--no-gc turns the collector off after
the warm-up) or on the host's own time per step (the ramp's wait). Prints one line per setting and a
JSON line at the end; `--report OUT LOG[:COMMIT]...` turns such logs into OUT.json / .md / .png.
Needs CUDA (a tiny model on the CPU with --quick, as a check of the script).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_e2e import ACCEPTANCE_LENGTH, NEMOTRON_H_8B, TINY  # noqa: E402
from profile_gaps import decode_engine, device_events, mean_context  # noqa: E402

GAP_BINS = (2, 5, 10, 20)  # µs: a gap's bin is the first bound above it (last: >= 20)


def device_gaps(prof, steps: int, trace_out: str = "") -> dict:
    """Busy ms/step, gaps >= 20 µs (ms/step and the 12 longest with their neighbours), every gap's
    ms/step by size bin and by the (ended, starting) launch pair around it, host ops."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(tmp + "/t.json")
        raw = Path(tmp + "/t.json").read_bytes()
        trace = json.loads(raw)
    if trace_out:
        Path(trace_out).write_bytes(gzip.compress(raw))
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    dev = device_events(events)
    if not dev:
        return {"error": "no device events"}
    # One pass in start order: a gap opens wherever a launch starts after every earlier one ended; it is
    # named by the launch that ended last before it and the one that closes it.
    t0, t1, last, gaps = dev[0][0], dev[0][1], dev[0][2], []
    for a, b, name in dev[1:]:
        if a > t1:
            gaps.append((a - t1, last[:50], name[:50]))
        if b > t1:
            t1, last = b, name
    gaps.sort(reverse=True)
    long = sum(g for g, _, _ in gaps if g >= 20)
    ops: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e["name"]] = ops.get(e["name"], 0.0) + e["dur"]
    per = steps * 1e3
    bins: dict[str, float] = {}
    pairs: dict[tuple[str, str], list[float]] = {}
    for g, a, b in gaps:
        key = next((f"< {x} us" for x in GAP_BINS if g < x), f">= {GAP_BINS[-1]} us")
        bins[key] = bins.get(key, 0.0) + g / per
        n_t = pairs.setdefault((a, b), [0, 0.0])
        n_t[0] += 1
        n_t[1] += g
    top_pairs = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:16]
    return {"kernels_per_step": len(dev) / steps,
            "gaps_by_size_ms": {k: round(v, 4) for k, v in bins.items()},
            "gap_pairs": [{"after": a, "before": b, "per_step": n / steps, "ms_per_step": round(t / per, 4)}
                          for (a, b), (n, t) in top_pairs],
            "device_span_ms": (t1 - t0) / per, "busy_ms": (t1 - t0 - sum(g for g, _, _ in gaps)) / per,
            "gaps_20us_ms": long / per, "gaps_20us": sum(g >= 20 for g, _, _ in gaps),
            "short_gaps_ms": (sum(g for g, _, _ in gaps) - long) / per,
            "longest": [(round(g, 1), a, b) for g, a, b in gaps[:12]],
            "host_ops_ms": {k: round(v / per, 3) for k, v in sorted(ops.items(), key=lambda x: -x[1])[:12]}}


def ramp_steps(engine, context: int, bucket: int) -> list[dict]:
    """Step `engine` until its rows' mean context reaches `context`; per `bucket` steps: the mean
    context, wall ms/step, and of it the ms/step spent in `LaunchedStep.results` (the wait for the
    sampled tokens' copy, then the lists) and in `launch` / `launch_ahead` (queueing a step). With
    async scheduling (or two interleaved request groups) the host does the rest of a step while the
    device runs the step queued before: a wait near zero means the device waited on the host."""
    from replayssm.engine import engine_step, llm_engine

    spent = {"wait": 0.0, "launch": 0.0}

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapper

    results, ahead, launch = engine_step.LaunchedStep.results, llm_engine.launch_ahead, llm_engine.launch
    engine_step.LaunchedStep.results = timed(results, "wait")
    llm_engine.launch_ahead = timed(ahead, "launch")
    llm_engine.launch = timed(launch, "launch")
    rows, n, t0 = [], 0, time.perf_counter()
    try:
        while not engine.scheduler.running or mean_context(engine) < context:
            engine.step()
            n += 1
            if n == bucket:
                wall = (time.perf_counter() - t0) / n * 1e3
                rows.append({"context": round(mean_context(engine)), "steps": n, "wall_ms": round(wall, 3),
                             **{f"{k}_ms": round(v / n * 1e3, 3) for k, v in spent.items()}})
                spent.update(wait=0.0, launch=0.0)
                n, t0 = 0, time.perf_counter()
    finally:
        engine_step.LaunchedStep.results, llm_engine.launch_ahead, llm_engine.launch = results, ahead, launch
    return rows


def run(cfg: dict, model_dir: str, on: bool, args, cuda: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    batch, prompt = (256, 32) if cuda else (4, 5)
    per_step = 1 + args.spec_k  # most tokens a step adds to a row
    total = args.context + 520 * per_step  # the ramp, then ~440 steps of windows, trace and profile
    engine = decode_engine(cfg, model_dir, on, batch, prompt, total, cuda,
                           max_model_len=prompt + total + per_step, spec_k=args.spec_k,
                           acceptance=args.acceptance, seed="0")
    if args.no_gc:
        gc.disable()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ramp = ramp_steps(engine, args.context, args.bucket)
    windows = []
    for n in (16, 64, 16, 128):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            engine.step()
        sync()
        windows.append([n, (time.perf_counter() - t) / n * 1e3])
    for _ in range(8):
        engine.step()
    t = time.perf_counter()
    for _ in range(64):
        engine.step()
    windows.append(["64 no sync", (time.perf_counter() - t) / 64 * 1e3])
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(32):
            engine.step()
        sync()
        traced = (time.perf_counter() - t) / 32 * 1e3
    host_profile = None
    if args.cprofile:
        import cProfile
        import io
        import pstats

        sync()
        with cProfile.Profile() as cp:
            for _ in range(args.cprofile):
                engine.step()
            sync()
        text = io.StringIO()
        pstats.Stats(cp, stream=text).sort_stats("tottime").print_stats(25)
        host_profile = text.getvalue()
        print(host_profile, flush=True)
    trace_out = f"{args.trace_out}-{'on' if on else 'off'}.json.gz" if args.trace_out else ""
    out = {"replayssm": on, "context": round(mean_context(engine)), "ramp": ramp,
           "windows_ms_per_step": windows, "traced_wall_ms_per_step": traced, "host_profile": host_profile,
           **device_gaps(prof, 32, trace_out)}
    del engine
    gc.enable()
    gc.unfreeze()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=900, help="mean context to decode to before timing")
    ap.add_argument("--settings", default="on,off", help="ReplaySSM settings, in order")
    ap.add_argument("--no-gc", action="store_true", help="the garbage collector off after the warm-up")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="then this many steps under cProfile (top 25 functions by own time printed)")
    ap.add_argument("--trace-out", default="", help="save each setting's trace as PREFIX-on/off.json.gz")
    ap.add_argument("--bucket", type=int, default=100,
                    help="steps per row of the ramp to --context (wall, token wait and launch per step)")
    ap.add_argument("--spec-k", type=int, default=0,
                    help="mode (b)'s engine instead: K synthetic drafts a row (a step is then one call of "
                    "engine.step: one request group's verify step where the groups interleave)")
    ap.add_argument("--acceptance", type=float, default=ACCEPTANCE_LENGTH,
                    help="with --spec-k: the drafts' mean acceptance length")
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU (a check of the script)")
    ap.add_argument("--report", nargs="+", metavar=("OUT", "LOG"),
                    help="no run: OUT.json / .md / .png from logs (LOG or LOG:COMMIT)")
    args = ap.parse_args()
    if args.report:
        report(args.report[0], args.report[1:])
        return
    import torch

    cuda = torch.cuda.is_available() and not args.quick
    cfg = dict(NEMOTRON_H_8B if cuda else TINY)
    if not cuda:
        args.context = min(args.context, 40)
    res = []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(cfg))
        for s in args.settings.split(","):
            r = run(cfg, model_dir, s == "on", args, cuda)
            res.append(r)
            w = ", ".join(f"{n}: {v:.2f}" for n, v in r["windows_ms_per_step"])
            print(f"replayssm {s} context {r['context']}: windows {w}; "
                  f"traced {r['traced_wall_ms_per_step']:.2f}, busy {r.get('busy_ms', float('nan')):.2f}, "
                  f"gaps >= 20 us {r.get('gaps_20us_ms', 0):.3f}",
                  flush=True)
            for row in r["ramp"]:
                print(f"  ramp context {row['context']:5d}: {row['wall_ms']:.2f} ms/step, waiting for tokens "
                      f"{row['wait_ms']:.2f}, launching {row['launch_ms']:.2f}", flush=True)
            print(f"  {r.get('kernels_per_step', 0):.0f} device events per step; gaps, ms/step: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r.get("gaps_by_size_ms", {}).items()), flush=True)
            for g in r.get("gap_pairs", [])[:10]:
                print(f"  gaps {g['ms_per_step']:.3f} ms/step ({g['per_step']:.1f} per step) "
                      f"after {g['after']!r} before {g['before']!r}", flush=True)
            for g in r.get("longest", [])[:6]:
                print(f"  gap {g[0]:8.1f} us after {g[1]!r} before {g[2]!r}", flush=True)
    from bench_kernels import git_commit

    print(json.dumps({"command": " ".join(["python3", "benchmarks/step_windows.py", *sys.argv[1:]]),
                      "commit": git_commit(), "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "no_gc": args.no_gc, "settings": res}))


def report(out: str, logs: list[str]) -> None:
    """OUT.json / .md / .png from the JSON lines of step_windows logs (LOG or LOG:COMMIT, the commit
    measured where the line's own is missing or stale): each run's ramp (wall and token wait per
    step by context, ON against OFF), its windows and its traced gaps."""
    runs = []
    for item in logs:
        path, _, commit = item.partition(":")
        for line in Path(path).read_text().splitlines():
            if line.startswith('{"command"'):
                run = json.loads(line)
                if commit or "commit" not in run:  # given: it beats the device's (perhaps stale) git HEAD
                    run["commit"] = commit or "unknown"
                run.setdefault("device", "NVIDIA H200")
                runs.append(run)
    spec = any("--spec-k" in run["command"] for run in runs)
    what = ("verify steps of mode (b) (k synthetic drafts a row, two request groups taking turns: a step "
            "is one group's, 128 rows)" if spec else "decode steps of mode (a)")
    md = [f"# Graph-replayed {what}: the ramp, windows and device gaps", "",
          "Mode (a)'s engine (batch 256, 32-token prompts, fp32 state, W = 16, CUDA graphs, async "
          "scheduling; with --spec-k, mode (b)'s drafts), decoded from its prompts to the run's context. "
          "Ramp rows: per step, the wall, "
          "the time the host waited for the sampled tokens (`LaunchedStep.results`) and the time it "
          "spent queueing steps (`launch`, `launch_ahead`); the device ran the step queued before "
          "meanwhile, so a wait well above zero means the host was not what the device waited on.", ""]
    for k, run in enumerate(runs, 1):
        md += [f"## Run {k}: `{run['command']}`", "",
               f"- commit `{run['commit']}`, device {run['device']}", "",
               "| context | ON ms/step | ON wait | ON launch | OFF ms/step | OFF wait | OFF launch "
               "| OFF / ON |",
               "|---|---|---|---|---|---|---|---|"]
        by = {s["replayssm"]: s for s in run["settings"]}
        if True in by and False in by:
            for a, b in zip(by[True]["ramp"][1:], by[False]["ramp"][1:]):  # the first row holds the prefill
                md.append(f"| {a['context']} | {a['wall_ms']:.2f} | {a['wait_ms']:.2f} | "
                          f"{a['launch_ms']:.2f} | {b['wall_ms']:.2f} | {b['wait_ms']:.2f} | "
                          f"{b['launch_ms']:.2f} | {b['wall_ms'] / a['wall_ms']:.3f} |")
        md += ["", "| setting | context | windows, ms/step | traced wall | GPU busy | device events / step | "
               "gaps by size, ms/step |", "|---|---|---|---|---|---|---|"]
        for s in run["settings"]:
            w = ", ".join(f"{v:.2f}" for _, v in s["windows_ms_per_step"])
            gaps = ", ".join(f"{g} {v:.3f}" for g, v in s.get("gaps_by_size_ms", {}).items()) or "-"
            ev = f"{s['kernels_per_step']:.0f}" if "kernels_per_step" in s else "-"
            busy = s.get("busy_ms", float("nan"))
            md.append(f"| {'on' if s['replayssm'] else 'off'} | {s['context']} | {w} | "
                      f"{s['traced_wall_ms_per_step']:.2f} | {busy:.2f} | {ev} | {gaps} |")
        md.append("")
    Path(out + ".md").write_text("\n".join(md))
    Path(out + ".json").write_text(json.dumps({"runs": runs}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, run in enumerate(runs, 1):
        for s in run["settings"]:
            ramp = s["ramp"][1:]
            name = "on" if s["replayssm"] else "off"
            ctx = [r["context"] for r in ramp]
            ax.plot(ctx, [r["wall_ms"] for r in ramp], "o-", label=f"run {k} {name}: step")
            ax.plot(ctx, [r["wait_ms"] for r in ramp], "x--",
                    label=f"run {k} {name}: host waits for tokens")
    ax.set_xlabel("mean context (tokens)")
    ax.set_ylabel("ms per step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.set_title(f"Mode ({'b' if spec else 'a'}) {'verify' if spec else 'decode'} steps: wall and host wait "
                 f"({runs[0]['device']})")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)


if __name__ == "__main__":
    main()
