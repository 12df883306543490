"""`replayssm bench --profile`: kernels attributed to layer parts; the CPU smoke run writes its files."""

import json

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
    captured = capsys.readouterr()
    assert "GPU busy" in captured.out
    _assert_plot_or_hint(tmp_path / "e2e-profile.png", captured.err)


def _assert_plot_or_hint(png, err):
    """With matplotlib the png is written; without, the output names the extra that brings it."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 0
    else:
        assert not png.exists() and "pip install -e '.[bench]'" in err


def test_profile_prompt_sets_the_profiled_prompt(tmp_path, capsys):
    """--profile-prompt profiles the steps after prompts of that length (the table says so); 0 is an error."""
    assert main(["bench", "--quick", "--profile", "--profile-steps", "1", "--profile-prompt", "9",
                 "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "e2e-profile.json").read_text())["workload"]["prompt"] == 9
    assert "9-token prompts" in (tmp_path / "e2e-profile.md").read_text()
    capsys.readouterr()
    assert main(["bench", "--quick", "--profile", "--profile-prompt", "0", "--out", str(tmp_path)]) != 0
    assert "--profile-prompt must be >= 1, got 0" in capsys.readouterr().err




def test_kernel_bench_cursor_mixes():
    """bench_kernels --lockstep: with one token every row flushes on the same one of the W recorded
    steps; by default rows flush at different steps (a few each step); --no-flush: no row flushes,
    histories kept. The cursors the kernels read are the histories the byte count uses."""
    import torch

    bk = _load_benchmark("bench_kernels")

    def histories(lockstep: bool, q: int = 1, noflush: bool = False) -> list[torch.Tensor]:
        cursors, hist = bk.simulate_cursors(100, torch.arange(64, dtype=torch.int32), q, bk.WINDOW,
                                            bk.WINDOW + q, "cpu", lockstep, noflush)
        assert all(bool((c[1][:64] == h).all()) for c, h in zip(cursors, hist))
        return hist

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
    over the fixed-tile variant ("tiles 64,4,3,1") where it was timed, else over "splits=1"."""
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


def test_prefill_ops_writes_json_md_and_plot(tmp_path, capsys):
    """bench_prefill_ops.write: prefill-ops.json holds the meta and rows, the md one line per (tokens,
    implementation) with the speed-up over the reference, and the png (or the hint to get it)."""
    po = _load_benchmark("bench_prefill_ops")
    rows = [dict(tokens=1040, name="reference", ms=3.0, launches=65, max_rel_err=1e-3, kernels_us=[]),
            dict(tokens=1040, name="triton", ms=0.5, launches=4, max_rel_err=1e-3,
                 kernels_us=[["chunk_state_kernel", 80.0, 1]])]
    meta = dict(commit="abc1234", device="NVIDIA H200", command="bench_prefill_ops.py", shape="8B shape")
    md = po.write({"meta": meta, "rows": rows}, tmp_path)
    assert json.loads((tmp_path / "prefill-ops.json").read_text())["meta"]["commit"] == "abc1234"
    assert "| 1040 | triton | 0.500 | 4 | 6.00x | 1.0e-03 |" in md and "commit `abc1234`" in md
    assert (tmp_path / "prefill-ops.md").read_text() == md
    _assert_plot_or_hint(tmp_path / "prefill-ops.png", capsys.readouterr().err)
