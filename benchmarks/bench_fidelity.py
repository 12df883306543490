"""Fidelity of 16-bit Mamba states: ``python3 benchmarks/bench_fidelity.py [--quick]``.

For each of several prompts, the reference engine (fp32 state, ReplaySSM on) generates N tokens
greedily (default 2,048). Every other engine (fp32 / fp16 / bf16 state, ReplaySSM on and off) is
then teacher-forced through that same token sequence: the prompt is one prefill, and every
generated token is fed back as a one-token decode row, so the recurrent state goes through N - 1
decode steps (and, with ReplaySSM, a ring flush every W tokens) in the engine's state dtype.
That is the path a 16-bit state changes: a prefill scans in fp32 and writes the state once.

Per (state dtype, ReplaySSM) and position t, with p the engine's log-softmax of its fp32 logits
and p_ref the reference's:

    top-1 agreement   argmax p_t == argmax p_ref_t (= the reference's token x_t)
    |d logprob|       |p_t(x_t) - p_ref_t(x_t)|

reported as means over all positions of all prompts (and over the last quarter of the positions,
where drift has had longest to build up). fp32 with ReplaySSM off is the baseline's own drift
(a different summation order of the same fp32 math): what a 16-bit state adds beyond it is the
cost of its bytes.

The engines are ModelRunners driven row by row (no scheduler): one slot and one run of KV blocks
per prompt, every prompt in every step. Model: ``--model`` takes a checkpoint directory or
``demo``; the default is the Nemotron-H-8B shape of ``replayssm bench`` with seeded random bf16
weights (``load_format="dummy"``, the same weights in every engine) on CUDA. ``--quick`` runs the
demo model on the CPU with short sequences: a smoke run of the code path, whose numbers describe
the demo model only. Results: benchmarks/results/fidelity.{json,md} (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
DUMMY_8B = "nemotron-h-8b-dummy"
# (state dtype, ReplaySSM) of every compared engine; the first is the reference.
ENGINES = (("float32", True), ("float32", False), ("float16", True), ("float16", False),
           ("bfloat16", True), ("bfloat16", False))


@dataclass(frozen=True)
class FidelityConfig:
    model: str = DUMMY_8B
    device: str = "cuda"
    dtype: str = "bfloat16"
    num_prompts: int = 4
    prompt_len: int = 64
    num_tokens: int = 2048
    window: int = 16
    kv_block_size: int = 16
    seed: int = 0


def quick_config() -> FidelityConfig:
    """The CPU smoke run: the demo model, 32 tokens at W = 4 (eight ring flushes per prompt)."""
    return FidelityConfig(model="demo", device="cpu", dtype="float32", num_prompts=2, prompt_len=12,
                          num_tokens=32, window=4, kv_block_size=4)


def model_dir(cfg: FidelityConfig, tmp: str) -> tuple[str, str]:
    """(checkpoint directory, load format): the 8B shape as a config.json with dummy weights, else the
    directory (or the demo checkpoint) with its own weights."""
    if cfg.model == DUMMY_8B:
        from replayssm.cli import _load_benchmark

        (Path(tmp) / "config.json").write_text(json.dumps(_load_benchmark("bench_e2e").NEMOTRON_H_8B))
        return tmp, "dummy"
    from replayssm.engine.runner_setup import resolve_model_dir

    return resolve_model_dir(cfg.model), "auto"


def build_runner(cfg: FidelityConfig, path: str, load_format: str, state_dtype: str, replayssm: bool):
    """A ModelRunner holding every prompt's whole sequence: one slot and one block run per prompt."""
    from replayssm.engine.model_runner import ModelRunner

    blocks = -(-(cfg.prompt_len + cfg.num_tokens) // cfg.kv_block_size)
    return ModelRunner(path, device=cfg.device, dtype=cfg.dtype, replayssm=replayssm,
                       replay_window=cfg.window, state_dtype=state_dtype,
                       num_kv_blocks=cfg.num_prompts * blocks, kv_block_size=cfg.kv_block_size,
                       num_slots=cfg.num_prompts + 1, max_num_seqs=cfg.num_prompts,
                       max_num_batched_tokens=cfg.num_prompts * cfg.prompt_len, seed=cfg.seed,
                       load_format=load_format, cuda_graphs=None)


@torch.no_grad()
def teacher_force(runner, prompts: list[list[int]], num_tokens: int, block_size: int,
                  forced: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """Prefill every prompt, then num_tokens - 1 one-token decode steps fed with forced[i][t] (None:
    the runner's own greedy argmax, which makes this the reference generation).

    Returns, each (num_prompts, num_tokens): "tokens" (the sequence fed: forced, or the argmax),
    "argmax" (the runner's argmax at each position) and "logprobs" (log-softmax of the fp32 logits
    at the fed token)."""
    from replayssm.engine.model_runner import ScheduledRow

    P = len(prompts)
    blocks = -(-(len(prompts[0]) + num_tokens) // block_size)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(P)]
    tokens, argmax, logprobs = [], [], []
    rows = [ScheduledRow(list(p), 0, tables[i], i, is_prefill=True) for i, p in enumerate(prompts)]
    for t in range(num_tokens):
        logits = runner.execute(rows)
        runner.commit(rows, [len(r.token_ids) for r in rows])
        lp = torch.log_softmax(logits.float(), dim=-1)
        best = lp.argmax(dim=-1)
        fed = best if forced is None else torch.tensor([f[t] for f in forced], device=lp.device)
        tokens.append(fed.cpu())
        argmax.append(best.cpu())
        logprobs.append(lp.gather(1, fed[:, None])[:, 0].cpu())
        start = len(prompts[0]) + t
        rows = [ScheduledRow([int(fed[i])], start, tables[i], i, is_prefill=False) for i in range(P)]
    return {k: torch.stack(v, dim=1) for k, v in (("tokens", tokens), ("argmax", argmax),
                                                    ("logprobs", logprobs))}


def compare(run: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Top-1 agreement with the reference's tokens and |d logprob| of them, overall and over the
    last quarter of the positions."""
    agree = (run["argmax"] == ref["tokens"]).double()
    delta = (run["logprobs"].double() - ref["logprobs"].double()).abs()
    tail = slice(3 * agree.shape[1] // 4, None)
    return {"top1_agreement": agree.mean().item(),
            "top1_agreement_last_quarter": agree[:, tail].mean().item(),
            "mean_abs_dlogprob": delta.mean().item(),
            "mean_abs_dlogprob_last_quarter": delta[:, tail].mean().item(),
            "max_abs_dlogprob": delta.max().item()}


def _release(runner) -> None:
    del runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_fidelity(cfg: FidelityConfig, log=print) -> dict[str, Any]:
    """The reference generation, then every engine of ENGINES teacher-forced through it."""
    with tempfile.TemporaryDirectory() as tmp:
        path, load_format = model_dir(cfg, tmp)
        from replayssm.models.config import ModelConfig

        vocab = ModelConfig.from_hf(path).vocab_size
        rng = random.Random(cfg.seed)
        prompts = [[rng.randrange(3, vocab) for _ in range(cfg.prompt_len)] for _ in range(cfg.num_prompts)]
        rows, ref = [], None
        for state_dtype, replayssm in ENGINES:
            runner = build_runner(cfg, path, load_format, state_dtype, replayssm)
            graphs = runner.graphs is not None
            run = teacher_force(runner, prompts, cfg.num_tokens, cfg.kv_block_size,
                                None if ref is None else ref["tokens"].tolist())
            replays = runner.graphs.num_replays if graphs else 0
            _release(runner)
            ref = run if ref is None else ref
            row = {"state_dtype": state_dtype, "replayssm": replayssm, "reference": run is ref,
                   "cuda_graphs": graphs, "graph_replays": replays, **compare(run, ref)}
            rows.append(row)
            log(f"fidelity: {state_dtype:8s} ReplaySSM {'on ' if replayssm else 'off'}: top-1 agreement "
                f"{row['top1_agreement']:.4f}, mean |d logprob| {row['mean_abs_dlogprob']:.3g}")
    return {"config": asdict(cfg), "prompts": len(prompts), "rows": rows}


def render(doc: dict[str, Any]) -> str:
    c = doc["config"]
    lines = ["# Fidelity of 16-bit Mamba states", "",
             f"- commit `{doc['commit']}`, device {doc['device']}, command `{doc['command']}`",
             f"- model {c['model']} ({c['dtype']} weights and activations), {c['num_prompts']} "
             f"random prompts of {c['prompt_len']} tokens, {c['num_tokens']} generated tokens each, "
             f"W = {c['window']}",
             "- reference: fp32 state, ReplaySSM on, greedy; every engine is teacher-forced through the "
             "reference tokens (prompt prefill, then one decode step per token)",
             "- top-1: the engine's argmax equals the reference token; |d lp|: the reference token's "
             "log-probability against the reference's", "",
             "| state dtype | ReplaySSM | top-1 agreement | top-1, last quarter | mean abs d lp | "
             "mean abs d lp, last quarter | max abs d lp | graphs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        name = "reference" if r["reference"] else ("on" if r["replayssm"] else "off")
        lines.append(f"| {r['state_dtype']} | {name} | {r['top1_agreement']:.4f} | "
                     f"{r['top1_agreement_last_quarter']:.4f} | {r['mean_abs_dlogprob']:.3g} | "
                     f"{r['mean_abs_dlogprob_last_quarter']:.3g} | {r['max_abs_dlogprob']:.3g} | "
                     f"{'yes' if r['graph_replays'] else 'no'} |")
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], out: str | Path, command: list[str]) -> dict[str, Any]:
    from replayssm.cli import _load_benchmark

    report = _load_benchmark("report_e2e")
    return report.write_doc(doc, out, report.run_meta(command), "fidelity", render)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run: the demo model, 2 prompts, 32 tokens, W = 4 (under a minute)")
    parser.add_argument("--model", default=None,
                        help=f"checkpoint directory, 'demo', or {DUMMY_8B} (default: {DUMMY_8B}; with "
                        "--quick demo)")
    parser.add_argument("--num-tokens", type=int, default=None,
                        help="generated tokens per prompt (default: 2048)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts (default: 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="tokens per random prompt (default: 64)")
    parser.add_argument("--replay-window", type=int, default=None,
                        help="ReplaySSM window W, also the KV block size (default: 16; with --quick 4)")
    parser.add_argument("--out", default=None,
                        help="results directory (default: benchmarks/results; with --quick a temporary one)")
    args = parser.parse_args(argv)
    cfg = quick_config() if args.quick else FidelityConfig()
    if not args.quick and not torch.cuda.is_available():
        parser.error("the full run needs CUDA; --quick runs the demo model on the CPU")
    changes = {k: v for k, v in (("model", args.model), ("num_tokens", args.num_tokens),
                                  ("num_prompts", args.num_prompts), ("prompt_len", args.prompt_len),
                                  ("window", args.replay_window), ("kv_block_size", args.replay_window))
               if v is not None}
    for flag in ("num_tokens", "num_prompts", "prompt_len", "replay_window"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    cfg = FidelityConfig(**{**asdict(cfg), **changes})
    out = args.out or (tempfile.mkdtemp(prefix="replayssm-fidelity-") if args.quick
                       else str(ROOT / "benchmarks" / "results"))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    doc = write(run_fidelity(cfg, log=log), out, ["python3", "benchmarks/bench_fidelity.py", *(argv or [])])
    print(render(doc), end="")
    log(f"fidelity: wrote {out}/fidelity.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
