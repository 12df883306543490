"""`replayssm bench --quick`: the end-to-end benchmark's CPU smoke run and its results files."""

import json

from replayssm.cli import main

FIELDS = ("mode", "setting", "batch", "rep", "order", "output_tok_s", "decode_tok_s_per_request", "ttft_s",
          "peak_decoding_requests", "preemptions", "prefix_hit_tokens", "acceptance_length", "wall_s")


def test_bench_quick_writes_rows_in_off_on_on_off_order(tmp_path, capsys):
    """The quick bench writes e2e.json (meta, one row per mode x rep in OFF/ON/ON/OFF order) and e2e.md."""
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "e2e.json").read_text())
    for key in ("commit", "device", "command", "versions", "workload", "rows", "ratios", "skipped"):
        assert key in doc, key
    ran = sorted({r["mode"] for r in doc["rows"]})
    assert "a" in ran and set(ran) | set(doc["skipped"]) == {"a", "b", "c"}
    for mode in ran:
        batches = sorted({r["batch"] for r in doc["rows"] if r["mode"] == mode})
        for b in batches:
            rows = sorted((r for r in doc["rows"] if r["mode"] == mode and r["batch"] == b),
                          key=lambda r: r["order"])
            assert [r["setting"] for r in rows] == ["off", "on", "on", "off"]
            for r in rows:
                assert all(f in r for f in FIELDS)
                assert r["output_tokens"] > 0 and r["output_tok_s"] > 0 and r["ttft_s"] > 0
                assert 1 <= r["peak_decoding_requests"] <= r["num_requests"]
    a = [r for r in doc["rows"] if r["mode"] == "a"]
    assert all(r["output_tokens"] == r["num_requests"] * doc["workload"]["decode_output"] for r in a)
    assert {q["mode"] for q in doc["ratios"]} == set(ran)
    assert all(r["cuda_graphs"] is False and r["graph_replays"] == 0 and r["graph_error"] is None
               for r in doc["rows"])
    assert set(doc["notes"]) == set(ran)
    md = (tmp_path / "e2e.md").read_text()
    assert "| mode | setting |" in md and "ON/OFF" in md
    assert "ON/OFF" in capsys.readouterr().out


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
             "skipped": {"b": "no spec"}, "modes": "ab", "notes": {"a": "a note"}}
    doc = report.write_results(first, tmp_path, ["replayssm", "bench"], targets)
    (a,) = doc["ratios"]
    assert a["value"] == 1.5 and a["meets_target"] and a["peak_decoding_on"] == 8
    second = {"rows": [_row("c", s, 1, i, 1.0, t) for s, i, t in (("off", 0, 2.0), ("on", 0, 0.2),
                                                                    ("on", 1, 0.2), ("off", 1, 2.0))],
              "skipped": {}, "modes": "c", "notes": {"c": "c note"}}
    doc = report.write_results(second, tmp_path, ["replayssm", "bench", "--modes", "c"], targets, merge=True)
    assert [r["mode"] for r in doc["rows"]] == ["a"] * 4 + ["c"] * 4
    assert doc["skipped"] == {"b": "no spec"} and doc["notes"] == {"a": "a note", "c": "c note"}
    c = next(q for q in doc["ratios"] if q["mode"] == "c")
    assert abs(c["value"] - 0.9) < 1e-12 and c["meets_target"]
