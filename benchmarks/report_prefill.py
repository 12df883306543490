"""e2e-prefill-profile.{json,md,png}: the document of benchmarks/profile_prefill.py, rendered.

The md answers: how long the (c) ON prefix-hit prefill step takes (wall), how much of it the device
is busy, which parts hold the kernels (count, ms) against OFF's prefill of the same prompt scaled to
the same number of tokens, where the host spends the step (engine phases) and where it waits for
the device (sync calls).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f}"


def render(doc: dict[str, Any]) -> str:
    """Markdown of a prefill profile document (with its run meta)."""
    w, on, off = doc["workload"], doc["on"], doc.get("off")
    dev = "GPU" if on["device_events"] else "CPU op"
    last = doc["turns"][-1]
    timed = [t["ttft_ms"] for t in doc["turns"] if t["kind"] == "timed"]
    lines = ["# Prefix-hit prefill step profile, mode (c) ON", "",
             f"- commit `{doc.get('commit')}`, device {doc.get('device')}, command `{doc.get('command')}`",
             f"- one conversation: {w['shared_context']} shared tokens, turns of {w['turn_input']} new "
             f"tokens + {w['output']} output tokens; {w['num_layers']} layers, hidden {w['hidden_size']}, "
             f"{w['dtype']}, KV block {w['kv_block_size']}, prefill budget {w['max_num_batched_tokens']} "
             f"tokens; cache {doc['num_slots']} slots, {doc['num_kv_blocks']} KV blocks",
             f"- {dev} ms: kernel time attributed to the innermost label open at the kernel's launch "
             "(CPU: time of the outermost ops); host ops: aten calls that launch device work", "",
             "| turn | kind | prompt | prefix hit | prefilled | TTFT ms | steps |",
             "|---|---|---|---|---|---|---|"]
    for t in doc["turns"]:
        lines.append(f"| {t['turn']} | {t['kind']} | {t['prompt_tokens']} | {t['hit_tokens']} | "
                     f"{t['prefilled_tokens']} | {t['ttft_ms']:.1f} | {t['ttft_steps']} |")
    busy = sum(p["us"] for p in on["parts"].values())
    blocked = sum(s["us"] for s in on["syncs"].values())
    lines += ["", f"- ON prefix-hit step: timed {', '.join(f'{v:.1f}' for v in timed)} ms; profiled "
              f"{last['ttft_ms']:.1f} ms wall, {dev} busy {_ms(busy)} ms, "
              f"{sum(p['kernels'] for p in on['parts'].values())} kernels, "
              f"{sum(p['host_ops'] for p in on['parts'].values())} host ops, host in sync calls "
              f"{_ms(blocked)} ms ({sum(s['count'] for s in on['syncs'].values())} calls)"]
    scale = None
    if off is not None:
        run = doc["off_run"]
        scale = last["prefilled_tokens"] / run["prompt_tokens"]
        per = run["ttft_ms"] * scale
        lines.append(f"- OFF whole prompt ({run['prompt_tokens']} tokens, {run['ttft_steps']} steps): "
                     f"{run['ttft_ms']:.1f} ms; at its rate the ON step's {last['prefilled_tokens']} tokens "
                     "take "
                     f"{per:.1f} ms, so the ON step has {last['ttft_ms'] - per:.1f} ms (profiled) / "
                     f"{(sum(timed) / len(timed) if timed else last['ttft_ms']) - per:.1f} ms (timed) beyond "
                     "OFF's per-token rate")
    head = "| part | ON kernels | ON ms | ON host ops |"
    rule = "|---|---|---|---|"
    if off is not None:
        head += " OFF ms (whole prompt) | OFF ms x ON/OFF tokens | ON - scaled OFF ms |"
        rule += "---|---|---|"
    lines += ["", head, rule]
    for part in doc["parts"]:
        a = on["parts"].get(part)
        b = off["parts"].get(part) if off is not None else None
        if not a and not b:
            continue
        a = a or {"kernels": 0, "us": 0.0, "host_ops": 0}
        row = f"| {part} | {a['kernels']} | {_ms(a['us'])} | {a['host_ops']} |"
        if off is not None:
            ob = b["us"] if b else 0.0
            row += f" {_ms(ob)} | {_ms(ob * scale)} | {_ms(a['us'] - ob * scale)} |"
        lines.append(row)
    lines += ["", "Host ms per engine phase (inclusive; runner.execute holds the forward's launches):", "",
              "| phase | ON ms | OFF ms |", "|---|---|---|"]
    for phase in doc["phases"]:
        a = on["phase_host_us"].get(phase, 0.0)
        b = off["phase_host_us"].get(phase, 0.0) if off is not None else 0.0
        if a or b:
            lines.append(f"| {phase} | {_ms(a)} | {_ms(b)} |")
    lines += ["", "Host calls that can wait for the device (syncs and copies; a pinned H2D copy returns at "
              "once), by label:", "",
              "| label | ON calls | ON ms | OFF calls | OFF ms |", "|---|---|---|---|---|"]
    labels = list(dict.fromkeys([*on["syncs"], *((off or {}).get("syncs") or {})]))
    for label in labels:
        a = on["syncs"].get(label, {"count": 0, "us": 0.0})
        b = (off or {}).get("syncs", {}).get(label, {"count": 0, "us": 0.0})
        lines.append(f"| {label} | {a['count']} | {_ms(a['us'])} | {b['count']} | {_ms(b['us'])} |")
    if not labels:
        lines.append("| (none recorded) | | | | |")
    lines += ["", "Top kernels per part, ON (us):", ""]
    for part, kern in on["top_kernels_us"].items():
        lines.append(f"- {part}: " + ", ".join(f"`{n[:60]}` {t:.0f}" for n, t in kern.items()))
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> str | None:
    """e2e-prefill-profile.png: ms by part of the ON prefix-hit step against OFF's prefill scaled to as
    many tokens (its per-token rate)."""
    from replayssm.cli import _load_benchmark

    on, off = doc["on"], doc.get("off")
    series = {"ON prefix-hit step": {p: v["us"] / 1e3 for p, v in on["parts"].items()}}
    if off is not None:
        scale = doc["turns"][-1]["prefilled_tokens"] / doc["off_run"]["prompt_tokens"]
        series["OFF, scaled to as many tokens"] = {p: v["us"] * scale / 1e3 for p, v in off["parts"].items()}
    return _load_benchmark("report_e2e").plot_parts(
        series, f"prefix-hit prefill step by part, {doc.get('device')} ({str(doc.get('commit'))[:7]})", "ms",
        path)


def write(doc: dict[str, Any], out_dir: str | Path, meta: dict[str, Any]) -> dict[str, Any]:
    """e2e-prefill-profile.{json,md,png} under out_dir; returns the document with its meta."""
    from replayssm.cli import _load_benchmark

    doc = _load_benchmark("report_e2e").write_doc(doc, out_dir, meta, "e2e-prefill-profile", render)
    doc["plot_note"] = plot(doc, Path(out_dir) / "e2e-prefill-profile.png")
    return doc
