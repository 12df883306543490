"""Write the end-to-end benchmark's results: e2e.{json,md,png} (table + ON/OFF ratios) and the step
profiles' e2e-profile.{json,md,png} and e2e-prefill-profile.{json,md,png}.

The JSON holds the commit, device, versions, command, workload, one row per (mode, setting,
batch, repetition) and the ratios; the markdown and the plot are rendered from it alone, so

    python3 benchmarks/report_e2e.py benchmarks/results/e2e.json [...e2e-profile.json ...]

renders them again. The plots need matplotlib (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PLOT_HINT = "no plot: matplotlib is not installed (pip install -e '.[bench]' adds it)"
# What each mode's ratio measures (the targets are bench_e2e.TARGETS); (s) reports two.
RATIO_SPEC = {
    "a": ("output_tok_s", "ON/OFF output tok/s (ReplaySSM on vs off, plain decode)", ">="),
    "b": ("output_tok_s", "ON/OFF output tok/s (spec k=3, ReplaySSM on vs off)", ">="),
    "c": ("ttft_s", "TTFT reduction, turns after the first (prefix caching on vs off)", ">="),
    "s": ("ttft_s", "seeds' workload: TTFT reduction, turns after the first (prefix caching on vs off)",
          ">="),
}
EXTRA_RATIOS = {"s": ("output_tok_s", "seeds' workload: ON/OFF output tok/s (prefix caching on vs off)")}
# Rows written before the state dtype and TP size were recorded ran fp32 state on one GPU.
# Rows written before the weight quantization and KV cache dtype were recorded ran the model dtype.
ROW_DEFAULTS = {"state_dtype": "float32", "tensor_parallel_size": 1, "quantization": "none",
                "kv_cache_dtype": "auto"}


def state_dtype(row: dict) -> str:
    return row.get("state_dtype", ROW_DEFAULTS["state_dtype"])


def variant(row: dict) -> str:
    """The row's state dtype, then " fp8 weights" / " fp8 KV" where they are not the model dtype: the
    settings that an ON/OFF ratio must not mix."""
    q, kv = row.get("quantization", "none"), row.get("kv_cache_dtype", "auto")
    return state_dtype(row) + ("" if q == "none" else f" {q} weights") + ("" if kv == "auto" else f" {kv} KV")


DTYPE_ORDER = ("float32", "float16", "bfloat16")  # the order of --state-dtype's choices


def _dtype_order(dtype: str) -> tuple[int, str]:
    base = dtype.split(" ")[0]
    return (DTYPE_ORDER.index(base) if base in DTYPE_ORDER else len(DTYPE_ORDER), dtype)


def run_meta(command: list[str]) -> dict[str, Any]:
    """Commit (with '+dirty' when tracked files differ), device, versions and the command line."""
    import torch

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    # The GPU machine gets a copy of the working tree whose git metadata may be stale: a device
    # run names its commit in REPLAYSSM_COMMIT (as bench_kernels.py reads it).
    commit = os.environ.get("REPLAYSSM_COMMIT") or git("rev-parse", "HEAD") or "unknown"
    if "REPLAYSSM_COMMIT" not in os.environ and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    return {"commit": commit, "device": device, "versions": versions, "command": " ".join(command)}


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def compute_ratios(rows: list[dict], targets: dict[str, float] | None) -> list[dict[str, Any]]:
    """Per (mode, batch, state dtype): ON and OFF means over the repetitions, their ratio, and the
    ratio against the mode's target where it has one (targets None: none, as in the CPU smoke run).
    TTFT ratios are reductions (1 - ON/OFF)."""
    groups: dict[tuple[str, int, str], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        groups[(r["mode"], r["batch"], variant(r))][r["setting"]].append(r)
    out = []
    order = lambda g: (g[0][0], g[0][1], _dtype_order(g[0][2]))  # noqa: E731
    for (mode, batch, dtype), by in sorted(groups.items(), key=order):
        if not by["on"] or not by["off"]:
            continue
        for key, what in (RATIO_SPEC[mode][:2],) + ((EXTRA_RATIOS[mode],) if mode in EXTRA_RATIOS else ()):
            on, off = _mean(by["on"], key), _mean(by["off"], key)
            if key == "ttft_s":
                value = 1.0 - on / off if off > 0 else 0.0
            else:
                value = on / off if off > 0 else 0.0
            peak_on = _mean(by["on"], "peak_decoding_requests")
            peak_off = _mean(by["off"], "peak_decoding_requests")
            q = {"mode": mode, "batch": batch, "state_dtype": dtype, "metric": key, "what": what, "on": on,
                 "off": off, "value": value, "peak_decoding_on": peak_on, "peak_decoding_off": peak_off}
            # The targets are fp32-state ones (the state-dtype comparison has its own, dtype_ratios).
            if targets is not None and mode in targets and dtype == "float32" and key == RATIO_SPEC[mode][0]:
                q.update(target=targets[mode], meets_target=value >= targets[mode])
            out.append(q)
    return out


def dtype_ratios(rows: list[dict], targets: dict[str, float] | None) -> list[dict[str, Any]]:
    """Per (mode, batch) and 16-bit state dtype: ON output tok/s with that state over ON with fp32
    state (means over the repetitions), with the target "mode:dtype" where one exists."""
    on: dict[tuple[str, int, str], list[dict]] = defaultdict(list)
    for r in rows:
        if r["setting"] == "on" and r["mode"] != "s" and variant(r) == state_dtype(r):
            on[(r["mode"], r["batch"], state_dtype(r))].append(r)
    out = []
    for (mode, batch, dtype), rs in sorted(on.items()):
        ref = on.get((mode, batch, "float32"))
        if dtype == "float32" or not ref:
            continue
        num, den = _mean(rs, "output_tok_s"), _mean(ref, "output_tok_s")
        q = {"mode": mode, "batch": batch, "state_dtype": dtype, "on": num, "on_float32": den,
             "value": num / den if den > 0 else 0.0}
        target = (targets or {}).get(f"{mode}:{dtype}")
        if target is not None:
            q.update(target=target, meets_target=q["value"] >= target)
        out.append(q)
    return out


def variant_ratios(rows: list[dict]) -> list[dict[str, Any]]:
    """Per (mode, batch, setting) and FP8 variant (FP8 weights and / or FP8 KV): its output tok/s over
    that of the model-dtype weights and KV with the same state dtype and setting (means over the
    repetitions), so ReplaySSM ON and OFF each show what FP8 gives."""
    by: dict[tuple[str, int, str, str], list[dict]] = defaultdict(list)
    for r in rows:
        if r["mode"] != "s":
            by[(r["mode"], r["batch"], r["setting"], variant(r))].append(r)
    out = []
    for (mode, batch, setting, var), rs in sorted(by.items()):
        base = var.split(" ")[0]
        ref = by.get((mode, batch, setting, base))
        if var == base or not ref:
            continue
        num, den = _mean(rs, "output_tok_s"), _mean(ref, "output_tok_s")
        out.append({"mode": mode, "batch": batch, "setting": setting, "variant": var, "base": base,
                    "output_tok_s": num, "base_output_tok_s": den, "value": num / den if den > 0 else 0.0})
    return out


# Rep-to-rep spread of one setting's ratio metric (max / min - 1) above which the run is flagged.
SPREAD_LIMIT = 0.2


def spread_warnings(rows: list[dict], limit: float = SPREAD_LIMIT) -> list[str]:
    """One line per (mode, batch, setting) whose repetitions differ by more than `limit` in the ratio's
    metric (max / min - 1), or whose caches were planned differently (num_requests_fit, num_slots)."""
    groups: dict[tuple[str, int, str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["mode"], r["batch"], r["setting"], variant(r))].append(r)
    out = []
    for (mode, batch, setting, dtype), rs in sorted(groups.items()):
        if dtype != "float32":
            setting = f"{setting} {dtype}"
        if len(rs) < 2:
            continue
        key = RATIO_SPEC[mode][0]
        vals = [r[key] for r in rs]
        if min(vals) > 0 and max(vals) / min(vals) - 1 > limit:
            out.append(f"({mode}) {setting} batch {batch}: {key} differs by {max(vals) / min(vals) - 1:.0%} "
                       f"across reps ({', '.join(f'{v:.4g}' for v in vals)}), above {limit:.0%}")
        fits, slots = [r.get("num_requests_fit") for r in rs], [r.get("num_slots") for r in rs]
        if len(set(fits)) > 1 or len(set(slots)) > 1:
            out.append(f"({mode}) {setting} batch {batch}: cache planned differently across reps "
                       f"(requests fit {', '.join(map(str, fits))}; slots {', '.join(map(str, slots))}): "
                       "free memory differed at engine build")
    return out


def mode_runs_meta(rows: list[dict]) -> dict[str, dict[str, Any]]:
    """Per mode: the commit(s) and command(s) its rows came from (rows carry them; see write_results)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        m = out.setdefault(r["mode"], {"commits": [], "commands": []})
        for key, field in (("commits", "commit"), ("commands", "command")):
            if r.get(field) and r[field] not in m[key]:
                m[key].append(r[field])
    return out


COLUMNS = (("mode", "{}"), ("setting", "{}"), ("batch", "{}"), ("state_dtype", "{}"),
           ("tensor_parallel_size", "{}"), ("quantization", "{}"), ("kv_cache_dtype", "{}"),
           ("rep", "{}"), ("output_tok_s", "{:.1f}"),
           ("decode_tok_s_per_request", "{:.2f}"), ("ttft_s", "{:.3f}"), ("peak_decoding_requests", "{}"),
           ("preemptions", "{}"), ("prefix_hit_tokens", "{}"), ("acceptance_length", "{:.3f}"),
           ("wall_s", "{:.1f}"))


def mode_notes(w: dict[str, Any], modes: str) -> dict[str, str]:
    """One line per mode: the sizes its rows ran with."""
    notes = {
        "a": f"(a) batch {w['decode_batch']}, {w['decode_prompt']}-token prompts, {w['decode_output']} "
             "output tokens per request",
        "b": f"(b) k = {w['spec_k']}, {w['spec_prompt']}-token prompts, {w['spec_output']} output tokens per "
             "request; drafts are synthetic (speculative_method='synthetic', forced acceptance): the output "
             "tokens are not the model's, only the speed counts",
        "c": f"(c) {w['conversations']} conversation(s) over {w['shared_context']} shared tokens, "
             f"{w['turns']} turns of {w['turn_input']} in / {w['turn_output']} out; TTFT over turns "
             f"2..{w['turns']}",
        "s": f"(s) the seeds' prefix-caching workload: {w['conversations']} conversation(s) over "
             f"{w.get('seed_shared_context')} shared tokens, {w.get('seed_turns')} turns of "
             f"{w.get('seed_turn_input')} in / {w.get('seed_turn_output')} out, k = {w['spec_k']} synthetic "
             f"drafts (acceptance length 3.1151), float16 state; TTFT over turns 2..{w.get('seed_turns')}",
    }
    return {m: n for m, n in notes.items() if m in modes}


SMOKE_NOTE = ("CPU smoke run of the code paths: a tiny random-weight model, one OFF/ON/ON/OFF set per mode, "
              "no warm-ups. The numbers show that every path runs; they do not measure ReplaySSM's speed "
              "(`replayssm bench` on a CUDA GPU does).")


def render_markdown(doc: dict[str, Any]) -> str:
    """The table of every run, then the ratios (with their targets, except in the CPU smoke run)."""
    smoke = doc["workload"].get("smoke", False)
    lines = ["# End-to-end benchmark" + (": CPU smoke run" if smoke else ""), ""]
    if smoke:
        lines += [SMOKE_NOTE, ""]
    lines += [f"- commit `{doc['commit']}`, device {doc['device']}, {doc['versions']}",
              f"- command: `{doc['command']}`", ""]
    lines += [f"- {note}" for note in mode_notes(doc["workload"], doc["modes"]).values()]
    graphs = {(r["mode"], bool(r.get("graph_replays"))) for r in doc["rows"]}
    lines += [f"- ({m}) {'CUDA graphs replayed' if g else 'eager (no graph replays)'}"
              for m, g in sorted(graphs)]
    lines += [f"- ({r['mode']}) {r['setting']} rep {r['rep']}: graphs turned off: {r['graph_error']}"
              for r in doc["rows"] if r.get("graph_error")]
    lines += ["", "| " + " | ".join(c for c, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in doc["rows"]:
        lines.append("| " + " | ".join(f.format(r.get(c, ROW_DEFAULTS.get(c))) for c, f in COLUMNS) + " |")
    runs = doc.get("runs_by_mode") or {}
    if len({(tuple(m["commits"]), tuple(m["commands"])) for m in runs.values()}) > 1:
        lines += ["", "Rows of different commands (per mode):", ""]
        lines += [f"- ({mode}) commit {', '.join(f'`{c}`' for c in m['commits'])}; command "
                  f"{', '.join(f'`{c}`' for c in m['commands'])}" for mode, m in sorted(runs.items())]
    warm = doc.get("warmups") or []
    lines += ["", f"Untimed warm-up runs before the timed ones: {len(warm)} (not in the table)" if warm else
              "No untimed warm-up runs: rep 0 of each setting includes first-use costs"]
    if doc.get("spread_warnings"):
        lines += ["", "## Warnings: repetitions disagree", ""]
        lines += [f"- WARNING {w}" for w in doc["spread_warnings"]]
    lines += ["", "## ON/OFF (means over repetitions, OFF/ON/ON/OFF order)", ""]
    lines += _ratio_lines(doc["ratios"])
    if doc.get("dtype_ratios"):
        lines += ["", "## 16-bit state against fp32 state (ON output tok/s, means over repetitions)", ""]
        for q in doc["dtype_ratios"]:
            line = f"- ({q['mode']}) batch {q['batch']}: ON {q['state_dtype']} / ON float32: " \
                f"{q['value']:.2f}x ({q['on']:.4g} vs {q['on_float32']:.4g} tok/s)"
            if "target" in q:
                line += f"; target {q['target']}x: {'met' if q['meets_target'] else 'below target'}"
            lines.append(line)
    if doc.get("variant_ratios"):
        lines += ["", "## FP8 weights / KV against the model dtype (output tok/s, means over reps)", ""]
        lines += [f"- ({q['mode']}) batch {q['batch']} {q['setting'].upper()}: {q['variant']} / {q['base']}: "
                  f"{q['value']:.2f}x ({q['output_tok_s']:.4g} vs {q['base_output_tok_s']:.4g} tok/s)"
                  for q in doc["variant_ratios"]]
    if doc.get("ratios_rep1") and not smoke:
        lines += ["", "## Secondary view: second repetitions only (rep 1 of each setting)", "",
                  "Each setting's rep 1 runs after its rep 0; a secondary view, not the measurement above.",
                  ""]
        lines += _ratio_lines(doc["ratios_rep1"])
    return "\n".join(lines) + "\n"


def _ratio_lines(ratios: list[dict[str, Any]]) -> list[str]:
    lines = []
    for q in ratios:
        reduction = q.get("metric", RATIO_SPEC[q["mode"]][0]) == "ttft_s"
        value = f"{q['value']:.1%}" if reduction else f"{q['value']:.2f}x"
        dtype = q.get("state_dtype", "float32")
        base, _, fp8 = dtype.partition(" ")  # the variant: state dtype, then any FP8 weights / KV
        state = ("" if base == "float32" else f", {base} state") + (f", {fp8}" if fp8 else "")
        if q["mode"] == "s":
            state = ""  # (s) always runs the seeds' fp16 state (see its note)
        line = f"- ({q['mode']}) batch {q['batch']}{state}: {q['what']}: {value} (ON {q['on']:.4g}, " \
            f"OFF {q['off']:.4g})"
        if "target" in q:
            target = f"{q['target']:.0%}" if reduction else f"{q['target']}x"
            line += f"; target {target}: {'met' if q['meets_target'] else 'below target'}"
        lines.append(line + f"; peak decoding requests ON {q['peak_decoding_on']:.0f} vs OFF "
                     f"{q['peak_decoding_off']:.0f}")
    return lines


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(doc: dict[str, Any], path: Path) -> str | None:
    """Bar chart of output tok/s and TTFT per run; returns a note instead when there is none."""
    plt = _pyplot()
    if plt is None:
        return PLOT_HINT
    rows = doc["rows"]
    if not rows:
        return "no rows: no plot"
    labels = [f"{r['mode']} {r['setting']} b{r['batch']}"
              f"{'' if variant(r) == 'float32' else ' ' + variant(r)} #{r['rep']}" for r in rows]
    colors = ["tab:green" if r["setting"] == "on" else "tab:gray" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, len(rows) * 0.6), 4.5))
    panels = ((axes[0], "output_tok_s", "output tokens/s"), (axes[1], "ttft_s", "mean TTFT (s)"))
    for ax, key, title in panels:
        ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), labels, rotation=70, fontsize=7)
        ax.set_title(title)
    commits = sorted({str(r.get("commit") or doc["commit"])[:7] for r in rows})
    smoke = " (CPU smoke run)" if doc["workload"].get("smoke") else ""
    fig.suptitle(f"replayssm e2e{smoke}, {doc['device']} ({', '.join(commits)})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def plot_parts(series: dict[str, dict[str, float]], title: str, xlabel: str, path: Path) -> str | None:
    """Horizontal bars of ms per part, one bar per series (e.g. OFF and ON); a note when there is no plot."""
    plt = _pyplot()
    if plt is None:
        return PLOT_HINT
    parts = list(dict.fromkeys(p for s in series.values() for p, v in s.items() if v))
    if not parts:
        return "no parts: no plot"
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(parts) * len(series) + 1.5))
    height = 0.8 / len(series)
    for i, (name, s) in enumerate(series.items()):
        ax.barh([j + i * height for j in range(len(parts))], [s.get(p, 0.0) for p in parts], height,
                label=name)
    ax.set_yticks([j + height * (len(series) - 1) / 2 for j in range(len(parts))], parts, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and a rename: a run killed by its time limit never leaves half a file
    (the next command's --merge reads it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def assemble(meta: dict[str, Any], result: dict[str, Any], targets: dict[str, float]) -> dict[str, Any]:
    """The results document: meta, rows, ratios (means, and rep 1 only), per-mode provenance, warnings.
    The CPU smoke run (workload["smoke"]) gets neither the GPU targets nor rep-to-rep warnings: its
    runs last a fraction of a second, so their spread says nothing."""
    rows = result["rows"]
    smoke = result["workload"].get("smoke", False)
    targets = None if smoke else targets
    return {**meta, **result, "runs_by_mode": mode_runs_meta(rows), "ratios": compute_ratios(rows, targets),
            "ratios_rep1": compute_ratios([r for r in rows if r["rep"] == 1], targets),
            "dtype_ratios": dtype_ratios(rows, targets), "variant_ratios": variant_ratios(rows),
            "spread_warnings": [] if smoke else spread_warnings(rows)}


def result_stem(model_shape: str, modes: str, state_dtypes: tuple[str, ...],
                quantizations: tuple[str, ...] = ("none",),
                kv_cache_dtypes: tuple[str, ...] = ("auto",), layers: int | None = None) -> str:
    """The file name of a run's result, so each configuration keeps its own current result: e2e for
    the default (Nemotron-H 8B, fp32 state, model-dtype weights and KV), then -SHAPE for another model
    shape, -Nlayers for a --layers cut, -seeds for mode s alone, the state dtypes when they are not
    fp32 alone (e2e-fp32-fp16), the weights when not the model dtype alone (-fp8; -w16-fp8 for both)
    and likewise the KV cache (-kvfp8; -kv16-kvfp8)."""
    stem = "e2e" if model_shape == "nemotron-h-8b" else f"e2e-{model_shape}"
    if layers is not None:
        stem += f"-{layers}layers"
    if modes == "s":
        stem += "-seeds"
    elif tuple(state_dtypes) != ("float32",):
        short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
        stem += "-" + "-".join(short[d] for d in state_dtypes)
    if tuple(quantizations) != ("none",):
        stem += "-" + "-".join({"none": "w16"}.get(q, q) for q in quantizations)
    if tuple(kv_cache_dtypes) != ("auto",):
        stem += "-" + "-".join({"auto": "kv16"}.get(d, f"kv{d}") for d in kv_cache_dtypes)
    return stem


def write_results(result: dict[str, Any], out_dir: str | Path, command: list[str],
                  targets: dict[str, float], merge: bool = False, with_plot: bool = True,
                  stem: str = "e2e") -> dict[str, Any]:
    """Write {stem}.json, .md and .png under out_dir (stem: `result_stem`); return the document.

    merge: keep the rows of the modes this run did not select from an existing {stem}.json (a
    benchmark split over several commands); each row says which command produced it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = run_meta(command)
    rows = [dict(r, command=meta["command"], commit=meta["commit"]) for r in result["rows"]]
    if merge and (out / f"{stem}.json").is_file():
        old = json.loads((out / f"{stem}.json").read_text())
        rows = [r for r in old["rows"] if r["mode"] not in result["modes"]] + rows
        warmups = [x for x in old.get("warmups", []) if x["mode"] not in result["modes"]]
        modes = "".join(sorted(set(old["modes"]) | set(result["modes"])))
        result = {**result, "modes": modes, "warmups": warmups + result.get("warmups", [])}
    doc = assemble(meta, {**result, "rows": rows}, targets)
    doc["plot_note"] = plot(doc, out / f"{stem}.png") if with_plot else "plot written at the end"
    write_atomic(out / f"{stem}.json", json.dumps(doc, indent=1, default=str) + "\n")
    write_atomic(out / f"{stem}.md", render_markdown(doc))
    return doc


# ---- the step profile (benchmarks/profile_e2e.py) -------------------------------------------------


def render_profile(doc: dict[str, Any]) -> str:
    """Markdown: ms per step by part for OFF and ON, wall times, SSM bytes against bandwidth."""
    off, on = doc["settings"]
    lines = ["# Decode step profile, mode (a) shape", "",
             f"- commit `{doc['commit']}`, device {doc['device']}, command `{doc['command']}`",
             f"- batch {off['batch']}, {doc.get('workload', {}).get('prompt', '?')}-token prompts, "
             f"eager steps profiled: {off['steps']} (one ring flush per row in ON); "
             "GPU ms = sum of kernel times attributed to the part; weights "
             f"{doc.get('workload', {}).get('quantization', 'none')}, KV cache "
             f"{doc.get('workload', {}).get('kv_cache_dtype', 'auto')}", "",
             "| part | OFF ms/step | ON ms/step | OFF - ON |", "|---|---|---|---|"]
    for p in doc["parts"]:
        a, b = off["parts_us_per_step"].get(p, 0.0) / 1e3, on["parts_us_per_step"].get(p, 0.0) / 1e3
        if a or b:
            lines.append(f"| {p} | {a:.3f} | {b:.3f} | {a - b:+.3f} |")
    lines.append(f"| **GPU busy** | {off['busy_ms_per_step']:.3f} | {on['busy_ms_per_step']:.3f} | "
                 f"{off['busy_ms_per_step'] - on['busy_ms_per_step']:+.3f} |")
    for key, what in (("eager_wall_ms_per_step", "eager wall"), ("graph_wall_ms_per_step", "graph wall")):
        if key in off and key in on:
            lines.append(f"| {what} (whole engine step) | {off[key]:.3f} | {on[key]:.3f} | "
                         f"{off[key] - on[key]:+.3f} |")
    bw = doc.get("copy_bandwidth_gb_s")
    lines += ["", f"- measured device copy bandwidth: {bw:.0f} GB/s (read + write)" if bw else
              "- no device copy bandwidth (no CUDA)"]
    for s in (off, on):
        name = "ON" if s["replayssm"] else "OFF"
        gbs = s["ssm_gb_s"]
        lines.append(f"- SSM part {name}: {s['ssm_bytes_per_step'] / 1e9:.2f} GB per step modelled, "
                     + (f"{gbs:.0f} GB/s achieved" + (f" ({gbs / bw:.0%} of copy bandwidth)" if bw else "")
                        if gbs else "no SSM kernel time found"))
    for part, nbytes in off.get("weight_bytes_per_step", {}).items():
        us = [s["parts_us_per_step"].get(part, 0.0) for s in (off, on)]
        rates = ", ".join(f"{name} {nbytes / (t * 1e-6) / 1e9:.0f} GB/s"
                          for name, t in zip(("OFF", "ON"), us) if t)
        lines.append(f"- {part}: {nbytes / 1e9:.2f} GB of weights read per step; {rates or 'no kernel time'}")
    ratio = lambda k: off[k] / on[k] if on.get(k) else None  # noqa: E731
    for k, what in (("busy_ms_per_step", "GPU busy"), ("eager_wall_ms_per_step", "eager wall"),
                    ("graph_wall_ms_per_step", "graph wall")):
        if k in on and ratio(k):
            lines.append(f"- OFF/ON step time, {what}: {ratio(k):.2f}x")
    lines += ["", "Top kernels per part (us per step, OFF then ON):", ""]
    for s in (off, on):
        for p, kern in s["top_kernels_us_per_step"].items():
            lines.append(f"- {'ON' if s['replayssm'] else 'OFF'} {p}: "
                         + ", ".join(f"`{n[:60]}` {t:.0f}" for n, t in kern.items()))
    return "\n".join(lines) + "\n"


def write_doc(doc: dict[str, Any], out_dir: str | Path, meta: dict[str, Any], stem: str,
              render: Any) -> dict[str, Any]:
    """{stem}.json and {stem}.md (render(doc)) under out_dir; returns the document with its meta."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {**meta, **doc}
    write_atomic(out / f"{stem}.json", json.dumps(doc, indent=1, default=str) + "\n")
    write_atomic(out / f"{stem}.md", render(doc))
    return doc


def plot_profile(doc: dict[str, Any], path: Path) -> str | None:
    """e2e-profile.png: ms per step by part, OFF against ON."""
    off, on = doc["settings"]
    return plot_parts({"OFF": {p: v / 1e3 for p, v in off["parts_us_per_step"].items()},
                       "ON": {p: v / 1e3 for p, v in on["parts_us_per_step"].items()}},
                      f"decode step by part, batch {off['batch']}, {doc['device']} "
                      f"({str(doc['commit'])[:7]})",
                      "ms per step", path)


def write_profile(doc: dict[str, Any], out_dir: str | Path, meta: dict[str, Any],
                  stem: str = "e2e-profile") -> dict[str, Any]:
    """{stem}.{json,md,png} under out_dir (e2e-profile for the default shape and dtypes, then as
    `result_stem`); returns the document with its meta."""
    doc = write_doc(doc, out_dir, meta, stem, render_profile)
    doc["plot_note"] = plot_profile(doc, Path(out_dir) / f"{stem}.png")
    return doc


def rerender(path: Path) -> str:
    """Render the md (and png) of an e2e.json, e2e-profile.json or e2e-prefill-profile.json again."""
    doc = json.loads(path.read_text())
    if path.name.startswith("e2e-prefill-profile"):
        from replayssm.cli import _load_benchmark

        rep = _load_benchmark("report_prefill")
        text, note = rep.render(doc), rep.plot(doc, path.with_suffix(".png"))
    elif path.name.startswith("e2e-profile"):
        text, note = render_profile(doc), plot_profile(doc, path.with_suffix(".png"))
    else:
        text, note = render_markdown(doc), plot(doc, path.with_suffix(".png"))
    write_atomic(path.with_suffix(".md"), text)
    return note or f"{path.with_suffix('.md')} and .png written"


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} RESULT.json [...]  (renders its .md and .png again)")
    for arg in sys.argv[1:]:
        print(f"{arg}: {rerender(Path(arg))}")
