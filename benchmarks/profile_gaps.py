"""Graph-replayed decode timeline, mode (a) shape: where the GPU waits for the host.

    python3 benchmarks/profile_gaps.py [--contexts 64,512,1000] [--steps 16] [--cprofile] [--out D] [--quick]
        [--async-scheduling auto|on|off|both] [--spec-k K [--acceptance L]]
    python3 benchmarks/profile_gaps.py --report D/e2e-gaps.json      # md and png again from the JSON

`replayssm bench --profile` labels kernels by layer part, which needs eager steps; the bench itself
replays CUDA graphs, and its steps are longer than the GPU work they hold. This script builds the
mode (a) engine (batch 256, CUDA graphs, W = 16) for ReplaySSM OFF and ON, decodes until each
context length in --contexts, and there times --steps steps twice: plain (wall ms/step), then
under torch.profiler with the engine's host phases labelled. From the trace:
  - GPU busy ms/step: the union of device intervals (kernels, copies, memsets);
  - GPU idle ms/step, split by the host phase running at each idle interval's midpoint
    (innermost label), with gaps under 5 us counted apart as kernel boundaries;
  - device ms/step per kernel group (SSM, conv, GEMM, attention, other) and the top kernels.
The profiled steps run slower than the plain ones (labels cost host time); the plain wall is the
measurement, the profiled split says where the waits are. Writes e2e-gaps.{json,md,png}
(e2e-gaps-spec.{json,md,png} with --spec-k: verify steps of mode (b)'s synthetic drafter, K drafts
with mean acceptance length L; a point's context is then the running requests' mean length).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_e2e import ACCEPTANCE_LENGTH, NEMOTRON_H_8B, TINY  # noqa: E402
from profile_e2e import _innermost, patched_labels  # noqa: E402

HOST = ("host: step (loops, sync)", "host: schedule", "host: rows", "host: execute (checks, views)",
        "host: build inputs", "host: graph run (copies, replay)", "host: sample", "host: commit",
        "host: append tokens", "host: make_output", "host: propose drafts", "host: verify")
GROUPS = (("SSM", r"replay|ssu|_lean|_ring_term|_stream_kernel|_flush|_weights_kernel|fold"),
          ("conv", r"conv"), ("attention", r"paged|attention|attn"),
          ("GEMM", r"nvjet|gemm|cutlass|xmma|splitK"), ("norm", r"_norm_kernel"))
SHORT_GAP_US = 5.0


def host_labels(engine):
    from replayssm.engine import engine_step, llm_engine, model_runner

    methods = [(engine, "step", HOST[0]), (engine.scheduler, "schedule", HOST[1]), (engine, "_row", HOST[2]),
               (engine.runner, "execute", HOST[3]), (engine, "_sample", HOST[6]),
               (engine.runner, "commit", HOST[7]), (engine.output, "append_token", HOST[8])]
    if engine.runner.graphs is not None:
        methods.append((engine.runner.graphs, "run", HOST[5]))
    if engine.spec is not None:
        methods += [(engine.spec, "propose", HOST[10]), (engine.spec, "verify", HOST[11])]
    functions = [(model_runner, "build_inputs", HOST[4]), (llm_engine, "make_output", HOST[9]),
                 (engine_step, "make_output", HOST[9])]
    return patched_labels(methods, functions)


def mean_context(engine) -> float:
    """Mean tokens of the running requests."""
    running = engine.scheduler.running
    return sum(r.num_tokens for r in running) / max(1, len(running))


def group(kernel: str) -> str:
    return next((g for g, pat in GROUPS if re.search(pat, kernel, re.I)), "other")


def device_events(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) of the trace's kernels, copies and memsets, by start."""
    return sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda x: x[0])


def busy_intervals(device: list[tuple[float, float, str]], t0: float, t1: float) -> list[list[float]]:
    """The union of the device intervals clipped to [t0, t1], as disjoint [start, end] in order."""
    merged: list[list[float]] = []
    for a, b, _ in device:
        a, b = max(a, t0), min(b, t1)
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def analyse(trace: dict, steps: int) -> dict[str, Any]:
    """Busy / idle / per-group device time per step from a chrome trace (see the module doc)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = device_events(events)
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
             if e.get("cat") == "user_annotation" and e["name"] in HOST]
    steps_spans = sorted(s for s in spans if s[2] == HOST[0])
    if not steps_spans or not device:
        return {"error": f"trace has {len(steps_spans)} steps and {len(device)} device events"}
    t0, t1 = steps_spans[0][0], steps_spans[-1][1]
    merged = busy_intervals(device, t0, t1)
    busy = sum(b - a for a, b in merged)
    gaps = [(a, b) for (_, a), (b, _) in zip([(None, t0)] + merged, merged + [(t1, None)]) if b > a]
    long_gaps = [(a, b) for a, b in gaps if b - a >= SHORT_GAP_US]
    owners = _innermost(spans, [(a + b) / 2 for a, b in long_gaps])
    short = sum(b - a for a, b in gaps if b - a < SHORT_GAP_US)
    idle: dict[str, float] = {"kernel boundaries (< 5 us)": short}
    for (a, b), owner in zip(long_gaps, owners):
        name = owner if owner in HOST else "between steps"
        idle[name] = idle.get(name, 0.0) + (b - a)
    groups: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for a, b, name in device:
        groups[group(name)] = groups.get(group(name), 0.0) + (b - a)
        kernels[name[:60]] = kernels.get(name[:60], 0.0) + (b - a)
    host = {}
    for a, b, name in spans:
        host[name] = host.get(name, 0.0) + (b - a)
    ms = lambda v: v / steps / 1e3  # noqa: E731
    desc = lambda d: sorted(d.items(), key=lambda kv: -kv[1])  # noqa: E731
    return {
        "profiled_wall_ms_per_step": ms(t1 - t0),
        "gpu_busy_ms_per_step": ms(busy),
        "gpu_idle_ms_per_step": ms(t1 - t0 - busy),
        "idle_ms_per_step_by_host_phase": {k: ms(v) for k, v in desc(idle)},
        "host_phase_ms_per_step_inclusive": {k: ms(v) for k, v in desc(host)},
        "device_ms_per_step_by_group": {k: ms(v) for k, v in desc(groups)},
        "top_kernels_ms_per_step": {k: ms(v) for k, v in desc(kernels)[:12]},
        "device_events": len(device),
    }


def cprofile_top(prof, steps: int, n: int = 30) -> list[str]:
    """The n functions with the most own time, as 'tottime cumtime ms/step calls/step name'."""
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [f"{tt / steps * 1e3:8.3f} {ct / steps * 1e3:8.3f} {nc / steps:8.1f} {Path(f).name}:{line}({fn})"
            for (f, line, fn), (_, nc, tt, ct, _) in rows]


def decode_engine(cfg: dict, model_dir: str, replayssm: bool, batch: int, prompt: int, max_tokens: int,
                  cuda: bool, *, max_model_len: int, async_scheduling: bool | None = None, spec_k: int = 0,
                  acceptance: float | None = None, seed: str = "gaps", freeze: bool = True):
    """Mode (a)'s engine (W = 16, fp32 state, dummy weights; CUDA graphs on CUDA; with spec_k, mode (b)'s
    synthetic drafts) holding `batch` greedy requests of random `prompt`-token prompts; with freeze,
    the objects made so far frozen out of the garbage collector's scans."""
    from replayssm.config import EngineConfig
    from replayssm.engine.llm_engine import LLMEngine
    from replayssm.sampling_params import SamplingParams

    kw = dict(device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32", replay_window=16,
              state_dtype="float32", kv_block_size=16, max_num_batched_tokens=8192, load_format="dummy",
              cuda_graphs=cuda, replayssm=replayssm, max_num_seqs=batch, max_model_len=max_model_len,
              async_scheduling=async_scheduling)
    if spec_k:
        kw.update(num_speculative_tokens=spec_k, speculative_method="synthetic",
                  synthetic_acceptance_length=acceptance)
    engine = LLMEngine(EngineConfig.from_kwargs(model_dir, **kw))
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(3, cfg["vocab_size"]) for _ in range(prompt)], params)
    if freeze:
        gc.collect()
        gc.freeze()
    return engine


def run_setting(cfg: dict, model_dir: str, args, replayssm: bool, log, async_scheduling: bool | None = None
                ) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    contexts = sorted(int(c) for c in args.contexts.split(","))
    per_step = 1 + args.spec_k  # most tokens a step adds to a request
    total = contexts[-1] + (3 * args.steps + 8) * per_step
    cuda = torch.cuda.is_available()
    engine = decode_engine(cfg, model_dir, replayssm, args.batch, args.prompt, total, cuda,
                           max_model_len=args.prompt + total + per_step, async_scheduling=async_scheduling,
                           spec_k=args.spec_k, acceptance=args.acceptance, seed=f"gaps-{replayssm}")
    out: dict[str, Any] = {"replayssm": replayssm, "async_scheduling": engine.async_scheduling,
                           "interleave": engine.interleave, "points": []}
    # Two interleaved request groups step in turns: a "step" here is one turn of each (every row once).
    calls = 2 if engine.interleave else 1

    for ctx in contexts:
        while not engine.scheduler.running or mean_context(engine) < ctx:  # the first step prefills
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(args.steps * calls):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / args.steps * 1e3
        cpu = (time.process_time() - c) / args.steps * 1e3
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with host_labels(engine), profile(activities=acts) as prof:
            for _ in range(args.steps * calls):
                engine.step()
            if cuda:
                torch.cuda.synchronize()
        top = None
        if args.cprofile:
            prof_py = cProfile.Profile()
            prof_py.enable()
            for _ in range(args.steps * calls):
                engine.step()
            prof_py.disable()
            top = cprofile_top(prof_py, args.steps)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            point = analyse(json.loads(Path(path).read_text()), args.steps)
        point.update(context=round(mean_context(engine)), wall_ms_per_step=wall, process_cpu_ms_per_step=cpu,
                     graph_replays=getattr(engine.runner.graphs, "num_replays", None))
        if top is not None:
            point["cprofile_top_ms_per_step"] = top
            for row in top[:15]:
                log(f"  cprofile {row}")
        out["points"].append(point)
        got = {k: point.get(f"{k}_ms_per_step", 0.0) for k in ("profiled_wall", "gpu_busy", "gpu_idle")}
        log(f"replayssm={replayssm} async={engine.async_scheduling} interleave={engine.interleave} "
            f"context~{point['context']}: "
            f"wall {wall:.2f} ms/step; profiled "
            f"{got['profiled_wall']:.2f}, GPU busy {got['gpu_busy']:.2f}, idle {got['gpu_idle']:.2f}")
    del engine
    gc.unfreeze()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def setting_name(s: dict) -> str:
    return ("on" if s["replayssm"] else "off") + (", async" if s.get("async_scheduling") else "") + \
        (", interleaved" if s.get("interleave") else "")


def render(doc: dict) -> str:
    title = (f"verify steps (k = {doc['spec_k']}, synthetic acceptance {doc['acceptance']})"
             if doc.get("spec_k") else "decode steps")
    lines = [f"# Graph-replayed {title}: GPU busy and where it waits", "",
             f"- commit `{doc['commit']}`, device {doc['device']}, command `{doc['command']}`",
             f"- batch {doc['batch']}, prompt {doc['prompt']}, {doc['steps']} steps per point; wall = plain "
             "steps, the rest from profiled steps (host labels add host time)", "",
             "| setting | context | wall ms/step | profiled ms/step | GPU busy | GPU idle "
             "| idle by host phase (ms/step) | device by group (ms/step) |", "|---" * 8 + "|"]
    for s in doc["settings"]:
        name = setting_name(s)
        for p in s["points"]:
            head = f"| {name} | {p['context']} | {p['wall_ms_per_step']:.2f} | "
            if "error" in p:
                lines.append(head + f"{p['error']} | | | | |")
                continue
            idle = ", ".join(f"{k} {v:.2f}" for k, v in p["idle_ms_per_step_by_host_phase"].items()
                             if v >= 0.01)
            grp = ", ".join(f"{k} {v:.2f}" for k, v in p["device_ms_per_step_by_group"].items())
            lines.append(head + f"{p['profiled_wall_ms_per_step']:.2f} | {p['gpu_busy_ms_per_step']:.2f} | "
                         f"{p['gpu_idle_ms_per_step']:.2f} | {idle} | {grp} |")
    lines += ["", "Host phases, inclusive ms/step (last point of each setting):", ""]
    for s in doc["settings"]:
        p = s["points"][-1]
        if "host_phase_ms_per_step_inclusive" in p:
            hp = ", ".join(f"{k} {v:.2f}" for k, v in p["host_phase_ms_per_step_inclusive"].items())
            lines.append(f"- {setting_name(s)}: {hp}")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    """One bar per (setting, context): plain wall ms/step beside the profiled step's GPU busy time by
    kernel group (stacked) and its idle time. Skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    points = [(f"{setting_name(s)}\n{p['context']} tok", p) for s in doc["settings"] for p in s["points"]
              if "error" not in p]
    if not points:
        return
    groups = list(dict.fromkeys(g for _, p in points for g in p["device_ms_per_step_by_group"]))
    fig, ax = plt.subplots(figsize=(2.2 * len(points) + 3, 4.5))
    xs = range(len(points))
    bottom = [0.0] * len(points)
    for g in groups:
        v = [p["device_ms_per_step_by_group"].get(g, 0.0) for _, p in points]
        ax.bar([x - 0.2 for x in xs], v, 0.4, bottom=bottom, label=f"kernels: {g} (summed)")
        bottom = [b + w for b, w in zip(bottom, v)]
    ax.bar([x - 0.2 for x in xs], [p["gpu_idle_ms_per_step"] for _, p in points], 0.4, bottom=bottom,
           color="lightgrey", hatch="//", label="GPU idle (profiled)")
    ax.bar([x + 0.2 for x in xs], [p["wall_ms_per_step"] for _, p in points], 0.4, color="k",
           label="wall, plain steps")
    ax.bar([x + 0.2 for x in xs], [p["gpu_busy_ms_per_step"] for _, p in points], 0.25, color="tab:cyan",
           label="GPU busy (union)")
    ax.set_xticks(list(xs), [n for n, _ in points])
    ax.set_ylabel("ms per step")
    spec = f", k = {doc['spec_k']}" if doc.get("spec_k") else ""
    ax.set_title(f"{doc['commit']}: batch {doc['batch']}{spec}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(doc: dict, out: Path) -> str:
    """STEM.json, STEM.md and STEM.png in out (STEM: e2e-gaps, or e2e-gaps-spec for verify steps)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = "e2e-gaps-spec" if doc.get("spec_k") else "e2e-gaps"
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    text = render(doc)
    (out / f"{stem}.md").write_text(text)
    plot(doc, out / f"{stem}.png")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="64,512,1000", help="context lengths to profile at (tokens)")
    ap.add_argument("--steps", type=int, default=16, help="steps per timed / profiled window (16 = W)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--cprofile", action="store_true",
                    help="after each point, one more window under cProfile (own-time top 30 into the JSON)")
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU (a check of the script)")
    ap.add_argument("--spec-k", type=int, default=0,
                    help="verify steps of K synthetic drafts instead of plain decode steps (mode (b))")
    ap.add_argument("--acceptance", type=float, default=ACCEPTANCE_LENGTH,
                    help=f"synthetic mean acceptance length with --spec-k (default: {ACCEPTANCE_LENGTH})")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off", "both"), default="auto",
                    help="engine async scheduling: auto (on with CUDA), on, off, or both (each setting "
                    "twice)")
    ap.add_argument("--report", metavar="JSON", help="only render JSON's md and png again (next to it)")
    args = ap.parse_args()
    if args.report:
        path = Path(args.report)
        print(write(json.loads(path.read_text()), path.parent))
        return
    if args.spec_k and not 1.0 <= args.acceptance <= args.spec_k + 1:
        ap.error(f"--acceptance must be in [1, spec_k + 1 = {args.spec_k + 1}], got {args.acceptance}")
    import torch

    cfg = dict(NEMOTRON_H_8B)
    if args.quick or not torch.cuda.is_available():
        cfg = dict(TINY)
        args.batch, args.prompt, args.steps = min(args.batch, 4), min(args.prompt, 5), min(args.steps, 3)
        args.contexts = "8,12"
    settings = []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(cfg))
        modes = dict(auto=[None], on=[True], off=[False], both=[False, True])[args.async_scheduling]
        for a in modes:
            for on in (False, True):
                settings.append(run_setting(cfg, model_dir, args, on, print, a))
    from report_e2e import run_meta

    meta = run_meta(["python3", "benchmarks/profile_gaps.py", *sys.argv[1:]])
    doc = {**meta, "batch": args.batch, "prompt": args.prompt, "steps": args.steps, "spec_k": args.spec_k,
           "acceptance": args.acceptance if args.spec_k else None, "settings": settings}
    print(write(doc, Path(args.out)))


if __name__ == "__main__":
    main()
