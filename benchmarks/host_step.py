"""Host (CPU-side) time of one engine decode step, split by phase: ``python3 benchmarks/host_step.py``.

Builds an LLMEngine like benchmarks/bench_e2e.py (dummy weights, fp32 state, W=16) on the CPU, with a
Nemotron-H-8B layer pattern (24 Mamba, 4 attention, 24 MLP layers) at a tiny width, so per-layer host
work (the conv-window commit runs once per Mamba layer) is counted as on the 8B while the compute
stays cheap. It admits `--batch` requests (default 256), runs until every row decodes, then times
`--steps` plain decode steps with ReplaySSM off and on. Every phase is a wrapped function timed with
perf_counter; "host" is the step wall minus the model forward and the LM head (on a GPU those run
as one CUDA-graph replay, so the host does not wait on them in Python). On the CPU the ops compute
for real; at this width their compute is small next to their Python overhead.

    python3 benchmarks/host_step.py                 # table: ms per step per phase, OFF and ON
    python3 benchmarks/host_step.py --profile on    # plus a cProfile of the ON steps (top by tottime)
    python3 benchmarks/host_step.py --tables        # block tables alone: per-row checks + nested
                                                    # torch.tensor (before) vs engine/block_tables.py

Also reported: to_device calls per step (each is torch.tensor + pin_memory + an async copy on CUDA)
and op-validation calls per step (replayssm/ops/_checks.py).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import pstats
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

# This checkout's package (or --repo's: to measure another version) and the sibling bench_e2e module.
_REPO = str(Path(__file__).resolve().parents[1])
if "--repo" in sys.argv:
    _REPO = sys.argv[sys.argv.index("--repo") + 1]
sys.path[:0] = [_REPO, str(Path(__file__).resolve().parent)]
from bench_e2e import NEMOTRON_H_8B  # noqa: E402

TINY_8B = {
    **NEMOTRON_H_8B, "vocab_size": 128, "hidden_size": 64, "mamba_num_heads": 4, "mamba_head_dim": 16,
    "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 4096, "dtype": "float32",
}
# Phases: (label, module path, attribute); each is wrapped so its time (inclusive) adds up per step.
PHASES = [
    ("schedule", "replayssm.engine.scheduler", "Scheduler.schedule"),
    ("_row", "replayssm.engine.llm_engine", "LLMEngine._row"),
    ("execute", "replayssm.engine.model_runner", "ModelRunner.execute"),
    ("  view_row", "replayssm.engine.model_runner", "view_row"),
    ("  BlockTables.tensor", "replayssm.engine.block_tables", "BlockTables.tensor"),
    ("  check_batch", "replayssm.engine.model_runner", "check_batch"),
    ("  build_inputs", "replayssm.engine.model_runner", "build_inputs"),
    ("  forward (model)", "replayssm.models.hybrid", "HybridForCausalLM.forward"),
    ("  compute_logits (model)", "replayssm.models.hybrid", "HybridForCausalLM.compute_logits"),
    ("_sample (lists + build + sample)", "replayssm.engine.llm_engine", "LLMEngine._sample"),
    ("  SamplingTensors.build", "replayssm.ops.sampling", "SamplingTensors.build"),
    ("  sample (op)", "replayssm.engine.llm_engine", "sample"),
    ("commit", "replayssm.engine.model_runner", "ModelRunner.commit"),
    # Before and after the commit moved to engine/decode_commit.py: whichever exists is wrapped.
    ("  replay_commit", "replayssm.engine.model_runner", "replay_commit"),
    ("  replay_commit", "replayssm.engine.decode_commit", "replay_commit"),
    ("    its compute (ref)", "replayssm.ops.replay", "replay_commit_ref"),
    ("  causal_conv1d_commit (all layers)", "replayssm.engine.model_runner", "causal_conv1d_commit"),
    ("  causal_conv1d_commit (all layers)", "replayssm.engine.decode_commit", "causal_conv1d_commit_layers"),
    ("    their compute (ref)", "replayssm.ops.conv1d", "causal_conv1d_commit_ref"),
    ("  decode_publications", "replayssm.engine.model_runner", "decode_publications"),
    ("  decode_publications", "replayssm.engine.decode_commit", "decode_publications"),
    ("  publish_*", "replayssm.engine.model_runner", "publish_conv_windows"),
    ("  publish_*", "replayssm.engine.model_runner", "publish_states"),
    ("  publish_*", "replayssm.engine.decode_commit", "publish_conv_windows"),
    ("  publish_*", "replayssm.engine.decode_commit", "publish_states"),
    ("  cursor mirror + rest of commit", "", ""),
    ("propose (drafts)", "replayssm.spec.decode", "SpecDecoder.propose"),
    ("verify", "replayssm.spec.decode", "SpecDecoder.verify"),
    ("  rejection_sample (op)", "replayssm.spec.decode", "rejection_sample"),
    ("append_token", "replayssm.engine.output", "OutputProcessor.append_token"),
    ("make_output", "replayssm.engine.llm_engine", "make_output"),
    ("make_output", "replayssm.engine.engine_step", "make_output"),
    ("step() itself (its loops, the rest)", "", ""),
]
TOP = ("schedule", "_row", "execute", "_sample (lists + build + sample)", "commit", "propose (drafts)",
       "verify", "append_token", "make_output")
# Host-to-device copies (each on CUDA: a tensor build, a pinned staging block, an async copy).
COUNTED = [("host-to-device copies", f"replayssm.engine.{m}", "to_device")
           for m in ("model_runner", "batch_inputs", "llm_engine", "publish", "decode_commit")]
COUNTED += [("host-to-device copies", "replayssm.engine.host_pack", "HostPack.send")]
COUNTED += [("op checks", f"replayssm.ops.{m}", n)
            for m in ("conv1d", "replay", "ssu", "attention", "norm", "moe")
            for n in ("check_tensor", "check_indices", "check_int")]
# Device work on a GPU (graph replay, Triton kernels): subtracted from the wall to get the host time.
MODEL = ("  forward (model)", "  compute_logits (model)", "    its compute (ref)", "    their compute (ref)",
         "  rejection_sample (op)")


class Timers:
    """Inclusive perf_counter time and call counts per label, for wrapped functions."""

    def __init__(self) -> None:
        self.time: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list = []

    def wrap(self, label: str, module: str, attr: str, timed: bool = True) -> None:
        import importlib

        try:
            owner = importlib.import_module(module)
        except ImportError:  # a module of the other code version (see PHASES)
            return
        *path, name = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        if name not in owner.__dict__:
            return
        raw = owner.__dict__[name]
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw

        @functools.wraps(fn)
        def timed_fn(*a, **k):
            self.calls[label] += 1
            if not timed:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.time[label] += time.perf_counter() - t0

        new = type(raw)(timed_fn) if isinstance(raw, (classmethod, staticmethod)) else timed_fn
        setattr(owner, name, new)
        self._undo.append((owner, name, raw))

    def reset(self) -> None:
        self.time.clear()
        self.calls.clear()

    def restore(self) -> None:
        for owner, name, raw in reversed(self._undo):
            setattr(owner, name, raw)
        self._undo.clear()


def run(setting: str, args, model_dir: str, profile: bool) -> dict:
    """Time `args.steps` decode steps of a `args.batch`-row engine (ReplaySSM per `setting`)."""
    from replayssm.config import EngineConfig
    from replayssm.engine.llm_engine import LLMEngine
    from replayssm.sampling_params import SamplingParams

    timers = Timers()
    for label, module, attr in PHASES:
        if module:
            timers.wrap(label, module, attr)
    for label, module, attr in COUNTED:
        timers.wrap(label, module, attr, timed=False)
    per_step = 1 + args.spec_k  # most tokens a step adds to a request
    spec = dict(num_speculative_tokens=args.spec_k, speculative_method="synthetic",
                synthetic_acceptance_length=args.acceptance) if args.spec_k else {}
    try:
        config = EngineConfig.from_kwargs(model_dir, device="cpu", dtype="float32", replayssm=setting == "on",
                                          replay_window=16, state_dtype="float32",
                                          kv_block_size=args.kv_block_size,
                                          max_num_seqs=args.batch,
                                          max_num_batched_tokens=args.batch * max(args.prompt, per_step),
                                          max_model_len=args.prompt + (args.warm + args.steps + 8) * per_step,
                                          load_format="dummy", seed=0, **spec)
        engine = LLMEngine(config)
        rng = random.Random(0)
        params = SamplingParams(temperature=args.temperature,
                                max_tokens=(args.warm + args.steps + 4) * per_step, ignore_eos=True,
                                seed=None)
        for i in range(args.batch):
            engine.add_request(f"r{i}", [rng.randrange(3, TINY_8B["vocab_size"]) for _ in range(args.prompt)],
                               params)
        for _ in range(args.warm):  # prefill, then a few decode steps (first-use costs)
            engine.step()
        assert len(engine.scheduler.running) == args.batch, "every request must be decoding"
        gc.collect()
        gc.freeze()
        timers.reset()
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        for _ in range(args.steps):
            engine.step()
        if prof is not None:
            prof.disable()
        wall = time.perf_counter() - t0
        gc.unfreeze()
    finally:
        timers.restore()
    n = args.steps
    ms = {label: timers.time[label] * 1e3 / n for label in dict.fromkeys(p[0] for p in PHASES)}
    model_ms = sum(ms[m] for m in MODEL)
    inside = ("  replay_commit", "  causal_conv1d_commit (all layers)", "  decode_publications",
              "  publish_*")
    ms["  cursor mirror + rest of commit"] = ms["commit"] - sum(ms[k] for k in inside)
    ms["step() itself (its loops, the rest)"] = wall * 1e3 / n - sum(ms[k] for k in TOP)
    out = {"setting": setting, "step_ms": wall * 1e3 / n, "host_ms": wall * 1e3 / n - model_ms, "phases": ms,
           "calls_per_step": {k: v / n for k, v in timers.calls.items()}}
    if prof is not None:
        # Host-side code only: the model's layers and ops compute on the GPU in a graph replay.
        stats = pstats.Stats(prof).sort_stats("tottime")
        stats.print_stats(r"engine/|cache/|sampling|_checks|common\.py|ops/replay|ops/conv1d",
                          args.profile_top)
    return out


def bench_tables(batch: int, steps: int = 64) -> None:
    """ms per step to turn `batch` block tables into the padded int32 tensor, range-checked: the
    pre-BlockTables way (min/max per row, torch.tensor over the padded nested lists) vs BlockTables."""
    import torch

    from replayssm.engine.block_tables import BlockTables

    rng, N = random.Random(0), 20000
    for width, grow in ((65, 1 / 16), (65, 1.0), (3, 1 / 16)):
        tables = [[rng.randrange(N) for _ in range(max(1, width - 4 + i % 4))] for i in range(batch)]
        bt, slots = BlockTables(batch, N), list(range(batch))
        bt.tensor(slots, [list(t) for t in tables])
        old = new = 0.0
        for _ in range(steps):
            for t in tables:
                if rng.random() < grow:
                    t.append(rng.randrange(N))
            rows = [list(t) for t in tables]
            t0 = time.perf_counter()
            assert all(min(t) >= 0 and max(t) < N for t in rows)
            w = max(len(t) for t in rows)
            torch.tensor([t + [-1] * (w - len(t)) for t in rows], dtype=torch.int32)
            t1 = time.perf_counter()
            bt.tensor(slots, rows)
            new += time.perf_counter() - t1
            old += t1 - t0
        print(f"{batch} rows x ~{width} blocks, {grow:.3g} of rows grow per step: per-row checks + nested "
              f"torch.tensor {old * 1e3 / steps:.3f} ms, BlockTables {new * 1e3 / steps:.3f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens per request")
    ap.add_argument("--kv-block-size", type=int, default=16,
                    help="1 with --prompt 64 gives ~70-block tables, like 1,000-token contexts at 16")
    ap.add_argument("--warm", type=int, default=6, help="untimed steps (prefill + first decodes)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (as bench_e2e)")
    ap.add_argument("--settings", default="off,on")
    ap.add_argument("--spec-k", type=int, default=0,
                    help="verify steps with K synthetic drafts (mode (b)) instead of plain decode steps")
    ap.add_argument("--acceptance", type=float, default=3.1151, help="synthetic mean acceptance length")
    ap.add_argument("--profile", default="", help="setting to run under cProfile too (off / on)")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--repo", default=_REPO, help="checkout whose replayssm package is measured")
    ap.add_argument("--tables", action="store_true", help="only the block-table microbenchmark")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    if args.spec_k and not 1.0 <= args.acceptance <= args.spec_k + 1:
        ap.error(f"--acceptance must be in [1, spec_k + 1 = {args.spec_k + 1}], got {args.acceptance}")
    import torch

    torch.set_num_threads(1)
    if args.tables:
        bench_tables(args.batch)
        return 0
    results = []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(TINY_8B))
        for s in args.settings.split(","):
            results.append(run(s, args, model_dir, profile=False))
            if args.profile == s:
                run(s, args, model_dir, profile=True)
    labels = list(dict.fromkeys(p[0] for p in PHASES))
    print(f"batch {args.batch}, {args.steps} decode steps, ms per step "
          "(inclusive; indented = inside the line above)")
    print(f"{'phase':38s}" + "".join(f"{r['setting']:>10s}" for r in results))
    for row in ("step_ms", "host_ms"):
        print(f"{row + (' (wall - device work)' if row == 'host_ms' else ' (wall)'):38s}"
              + "".join(f"{r[row]:10.2f}" for r in results))
    for label in labels:
        print(f"{label:38s}" + "".join(f"{r['phases'][label]:10.2f}" for r in results))
    for label in ("host-to-device copies", "op checks"):
        counts = "".join(f"{r['calls_per_step'].get(label, 0):10.1f}" for r in results)
        print(f"{label + ' per step':38s}" + counts)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
