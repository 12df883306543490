"""`replayssm bench --quick`: the end-to-end benchmark's CPU smoke run and its results files."""

import json

import pytest

from replayssm.cli import main

FIELDS = ("mode", "setting", "batch", "rep", "order", "output_tok_s", "decode_tok_s_per_request", "ttft_s",
          "peak_decoding_requests", "preemptions", "prefix_hit_tokens", "acceptance_length", "wall_s")


def test_bench_quick_is_a_cpu_smoke_run(tmp_path, capsys):
    """The quick bench says it is a CPU smoke run and writes e2e.json (meta, one row per mode x rep in
    OFF/ON/ON/OFF order, no warm-ups) and e2e.md, with ON/OFF ratios but no GPU targets and no
    rep-to-rep warnings; the plot is written, or the output says which extra brings matplotlib."""
    import importlib.util

    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "e2e.json").read_text())
    for key in ("commit", "device", "command", "versions", "workload", "rows", "ratios"):
        assert key in doc, key
    assert doc["workload"]["smoke"] is True and doc["workload"]["device"] == "cpu"
    assert sorted({r["mode"] for r in doc["rows"]}) == ["a", "b", "c"]
    for mode in "abc":
        batches = sorted({r["batch"] for r in doc["rows"] if r["mode"] == mode})
        assert len(batches) == 1
        rows = sorted((r for r in doc["rows"] if r["mode"] == mode), key=lambda r: r["order"])
        assert [r["setting"] for r in rows] == ["off", "on", "on", "off"]
        for r in rows:
            assert all(f in r for f in FIELDS)
            assert r["output_tokens"] > 0 and r["output_tok_s"] > 0 and r["ttft_s"] > 0
            assert 1 <= r["peak_decoding_requests"] <= r["num_requests"]
    a = [r for r in doc["rows"] if r["mode"] == "a"]
    assert all(r["output_tokens"] == r["num_requests"] * doc["workload"]["decode_output"] for r in a)
    assert {q["mode"] for q in doc["ratios"]} == {"a", "b", "c"}
    assert all("target" not in q and "meets_target" not in q for q in doc["ratios"])
    assert doc["spread_warnings"] == [] and doc["warmups"] == []
    assert all(r["cuda_graphs"] is False and r["graph_replays"] == 0 and r["graph_error"] is None
               for r in doc["rows"])
    md = (tmp_path / "e2e.md").read_text()
    assert md.startswith("# End-to-end benchmark: CPU smoke run") and "| mode | setting |" in md
    captured = capsys.readouterr()
    assert "CPU smoke run of the code paths" in captured.err and "CPU smoke run" in captured.out
    assert "ON/OFF" in captured.out
    for text in (captured.out, captured.err, md):
        assert "target" not in text and "MISSES" not in text and "WARNING" not in text
        assert "warm-up (not recorded)" not in text and "Secondary view" not in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "e2e.png").stat().st_size > 0
    else:
        assert not (tmp_path / "e2e.png").exists()
        assert "matplotlib is not installed (pip install -e '.[bench]' adds it)" in captured.err


def _workload(smoke=False):
    import dataclasses

    from replayssm.cli import _load_benchmark

    return dataclasses.asdict(dataclasses.replace(_load_benchmark("bench_e2e").quick_workload(), smoke=smoke))


def _row(mode, setting, batch, rep, tok_s, ttft):
    return {"mode": mode, "setting": setting, "batch": batch, "rep": rep, "output_tok_s": tok_s,
            "ttft_s": ttft, "peak_decoding_requests": batch if setting == "on" else batch // 2,
            "decode_tok_s_per_request": 1.0, "preemptions": 0, "prefix_hit_tokens": 0,
            "acceptance_length": 1.0, "wall_s": 1.0}


def test_ratios_and_merge(tmp_path):
    """ON/OFF ratios average the repetitions ((c): TTFT reduction); --merge keeps other modes' rows."""
    from replayssm.cli import _load_benchmark

    report = _load_benchmark("report_e2e")
    targets = {"a": 1.45, "b": 2.2, "c": 0.88}
    first = {"rows": [_row("a", s, 8, i, t, 1.0) for s, i, t in (("off", 0, 10), ("on", 0, 16),
                                                                   ("on", 1, 14), ("off", 1, 10))],
             "modes": "a", "workload": _workload()}
    doc = report.write_results(first, tmp_path, ["replayssm", "bench"], targets)
    (a,) = doc["ratios"]
    assert a["value"] == 1.5 and a["meets_target"] and a["peak_decoding_on"] == 8
    second = {"rows": [_row("c", s, 1, i, 1.0, t) for s, i, t in (("off", 0, 2.0), ("on", 0, 0.2),
                                                                    ("on", 1, 0.2), ("off", 1, 2.0))],
              "modes": "c", "workload": _workload()}
    doc = report.write_results(second, tmp_path, ["replayssm", "bench", "--modes", "c"], targets, merge=True)
    assert [r["mode"] for r in doc["rows"]] == ["a"] * 4 + ["c"] * 4 and doc["modes"] == "ac"
    md = (tmp_path / "e2e.md").read_text()
    assert "- (a) batch 4, 5-token prompts" in md and "- (c) 2 conversation(s)" in md
    c = next(q for q in doc["ratios"] if q["mode"] == "c")
    assert abs(c["value"] - 0.9) < 1e-12 and c["meets_target"]


def test_spread_warnings_and_rep1_view(tmp_path):
    """A setting whose reps differ by > 20% (or were planned for different request counts) is flagged;
    the md shows the rep-1-only ratios as a labeled secondary view beside the means and the targets.
    The CPU smoke run's document has neither warnings nor targets for the same rows."""
    from replayssm.cli import _load_benchmark

    report = _load_benchmark("report_e2e")
    rows = [_row("a", s, 8, i, t, 1.0) for s, i, t in (("off", 0, 5), ("on", 0, 5), ("on", 1, 8),
                                                         ("off", 1, 5.5))]
    for r, fit in zip(rows, (8, 8, 8, 6)):
        r["num_requests_fit"] = fit
    targets = {"a": 1.45, "b": 2.2, "c": 0.88}
    doc = report.write_results({"rows": rows, "modes": "a", "workload": _workload()}, tmp_path,
                               ["replayssm", "bench"], targets, with_plot=False)
    assert len(doc["spread_warnings"]) == 2
    assert "(a) off batch 8: cache planned differently" in doc["spread_warnings"][0]
    assert "(a) on batch 8: output_tok_s differs by 60%" in doc["spread_warnings"][1]
    assert report.spread_warnings(rows[:2] + [dict(rows[2], output_tok_s=5.9)]) == []
    (mean,), (rep1,) = doc["ratios"], doc["ratios_rep1"]
    assert abs(mean["value"] - 6.5 / 5.25) < 1e-12 and abs(rep1["value"] - 8 / 5.5) < 1e-12
    md = (tmp_path / "e2e.md").read_text()
    assert md.index("## ON/OFF (means") < md.index("## Secondary view: second repetitions only")
    assert "WARNING (a) on batch 8" in md and "No untimed warm-up runs" in md
    assert "target 1.45x: below target" in md
    smoke = report.write_results({"rows": rows, "modes": "a", "workload": _workload(smoke=True)},
                                 tmp_path / "smoke", ["replayssm", "bench", "--quick"], targets,
                                 with_plot=False)
    assert smoke["spread_warnings"] == [] and all("target" not in q for q in smoke["ratios"])
    md = (tmp_path / "smoke" / "e2e.md").read_text()
    assert "CPU smoke run" in md and "WARNING" not in md and "target" not in md


def test_each_engine_is_released_before_the_next_is_built(monkeypatch):
    """Every engine (a graph runner holding the model runner included) is gone before the next engine is
    built, warm-up engines included: the planner sizes caches from free memory, so a live predecessor
    would shrink the next plan."""
    import dataclasses
    import weakref
    from types import SimpleNamespace

    from replayssm.cli import _load_benchmark
    from replayssm.engine import llm_engine

    bench = _load_benchmark("bench_e2e")
    runners: list = []

    class Tracked(llm_engine.LLMEngine):
        def __init__(self, config):
            assert all(ref() is None for ref in runners), "a previous engine is still alive"
            super().__init__(config)
            # Like CudaGraphRunner: holds the runner; run() -> None means "run eagerly".
            self.runner.graphs = SimpleNamespace(runner=self.runner, run=lambda batch: None, num_replays=0,
                                                 error=None)
            runners.append(weakref.ref(self.runner))

    monkeypatch.setattr(llm_engine, "LLMEngine", Tracked)
    w = dataclasses.replace(bench.quick_workload(), decode_output=3, warmup=True)
    log: list[str] = []
    doc = bench.run_benchmark(w, "a", log=log.append)
    assert len(runners) == 6 and len(doc["rows"]) == 4 and len(doc["warmups"]) == 2
    # One untimed warm-up per setting, logged before that setting's rep 0, not a row.
    for setting in ("off", "on"):
        head = f"bench: (a) {setting:3s} batch    4"
        warm = [i for i, line in enumerate(log) if line.startswith(head + " warm-up (not recorded)")]
        rep0 = [i for i, line in enumerate(log) if line.startswith(head + " rep 0:")]
        assert len(warm) == 1 and len(rep0) == 1 and warm[0] < rep0[0], setting


def test_bench_cuda_graphs_flag_reaches_the_engines(tmp_path, capsys):
    """Graphs follow the engine's default (None: wherever supported) unless the flag says otherwise:
    --no-cuda-graphs asks for eager steps; --cuda-graphs insists, so a CPU run is refused with the
    engine's reason (at the first engine's build, before any row)."""
    for flags, wanted in (([], None), (["--no-cuda-graphs"], False)):
        out = tmp_path / str(wanted)
        assert main(["bench", "--quick", "--modes", "a", "--scale", "0.5", "--out", str(out), *flags]) == 0
        doc = json.loads((out / "e2e.json").read_text())
        assert doc["workload"]["cuda_graphs"] is wanted
        assert doc["rows"] and all(r["cuda_graphs"] is False for r in doc["rows"])  # the CPU: eager
    assert main(["bench", "--quick", "--modes", "a", "--cuda-graphs", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "replayssm bench: error:" in err and "cuda_graphs" in err
    assert not (tmp_path / "e2e.json").exists() or not json.loads((tmp_path / "e2e.json").read_text())["rows"]


def test_bench_replay_stagger_flag_reaches_the_engines(tmp_path):
    """Staggered checkpoints follow the engine's default (on) unless --no-replay-stagger; rows record it."""
    for flags, wanted in (([], True), (["--no-replay-stagger"], False)):
        out = tmp_path / str(wanted)
        assert main(["bench", "--quick", "--modes", "a", "--scale", "0.5", "--out", str(out), *flags]) == 0
        doc = json.loads((out / "e2e.json").read_text())
        assert doc["rows"] and all(r["replay_stagger"] is wanted for r in doc["rows"])


def test_bench_multiturn_sizes_from_flags(tmp_path, capsys):
    """--shared-context / --turns / --turn-input / --turn-output set mode (c)'s sizes after --scale:
    the rows and the md's note carry them, and each conversation runs that many turns (one TTFT per turn
    after the first); a size below 1 is refused with a message naming the flag."""
    out = tmp_path / "c"
    assert main(["bench", "--quick", "--modes", "c", "--scale", "0.5", "--shared-context", "20",
                 "--turns", "3", "--turn-input", "5", "--turn-output", "2", "--out", str(out)]) == 0
    doc = json.loads((out / "e2e.json").read_text())
    w = doc["workload"]
    assert (w["shared_context"], w["turns"], w["turn_input"], w["turn_output"]) == (20, 3, 5, 2)
    assert len(doc["rows"]) == 4
    for r in doc["rows"]:
        assert (r["shared_context"], r["turns"], r["turn_input"], r["output_len"]) == (20, 3, 5, 2)
        n = w["conversations"] * 3
        assert r["num_requests"] == n and r["output_tokens"] == n * 2
    assert "over 20 shared tokens, 3 turns of 5 in / 2 out" in (out / "e2e.md").read_text()
    assert main(["bench", "--quick", "--modes", "c", "--turns", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--turns must be >= 1, got 0" in capsys.readouterr().err


def test_bench_quick_without_out_leaves_the_checkout_results_alone(tmp_path, capsys, monkeypatch):
    """--quick with no --out writes to a new temporary directory (named on stderr), never over the
    measured benchmarks/results of the checkout."""
    import tempfile
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "e2e.json"
    before = results.stat().st_mtime_ns if results.exists() else None
    made = tmp_path / "quick"
    plain_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        if kwargs.get("prefix") != "replayssm-bench-quick-":
            return plain_mkdtemp(*args, **kwargs)
        made.mkdir()
        return str(made)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    assert main(["bench", "--quick", "--modes", "a", "--scale", "0.5"]) == 0
    assert json.loads((made / "e2e.json").read_text())["rows"]
    assert str(made) in capsys.readouterr().err
    assert (results.stat().st_mtime_ns if results.exists() else None) == before


def test_bench_granite_model_shape(tmp_path, capsys):
    """--model-shape granite-4.0-h-small runs the modes on a toy Granite 4.0-H (its config recorded); the
    full shape builds as a 32B-parameter model; an unknown shape is refused naming the flag."""
    from replayssm.cli import _load_benchmark
    from replayssm.models.config import ModelConfig
    from replayssm.models.dummy import parameter_bytes

    assert main(["bench", "--quick", "--model-shape", "granite-4.0-h-small", "--modes", "ab",
                 "--scale", "0.5", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "e2e-granite-4.0-h-small.json").read_text())  # its own result file
    assert not (tmp_path / "e2e.json").exists()
    assert doc["workload"]["config"]["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert sorted({r["mode"] for r in doc["rows"]}) == ["a", "b"]
    assert all(r["output_tokens"] > 0 for r in doc["rows"])
    full = ModelConfig.from_hf(_load_benchmark("bench_e2e").GRANITE_4_H_SMALL)
    assert 31e9 < parameter_bytes(full) / 2 < 33e9
    assert main(["bench", "--quick", "--model-shape", "llama-7b", "--out", str(tmp_path / "x")]) == 2
    assert "--model-shape must be one of" in capsys.readouterr().err


def test_bench_qwen_model_shapes(tmp_path):
    """--model-shape qwen3.5-27b runs modes a and b on a toy Qwen3.5 (Gated DeltaNet, dummy weights) into
    its own result file; the full shapes build as the published 27B dense and 80B MoE models."""
    from replayssm.cli import _load_benchmark
    from replayssm.models.config import ModelConfig
    from replayssm.models.dummy import parameter_bytes

    assert main(["bench", "--quick", "--model-shape", "qwen3.5-27b", "--modes", "ab", "--scale", "0.5",
                 "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "e2e-qwen3.5-27b.json").read_text())
    assert doc["workload"]["config"]["architectures"] == ["Qwen3_5ForCausalLM"]
    assert sorted({r["mode"] for r in doc["rows"]}) == ["a", "b"]
    assert all(r["output_tokens"] > 0 for r in doc["rows"])
    bench = _load_benchmark("bench_e2e")
    dense = ModelConfig.from_hf(bench.QWEN3_5_27B)
    assert dense.num_gdn_layers == 48 and 26.5e9 < parameter_bytes(dense) / 2 < 27.5e9
    moe = ModelConfig.from_hf(bench.QWEN3_NEXT_80B_A3B)
    assert moe.num_experts == 512 and 79e9 < parameter_bytes(moe) / 2 < 81e9


def test_bench_quick_state_dtypes_seed_mode_and_tp(tmp_path):
    """--state-dtype float32,float16 runs mode (a) once per state dtype (ratios per dtype and ON fp16 /
    ON fp32), mode s runs the seeds' workload (fp16 state, k=3 drafts, prefix hits when ON) with TTFT
    and tok/s ratios, and every row records its state dtype and TP size (2 here, over gloo)."""
    argv = ["bench", "--quick", "--modes", "as", "--state-dtype", "float32,float16", "--tensor-parallel-size",
            "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "e2e-fp32-fp16.json").read_text())  # named by its state dtypes
    assert all(r["tensor_parallel_size"] == 2 for r in doc["rows"])
    for dtype in ("float32", "float16"):
        rows = sorted((r for r in doc["rows"] if r["mode"] == "a" and r["state_dtype"] == dtype),
                      key=lambda r: r["order"])
        assert [r["setting"] for r in rows] == ["off", "on", "on", "off"]
        assert any(q["mode"] == "a" and q["state_dtype"] == dtype for q in doc["ratios"])
    (cross,) = doc["dtype_ratios"]
    assert (cross["mode"], cross["state_dtype"]) == ("a", "float16") and cross["value"] > 0
    seed = [r for r in doc["rows"] if r["mode"] == "s"]
    assert [r["setting"] for r in seed] == ["off", "on", "on", "off"]
    assert all(r["state_dtype"] == "float16" and r["k"] == 3 and r["spec_draft_tokens"] > 0 for r in seed)
    assert all((r["prefix_hit_tokens"] > 0) == (r["setting"] == "on") for r in seed)
    assert {q["metric"] for q in doc["ratios"] if q["mode"] == "s"} == {"ttft_s", "output_tok_s"}
    md = (tmp_path / "e2e-fp32-fp16.md").read_text()
    assert "| state_dtype | tensor_parallel_size |" in md and "ON float16 / ON float32" in md
    assert "seeds' prefix-caching workload" in md


@pytest.mark.parametrize("flag", [["--state-dtype", "float32,int8"], ["--tensor-parallel-size", "0"],
                                  ["--modes", "ax"], ["--quantization", "fp8,int4"],
                                  ["--kv-cache-dtype", "fp16"], ["--quantization", "none,fp8", "--profile"]])
def test_bench_refuses_bad_flags(flag, tmp_path, capsys):
    """A bad --state-dtype, --tensor-parallel-size, --modes, --quantization or --kv-cache-dtype (or the FP8
    flags listing several settings with --profile) is a usage error naming the flag."""
    assert main(["bench", "--quick", *flag, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "replayssm bench: error:" in err and flag[0] in err
    assert not (tmp_path / "e2e.json").exists()


def test_result_stem_names_each_configuration():
    """Each configuration keeps its own current result file: the default is e2e; another model shape,
    mode s alone and non-fp32 state dtypes each add to the name."""
    from replayssm.cli import _load_benchmark

    stem = _load_benchmark("report_e2e").result_stem
    assert stem("nemotron-h-8b", "abc", ("float32",)) == "e2e"
    assert stem("granite-4.0-h-tiny", "ab", ("float32",)) == "e2e-granite-4.0-h-tiny"
    assert stem("nemotron-h-8b", "s", ("float32",)) == "e2e-seeds"
    assert stem("nemotron-h-8b", "a", ("float32", "float16")) == "e2e-fp32-fp16"
    assert stem("nemotron-3-nano-30b-a3b", "ab", ("float32",), ("fp8",)) == "e2e-nemotron-3-nano-30b-a3b-fp8"
    assert stem("nemotron-h-8b", "ab", ("float32",), ("none", "fp8"), ("auto", "fp8")) == \
        "e2e-w16-fp8-kv16-kvfp8"
    assert stem("nemotron-3-nano-30b-a3b", "a", ("float32",), ("none", "fp8"), layers=26) == \
        "e2e-nemotron-3-nano-30b-a3b-26layers-w16-fp8"


def test_first_layers_keeps_the_published_layer_mix():
    """--layers cuts the layer pattern, not just the depth: the first n pattern entries survive, and a
    count outside 1..depth is a ValueError naming the flag."""
    from replayssm.cli import _load_benchmark

    bench = _load_benchmark("bench_e2e")
    nano = bench.first_layers(bench.NEMOTRON_3_NANO, 26)
    assert nano["num_hidden_layers"] == 26
    assert nano["hybrid_override_pattern"] == bench.NEMOTRON_3_NANO["hybrid_override_pattern"][:26]
    assert {"M", "E", "*"} <= set(nano["hybrid_override_pattern"])
    granite = bench.first_layers(bench.GRANITE_4_H_TINY, 7)
    assert granite["layer_types"] == ["mamba"] * 5 + ["attention", "mamba"]
    with pytest.raises(ValueError, match="--layers"):
        bench.first_layers(bench.NEMOTRON_3_NANO, 53)


def test_bench_quick_fp8_weights_and_kv(tmp_path):
    """--quantization none,fp8 --kv-cache-dtype auto,fp8 runs modes a and b once per combination on the
    Nemotron 3 Nano shape's toy twin (FP8 experts included); every row records its weights and KV dtype,
    ON/OFF ratios stay within one combination, and each FP8 combination is compared with the model
    dtype ON and OFF; the result file is named by the shape and both lists."""
    argv = ["bench", "--quick", "--model-shape", "nemotron-3-nano-30b-a3b", "--modes", "ab", "--quantization",
            "none,fp8", "--kv-cache-dtype", "auto,fp8", "--scale", "0.5", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "e2e-nemotron-3-nano-30b-a3b-w16-fp8-kv16-kvfp8.json").read_text())
    combos = {(r["quantization"], r["kv_cache_dtype"]) for r in doc["rows"]}
    assert combos == {("none", "auto"), ("none", "fp8"), ("fp8", "auto"), ("fp8", "fp8")}
    assert all(r["output_tokens"] > 0 for r in doc["rows"])
    assert len({(q["mode"], q["state_dtype"]) for q in doc["ratios"]}) == 2 * 4
    variants = {(q["mode"], q["setting"], q["variant"]) for q in doc["variant_ratios"]}
    assert ("a", "on", "float32 fp8 weights") in variants
    assert ("b", "off", "float32 fp8 weights fp8 KV") in variants
    md = (tmp_path / "e2e-nemotron-3-nano-30b-a3b-w16-fp8-kv16-kvfp8.md").read_text()
    assert "| quantization | kv_cache_dtype |" in md and "float32 fp8 weights / float32" in md


def test_bench_profile_takes_one_weight_and_kv_setting(tmp_path, capsys):
    """--profile runs one (weights, KV cache) setting: a list of several is a usage error naming the flag,
    and --layers beyond the shape's depth is one too."""
    from replayssm.cli import main

    assert main(["bench", "--quick", "--profile", "--quantization", "none,fp8", "--out", str(tmp_path)]) == 2
    assert "--profile takes one --quantization" in capsys.readouterr().err
    assert main(["bench", "--quick", "--modes", "a", "--layers", "0", "--out", str(tmp_path)]) == 2
    assert "--layers must be in 1..6" in capsys.readouterr().err
