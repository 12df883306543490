"""`replayssm bench --profile-prefill`: the (c) ON prefix-hit prefill step, attributed and written."""

import json

from replayssm.cli import _load_benchmark, main


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_summarize_trace_counts_kernels_phases_and_syncs():
    """Kernels go to the innermost label at launch; phases sum their spans; syncs count where they ran."""
    prof = _load_benchmark("profile_prefill")
    scan, glue, sched = "mamba chunked scan", "runner.execute glue (checks, inputs)", prof.PARTS[0]
    trace = {"traceEvents": [
        _x("user_annotation", sched, 0, 10),
        _x("user_annotation", glue, 20, 100),
        _x("user_annotation", scan, 30, 20),
        _x("cpu_op", "aten::mul", 31, 2),
        _x("cpu_op", "aten::index", 34, 3),
        _x("cpu_op", "aten::view", 38, 1),  # a view: launches nothing
        _x("cuda_runtime", "cudaLaunchKernel", 32, 1, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 35, 1, correlation=2),
        _x("cuda_runtime", "cudaStreamSynchronize", 40, 7),
        _x("cuda_runtime", "cudaLaunchKernel", 60, 1, correlation=3),
        _x("kernel", "mul_kernel", 50, 4, tid=9, correlation=1),
        _x("kernel", "index_kernel", 55, 6, tid=9, correlation=2),
        _x("kernel", "gemm", 70, 9, tid=9, correlation=3),
    ]}
    s = prof.summarize_trace(trace)
    assert s["device_events"]
    assert s["parts"][scan] == {"kernels": 2, "us": 10, "host_ops": 2}
    assert s["parts"][glue]["kernels"] == 1 and s["parts"][glue]["us"] == 9
    assert s["phase_host_us"] == {sched: 10, glue: 100}
    assert s["syncs"] == {scan: {"count": 1, "us": 7}}


def test_prefill_profile_quick_writes_files(tmp_path, capsys):
    """CPU smoke run: later turns hit the prefix cache, prefill few tokens; ON and OFF parts are written."""
    assert main(["bench", "--quick", "--profile-prefill", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "e2e-prefill-profile.json").read_text())
    turns = doc["turns"]
    assert [t["kind"] for t in turns] == ["fill", "warm", "timed", "timed", "profiled"]
    assert turns[0]["hit_tokens"] == 0
    for t in turns[1:]:
        assert 0 < t["hit_tokens"] and t["prefilled_tokens"] < t["prompt_tokens"] and t["ttft_steps"] == 1
    for part in ("mamba chunked scan", "mamba checkpoint states", "attention prefill (paged, cached context)",
                 "engine: slot copies (checkpoint -> live)"):
        assert doc["on"]["parts"][part]["host_ops"] > 0, part
    assert doc["on"]["phase_host_us"]["engine: schedule (prefix match, block hashes)"] > 0
    assert doc["off_run"]["prompt_tokens"] == turns[-1]["prompt_tokens"]
    assert doc["off"]["parts"]["mamba chunked scan"]["us"] > 0
    md = (tmp_path / "e2e-prefill-profile.md").read_text()
    assert "| part | ON kernels | ON ms | ON host ops |" in md and "beyond OFF's per-token rate" in md
    assert "Prefix-hit prefill step profile" in capsys.readouterr().out
