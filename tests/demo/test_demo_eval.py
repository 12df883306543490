"""`replayssm eval` and demo_eval.evaluate: accuracy on the held-out set with any engine settings."""

from __future__ import annotations

import json
import math

import pytest
from demo_helpers import one_thread, toy_checkpoint  # noqa: F401 (autouse fixture)

import replayssm.engine.llm as llm_module
from replayssm.cli import main
from replayssm.demo_eval import evaluate
from replayssm.demo_task import few_shot_prefix, held_out_set

FIELDS = ("accuracy", "stderr", "correct", "num_questions", "mean_acceptance_length",
          "prefix_cache_hit_tokens")


class _Answering:
    """A stand-in LLM that answers every question right except those whose index is in `wrong`."""

    wrong: set[int] = set()
    prompts: list[str] = []

    def __init__(self, model, **kw):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def generate(self, prompts, params, use_tqdm):
        _Answering.prompts = prompts
        by_prompt = {p.prompt: p for p in held_out_set()}

        class Out:
            def __init__(self, text):
                self.text = text

        outs = []
        for i, prompt in enumerate(prompts):
            p = by_prompt[prompt.rsplit("\n", 1)[-1]]
            outs.append(Out(p.answer.replace(f"is {p.value}.", f"is {p.value + 1}.") if i in self.wrong
                            else p.answer.rstrip("\n")))
        return outs

    def get_metrics(self):
        return {"prefix_cache_hit_tokens": 0, "prefix_cache_query_tokens": 0, "generation_tokens": 0}


def test_accuracy_counts_exact_answers(monkeypatch):
    """Accuracy is the share of exact final answers, with the binomial standard error; few-shot prompts
    carry the prefix before every question."""
    monkeypatch.setattr(llm_module, "LLM", _Answering)
    _Answering.wrong = {1, 4}
    r = evaluate("unused", limit=8, few_shot=2)
    assert (r["correct"], r["num_questions"], r["accuracy"]) == (6, 8, 0.75)
    assert r["stderr"] == pytest.approx(math.sqrt(0.75 * 0.25 / 8))
    assert r["mean_acceptance_length"] is None
    assert all(p.startswith(few_shot_prefix(2)) for p in _Answering.prompts)


def test_eval_reports_acceptance_and_prefix_hits():
    """On a real engine run: MTP k=2 gives a mean acceptance length in [1, 3], and a few-shot prefix with
    prefix caching gives hit tokens."""
    r = evaluate(toy_checkpoint(), limit=3, few_shot=2, max_tokens=8, device="cpu", speculative_method="mtp",
                 num_speculative_tokens=2, enable_prefix_caching=True, max_num_seqs=1)
    assert r["num_questions"] == 3 and 0.0 <= r["accuracy"] <= 1.0
    assert 1.0 <= r["mean_acceptance_length"] <= 3.0 and r["spec_verify_steps"] > 0
    assert r["prefix_cache_hit_tokens"] >= 2 * 16


def test_cli_eval_json(capsys):
    """`replayssm eval --json` prints one JSON object with the result fields and the engine settings."""
    assert main(["eval", "--model", toy_checkpoint(), "--device", "cpu", "--limit", "2", "--max-tokens", "4",
                 "--state-dtype", "bfloat16", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert all(f in r for f in FIELDS) and r["num_questions"] == 2
    assert r["settings"]["state_dtype"] == "bfloat16"


@pytest.mark.parametrize("argv, field", [(["--limit", "0"], "limit"), (["--few-shot", "-1"], "few_shot"),
                                         (["--max-tokens", "0"], "max_tokens")])
def test_cli_eval_refuses_bad_values(argv, field, capsys):
    """A bad --limit, --few-shot or --max-tokens exits 2 with one line naming the field."""
    assert main(["eval", "--model", toy_checkpoint(), "--device", "cpu", *argv]) == 2
    assert field in capsys.readouterr().err


def test_eval_table_writes_rows_with_paired_differences(tmp_path, monkeypatch):
    """benchmarks/eval_table.py writes eval.{json,md}: one row per setting, each non-reference row with
    its difference from its reference and the paired standard error sqrt(discordant) / n."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "eval_table.py"
    spec = importlib.util.spec_from_file_location("eval_table_under_test", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    marks = {False: "1101", True: "0111"}  # per question; ReplaySSM off gets the other mark

    def fake_evaluate(model, *, limit, few_shot, device, **settings):
        per = marks[settings.get("replayssm", True) is False]
        return {"num_questions": 4, "correct": per.count("1"), "accuracy": per.count("1") / 4, "stderr": 0.2,
                "mean_acceptance_length": None, "prefix_cache_hit_tokens": 0, "elapsed_s": 0.0,
                "per_question": per, "examples": []}

    monkeypatch.setattr(table, "evaluate", fake_evaluate)
    assert table.main(["--model", "x", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "eval.json").read_text())
    rows = {r["row"]: r for r in doc["rows"]}
    assert len(rows) == len(table.ROWS) and (tmp_path / "eval.md").is_file()
    off = rows["ReplaySSM off"]
    assert (off["diff"], off["discordant"], off["diff_stderr"]) == (0.0, 2, math.sqrt(2) / 4)
    assert rows["state bf16"]["discordant"] == 0 and doc["meta"]["commit"]
