"""Garbage-collector pauses during engine steps, with and without `gc.freeze()` after the engine is
built (what `replayssm serve` does, `server/launch.freeze_heap`).

    PYTHONPATH=. python3 benchmarks/gc_pauses.py [--steps 300] [--batch 256] [--freeze]

Builds the mode (a) engine of profile_gaps.decode_engine on the CPU with the Nemotron-H-8B layer
pattern at a tiny width (host_step.py's config; torch and transformers imported, as in a server
process), holding --batch greedy requests of 8-token prompts, and times every collection of --steps
steps by generation (gc.callbacks). Prints one JSON line: the count, total and longest pause per
generation, the objects still tracked and frozen.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from host_step import TINY_8B  # noqa: E402
from profile_gaps import decode_engine  # noqa: E402


def _run(args, timed, pauses: list[tuple[int, float]]) -> dict:
    """Build (profile_gaps.decode_engine, on the CPU), optionally freeze, step with `timed` among
    gc.callbacks; the result row."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(TINY_8B))
        engine = decode_engine(TINY_8B, d, True, args.batch, 8, args.steps + 16, False,
                               max_model_len=args.steps + 64, seed="gc", freeze=args.freeze)
        gc.callbacks.append(timed)
        t0 = time.perf_counter()
        try:
            for _ in range(args.steps):
                engine.step()
        finally:
            gc.callbacks.remove(timed)
        wall = time.perf_counter() - t0
    by: dict[int, list[float]] = {}
    for g, ms in pauses:
        by.setdefault(g, []).append(ms)
    return {"freeze": args.freeze, "steps": args.steps, "batch": args.batch, "wall_s": round(wall, 2),
            "tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count(),
            "by_generation": {g: {"count": len(v), "total_ms": round(sum(v), 1), "max_ms": round(max(v), 1)}
                              for g, v in sorted(by.items())}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--freeze", action="store_true",
                    help="gc.collect() and gc.freeze() once the engine holds its requests")
    args = ap.parse_args(argv)
    import transformers  # noqa: F401  (loaded in a server process: its objects count)

    pauses: list[tuple[int, float]] = []
    start: list[float] = []

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            start.append(time.perf_counter())
        else:
            pauses.append((info["generation"], (time.perf_counter() - start.pop()) * 1e3))

    try:
        out = _run(args, timed, pauses)
    finally:
        gc.unfreeze()  # the frozen heap would otherwise never be collected in this process
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
