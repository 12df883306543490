"""benchmarks/bench_fidelity.py: teacher forcing through decode steps, and its CPU quick run."""

import json

import torch

from replayssm import LLM, SamplingParams
from replayssm.cli import _load_benchmark


def test_teacher_forced_decode_logprobs_equal_prefill_prompt_logprobs():
    """Feeding a forced sequence one decode step at a time (fp32 state, ReplaySSM on, ring flushes)
    scores every forced token as the prefill of the whole sequence does (prompt_logprobs), and the
    runner's own argmax is reported beside it."""
    fid = _load_benchmark("bench_fidelity")
    cfg = fid.FidelityConfig(**{**fid.asdict(fid.quick_config()), "num_prompts": 2, "num_tokens": 14})
    path, load_format = fid.model_dir(cfg, "")
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, 40, (2, cfg.prompt_len), generator=g).tolist()
    forced = torch.randint(3, 40, (2, cfg.num_tokens), generator=g).tolist()  # not the model's choices
    runner = fid.build_runner(cfg, path, load_format, "float32", True)
    run = fid.teacher_force(runner, prompts, cfg.num_tokens, cfg.kv_block_size, forced)
    assert run["tokens"].tolist() == forced
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    with LLM("demo", device="cpu", dtype="float32") as llm:
        outs = llm.generate([p + f for p, f in zip(prompts, forced)], params, use_tqdm=False)
    for i, out in enumerate(outs):
        ref = torch.tensor(out.prompt_logprobs[cfg.prompt_len:])
        torch.testing.assert_close(run["logprobs"][i], ref, rtol=0, atol=1e-4)
    assert not torch.equal(run["argmax"], run["tokens"])


def test_fidelity_quick_run_writes_the_table(tmp_path, capsys):
    """--quick writes fidelity.{json,md}: the fp32 ReplaySSM-on reference agrees with itself exactly,
    every other engine is scored against it, and the 16-bit states move the logprobs (their bytes
    reach the decode path) while fp32 with ReplaySSM off stays within fp32 rounding."""
    fid = _load_benchmark("bench_fidelity")
    assert fid.main(["--quick", "--num-tokens", "20", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "fidelity.json").read_text())
    rows = {(r["state_dtype"], r["replayssm"]): r for r in doc["rows"]}
    assert set(rows) == set(fid.ENGINES) and doc["rows"][0]["reference"]
    ref = rows[("float32", True)]
    assert ref["top1_agreement"] == 1.0 and ref["max_abs_dlogprob"] == 0.0
    assert all(0.0 <= r["top1_agreement"] <= 1.0 for r in doc["rows"])
    fp32_drift = rows[("float32", False)]["mean_abs_dlogprob"]
    assert fp32_drift < 1e-4
    for dtype in ("float16", "bfloat16"):
        assert all(rows[(dtype, on)]["mean_abs_dlogprob"] > fp32_drift for on in (True, False))
    md = (tmp_path / "fidelity.md").read_text()
    assert md.startswith("# Fidelity of 16-bit Mamba states") and "| bfloat16 | off |" in md
    assert "| float32 | reference |" in capsys.readouterr().out
