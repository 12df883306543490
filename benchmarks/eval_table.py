"""The demo model's accuracy table: one engine setting changed per row, all on the same held-out set.

    python3 benchmarks/eval_table.py [--model demo] [--limit N] [--few-shot 2] [--out benchmarks/results]

Rows: ReplaySSM off / on; Mamba state fp32 / fp16 / bf16 (stochastic rounding); prefix caching none /
align with a few-shot prefix shared by every question; MTP off / k=3 / k=5; and MTP k=3 with the
few-shot prefix under both cache modes. Each row reports accuracy with its binomial standard error,
and its difference from the reference row (ReplaySSM on, fp32, no prefix caching, no MTP; the
few-shot rows against the few-shot reference) with the paired standard error sqrt(b + c) / n, where
b + c counts the questions whose correctness differs between the two rows. Writes eval.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_e2e import ROOT, run_meta  # noqa: E402

from replayssm.demo_eval import evaluate  # noqa: E402

# (name, reference row (listed before it), few-shot?, engine settings)
ROWS = [
    ("reference", None, False, {}),
    ("ReplaySSM off", "reference", False, {"replayssm": False}),
    ("state fp16", "reference", False, {"state_dtype": "float16"}),
    ("state bf16", "reference", False, {"state_dtype": "bfloat16"}),
    ("MTP k=3", "reference", False, {"speculative_method": "mtp", "num_speculative_tokens": 3}),
    ("MTP k=5", "reference", False, {"speculative_method": "mtp", "num_speculative_tokens": 5}),
    ("few-shot, prefix none", None, True, {}),
    ("few-shot, prefix align", "few-shot, prefix none", True, {"enable_prefix_caching": True}),
    ("few-shot, prefix none, MTP k=3", "few-shot, prefix none", True,
     {"speculative_method": "mtp", "num_speculative_tokens": 3}),
    ("few-shot, prefix align, MTP k=3", "few-shot, prefix none", True,
     {"enable_prefix_caching": True, "speculative_method": "mtp", "num_speculative_tokens": 3}),
]


def paired(a: str, b: str) -> tuple[float, float, int]:
    """(accuracy of a - accuracy of b, its paired standard error, discordant questions)."""
    n = len(a)
    diff = (a.count("1") - b.count("1")) / n
    discordant = sum(x != y for x, y in zip(a, b))
    return diff, math.sqrt(discordant) / n, discordant


def run(model: str, limit: int | None, few_shot: int, device: str, log=print) -> list[dict]:
    rows, by_name = [], {}
    for name, ref, uses_prefix, settings in ROWS:
        r = evaluate(model, limit=limit, few_shot=few_shot if uses_prefix else 0, device=device, **settings)
        row = {"row": name, "reference": ref, **{k: v for k, v in r.items() if k != "examples"}}
        if ref is not None:
            row["diff"], row["diff_stderr"], row["discordant"] = paired(r["per_question"],
                                                                         by_name[ref]["per_question"])
        by_name[name] = row
        rows.append(row)
        log(f"eval_table: {name}: accuracy {r['accuracy']:.4f} +- {r['stderr']:.4f}, "
            f"{r['elapsed_s']:.1f} s")
    return rows


def render(doc: dict) -> str:
    m = doc["meta"]
    out = [f"# Demo model accuracy ({doc['num_questions']} held-out questions)", "",
           f"commit {m['commit']}, device {m['device']}, command `{m['command']}`", "",
           "| row | accuracy +- se | diff vs reference +- paired se (discordant) | mean acceptance length | "
           "prefix-hit tokens | time s |", "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        diff = "-" if r["reference"] is None else (
            f"{r['diff']:+.4f} +- {r['diff_stderr']:.4f} ({r['discordant']}) vs {r['reference']}")
        acc = r["mean_acceptance_length"]
        out.append(f"| {r['row']} | {r['accuracy']:.4f} +- {r['stderr']:.4f} | {diff} | "
                   f"{'-' if acc is None else f'{acc:.3f}'} | {r['prefix_cache_hit_tokens']} | "
                   f"{r['elapsed_s']:.1f} |")
    out += ["", "A difference within about two paired standard errors is sampling noise of the set size.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help="checkpoint directory or 'demo' (default: demo)")
    p.add_argument("--limit", type=int, default=None, help="first N held-out questions (default: all 500)")
    p.add_argument("--few-shot", type=int, default=2,
                   help="solved problems in the shared prefix (default: 2; with the question and answer "
                   "they fit the 512 tokens of a training row)")
    p.add_argument("--device", default="auto", help="engine device (default: auto)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results directory")
    a = p.parse_args(argv)
    command = ["python3", "benchmarks/eval_table.py", *(sys.argv[1:] if argv is None else argv)]
    rows = run(a.model, a.limit, a.few_shot, a.device)
    doc = {"meta": run_meta(command), "model": a.model, "few_shot": a.few_shot,
           "num_questions": rows[0]["num_questions"], "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "eval.md").write_text(render(doc))
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
