"""`replayssm eval`: exact-answer accuracy on the demo task's held-out set, with any engine settings.

Greedy answers (stop at the newline that ends an answer), one engine for all questions; reports
accuracy with its binomial standard error, the speculative mean acceptance length and the
prefix-cache hit tokens. `few_shot=K` puts K solved training problems before every question: a
shared prefix that prefix caching can reuse.
"""

from __future__ import annotations

import math
import time
from typing import Any

from replayssm.demo_task import NUM_TEST, extract_answer, few_shot_prefix, held_out_set


def evaluate(model: str = "demo", *, limit: int | None = None, few_shot: int = 0, max_tokens: int = 96,
             log_examples: int = 0, **engine_kwargs: Any) -> dict[str, Any]:
    """Accuracy of `model` (a checkpoint directory or 'demo') on the first `limit` held-out questions
    (default: all NUM_TEST); `engine_kwargs` are LLM's (device, replayssm, state_dtype,
    enable_prefix_caching, speculative_method, num_speculative_tokens, ...). `log_examples` keeps that
    many (prompt, output, expected) triples in the result."""
    from replayssm.engine.llm import LLM
    from replayssm.sampling_params import SamplingParams

    if limit is not None and not 1 <= limit <= NUM_TEST:
        raise ValueError(f"limit must be in [1, {NUM_TEST}], got {limit}")
    if not isinstance(few_shot, int) or few_shot < 0:
        raise ValueError(f"few_shot must be an int >= 0, got {few_shot!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    problems = held_out_set()[:limit]
    prefix = few_shot_prefix(few_shot)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["\n"])
    with LLM(model, **engine_kwargs) as llm:
        start = time.perf_counter()
        outputs = llm.generate([prefix + p.prompt for p in problems], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        m = llm.get_metrics()
    answers = [extract_answer(o.text) for o in outputs]
    correct = sum(a == p.value for a, p in zip(answers, problems))
    n = len(problems)
    acc = correct / n
    steps = m.get("spec_verify_steps", 0)
    return {
        "num_questions": n,
        "correct": correct,
        "accuracy": acc,
        "stderr": math.sqrt(acc * (1 - acc) / n),
        "mean_acceptance_length": m["spec_mean_acceptance_length"] if steps else None,
        "spec_verify_steps": steps,
        "prefix_cache_hit_tokens": m["prefix_cache_hit_tokens"],
        "prefix_cache_query_tokens": m["prefix_cache_query_tokens"],
        "generation_tokens": m["generation_tokens"],
        # One character per question, "1" right / "0" wrong: paired comparisons between settings.
        "per_question": "".join("01"[a == p.value] for a, p in zip(answers, problems)),
        "elapsed_s": round(elapsed, 3),
        "few_shot": few_shot,
        "settings": {"model": model, **engine_kwargs},
        "examples": [{"prompt": p.prompt, "output": o.text, "expected": p.value}
                     for p, o in list(zip(problems, outputs))[:log_examples]],
    }


def render(result: dict[str, Any]) -> str:
    """One line: accuracy +- stderr, acceptance length, prefix hits."""
    acc = result["mean_acceptance_length"]
    return (f"accuracy {result['accuracy']:.4f} +- {result['stderr']:.4f} ({result['correct']}/"
            f"{result['num_questions']}), mean acceptance length {'-' if acc is None else f'{acc:.3f}'}, "
            f"prefix-hit tokens {result['prefix_cache_hit_tokens']}, {result['elapsed_s']:.1f} s")
