"""`replayssm bench --profile`: kernels attributed to layer parts; the CPU smoke run writes its files."""

import json
from pathlib import Path

from replayssm.cli import _load_benchmark, main


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_attribute_innermost_label_at_launch():
    """A kernel goes to the innermost label open at its launch; unknown launches fall back to its name."""
    prof = _load_benchmark("profile_e2e")
    ssm, other = prof.PARTS[0], "mamba other (splits, copies)"
    trace = {"traceEvents": [
        _x("user_annotation", "residual / casts", 0, 100),
        _x("user_annotation", other, 10, 50),
        _x("user_annotation", ssm, 20, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 22, 1, correlation=7),  # inside ssm
        _x("cuda_driver", "cuLaunchKernel", 40, 1, correlation=8),  # mixer, after the ssm label closed
        _x("cuda_runtime", "cudaLaunchKernel", 90, 1, correlation=9),  # block only
        _x("cuda_runtime", "cudaLaunchKernel", 200, 1, correlation=10),  # no label
        _x("kernel", "_ssu_kernel", 300, 40, tid=7, correlation=7),
        _x("kernel", "copy_kernel", 350, 5, tid=7, correlation=8),
        _x("kernel", "add_kernel", 360, 3, tid=7, correlation=9),
        _x("kernel", "gemm", 370, 2, tid=7, correlation=10),
        _x("kernel", "_conv_update_kernel", 380, 4, tid=7, correlation=99),  # launch not recorded
    ]}
    got = prof.attribute(trace)
    assert got == {ssm: {"_ssu_kernel": 40}, other: {"copy_kernel": 5}, "residual / casts": {"add_kernel": 3},
                   "other": {"gemm": 2}, "mamba conv": {"_conv_update_kernel": 4}}


def test_ssm_bytes_nemotron_shape():
    """Modelled SSM bytes per step: OFF reads + writes 24 x 256 x 4 MiB; ON is below OFF by about 1.7x."""
    prof, bench = _load_benchmark("profile_e2e"), _load_benchmark("bench_e2e")
    off = prof.ssm_bytes(bench.NEMOTRON_H_8B, 256, False, 16)
    on = prof.ssm_bytes(bench.NEMOTRON_H_8B, 256, True, 16)
    assert off == 24 * 256 * 2 * (4 << 20)
    assert 1.6 < off / on < 1.8


def test_profile_quick_writes_parts(tmp_path, capsys):
    """The CPU smoke profile writes e2e-profile.{json,md} with OFF and ON parts that add up to busy time."""
    assert main(["bench", "--quick", "--profile", "--profile-steps", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "e2e-profile.json").read_text())
    off, on = doc["settings"]
    assert (off["replayssm"], on["replayssm"]) == (False, True)
    for s in (off, on):
        assert s["parts_us_per_step"]["mamba SSM (replay / state update)"] > 0
        assert abs(sum(s["parts_us_per_step"].values()) / 1e3 - s["busy_ms_per_step"]) < 1e-9
        assert s["eager_wall_ms_per_step"] > 0
    assert "| part | OFF ms/step |" in (tmp_path / "e2e-profile.md").read_text()
    assert "GPU busy" in capsys.readouterr().out


def test_profile_prompt_sets_the_profiled_prompt(tmp_path, capsys):
    """--profile-prompt profiles the steps after prompts of that length (the table says so); 0 is an error."""
    assert main(["bench", "--quick", "--profile", "--profile-steps", "1", "--profile-prompt", "9",
                 "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "e2e-profile.json").read_text())["workload"]["prompt"] == 9
    assert "9-token prompts" in (tmp_path / "e2e-profile.md").read_text()
    capsys.readouterr()
    assert main(["bench", "--quick", "--profile", "--profile-prompt", "0", "--out", str(tmp_path)]) != 0
    assert "--profile-prompt must be >= 1, got 0" in capsys.readouterr().err


def test_profile_gaps_quick_spec_and_async_settings(tmp_path):
    """profile_gaps.py on the CPU: --async-scheduling both gives four settings (async on where asked),
    --spec-k writes the verify-step files."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "profile_gaps.py"
    run = lambda *a: subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path), *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    assert run("--async-scheduling", "both").returncode == 0
    doc = json.loads((tmp_path / "e2e-gaps.json").read_text())
    assert [(s["replayssm"], s["async_scheduling"]) for s in doc["settings"]] == \
        [(False, False), (True, False), (False, True), (True, True)]
    assert run("--spec-k", "3").returncode == 0
    spec = json.loads((tmp_path / "e2e-gaps-spec.json").read_text())
    assert spec["spec_k"] == 3 and len(spec["settings"]) == 2
    assert "verify steps (k = 3" in (tmp_path / "e2e-gaps-spec.md").read_text()
    bad = run("--spec-k", "2")  # the default acceptance 3.1151 is above k + 1
    assert bad.returncode == 2 and "--acceptance must be in" in bad.stderr
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "e2e-gaps-spec.json").write_text(json.dumps(spec))
    assert run("--report", str(tmp_path / "again" / "e2e-gaps-spec.json")).returncode == 0
    again = (tmp_path / "again" / "e2e-gaps-spec.md").read_text()
    assert again == (tmp_path / "e2e-gaps-spec.md").read_text()


class _Trace:
    def __init__(self, events):
        self.events = events

    def export_chrome_trace(self, path):
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events}, f)


def test_step_windows_device_gaps():
    """step_windows.device_gaps: busy is the union of device intervals (overlaps counted once), gaps of
    20 µs or more are summed apart from shorter ones and listed longest first with their neighbours."""
    sw = _load_benchmark("step_windows")
    events = [_x("kernel", "a", 0, 100), _x("kernel", "b", 50, 100),  # overlap: busy 0-150
              _x("gpu_memcpy", "copy", 160, 40),                        # gap 10 (short)
              _x("kernel", "c", 300, 100),                              # gap 100
              _x("gpu_memset", "set", 430, 20),                         # gap 30
              _x("cpu_op", "aten::copy_", 0, 2000), _x("user_annotation", "x", 0, 5000)]
    got = sw.device_gaps(_Trace(events), steps=1)
    assert abs(got["busy_ms"] - 0.31) < 1e-9 and abs(got["device_span_ms"] - 0.45) < 1e-9
    assert abs(got["gaps_20us_ms"] - 0.13) < 1e-9 and got["gaps_20us"] == 2
    assert abs(got["short_gaps_ms"] - 0.01) < 1e-9
    assert got["longest"][0] == (100.0, "copy", "c") and got["host_ops_ms"] == {"aten::copy_": 2.0}
    assert got["kernels_per_step"] == 5
    assert got["gaps_by_size_ms"] == {"< 20 us": 0.01, ">= 20 us": 0.13}
    assert [(g["after"], g["before"], g["per_step"], g["ms_per_step"]) for g in got["gap_pairs"]] == \
        [("copy", "c", 1, 0.1), ("c", "set", 1, 0.03), ("b", "copy", 1, 0.01)]
    assert "error" in sw.device_gaps(_Trace([_x("cpu_op", "aten::mm", 0, 5)]), steps=1)


def test_step_windows_quick(capsys):
    """step_windows.py --quick on the CPU: every window timed, one JSON line naming the command."""
    sw = _load_benchmark("step_windows")
    import sys
    from unittest import mock

    with mock.patch.object(sys, "argv", ["step_windows.py", "--quick", "--settings", "on", "--no-gc",
                                         "--bucket", "10"]):
        sw.main()
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (res,) = doc["settings"]
    assert doc["no_gc"] and res["replayssm"] and [w[0] for w in res["windows_ms_per_step"]] == \
        [16, 64, 16, 128, "64 no sync"]
    assert all(w[1] > 0 for w in res["windows_ms_per_step"]) and res["context"] >= 40
    # The ramp to the context (~35 steps): a row per 10, each with its wall and the parts of it spent
    # waiting for tokens and launching ahead, contexts rising.
    ramp = res["ramp"]
    assert len(ramp) >= 2 and [r["context"] for r in ramp] == sorted(r["context"] for r in ramp)
    for row in ramp:
        assert row["steps"] == 10 and row["wall_ms"] > 0 and 0 <= row["wait_ms"] <= row["wall_ms"]


def test_step_windows_report(tmp_path, capsys):
    """step_windows.py --report: the ramp table pairs ON and OFF rows by position (the first, which
    holds the prefill, left out) with OFF / ON; one windows row per setting; a JSON of the runs; the
    commit given with the log replaces the line's own (the device's git HEAD can be stale)."""
    sw = _load_benchmark("step_windows")

    def setting(on, walls):
        ramp = [{"context": 100 * (i + 1), "steps": 100, "wall_ms": w, "wait_ms": w / 2, "launch_ms": 1.0}
                for i, w in enumerate(walls)]
        return {"replayssm": on, "context": 300, "ramp": ramp, "windows_ms_per_step": [[16, walls[-1]]],
                "traced_wall_ms_per_step": walls[-1], "busy_ms": walls[-1] - 1}

    log = tmp_path / "sw.log"
    log.write_text("noise\n" + json.dumps({"command": "python3 benchmarks/step_windows.py", "commit": "stale",
                                             "no_gc": False,
                                             "settings": [setting(True, [90.0, 16.0, 17.0]),
                                                          setting(False, [40.0, 20.0, 21.25])]}) + "\n")
    out = str(tmp_path / "r")
    sw.report(out, [f"{log}:abc123"])
    md = Path(out + ".md").read_text()
    assert "| 200 | 16.00 | 8.00 | 1.00 | 20.00 | 10.00 | 1.00 | 1.250 |" in md
    assert "| 300 | 17.00 | 8.50 | 1.00 | 21.25 | 10.62 | 1.00 | 1.250 |" in md and "| 100 |" not in md
    assert "commit `abc123`" in md and "| on | 300 | 17.00 | 17.00 | 16.00 | - | - |" in md
    assert json.loads(Path(out + ".json").read_text())["runs"][0]["commit"] == "abc123"


def test_host_step_spec_phases(tmp_path):
    """host_step.py --spec-k times verify steps: the drafter and verify phases run every step."""
    host_step = _load_benchmark("host_step")
    out = tmp_path / "h.json"
    assert host_step.main(["--batch", "8", "--steps", "3", "--warm", "3", "--spec-k", "3", "--settings", "on",
                           "--json", str(out)]) == 0
    (res,) = json.loads(out.read_text())["results"]
    assert res["calls_per_step"]["verify"] == 1 and res["calls_per_step"]["propose (drafts)"] == 1
    assert res["phases"]["propose (drafts)"] > 0 and res["host_ms"] > 0


def test_kernel_bench_cursor_mixes():
    """bench_kernels --lockstep: with one token every row flushes on the same one of the W recorded
    steps; by default rows flush at different steps (a few each step); --no-flush: no row flushes,
    histories kept. The cursors the kernels read are the histories the byte count uses."""
    import torch

    bk = _load_benchmark("bench_kernels")

    def histories(lockstep: bool, q: int = 1, noflush: bool = False) -> list[torch.Tensor]:
        bench = bk.Bench.__new__(bk.Bench)
        bench.case, bench.R = bk.Case("nemotron-h-8b", 64, "fp32", q, lockstep, noflush), bk.WINDOW + q
        bench.state = torch.empty(0)
        bench._simulate_cursors(100, torch.arange(64, dtype=torch.int32))
        assert all(bool((c[1][:64] == h).all()) for c, h in zip(bench.cursors, bench.hist))
        return bench.hist

    def flush_counts(lockstep: bool, q: int = 1, noflush: bool = False) -> list[int]:
        return [int((h + q > bk.WINDOW).sum()) for h in histories(lockstep, q, noflush)]

    assert sorted(flush_counts(True)) == [0] * (bk.WINDOW - 1) + [64]
    mixed = flush_counts(False)
    assert sum(mixed) == 64 and max(mixed) < 64  # each row once per window, spread over steps
    for q in (1, 4):
        assert flush_counts(False, q, noflush=True) == [0] * bk.WINDOW
    assert max(int(h.max()) for h in histories(False, 4, noflush=True)) == bk.WINDOW - 4  # the longest kept


def test_decode_attention_report(tmp_path):
    """bench_decode_attention --report: one table line per (case, variant) with µs, GB/s and the speed-up
    over the kernel before session 24 ("tiles 64,4,3,1") where it was timed, else over "splits=1"."""
    bda = _load_benchmark("bench_decode_attention")
    row = lambda v, us: dict(rows=1, q=1, ctx=13000, variant=v, auto_splits=32, us=us, kv_gb=0.0532,  # noqa: E731
                             gb_s=round(0.0532 / us * 1e6, 1), max_diff_vs_auto=0.0)
    meta = dict(commit="abc1234", device="NVIDIA H200", command="bench_decode_attention.py")
    path = tmp_path / "decode-attention.json"
    path.write_text(json.dumps(dict(meta=meta, rows=[row("auto", 34.0), row("splits=1", 380.0),
                                                      row("tiles 64,4,3,1", 408.0)])))
    md = bda.report(path)
    assert "reference: `tiles 64,4,3,1`" in md and "commit `abc1234`" in md
    assert "| 1 | 1 | 13000 | 32 | auto | 34.00 | 1565 | 12.00x |" in md
    assert (tmp_path / "decode-attention.md").read_text() == md
    path.write_text(json.dumps(dict(meta=meta, rows=[row("auto", 34.0), row("splits=1", 380.0)])))
    assert "| auto | 34.00 | 1565 | 11.18x |" in bda.report(path)


def test_gc_pauses_quick():
    """gc_pauses.py: every collection of the steps is timed by generation; --freeze moves the heap out
    of the collector's view (and the script unfreezes it before returning)."""
    import gc

    gp = _load_benchmark("gc_pauses")
    out = gp.main(["--steps", "3", "--batch", "2", "--freeze"])
    assert out["frozen_objects"] > 10 * out["tracked_objects"] and gc.get_freeze_count() == 0
    for g, row in out["by_generation"].items():
        assert int(g) in (0, 1, 2) and row["count"] >= 1 and row["max_ms"] <= row["total_ms"]
    assert gp.main(["--steps", "2", "--batch", "2"])["frozen_objects"] == 0
