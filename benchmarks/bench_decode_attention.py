"""Decode and verify attention on the GPU: the Triton paged decode kernel, key splits and tiles.

Nemotron-H-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16, KV block 16). Each
case is `rows` rows of `q` new tokens over `ctx` cached keys each, the rows' blocks spread over
the pool in random order. The e2e modes' decode steps: (a) 256 rows at its start, middle and end
(64, 532, 1,032 keys), (b) verify rows (q = 4), (c) one long conversation (one row, ~13k keys),
plus smaller batches. Per case and variant: µs per call from a CUDA graph of 20 calls (median of
its replays, `bench_kernels.time_graph`), the K/V bytes read and their GB/s, and the largest
difference from the default's output ("auto": the kernel's own split choice; "splits=1": one
program per row and KV head, no key splits; "tiles N,W,S[,SPLITS]": fixed tiles).
Writes decode-attention.{json,md,png} (png with matplotlib: the `[bench]` extra) into --out.

    python3 benchmarks/bench_decode_attention.py [--tiles 64,4,3,1 ...] [--out benchmarks/results]
    python3 benchmarks/bench_decode_attention.py --report DIR/decode-attention.json   (md + png only)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_kernels import git_commit, time_graph  # noqa: E402
from report_e2e import PLOT_HINT  # noqa: E402

from replayssm.ops.triton.attention import decode_splits, paged_attention_triton  # noqa: E402

HEADS, KV_HEADS, D, BLOCK = 32, 8, 128, 16
# (rows, q, ctx): the e2e modes' steps, then smaller batches at longer contexts.
CASES = ((256, 1, 64), (256, 1, 532), (256, 1, 1032), (256, 4, 300), (512, 4, 300), (32, 1, 2048),
         (8, 1, 4096), (1, 1, 13000), (1, 4, 13000), (1, 1, 32768))
CALLS = 20


def case(rows: int, q_len: int, ctx: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache, cu_seqlens, block_tables, context_lens; every row's blocks permuted."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per = -(-ctx // BLOCK)
    blocks = rows * per + 8
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, D, generator=g, device="cuda").bfloat16()
    v_cache = torch.randn(blocks, BLOCK, KV_HEADS, D, generator=g, device="cuda").bfloat16()
    q = torch.randn(rows * q_len, HEADS, D, generator=g, device="cuda").bfloat16()
    table = torch.randperm(blocks, generator=g, device="cuda")[:rows * per].view(rows, per).int()
    cu = torch.arange(0, rows * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    ctx_t = torch.full((rows,), ctx, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, cu, table, ctx_t


def time_us(fn) -> float:
    """µs per call: `bench_kernels.time_graph` over a CUDA graph of CALLS calls (warmed outside the
    capture; median of its replays)."""
    return time_graph(lambda: [fn() for _ in range(CALLS)], CALLS)[0]


def report(path: Path) -> str:
    """decode-attention.md and .png beside a decode-attention.json: per case the variants' µs, GB/s and
    speed against the case's reference (the variant "tiles 64,4,3,1": one program per row and KV head
    at 64-key tiles and three stages, where it was timed; else "splits=1")."""
    doc = json.loads(path.read_text())
    meta, rows = doc["meta"], doc["rows"]
    cases: dict[tuple, dict] = {}
    for r in rows:
        cases.setdefault((r["rows"], r["q"], r["ctx"]), {})[r["variant"]] = r
    ref_name = "tiles 64,4,3,1" if any("tiles 64,4,3,1" in v for v in cases.values()) else "splits=1"
    md = ["# Decode / verify attention (Triton paged decode kernel)", "",
          f"- commit `{meta.get('commit', '?')}`, device {meta['device']}, command `{meta['command']}`",
          f"- Nemotron-H-8B attention: {HEADS} heads, {KV_HEADS} KV heads, head dim {D}, bf16, KV block "
          f"{BLOCK}; µs per call from CUDA graphs of {CALLS} calls; GB/s = K/V bytes read / time",
          f"- reference: `{ref_name}`; speed-up = reference µs / variant µs", "",
          "| rows | q | keys | auto splits | variant | µs | GB/s | speed-up |",
          "|---|---|---|---|---|---|---|---|"]
    bars = []
    for (b, q, ctx), variants in cases.items():
        ref = variants.get(ref_name)
        for name, r in variants.items():
            up = ref["us"] / r["us"] if ref else None
            md.append(f"| {b} | {q} | {ctx} | {r['auto_splits']} | {name} | {r['us']:.2f} | "
                      f"{r['gb_s']:.0f} | " + (f"{up:.2f}x |" if up else "- |"))
            if name == "auto" and up:
                bars.append((f"{b} rows q{q} {ctx} keys", up))
    text = "\n".join(md) + "\n"
    path.with_suffix(".md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 0.35 * len(bars) + 1.5))
        ax.barh([n for n, _ in bars], [v for _, v in bars], color="tab:green")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"speed-up of the default over `{ref_name}` (log scale)")
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=120)
        plt.close(fig)
    except ImportError:
        print(f"decode-attention: {PLOT_HINT}", file=sys.stderr)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", action="append", default=[],
                    help="BLOCK_N,num_warps,num_stages[,splits] (repeatable)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="write decode-attention.{json,md,png} there (default: benchmarks/results)")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="no timing: write the .md and .png of an existing decode-attention.json")
    args = ap.parse_args()
    if args.report:
        print(report(Path(args.report)))
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs): heads {HEADS}, KV heads {KV_HEADS}, head dim {D}, "
          f"bf16, KV block {BLOCK}", flush=True)
    rows_out = []
    for rows, q_len, ctx in CASES:
        a = case(rows, q_len, ctx)
        kw = dict(scale=D ** -0.5, max_query_len=q_len, max_context_len=ctx)
        auto = decode_splits(rows * KV_HEADS, ctx, sms)
        variants = [("auto", {}), ("splits=1", {"splits": 1})]
        for t in args.tiles:
            n, w, st, *sp = (int(v) for v in t.split(","))
            variants.append((f"tiles {t}", {"tiles": (n, w, st), **({"splits": sp[0]} if sp else {})}))
        ref = paged_attention_triton(*a, **kw).float()
        gb = rows * ctx * KV_HEADS * D * 2 * 2 / 1e9
        for name, extra in variants:
            def fn(extra=extra, a=a, kw=kw):
                return paged_attention_triton(*a, **kw, **extra)
            diff = (fn().float() - ref).abs().max().item()
            us = time_us(fn)
            row = dict(rows=rows, q=q_len, ctx=ctx, variant=name, auto_splits=auto, us=round(us, 2),
                       kv_gb=round(gb, 4), gb_s=round(gb / us * 1e6, 1), max_diff_vs_auto=diff)
            rows_out.append(row)
            print(f"rows {rows:4d} q {q_len} ctx {ctx:6d} (auto splits {auto:2d}) {name:18s} {us:9.2f} us "
                  f"{row['gb_s']:8.1f} GB/s  max diff {diff:.2e}", flush=True)
        a = ref = None
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    meta = dict(commit=git_commit(), device=torch.cuda.get_device_name(), command=" ".join(sys.argv))
    doc = json.dumps(dict(meta=meta, rows=rows_out), indent=1)
    (Path(args.out) / "decode-attention.json").write_text(doc + "\n")
    print(report(Path(args.out) / "decode-attention.json"))


if __name__ == "__main__":
    main()
