"""One eager step of each decode kernel at the headline case, for Nsight Compute to profile.

    ncu --nvtx --nvtx-include "probe/" --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section WarpStateStats \\
        python3 benchmarks/ncu_probe.py [qN] [bBATCH] [SHAPE] [route:tile ...]

Nemotron-H-8B Mamba layer (or SHAPE of bench_kernels.SHAPES), batch 256 (or BATCH), fp32 state,
q = 1 (N with a first argument qN), W = 16;
cursors from the benchmark's steady-state mix (about 1/16 of the rows flush at q = 1). Prints the
launch order so the report reads.

    python3 benchmarks/ncu_probe.py --times [qN] [route:tile ...]

instead times each kernel of each route at full clocks (torch.profiler over 20 eager steps, after
2 untimed ones) and prints microseconds per step per kernel, so a route's launches can be split
without Nsight Compute's locked clocks. "fi:monolith" / "fi:two-kernel" run FlashInfer's
checkpointing_ssu (that algorithm) on the same pools.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from bench_kernels import SHAPES, WINDOW, Bench, Case, Tile

from replayssm.ops.triton import replay as treplay
from replayssm.ops.triton import ssu as tssu

_FI = {}


def _tile(text: str) -> Tile:
    """A route:tile of bench_kernels, or "fi:ALGORITHM" (FlashInfer's checkpointing_ssu)."""
    return Tile(text, None) if text.startswith("fi:") else Tile.parse(text)


def _fi_step(bench: Bench, algo: str, start, comm) -> None:
    """FlashInfer's checkpointing_ssu with that algorithm on the same pools (FlashInfer installed by
    flashinfer_build.py at /tmp/fi, as bench_kernels --flashinfer)."""
    import fi_kernels as fk

    if not _FI:
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fiws")
        fk.setup(Path("/tmp/fi"))
        _FI["mamba"] = fk.load()[0]
        import tvm_ffi

        _FI["ctx"] = tvm_ffi.use_torch_stream
    m = _FI["mamba"]
    key = ("scratch", bench.case.batch, bench.case.q)
    if key not in _FI:
        _FI[key] = fk.replay_scratch(m, bench.case.batch, bench.H, bench.case.q, bench.x.device)
    with _FI["ctx"]():
        fk.replay(m, bench, start.clone(), comm.clone(), bench.idx[0], bench.y, algo, _FI[key])


def _step(bench: Bench, tile: Tile, start, comm) -> None:
    if tile.route.startswith("fi:"):
        _fi_step(bench, tile.route[3:], start, comm)
    elif not tile.route:
        tssu.launch_ssu(bench.state, bench.x, bench.dt, bench.A, bench.B, bench.C, bench.D,
                        bench.dt_bias, bench.idx[0], None, True, 0, bench.y, tile.config)
    else:
        treplay.launch_replay_forward(
            bench.x, bench.dt, bench.A, bench.B, bench.C, bench.D, bench.dt_bias, bench.state,
            bench.ring_x, bench.ring_B, bench.ring_dt, start.clone(), comm.clone(), bench.idx[0],
            WINDOW, True, 0, bench.y, tile.config, tile.route)


def times(bench: Bench, tiles: list[str], steps: int = 20) -> None:
    """Microseconds per step of every kernel of each route (full clocks, eager launches)."""
    from torch.profiler import ProfilerActivity, profile

    start, comm = bench.cursors[0]
    for text in tiles:
        tile = _tile(text)
        for _ in range(2):
            _step(bench, tile, start, comm)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                _step(bench, tile, start, comm)
            torch.cuda.synchronize()
        per = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and e.device_time_total > 0:
                per[e.key] = e.device_time_total / steps
        total = sum(per.values())
        parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
        print(f"times q={bench.case.q} {tile.name}: sum {total:.1f} us/step: {parts}", flush=True)


def main() -> None:
    args = sys.argv[1:]
    timing = "--times" in args
    args = [a for a in args if a != "--times"]
    q = int(args.pop(0)[1:]) if args and args[0].startswith("q") else 1  # "q4": several tokens
    shape, batch = "nemotron-h-8b", 256
    if args and args[0].startswith("b"):  # "b128": another batch
        batch = int(args.pop(0)[1:])
    if args and args[0] in SHAPES:
        shape = args.pop(0)
    tiles = args or ["64x8", "fused:32x4", "stream-list:32x4"]
    bench = Bench(Case(shape, batch, "fp32", q))
    if timing:
        times(bench, tiles)
        return
    start, comm = bench.cursors[0]
    for text in tiles:
        tile = _tile(text)
        for k in range(2):  # the first call compiles; the second is in an NVTX range "probe"
            if k:
                torch.cuda.nvtx.range_push("probe")  # ncu --nvtx --nvtx-include "probe/": this step only
            _step(bench, tile, start, comm)
            if k:
                torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"profiled {tile.name}", flush=True)


if __name__ == "__main__":
    main()
