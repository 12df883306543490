"""Structured output (engine/structured.py) on the random-weight demo model: outputs under a JSON
object, a JSON schema or a regex parse, validate and fullmatch, in plain decode steps and in
speculative verify steps (n-gram and synthetic drafts, k = 3); the mask and the matcher bookkeeping
in isolation."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import requires_cuda

from replayssm import LLM, SamplingParams
from replayssm.demo import demo_checkpoint
from replayssm.engine.structured import (
    StructuredOutputs,
    apply_token_bitmask,
    apply_token_bitmask_ref,
    mask_logits,
    verify_masks,
)
from replayssm.speculative.proposer import Drafts

xgrammar = pytest.importorskip("xgrammar")

PROMPTS = ["Hello there", "The answer is", "{"] * 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "blue"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{3}"
SPECS = {"json_object": {"json_object": True}, "json_schema": {"json": SCHEMA}, "regex": {"regex": REGEX}}
# The random-weight demo: its outputs wander over the whole vocabulary, so every spec is exercised
# (the trained demo answers arithmetic and rarely closes a free JSON object).
RANDOM_DEMO = demo_checkpoint(trained=False)
ENGINE = dict(device="cpu", max_model_len=256, max_num_seqs=8)


def validate(value, schema: dict) -> None:
    """Assert `value` follows `schema` (the keywords SCHEMA uses)."""
    if "enum" in schema:
        assert value in schema["enum"], value
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), value
        assert set(schema.get("required", [])) <= set(value), value
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), value
        for key, sub in schema["properties"].items():
            if key in value:
                validate(value[key], sub)
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), value
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), value
    else:
        assert kind == "boolean" and isinstance(value, bool), value


def check(kind: str, text: str) -> None:
    """The output follows the spec named `kind`."""
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
        return
    value = json.loads(text)
    assert isinstance(value, dict), text
    if kind == "json_schema":
        validate(value, SCHEMA)


def check_outputs(kind: str, outputs: list) -> None:
    """Every output follows its spec. A free JSON object's strings are unbounded, so random weights
    may run one into max_tokens: those are left out, but some outputs must be objects with keys."""
    done = [o for o in outputs if kind != "json_object" or o.finish_reason == "stop"]
    for out in done:
        assert out.finish_reason == "stop", out.text
        check(kind, out.text)
    if kind == "json_object":
        assert any(json.loads(o.text) for o in done), [o.text for o in outputs]


def _follows(kind: str, text: str) -> bool:
    try:
        check(kind, text)
    except (AssertionError, ValueError):
        return False
    return True


def params(kind: str | None, temperature: float, seed: int = 0) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=200,
                           structured=SPECS[kind] if kind else None) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def llm():
    return LLM(RANDOM_DEMO, **ENGINE)


@pytest.fixture(scope="module", params=["ngram", "synthetic"])
def spec_llm(request):
    kw = dict(num_speculative_tokens=3, speculative_method=request.param)
    if request.param == "synthetic":
        kw.update(synthetic_acceptance_length=3.0)
    return LLM(RANDOM_DEMO, **ENGINE, **kw)


# Greedy free JSON objects from random weights run their first string into max_tokens: sampled only.
@pytest.mark.parametrize("kind,temperature", [("json_schema", 0.0), ("json_schema", 1.0), ("regex", 0.0),
                                              ("regex", 1.0), ("json_object", 1.0)])
def test_plain_outputs_follow_the_spec(llm, kind, temperature):
    """Greedy and sampled outputs under each spec finish with "stop" and parse / validate / fullmatch."""
    check_outputs(kind, llm.generate(PROMPTS, params(kind, temperature), use_tqdm=False))


def test_without_the_mask_outputs_do_not_parse(llm):
    """The same requests without a spec produce text that is neither JSON nor a regex match."""
    for out in llm.generate(PROMPTS, params(None, 1.0), use_tqdm=False):
        with pytest.raises(json.JSONDecodeError):
            json.loads(out.text)
        assert not re.fullmatch(REGEX, out.text)


@pytest.mark.parametrize("kind", list(SPECS))
def test_speculative_outputs_follow_the_spec(spec_llm, kind):
    """With n-gram or synthetic drafts (k = 3), sampled outputs under each spec parse / validate /
    fullmatch: refused drafts are rejected, the bonus and corrected tokens are masked."""
    before = spec_llm.get_metrics()["spec_draft_tokens"]
    check_outputs(kind, spec_llm.generate(PROMPTS, params(kind, 1.0), use_tqdm=False))
    assert spec_llm.get_metrics()["spec_draft_tokens"] > before  # verify steps did run


@pytest.mark.parametrize("interleave", [False, True])
def test_speculative_greedy_equals_plain_greedy(llm, interleave):
    """Greedy structured decoding with n-gram drafts emits exactly plain greedy structured decoding's
    tokens (the verify masks follow the drafts and roll back), also with two interleaved request
    groups whose verify steps read back one turn later."""
    spec = LLM(RANDOM_DEMO, **ENGINE, num_speculative_tokens=3, speculative_method="ngram",
               async_scheduling=interleave)
    assert spec.engine.interleave == interleave
    for kind in ("json_schema", "regex"):
        got = spec.generate(PROMPTS, params(kind, 0.0), use_tqdm=False)
        want = llm.generate(PROMPTS, params(kind, 0.0), use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.get_metrics()["spec_accepted_tokens"] > 0


def test_async_scheduling_mixed_batch(llm):
    """With async scheduling, structured and free rows share steps: structured outputs follow their
    spec, and every output equals a synchronous run's."""
    mixed = params("json_schema", 1.0) + params(None, 1.0, seed=10)
    prompts = PROMPTS + PROMPTS
    sync = llm.generate(prompts, mixed, use_tqdm=False)
    fast = LLM(RANDOM_DEMO, **ENGINE, async_scheduling=True)
    got = fast.generate(prompts, mixed, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in sync]
    check_outputs("json_schema", got[: len(PROMPTS)])


def test_grammar_end_finishes_with_ignore_eos(llm):
    """A grammar that has ended finishes its request ("stop") even with ignore_eos."""
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, structured={"regex": "ab|cd"})
    out = llm.generate("x", sp, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text in ("ab", "cd")
    assert len(out.token_ids) == 3  # two characters and the end-of-sequence token


@pytest.mark.parametrize("spec,match", [
    ({"regex": "((("}, "invalid regex"),
    ({"json": {"type": 5}}, "invalid JSON schema"),
    ({"json_object": False}, "json_object"),
    ({"xml": "<a/>"}, "exactly one key"),
    ({"json": "{not json"}, "not valid JSON"),
])
def test_bad_specs_are_value_errors(llm, spec, match):
    """A malformed spec or a schema / regex the compiler refuses is a ValueError; nothing is added."""
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS, SamplingParams(structured=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_apply_token_bitmask_matches_references():
    """The mask sets exactly the tokens whose bit is 0 to -inf: equal to a per-token loop and to
    xgrammar's own apply_token_bitmask_inplace, with a vocabulary that is not a multiple of 32."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 77, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 3), generator=gen, dtype=torch.int32)
    got = apply_token_bitmask(logits, bitmask)
    assert torch.equal(got, apply_token_bitmask_ref(logits, bitmask))
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(got, theirs)


def test_rows_without_grammar_cost_nothing(llm):
    """mask_logits returns the very logits tensor when no request has a grammar, and masks only the
    structured rows otherwise."""

    class Req:
        def __init__(self, grammar=None):
            self.grammar = grammar

    logits = torch.randn(3, 100)
    assert mask_logits(logits, [Req(), Req(), Req()]) is logits
    matcher = llm.engine.structured.matcher({"regex": "q"})
    masked = mask_logits(logits, [Req(), Req(matcher), Req()])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    q = llm.tokenizer.encode("q", add_special_tokens=False)[0]
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [q]


def test_verify_masks_follow_drafts_and_roll_back(llm):
    """Position j's mask is the grammar's state after drafts[:j]; a refused draft stops the walk
    (num_valid) and later positions repeat its mask; the matcher ends where it started."""
    structured: StructuredOutputs = llm.engine.structured
    enc = lambda s: llm.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731

    class Req:
        grammar = structured.matcher({"regex": "abc"})

    r = Req()
    assert r.grammar.accept_token(enc("a")[0])
    masks = verify_masks([r], [Drafts(enc("bz") + [0])], K=3, vocab_size=100)
    assert masks.num_valid == [1]  # "b" is allowed, "z" is not
    allowed = [[t for t in range(100) if (int(masks.bitmask[j, t // 32]) >> (t % 32)) & 1] for j in range(4)]
    assert allowed[:3] == [enc("b"), enc("c"), enc("c")] and allowed[3] == allowed[2]
    # Back at "a": the matcher accepts "b", "c" and then only the end-of-sequence token.
    assert r.grammar.accept_token(enc("b")[0]) and r.grammar.accept_token(enc("c")[0])
    assert r.grammar.accept_token(2) and r.grammar.is_terminated()


@pytest.mark.gpu
@requires_cuda
def test_cuda_plain_and_interleaved_speculative():
    """On CUDA (async scheduling, graph replay): structured outputs follow their spec beside free rows,
    plain and with interleaved n-gram verify steps, and free rows alone still launch steps ahead. (That
    free rows keep their own tokens beside structured ones is checked on the CPU: on the GPU a row's
    logits move in the last bits with the batch's size, which can change a sampled token.)"""
    kw = dict(ENGINE, device="cuda", cuda_graphs=True)
    plain = LLM(RANDOM_DEMO, **kw)
    spec = LLM(RANDOM_DEMO, **kw, num_speculative_tokens=3, speculative_method="ngram")
    assert plain.engine.async_scheduling and spec.engine.interleave
    for llm in (plain, spec):
        llm.generate(PROMPTS, params(None, 1.0, seed=10), use_tqdm=False)  # alone: steps launch ahead
        for kind, temperature in (("json_schema", 0.0), ("regex", 1.0)):  # json_object: on the CPU
            outs = llm.generate(PROMPTS * 2, params(kind, temperature) + params(None, 1.0, seed=10),
                                use_tqdm=False)
            check_outputs(kind, outs[: len(PROMPTS)])
            mixed = outs[len(PROMPTS):]  # free rows beside structured ones: no grammar reaches them
            assert any(o.finish_reason != "stop" for o in mixed) or not all(
                _follows(kind, o.text) for o in mixed), [o.text for o in mixed]
    assert plain.get_metrics()["num_ahead_steps"] > 0


def test_grammar_end_token_text_is_left_out():
    """The trained demo ends lines with a printable end-of-sequence token ("\\n"); a grammar that ends
    on it finishes with "stop" and, as for any eos, its text is not in the output (ignore_eos too)."""
    llm = LLM("demo", **ENGINE)
    eos_texts = {llm.engine.tokenizer.decode([t]) for t in llm.engine.output.eos_token_ids}
    assert "\n" in eos_texts  # the property needs a printable end-of-sequence token
    outs = llm.generate(["Q: Ann has 7 pens. How many pens does Ann have? A:"] * 4,
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True,
                                        structured=SPECS["regex"]) for i in range(4)])
    for out in outs:
        assert out.finish_reason == "stop"
        assert re.fullmatch(REGEX, out.text), out.text
