"""Plain decode steps of mode (a), graph-replayed: wall per step over windows of several lengths, and
one device-gap trace (no host labels).

    PYTHONPATH=. python3 benchmarks/step_windows.py [--context 900] [--settings on,off] [--no-gc]

Builds the mode (a) engine (Nemotron-H-8B shape, batch 256, 32-token prompts, fp32 state, W = 16,
CUDA graphs, async scheduling) per setting, decodes to --context, then times windows of 16, 64, 16
and 128 steps (each after a device sync), 64 steps without a sync before them, and 32 steps under
torch.profiler: from that trace, the device's busy time (union of kernels and copies), its gaps of
20 µs or more (the longest listed with the launches around them) and the host ops' time. Answers
whether a step's wall above its GPU work depends on the window (a pipeline fill after a sync) or on
host pauses (--no-gc turns the collector off after the warm-up). Prints one line per setting and a
JSON line at the end. Needs CUDA (a tiny model on the CPU with --quick, as a check of the script).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_e2e import NEMOTRON_H_8B, TINY  # noqa: E402
from profile_gaps import decode_engine, device_events, mean_context  # noqa: E402


def device_gaps(prof, steps: int) -> dict:
    """Busy ms/step, gaps >= 20 µs (ms/step and the 12 longest with their neighbours), host ops."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(tmp + "/t.json")
        trace = json.loads(Path(tmp + "/t.json").read_text())
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
    return {"device_span_ms": (t1 - t0) / per, "busy_ms": (t1 - t0 - sum(g for g, _, _ in gaps)) / per,
            "gaps_20us_ms": long / per, "gaps_20us": sum(g >= 20 for g, _, _ in gaps),
            "short_gaps_ms": (sum(g for g, _, _ in gaps) - long) / per,
            "longest": [(round(g, 1), a, b) for g, a, b in gaps[:12]],
            "host_ops_ms": {k: round(v / per, 3) for k, v in sorted(ops.items(), key=lambda x: -x[1])[:12]}}


def run(cfg: dict, model_dir: str, on: bool, args, cuda: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    batch, prompt = (256, 32) if cuda else (4, 5)
    engine = decode_engine(cfg, model_dir, on, batch, prompt, args.context + 500, cuda,
                           max_model_len=args.context + 600, seed="0")
    if args.no_gc:
        gc.disable()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    while not engine.scheduler.running or mean_context(engine) < args.context:
        engine.step()
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
    out = {"replayssm": on, "context": round(mean_context(engine)), "windows_ms_per_step": windows,
           "traced_wall_ms_per_step": traced, **device_gaps(prof, 32)}
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
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU (a check of the script)")
    args = ap.parse_args()
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
            for g in r.get("longest", [])[:6]:
                print(f"  gap {g[0]:8.1f} us after {g[1]!r} before {g[2]!r}", flush=True)
    print(json.dumps({"command": " ".join(["python3", "benchmarks/step_windows.py", *sys.argv[1:]]),
                      "no_gc": args.no_gc, "settings": res}))


if __name__ == "__main__":
    main()
