"""Profile of one prefix-hit prefill step of mode (c) ON (``replayssm bench --profile-prefill``).

Mode (c) ON prefills only the ~1,040 new tokens of a later turn; this shows where that step's time
goes beyond OFF's per-token rate (checkpoint states, attention over the cached context). It runs the (c) ON
engine on one conversation (shared context + turns of `turn_input` new tokens and 16 output
tokens, so a later turn prefills 1,024 + 16 tokens, as in the bench): turn 0 fills the cache,
then every later turn's first step is the prefix-hit prefill (the request's TTFT step):
    `warm` turns untimed, `timed` turns wall-timed (device synced), one turn under
    torch.profiler with labels on the engine phases (schedule + prefix match, slot copies,
    checkpoint plan, publish), the layer parts and the prefill ops (varlen conv, chunked scan,
    checkpoint states and conv windows, KV store, paged attention over the cached context).
Every kernel goes to the innermost label open at its launch (profile_e2e.attribute_events); the
document has kernels and kernel ms per part, wall ms, host ms per engine phase, and the host
syncs (calls that wait for the device) with the label they ran under. For scale, an OFF engine
prefills the same final prompt whole (timed and profiled: its kernel ms per part over all its
tokens, and per 1,040 tokens). Writes e2e-prefill-profile.{json,md,png}; runs on the CPU as well
(CPU op time stands in for kernel time there).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

PARTS = ("engine: schedule (prefix match, block hashes)", "engine: slot copies (checkpoint -> live)",
         "engine: checkpoint plan", "engine: publish + register blocks",
         "runner.execute glue (checks, inputs)",
         "embedding", "norms", "residual / casts", "mamba in/out proj GEMM", "mamba conv (varlen)",
         "mamba checkpoint conv windows", "mamba chunked scan", "mamba checkpoint states",
         "mamba gated norm", "mamba other (splits, copies)", "attention KV store",
         "attention prefill (paged, cached context)", "attention proj GEMM", "MLP", "lm_head", "sampling",
         "commit", "engine.step (rest: outputs, token read-back)", "other")
# Engine phases: top-level spans of a step, their host time is the step's host breakdown.
PHASES = PARTS[:5] + ("sampling", "commit")
# Calls that can wait for the device: syncs, and copies (a D2H or pageable copy waits; a pinned one
# does not, its time shows it).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")


def labels(engine):
    """record_function labels (PARTS) on the engine phases, layer parts and prefill ops (undone on exit)."""
    from replayssm.engine import llm_engine
    from replayssm.models.layers import attention, mamba2
    from replayssm.ops import ssd

    e2e = _load("profile_e2e")
    methods = e2e.layer_labels(engine.runner.model)
    methods += [(block.mixer, "_publish_conv_windows", "mamba checkpoint conv windows")
                for block in engine.runner.model.layers if block.kind == "mamba"]
    methods += [
        (engine, "step", "engine.step (rest: outputs, token read-back)"),
        (engine.runner, "commit", "commit"),
        (engine.runner, "execute", "runner.execute glue (checks, inputs)"),
        (engine.runner, "copy_slots", "engine: slot copies (checkpoint -> live)"),
        (engine.scheduler, "schedule", "engine: schedule (prefix match, block hashes)"),
    ]
    if engine.prefix_cache is not None:
        methods += [(engine.prefix_cache, "plan", "engine: checkpoint plan"),
                    (engine.prefix_cache, "finish", "engine: publish + register blocks")]
    functions = [
        (llm_engine, "sample_chunks", "sampling"),
        (mamba2, "causal_conv1d_varlen", "mamba conv (varlen)"),
        (mamba2, "ssd_chunked_scan", "mamba chunked scan"),
        (ssd, "_boundary_states", "mamba checkpoint states"),
        *((tssd, "launch_boundaries", "mamba checkpoint states") for tssd in _triton_ssd()),
        (mamba2, "rms_norm_gated", "mamba gated norm"),
        (attention, "store_kv", "attention KV store"),
        (attention, "paged_attention", "attention prefill (paged, cached context)"),
    ]
    return e2e.patched_labels(methods, functions)


def _triton_ssd() -> list:
    """The Triton scan module when it imports (its checkpoint launch is labelled apart from the scan)."""
    try:
        from replayssm.ops.triton import ssd as tssd
    except ImportError:  # no Triton: the reference computes the checkpoints
        return []
    return [tssd]


# Aten ops that launch no kernel of their own (views, allocation, dispatch to another op).
NO_KERNEL = {"aten::" + n for n in (
    "as_strided", "as_strided_", "view", "_unsafe_view", "_reshape_alias", "reshape", "expand", "permute",
    "transpose", "t", "select", "slice", "unsqueeze", "squeeze", "alias", "detach", "detach_", "lift_fresh",
    "empty", "empty_strided", "empty_like", "new_empty", "resize_", "flatten", "split", "split_with_sizes",
    "narrow", "unbind", "resolve_conj", "resolve_neg", "to", "_to_copy", "clone", "contiguous", "view_as",
    "scalar_tensor", "numpy_T", "chunk", "unflatten", "movedim", "result_type")}


def leaf_ops(events: list[dict]) -> list[dict]:
    """CPU ops that would launch device work: aten ops (not views or allocations) with no such op inside."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")
                  and e["name"] not in NO_KERNEL), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    leaves, stack = [], []
    for e in ops:
        while stack and (stack[-1]["tid"] != e["tid"] or stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]):
            stack.pop()
        if stack:
            stack[-1]["_parent"] = True
        stack.append(e)
    for e in ops:
        if not e.pop("_parent", False):
            leaves.append(e)
    return leaves


def summarize_trace(trace: dict) -> dict[str, Any]:
    """Kernels (count, us) and kernel-launching host ops per part, host us per engine phase, host syncs
    (count, us) per label. Without device events (CPU) the us are those of the outermost CPU ops."""
    parts: dict[str, dict[str, float]] = {}
    top: dict[str, dict[str, float]] = {}
    e2e = _load("profile_e2e")
    for part, e in e2e.attribute_events(trace, PARTS):
        part = part if part in PARTS else "other"
        p = parts.setdefault(part, {"kernels": 0, "us": 0.0, "host_ops": 0})
        p["kernels"] += 1
        p["us"] += e["dur"]
        names = top.setdefault(part, {})
        names[e["name"]] = names.get(e["name"], 0.0) + e["dur"]
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
             if e.get("cat") == "user_annotation" and e["name"] in PARTS]
    leaves = leaf_ops(events)
    for label in e2e._innermost(spans, [e["ts"] for e in leaves]):
        parts.setdefault(label, {"kernels": 0, "us": 0.0, "host_ops": 0})["host_ops"] += 1
    phases: dict[str, float] = {}
    for t0, t1, name in spans:
        if name in PHASES:  # top-level calls of a step, never nested in one another: plain sums
            phases[name] = phases.get(name, 0.0) + (t1 - t0)
    syncs = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in SYNC_CALLS]
    where = e2e._innermost(spans, [e["ts"] for e in syncs])
    sync_by: dict[str, dict[str, float]] = {}
    for label, e in zip(where, syncs):
        s = sync_by.setdefault(label, {"count": 0, "us": 0.0})
        s["count"] += 1
        s["us"] += e["dur"]
    return {"parts": parts, "top_kernels_us": {p: dict(sorted(k.items(), key=lambda x: -x[1])[:4])
                                               for p, k in top.items()},
            "phase_host_us": phases, "syncs": sync_by,
            "device_events": any(e.get("cat") == "kernel" for e in events)}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _request(engine, rid: str, prompt: list[int], max_tokens: int, profiled: bool = False) -> dict[str, Any]:
    """Submit one request and run it to the end; the steps up to its first token (its TTFT) are
    timed (device synced before and after) and, if `profiled`, run under torch.profiler with labels.
    Returns ttft_ms, ttft_steps, outputs (its token ids) and the trace summary (profiled only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from replayssm.sampling_params import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    res: dict[str, Any] = {}
    _sync()
    with contextlib.ExitStack() as stack:
        if profiled:
            stack.enter_context(labels(engine))
            prof = stack.enter_context(profile(activities=acts))
        t0, steps, first = time.perf_counter(), 0, False
        while not first:
            outs = engine.step()
            steps += 1
            first = any(o.request_id == rid and o.token_ids for o in outs)
        _sync()
        res["ttft_ms"], res["ttft_steps"] = (time.perf_counter() - t0) * 1e3, steps
    while engine.has_unfinished_requests():
        outs += engine.step()
    res["outputs"] = list(next(o for o in reversed(outs) if o.request_id == rid).token_ids)
    if profiled:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            res["profile"] = summarize_trace(json.loads(Path(path).read_text()))
    return res


def _engine(w, model_dir: str, on: bool, max_model_len: int):
    from replayssm.config import EngineConfig
    from replayssm.engine.llm_engine import LLMEngine

    kw = next(kw for mode, setting, kw, _ in _load("bench_e2e").mode_runs(w)
              if (mode, setting) == ("c", "on" if on else "off"))
    return LLMEngine(EngineConfig.from_kwargs(model_dir, **dict(kw, max_model_len=max_model_len)))


def _release(engine) -> None:
    import torch

    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_prefill_profile(w, warm: int = 1, timed: int = 2, output: int = 16, with_off: bool = True,
                        log=print, save=None) -> dict[str, Any]:
    """(c) ON: turn 0, then `warm` untimed, `timed` timed and 1 profiled prefix-hit turns; then (with_off)
    an OFF engine prefills the last turn's prompt whole, timed then profiled. Returns the document;
    save(document) runs after the ON part too, so a run cut short keeps it."""
    turns = 1 + warm + timed + 1
    max_len = w.shared_context + turns * (w.turn_input + output) + 1
    rng, vocab = random.Random("prefill-profile"), w.config["vocab_size"]
    new = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    doc: dict[str, Any] = {"parts": list(PARTS), "phases": list(PHASES), "workload": {
        "shared_context": w.shared_context, "turn_input": w.turn_input, "output": output,
        "kv_block_size": w.kv_block_size, "max_num_batched_tokens": w.max_num_batched_tokens,
        "cuda_graphs": w.cuda_graphs, "dtype": w.dtype, "hidden_size": w.config["hidden_size"],
        "num_layers": w.config["num_hidden_layers"], "warm": warm, "timed": timed}}
    turn_rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(w.config))
        engine = _engine(w, model_dir, True, max_len)
        gc.collect()
        gc.freeze()  # as in the bench: no full collection pauses inside the timed steps
        try:
            history = new(w.shared_context)
            for t in range(turns):
                history += new(w.turn_input)
                hit0 = engine.get_metrics()["prefix_cache_hit_tokens"]
                r = _request(engine, f"t{t}", list(history), output, profiled=t == turns - 1)
                hit = engine.get_metrics()["prefix_cache_hit_tokens"] - hit0
                kind = "fill" if t == 0 else "warm" if t <= warm else "timed" if t < turns - 1 else "profiled"
                turn_rows.append({"turn": t, "kind": kind, "prompt_tokens": len(history), "hit_tokens": hit,
                                  "prefilled_tokens": len(history) - hit, "ttft_ms": r["ttft_ms"],
                                  "ttft_steps": r["ttft_steps"]})
                if "profile" in r:
                    doc["on"] = r["profile"]
                history += r["outputs"]
            m = engine.get_metrics()
            doc["num_slots"], doc["num_kv_blocks"] = m["num_slots"], m["num_kv_blocks"]
        finally:
            gc.unfreeze()
        _release(engine)
        doc["turns"] = turn_rows
        timed_ms = [r["ttft_ms"] for r in turn_rows if r["kind"] == "timed"]
        log(f"prefill profile: ON prefix-hit TTFT steps {[round(v, 1) for v in timed_ms]} ms, profiled "
            f"{turn_rows[-1]['ttft_ms']:.1f} ms ({turn_rows[-1]['prefilled_tokens']} tokens after a "
            f"{turn_rows[-1]['hit_tokens']}-token hit)")
        if save is not None:
            save(doc)
        if with_off:
            prompt = history[: turn_rows[-1]["prompt_tokens"]]
            engine = _engine(w, model_dir, False, max_len)
            _request(engine, "warm", prompt[: w.turn_input], 1)  # first-use costs stay out of the timing
            timed_off = _request(engine, "timed", prompt, 1)
            r = _request(engine, "profiled", prompt, 1, profiled=True)
            doc["off"] = r["profile"]
            doc["off_run"] = {"prompt_tokens": len(prompt), "ttft_ms": timed_off["ttft_ms"],
                              "ttft_steps": timed_off["ttft_steps"], "profiled_ttft_ms": r["ttft_ms"]}
            log(f"prefill profile: OFF whole prompt of {len(prompt)} tokens: {timed_off['ttft_ms']:.1f} ms "
                f"in {timed_off['ttft_steps']} steps")
            _release(engine)
    return doc


@functools.cache
def _load(name: str):
    from replayssm.cli import _load_benchmark

    return _load_benchmark(name)
