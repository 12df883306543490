"""Step profile of mode (a) (``replayssm bench --profile``): where a plain decode step's time goes.

For ReplaySSM OFF and ON (same engine settings as mode (a), batch 256): prefill, a few eager
warm-up steps, then over windows of `steps` decode steps (16 = W covers one ring flush per row):
    eager wall ms/step, then the same steps under torch.profiler with every kernel attributed
    to a layer part (module and op labels, innermost wins; launch time inside the label), then
    (graphs on) wall ms/step of graph replays.
The SSM part is set against its byte count (state read/write, ring, flushes) and a measured
device copy bandwidth (report_e2e.py writes e2e-profile.json and .md). Graph replays hide the
kernels from the labels, which is why the labelled steps run eagerly.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

# Labels (innermost wins) -> the parts the report splits a step into.
PARTS = ("mamba SSM (replay / state update)", "mamba conv", "mamba in/out proj GEMM", "mamba gated norm",
         "mamba other (splits, copies)", "attention (KV store + paged decode)", "attention proj GEMM",
         "MLP", "norms", "embedding", "lm_head", "sampling", "commit (conv windows, cursors)",
         "runner.execute glue (inputs, indexing)", "residual / casts", "other")


def _wrap(fn, name: str):
    from torch.profiler import record_function

    def labelled(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return labelled


def layer_labels(model) -> list[tuple[object, str, str]]:
    """(object, method, label) for the block parts every step profile labels (shared with
    profile_prefill.py): residual, norms, Mamba projections, attention projections, MLP, embedding,
    lm_head."""
    out = []
    for block in model.layers:
        out += [(block, "forward", "residual / casts"), (block.norm, "forward", "norms")]
        mixer = block.mixer
        if block.kind == "mamba":
            out += [(mixer, "forward", "mamba other (splits, copies)"),
                    (mixer.in_proj, "forward", "mamba in/out proj GEMM"),
                    (mixer.out_proj, "forward", "mamba in/out proj GEMM")]
        elif block.kind == "attention":
            out.append((mixer, "forward", "attention proj GEMM"))
        else:
            out.append((mixer, "forward", "MLP"))
    return out + [(model.embeddings, "forward", "embedding"), (model, "compute_logits", "lm_head"),
                  (model.norm_f, "forward", "norms")]


@contextlib.contextmanager
def patched_labels(methods: list[tuple[object, str, str]], functions: list[tuple[object, str, str]]):
    """Wrap each object's method (an instance attribute) and each module's function in a
    record_function label while the block runs; undone on exit."""
    attrs, patched = [], []
    for obj, attr, name in methods:
        attrs.append((obj, attr))
        setattr(obj, attr, _wrap(getattr(obj, attr), name))
    for module, attr, name in functions:
        patched.append((module, attr, getattr(module, attr)))
        setattr(module, attr, _wrap(getattr(module, attr), name))
    try:
        yield
    finally:
        for obj, attr in reversed(attrs):
            delattr(obj, attr)
        for module, attr, orig in reversed(patched):
            setattr(module, attr, orig)


def labels(engine):
    """Wrap the step's modules and ops in record_function labels named by PARTS (undone on exit)."""
    from replayssm.engine import llm_engine
    from replayssm.models.layers import attention, mamba2

    methods = layer_labels(engine.runner.model) + [
        (engine.runner, "commit", "commit (conv windows, cursors)"),
        (engine.runner, "execute", "runner.execute glue (inputs, indexing)"),
    ]
    functions = [(mamba2, name, "mamba SSM (replay / state update)")
                 for name in ("replay_forward", "selective_state_update")] + [
        (llm_engine, "sample_chunks", "sampling"),
        (mamba2, "causal_conv1d_update", "mamba conv"),
        (mamba2, "rms_norm_gated", "mamba gated norm"),
        (attention, "store_kv", "attention (KV store + paged decode)"),
        (attention, "paged_attention", "attention (KV store + paged decode)"),
    ]
    return patched_labels(methods, functions)


def attribute(trace: dict, parts: tuple[str, ...] = PARTS) -> dict[str, dict[str, float]]:
    """Chrome trace -> {part: {kernel name: total us}}: each device kernel (memcpy, memset) goes to the
    innermost label open when it was launched (its runtime or driver call with the same correlation
    id); without a launch record or a label, to the part its name says (else "other"). A trace
    without device events (CPU run) attributes the outermost CPU ops instead, at their own start.
    Threads are not told apart: the engine labels and launches from one thread."""
    out: dict[str, dict[str, float]] = {}
    for part, e in attribute_events(trace, parts):
        names = out.setdefault(part, {})
        names[e["name"]] = names.get(e["name"], 0.0) + e["dur"]
    return out


def attribute_events(trace: dict, parts: tuple[str, ...] = PARTS) -> list[tuple[str, dict]]:
    """(part, event) for every device event (or outermost CPU op without any), as `attribute` says;
    labels are the user annotations named in `parts`."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launch_at = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    if device:
        items = [(launch_at.get(e.get("args", {}).get("correlation")), e) for e in device]
    else:
        end: dict[Any, float] = {}
        items = []
        for e in sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end.get(e["tid"], float("-inf")):  # not inside another CPU op
                end[e["tid"]] = e["ts"] + e["dur"]
                items.append((e["ts"], e))
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
             if e.get("cat") == "user_annotation" and e["name"] in parts]
    launched = [(t, e) for t, e in items if t is not None]
    labels = _innermost(spans, [t for t, _ in launched]) + ["other"] * (len(items) - len(launched))
    ordered = launched + [(t, e) for t, e in items if t is None]
    return [(by_name(e["name"]) if part == "other" else part, e) for part, (_, e) in zip(labels, ordered)]


# Fallback for kernels whose launch the trace does not hold (e.g. no driver-API records).
NAME_PARTS = (("replay|ssu|selective|state_update|_weights_kernel|_out_kernel|_stream_kernel|fold", PARTS[0]),
              ("conv", PARTS[1]),
              ("paged|attention|attn", PARTS[5]))


def by_name(kernel: str) -> str:
    """The part a kernel name alone says it belongs to, else "other"."""
    import re

    return next((part for pattern, part in NAME_PARTS if re.search(pattern, kernel, re.I)), "other")


def _innermost(spans: list[tuple[float, float, str]], times: list[float]) -> list[str]:
    """For every time, the name of the innermost (properly nested) span holding it, else "other"."""
    spans = sorted(spans, key=lambda s: (s[0], -s[1]))
    order = sorted(range(len(times)), key=lambda i: times[i])
    out, stack, j = ["other"] * len(times), [], 0
    for i in order:
        t = times[i]
        while j < len(spans) and spans[j][0] <= t:
            while stack and stack[-1][1] < spans[j][0]:
                stack.pop()
            stack.append(spans[j])
            j += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        if stack:
            out[i] = stack[-1][2]
    return out


def ssm_bytes(cfg: dict, batch: int, replayssm: bool, window: int) -> float:
    """Bytes the SSM part moves per decode step (fp32 state; ring entries in bf16 with fp32 dt).

    OFF: every row's state read and written. ON: the checkpoint read every step, on average
    (W - 1) / 2 ring entries read, and a flush (read + write) every W steps.
    """
    H, P, N, G = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"]
    layers = cfg["hybrid_override_pattern"].count("M")
    state = H * P * N * 4
    if not replayssm:
        per_row = 2 * state
    else:
        entry = H * P * 2 + G * N * 2 + H * 4
        per_row = state + (window - 1) / 2 * entry + 2 * state / window
    return float(layers * batch * per_row)


def weight_bytes(model) -> dict[str, int]:
    """Bytes of the weights each GEMM part reads once per decode step (part name -> bytes)."""
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    out = {"mamba in/out proj GEMM": 0, "attention proj GEMM": 0, "MLP": 0}
    for block in model.layers:
        if block.kind == "mamba":
            out["mamba in/out proj GEMM"] += size(block.mixer.in_proj) + size(block.mixer.out_proj)
        elif block.kind == "attention":
            out["attention proj GEMM"] += size(block.mixer)
        else:
            out["MLP"] += size(block.mixer)
    head = model.lm_head if model.lm_head is not None else model.embeddings
    out["lm_head"] = head.weight.numel() * head.weight.element_size()
    return out


def copy_bandwidth() -> float | None:
    """Device-to-device copy bandwidth (read + write bytes / s) of a 2 GiB copy, None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(1 << 29, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        dst.copy_(src)
    stop.record()
    stop.synchronize()
    return 5 * 2 * src.numel() * 4 / (start.elapsed_time(stop) / 1e3)


def _timed(engine, steps: int) -> float:
    """Wall ms per engine step over `steps` steps (each step ends reading its tokens back)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def profile_setting(w, model_dir: str, replayssm: bool, steps: int, warm: int, log) -> dict[str, Any]:
    """One engine (mode (a) settings): timed eager, profiled eager, timed graph windows."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from replayssm.config import EngineConfig
    from replayssm.engine.llm_engine import LLMEngine
    from replayssm.sampling_params import SamplingParams

    total = 1 + 2 * warm + 3 * steps + 2
    kw = dict(device=w.device, dtype=w.dtype, replay_window=w.window, state_dtype="float32",
              kv_block_size=w.kv_block_size, max_num_batched_tokens=w.max_num_batched_tokens,
              load_format="dummy", cuda_graphs=w.cuda_graphs, replayssm=replayssm,
              max_num_seqs=w.decode_batch, max_model_len=w.decode_prompt + total + 1,
              quantization=None if w.quantizations[0] == "none" else w.quantizations[0],
              kv_cache_dtype=w.kv_cache_dtypes[0])
    engine = LLMEngine(EngineConfig.from_kwargs(model_dir, **kw))
    rng, vocab = random.Random(f"profile-{replayssm}"), w.config["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    for i in range(w.decode_batch):
        engine.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(w.decode_prompt)], params)
    graphs, engine.runner.graphs = engine.runner.graphs, None
    res: dict[str, Any] = {"replayssm": replayssm, "batch": w.decode_batch, "steps": steps}
    gc.collect()
    gc.freeze()  # as in the bench: no full collection pauses inside the timed windows
    res["prefill_ms"] = _timed(engine, 1)
    _timed(engine, warm)
    res["eager_wall_ms_per_step"] = _timed(engine, steps)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with labels(engine), profile(activities=acts) as prof:
        _timed(engine, steps)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        parts = attribute(json.loads(Path(path).read_text()))
    res["parts_us_per_step"] = {p: sum(k.values()) / steps for p, k in parts.items()}
    res["top_kernels_us_per_step"] = {p: dict(sorted(((n, t / steps) for n, t in k.items()),
                                                     key=lambda x: -x[1])[:4]) for p, k in parts.items()}
    res["busy_ms_per_step"] = sum(res["parts_us_per_step"].values()) / 1e3
    if graphs is not None:
        engine.runner.graphs = graphs
        _timed(engine, warm)
        res["graph_wall_ms_per_step"] = _timed(engine, steps)
        res["graph_replays"], res["graph_error"] = graphs.num_replays, graphs.error
    res["weight_bytes_per_step"] = weight_bytes(engine.runner.model)
    res["ssm_bytes_per_step"] = ssm_bytes(w.config, w.decode_batch, replayssm, w.window)
    ssm_us = res["parts_us_per_step"].get(PARTS[0], 0.0)
    res["ssm_gb_s"] = res["ssm_bytes_per_step"] / (ssm_us * 1e-6) / 1e9 if ssm_us else None
    log(f"profile: replayssm={replayssm}: eager {res['eager_wall_ms_per_step']:.2f} ms/step, GPU busy "
        f"{res['busy_ms_per_step']:.2f} ms/step, graphs {res.get('graph_wall_ms_per_step', 0):.2f} ms/step")
    del engine, graphs
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def run_profile(w, steps: int = 16, warm: int = 4, log=print) -> dict[str, Any]:
    """OFF then ON; returns the document report_e2e.write_profile writes."""
    settings = []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(w.config))
        for on in (False, True):
            settings.append(profile_setting(w, model_dir, on, steps, warm, log))
    return {"settings": settings, "parts": list(PARTS),
            "copy_bandwidth_gb_s": (bw / 1e9) if (bw := copy_bandwidth()) else None,
            "workload": {"batch": w.decode_batch, "prompt": w.decode_prompt, "window": w.window,
                         "cuda_graphs": w.cuda_graphs, "dtype": w.dtype,
                         "quantization": w.quantizations[0], "kv_cache_dtype": w.kv_cache_dtypes[0]}}
