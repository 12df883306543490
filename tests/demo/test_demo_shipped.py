"""`--model demo`: the packaged trained checkpoint when the package holds one, else the random one.

The tests of the trained checkpoint itself are skipped until replayssm/demo_model/ holds it
(written by `python -m replayssm.demo_train`, docs/demo.md)."""

from __future__ import annotations

import pytest
from demo_helpers import one_thread  # noqa: F401 (autouse fixture)

import replayssm.demo as demo
from replayssm.demo_eval import evaluate
from replayssm.engine.llm import LLM
from replayssm.models.config import ModelConfig
from replayssm.sampling_params import SamplingParams

SHIPPED = demo.packaged_demo()
requires_shipped = pytest.mark.skipif(
    SHIPPED is None, reason="no trained demo checkpoint in replayssm/demo_model/ (docs/demo.md says how to "
    "train and place it)")
# The README's quick-start question and the answer line the shipped model gives.
README_PROMPT = "Q: Ann has 7 pens. She buys 5 more. She gives 3 away. How many pens does Ann have now? A:"
README_ANSWER = " 7+5=12. 12-3=9. The answer is 9."


def test_demo_uses_packaged_checkpoint_when_present(tmp_path, monkeypatch):
    """demo_checkpoint() is the packaged folder once it holds model.safetensors, else the random one."""
    monkeypatch.setattr(demo, "PACKAGED_DEMO", tmp_path / "demo_model")
    random_dir = demo.demo_checkpoint(cache_dir=str(tmp_path / "cache"))
    assert random_dir.startswith(str(tmp_path / "cache"))
    (tmp_path / "demo_model").mkdir()
    (tmp_path / "demo_model" / "model.safetensors").write_bytes(b"")
    assert demo.demo_checkpoint(cache_dir=str(tmp_path / "cache")) == str(tmp_path / "demo_model")


@requires_shipped
def test_shipped_checkpoint_loads_with_its_mtp_layer():
    """The shipped checkpoint is a Nemotron-H with one MTP layer, small enough to ship (< 16 MB)."""
    import os

    cfg = ModelConfig.from_hf(SHIPPED)
    assert cfg.num_nextn_predict_layers == 1 and cfg.mtp_layer_types
    assert os.path.getsize(os.path.join(SHIPPED, "model.safetensors")) < 16 << 20


@requires_shipped
def test_shipped_answers_held_out_questions():
    """Greedy answers on the first 10 held-out questions are right (at least 9 of them), on the CPU."""
    r = evaluate("demo", limit=10, device="cpu")
    assert r["correct"] >= 9, r


@requires_shipped
def test_shipped_answers_the_readme_question():
    """`replayssm generate --model demo` answers the README's example question."""
    with LLM("demo", device="cpu") as llm:
        out = llm.generate(README_PROMPT, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0]
    assert out.text == README_ANSWER


@requires_shipped
def test_shipped_mtp_acceptance():
    """The shipped MTP head drafts with a natural mean acceptance length above 1.5 (k=3, greedy)."""
    r = evaluate("demo", limit=16, device="cpu", speculative_method="mtp", num_speculative_tokens=3)
    assert r["mean_acceptance_length"] > 1.5, r
