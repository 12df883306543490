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
    md = (tmp_path / "e2e.md").read_text()
    assert "| mode | setting |" in md and "ON/OFF" in md
    assert "ON/OFF" in capsys.readouterr().out
