"""benchmarks/bench_gdn_kernels.py: the --quick CPU smoke run (plain and --sweep) writes its files; the
byte model."""

import json

import pytest

from replayssm.cli import _load_benchmark

pytest.importorskip("triton")  # the script shares bench_kernels' timing helpers, which import triton


def test_quick_run_writes_json_and_table(tmp_path):
    """--quick writes gdn-kernels.json (meta, one row per case and op, finite times and bytes, no copy
    percentage) and gdn-kernels.md with one table line per case."""
    bench = _load_benchmark("bench_gdn_kernels")
    bench.main(["--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "gdn-kernels.json").read_text())
    assert doc["meta"]["device"] == "cpu (quick)" and doc["meta"]["copy_gbps"] is None
    rows = doc["rows"]
    assert sorted((r["state_dtype"], r["q"], r["impl"]) for r in rows) == sorted(
        (sd, q, impl) for sd in ("fp32", "bf16") for q in (1, 4) for impl in ("baseline", "replay"))
    for r in rows:
        assert r["us_per_step"] > 0 and r["bytes_per_step"] > 0 and r["pct_copy"] is None
    table = (tmp_path / "gdn-kernels.md").read_text().splitlines()
    assert len([line for line in table if line.startswith("| tiny")]) == 4


def test_bytes_per_step_qwen3_next_shape():
    """At the Qwen3-Next-80B-A3B shape with fp32 state, the baseline moves 4 MiB of state per row and step
    (read + write) plus its tokens; the replay step at most 2 MiB + one flush in W + ring traffic."""
    bench = _load_benchmark("bench_gdn_kernels")
    b = bench.Bench(bench.Case("qwen3-next-80b-a3b", 1, "fp32", 1), bench.SHAPES, "cpu", rotate=False)
    state = 32 * 128 * 128 * 4
    entry = 16 * 128 * 2 + 32 * 128 * 2 + 8 * 32
    tokens = entry + 16 * 128 * 2 + 32 * 128 * 2
    assert b.bytes_per_step("baseline") == tokens + 2 * state
    replay = b.bytes_per_step("replay")
    assert state + tokens + entry <= replay <= 2 * state + tokens + (bench.WINDOW + 1) * entry


def test_quick_sweep_times_both_ops_at_every_tile(tmp_path, capsys):
    """--quick --sweep writes gdn-kernels_sweep.json (no md): one row per case, op and tile named
    "<op> <tile>", and prints one winner per (op, state dtype, q) among the swept tiles."""
    bench = _load_benchmark("bench_gdn_kernels")
    bench.main(["--quick", "--sweep", "16x4,32x8", "--out", str(tmp_path)])
    assert not (tmp_path / "gdn-kernels.md").exists() and not (tmp_path / "gdn-kernels.json").exists()
    doc = json.loads((tmp_path / "gdn-kernels_sweep.json").read_text())
    cases = [(sd, q) for sd in ("fp32", "bf16") for q in (1, 4)]
    names = [f"{op} {tile}" for op in ("baseline", "replay") for tile in ("16x4", "32x8")]
    assert sorted((r["state_dtype"], r["q"], r["impl"]) for r in doc["rows"]) == sorted(
        (sd, q, name) for sd, q in cases for name in names)
    assert all(r["sweep"] and r["us_per_step"] > 0 for r in doc["rows"])
    keys = {f"{op} {sd} q={q}" for sd, q in cases for op in ("baseline", "replay")}
    assert set(doc["winners"]) == keys and all(set(w) == {"16x4", "32x8"} for w in doc["winners"].values())
    winners = [line for line in capsys.readouterr().out.splitlines() if "-> winner" in line]
    assert sorted(line.split(" tiles")[0] for line in winners) == sorted(keys)


def test_sweep_rejects_a_malformed_tile(tmp_path, capsys):
    """--sweep with a tile that is not BLOCK_VxWARPS in powers of two exits with a message naming it."""
    bench = _load_benchmark("bench_gdn_kernels")
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--sweep", "32x4,48x4", "--out", str(tmp_path)])
    assert "--sweep: tile '48x4'" in capsys.readouterr().err
