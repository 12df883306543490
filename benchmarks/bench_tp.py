"""Tensor parallelism on one host: TP=1 vs TP=2 on the same random-weight Nemotron-H-shaped model.

    PYTHONPATH=. python3 benchmarks/bench_tp.py    # needs 2 GPUs; a few minutes on 2 x H200
    PYTHONPATH=. python3 benchmarks/bench_tp.py --smoke    # tiny model, CPU processes (gloo)

1. Writes a ~1.5B-parameter bf16 checkpoint with seeded random weights (Mamba-2, attention,
   MLP and MoE layers; no tokenizer, prompts are token ids) into a temp dir.
2. Correctness: greedy tokens of TP=1 and TP=2 in float32 (same weights upcast), 4 prompts x 32
   tokens; the first diverging position is recorded if any.
3. Throughput: bf16, ReplaySSM on, one warm-up call, then `--num-requests` requests with
   `--prompt-len` prompt and `--output-len` output tokens (ignore_eos) per TP size; output
   tokens/s from wall time. bf16 greedy tokens are compared too (informational: reduction
   order differs between TP sizes, so near-ties may flip in bf16).
Writes benchmarks/results/tp.json (commit, device, command, rows), tp.md and tp.png (with
matplotlib: the `[bench]` extra), and prints the table last; --smoke writes to a temporary directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

# The shared GPU machines forbid NVLink multicast (it can take their GPUs down); keep it off.
for _name in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

from replayssm import LLM, SamplingParams  # noqa: E402
from replayssm.demo import DEMO_CONFIG, demo_weights  # noqa: E402
from replayssm.distributed import group as tp_group  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# 5 x "M-M-M*-ME": 20 Mamba-2, 15 MLP, 5 attention, 5 MoE layers; about 1.5B parameters.
CONFIG = {
    **DEMO_CONFIG,
    "vocab_size": 32000,
    "hidden_size": 2048,
    "hybrid_override_pattern": "M-M-M*-ME" * 5,
    "num_hidden_layers": 45,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "chunk_size": 128,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 8192,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 1024,
    "moe_shared_expert_intermediate_size": 2048,
    "max_position_embeddings": 4096,
    "dtype": "bfloat16",
}


# --smoke: the same script on CPU processes (gloo) with a tiny model, to check the script itself.
SMOKE = {"hidden_size": 128, "vocab_size": 512, "mamba_num_heads": 8, "mamba_head_dim": 16,
         "ssm_state_size": 16, "n_groups": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "intermediate_size": 256, "moe_intermediate_size": 64,
         "moe_shared_expert_intermediate_size": 128, "hybrid_override_pattern": "M-M-M*-ME",
         "num_hidden_layers": 9}


def write_checkpoint(path: str, device: str, seed: int = 0) -> int:
    """config.json + model.safetensors (bf16, drawn on `device`); returns the parameter count."""
    from safetensors.torch import save_file

    weights = {k: v.to(torch.bfloat16).cpu() for k, v in demo_weights(CONFIG, seed, device).items()}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return sum(w.numel() for w in weights.values())


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, CONFIG["vocab_size"], (length,), generator=gen).tolist() for _ in range(n)]


def run(path: str, tp: int, dtype: str, batches: list[list[list[int]]], max_tokens: int,
        args: argparse.Namespace) -> tuple[list[list[int]], float]:
    """Generate every batch in order with one engine; returns the last batch's tokens and its wall time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(path, device=args.device, dtype=dtype, tensor_parallel_size=tp,
              memory_budget=args.memory_budget, max_num_seqs=args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=max(args.prompt_len, 64) + max(args.output_len, 32) + 16)
    try:
        for batch in batches:
            sync()
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            sync()
            elapsed = time.perf_counter() - start
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return [o.token_ids for o in outs], elapsed


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_divergence(a: list[list[int]], b: list[list[int]]) -> list[int] | None:
    """[request, position] of the first differing token, or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return [i, j]
    return None


def commit() -> str:
    if os.environ.get("REPLAYSSM_COMMIT"):
        return os.environ["REPLAYSSM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(record: dict, out_dir: str) -> str:
    """tp.json, tp.md and tp.png (matplotlib permitting) under out_dir; returns the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tp.json"), "w") as f:
        json.dump(record, f, indent=2)
    lines = [
        "# Tensor parallelism: TP=1 vs TP=2",
        "",
        f"commit `{record['commit']}`, {record['device']}, `{record['command']}`",
        f"model: {record['params'] / 1e9:.2f}B-parameter random-weight Nemotron-H shape "
        f"({CONFIG['hybrid_override_pattern'][:9]} x 5), bf16",
        f"greedy tokens TP=2 == TP=1 in float32: **{record['fp32_tokens_equal']}** "
        f"(first divergence: {record['fp32_first_divergence']})",
        "",
        "| tp | dtype | requests | prompt | output | seconds | output tok/s | speedup | tokens == TP=1 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = record["rows"][0]["output_tok_s"]
    for r in record["rows"]:
        lines.append(f"| {r['tp']} | {r['dtype']} | {r['requests']} | {r['prompt_len']} | "
                     f"{r['output_len']} | {r['seconds']:.2f} | {r['output_tok_s']:.0f} | "
                     f"{r['output_tok_s'] / base:.2f}x | {r['tokens_equal_tp1']} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "tp.md"), "w") as f:
        f.write(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_tp: no plot: matplotlib is not installed (pip install -e '.[bench]' adds it)",
              file=sys.stderr)
        return table
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar([f"TP={r['tp']}" for r in record["rows"]], [r["output_tok_s"] for r in record["rows"]])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{record['params'] / 1e9:.1f}B hybrid, bf16, {record['rows'][0]['requests']} requests")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "tp.png"), dpi=120)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--memory-budget", type=int, default=8 << 30, help="cache bytes per GPU")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo): checks the script")
    args = parser.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        CONFIG.update(SMOKE)
        args.num_requests, args.prompt_len, args.output_len = 4, 16, 8
    elif torch.cuda.device_count() < 2:
        print("bench_tp: needs 2 CUDA devices", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="replayssm-tp-bench-")
    try:
        params = write_checkpoint(root, args.device)
        check = [prompts(4, 64, seed=1)]
        fp32 = {tp: run(root, tp, "float32", check, 32, args)[0] for tp in (1, 2)}
        work = [prompts(4, 32, seed=2), prompts(args.num_requests, args.prompt_len, seed=3)]
        rows, ref = [], None
        dtype = "float32" if args.smoke else "bfloat16"  # gloo has no bf16 all-reduce on CPU
        for tp in (1, 2):
            tokens, seconds = run(root, tp, dtype, work, args.output_len, args)
            ref = tokens if ref is None else ref
            n = sum(len(t) for t in tokens)
            rows.append(dict(tp=tp, dtype=dtype, requests=args.num_requests, prompt_len=args.prompt_len,
                             output_len=args.output_len, output_tokens=n, seconds=seconds,
                             output_tok_s=n / seconds, tokens_equal_tp1=tokens == ref,
                             first_divergence=first_divergence(ref, tokens)))
    finally:
        tp_group.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    record = dict(
        commit=commit(),
        device="cpu (smoke)" if args.smoke else
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        command="python3 " + " ".join(sys.argv),
        params=params,
        config=CONFIG,
        fp32_tokens_equal=fp32[1] == fp32[2],
        fp32_first_divergence=first_divergence(fp32[1], fp32[2]),
        rows=rows,
    )
    # The smoke run writes next to its temp checkpoint, never over the GPU results.
    print(write_results(record, tempfile.mkdtemp(prefix="replayssm-tp-smoke-") if args.smoke else RESULTS))
    return 0 if record["fp32_tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
