"""Decode hot-path kernels on the GPU: the baseline selective state update vs the ReplaySSM forward.

    python3 benchmarks/bench_kernels.py [--out benchmarks/results] [--shapes nemotron-h-8b,...]
        [--batches 1,32,256] [--qs 1,4] [--dtypes fp32,fp16] [--lockstep] [--no-flush] [--flashinfer]
        [--sweep-baseline 16x4,32x4,...]

The defaults run the grid the results table reports: the Nemotron-H 8B shape (H = 128, P = 64,
N = 128) and the Nemotron-3 Super TP8 shape (H = 16), batch 1 / 32 / 256, q = 1 and 4 tokens per
row, fp32 and fp16 state, bf16 activations, W = 16. "replay" is the route the public op takes
(`ops.triton.replay.pick_route`); "baseline" is the SSU at the engine's tile for the state dtype
(`ops/triton/ssu.py: CONFIGS`). --flashinfer also times
FlashInfer's kernels on fp32 cases (bench_flashinfer.py; flashinfer_build.py installs them).

Writes kernels.json (commit, device, versions, command, copy bandwidth, one row per case and
implementation, rewritten after every case), kernels.md (tables; benchmarks/report.py) and
kernels.png (plot, if matplotlib imports). Method: every number is the median over CUDA-graph
replays of whole W-step cycles, flush steps included; the cursors of each cycle step are simulated
ahead with the reference commit (q = 1 accepts 1; q > 1 accepts uniform in [1, q]), so the graph
replays the same per-row mix of flush and non-flush rows every time (--lockstep: every row starts
at the same cursor, as a batch that began together; --no-flush: no row flushes). Slot sets rotate
so each graph touches >= 4x L2 of state. Bytes are the fewest each kernel must move.

--sweep-baseline times the baseline at each listed tile (block_p x num_warps) beside the replay route
on every case, writes kernels_sweep.json (no report) and prints the tile with the least total time
per state dtype: the candidate for that dtype's row of `ops/triton/ssu.py: CONFIGS`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

from replayssm.ops.replay import replay_commit_ref
from replayssm.ops.triton import replay as treplay
from replayssm.ops.triton import ssu as tssu
from replayssm.ops.triton.ssu import LaunchConfig

SHAPES = {"nemotron-h-8b": (128, 64, 128, 8), "nemotron-3-super-tp8": (16, 64, 128, 1)}  # H, P, N, G
BATCHES = [1, 32, 256]
STATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QS = [1, 4]
WINDOW = 16
ACT = torch.bfloat16
ROTATE_BYTES = 240e6  # 4x the H200's 60 MB L2
MAX_SETS = 512
IMPLS = ("baseline", "replay")


@dataclass(frozen=True)
class Case:
    shape: str
    batch: int
    state_dtype: str
    q: int
    # Every row's cursor starts at the same place, as in a batch that began decoding together: with one
    # token all rows then flush on the same step of the W; else each starts anywhere in its window and
    # rows flush at different steps, a few each step (continuous arrivals).
    lockstep: bool = False
    # Every cursor capped at W - q, so no row flushes (the history kept): against the default mix, what
    # the flush rows cost a step.
    noflush: bool = False


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus written."""
    a = torch.randn(2**29, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return 2 * a.numel() * 4 / statistics.median(times[2:]) / 1e9


def pool_slots(n_sets: int, b: int, q: int) -> int:
    """Slots of a pool for n_sets sets of b rows, plus q destination slots a row when q > 1 (the
    baseline verify writes the state after each draft token to its own slot)."""
    return n_sets * b * (1 + (q if q > 1 else 0))


def slot_sets(n_sets: int, b: int, q: int, device) -> tuple[list, list, torch.Tensor]:
    """A random permutation of the pool dealt into n_sets sets: each set's (b,) int32 state indices, its
    (b, q) verify destinations (None when q = 1), and all the sets' live slots (the indices' union)."""
    perm = torch.randperm(pool_slots(n_sets, b, q), device=device).to(torch.int32)
    nb = n_sets * b
    idx = [perm[j * b:(j + 1) * b].contiguous() for j in range(n_sets)]
    dst = [perm[nb + j * b * q: nb + (j + 1) * b * q].view(b, q).contiguous() if q > 1 else None
           for j in range(n_sets)]
    return idx, dst, perm[:nb]


def simulate_cursors(S: int, live: torch.Tensor, q: int, W: int, ring_rows: int, device,
                     lockstep: bool = False, noflush: bool = False) -> tuple[list, list]:
    """Ring cursors of a pool of S slots over one W-step cycle in the steady mix: random starts, the
    live slots advanced 2W steps by the reference commit (q = 1 accepts 1; q > 1 accepts uniform in
    [1, q]), then W recorded steps. Returns each recorded step's (ring_start, committed) on device and
    the live slots' committed counts on the host (lockstep, noflush: as `Case`)."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randint(0, ring_rows, (S,), dtype=torch.int32, generator=gen)
    comm = torch.randint(1 if q == 1 else 0, W + 1, (S,), dtype=torch.int32, generator=gen)
    if lockstep:
        comm.fill_(1 if q == 1 else 0)
    live = live.cpu()
    cursors, hist = [], []
    for k in range(3 * W):  # 2W steps to reach the steady mix, then W recorded steps
        if k >= 2 * W:
            c = comm.clamp(max=W - q) if noflush else comm.clone()
            cursors.append((start.clone().to(device), c.to(device)))
            hist.append(c[live.long()].clone())
        acc = torch.randint(1, q + 1, (live.numel(),), dtype=torch.int32, generator=gen)
        replay_commit_ref(start, comm, live, acc, q, W, ring_rows=ring_rows)
    return cursors, hist


class Bench:
    """Pools, tokens and simulated cursors for one case; bodies issue one graph's launches."""

    def __init__(self, case: Case, seed: int = 0, device: str = "cuda"):
        torch.manual_seed(seed)
        H, P, N, G = SHAPES[case.shape]
        self.case, self.H, self.P, self.N, self.G = case, H, P, N, G
        b, q, W = case.batch, case.q, WINDOW
        sd = STATE_DTYPES[case.state_dtype]
        self.R = W + q
        slot_bytes = H * P * N * sd.itemsize
        self.n_sets = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / (b * slot_bytes))))
        S = pool_slots(self.n_sets, b, q)
        dev = device
        self.state = (torch.randn(S, H, P, N, device=dev) * 0.5).to(sd)
        self.ring_x = torch.randn(S, H, self.R, P, device=dev).to(ACT)
        self.ring_B = torch.randn(S, G, self.R, N, device=dev).to(ACT)
        self.ring_dt = torch.rand(S, H, self.R, device=dev) * 0.1 + 0.01
        self.idx, self.dst, live = slot_sets(self.n_sets, b, q, dev)
        self.x = torch.randn(b, q, H, P, device=dev).to(ACT)
        self.dt = torch.randn(b, q, H, device=dev) - 2.0
        self.B = torch.randn(b, q, G, N, device=dev).to(ACT) / math.sqrt(N)
        self.C = torch.randn(b, q, G, N, device=dev).to(ACT) / math.sqrt(N)
        self.A = -torch.exp(torch.rand(H, device=dev))
        self.D = torch.randn(H, device=dev)
        self.dt_bias = torch.rand(H, device=dev) - 1.0
        self.y = torch.empty_like(self.x)
        self.cursors, self.hist = simulate_cursors(S, live, q, W, self.R, dev, case.lockstep,
                                                     case.noflush)

    def bytes_per_step(self, impl: str) -> float:
        """Fewest bytes one step must move, averaged over the recorded cycle."""
        H, P, N, G = self.H, self.P, self.N, self.G
        b, q = self.case.batch, self.case.q
        s, a = STATE_DTYPES[self.case.state_dtype].itemsize, ACT.itemsize
        tokens = b * q * (2 * H * P * a + H * 4 + 2 * G * N * a)  # x, y, dt, B, C
        if impl == "baseline":
            return tokens + b * H * P * N * s * (1 + q)  # read once; write once (plain) or q times
        h = torch.stack(self.hist).double()  # (W, rows)
        flush = (h + q > WINDOW).double()
        per_row = (H * P * N * s * (1 + flush) + h * (H * (P * a + 4) + G * N * a)
                   + q * (H * P * a + H * 4 + G * N * a))  # + history reads, + appends
        return tokens + float(per_row.sum(1).mean()) / self.n_sets

    def body(self, impl: str, route=None, tile: LaunchConfig | None = None):
        """The launches of one graph: W recorded steps over every slot set. impl "baseline" (the SSU at
        tile, None: the engine's, `ssu.CONFIGS`) or "replay" (route: a settings object of
        `ops.triton.replay`; None: its table)."""
        tile = tile or tssu.CONFIGS[STATE_DTYPES[self.case.state_dtype]]

        def run():
            for k in range(WINDOW):
                start, comm = self.cursors[k]
                for j in range(self.n_sets):
                    if impl == "baseline":
                        tssu.launch_ssu(self.state, self.x, self.dt, self.A, self.B, self.C, self.D,
                                        self.dt_bias, self.idx[j], self.dst[j], True, k, self.y, tile)
                    else:
                        treplay.launch_replay_forward(
                            self.x, self.dt, self.A, self.B, self.C, self.D, self.dt_bias, self.state,
                            self.ring_x, self.ring_B, self.ring_dt, start, comm, self.idx[j], WINDOW, True, k,
                            self.y, route)
        return run


def capture_graph(run) -> torch.cuda.CUDAGraph:
    """`run` warmed on a side stream (it compiles outside the graph), captured, and replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    return g


def time_graph(run, steps: int) -> tuple[float, int]:
    """Median µs per step over CUDA-graph replays of `run` (which issues `steps` steps)."""
    g = capture_graph(run)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    g.replay()
    e1.record()
    torch.cuda.synchronize()
    reps = max(5, min(25, int(300.0 / max(e0.elapsed_time(e1), 1e-3))))
    times = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    del g
    return statistics.median(times) * 1e3 / steps, reps


def measure(bench: Bench, impl: str, route=None, tile: LaunchConfig | None = None) -> dict:
    """One row: µs per step of impl on the bench's case (route: as `Bench.body`; tile: the baseline's,
    None: the engine's, `ssu.CONFIGS`)."""
    bench.y.fill_(float("nan"))
    us, reps = time_graph(bench.body(impl, route, tile), WINDOW * bench.n_sets)
    assert not bench.y.isnan().any(), f"{impl}: NaN output"
    c = bench.case
    nbytes = bench.bytes_per_step(impl)
    H, P, N, G = SHAPES[c.shape]
    sweep = tile is not None
    if impl == "baseline":
        tile = tile or tssu.CONFIGS[STATE_DTYPES[c.state_dtype]]
        name = f"ssu {tile.block_p}x{tile.num_warps}"
    else:
        tile = route or treplay.pick_route(c.batch, c.q, H, P, N, STATE_DTYPES[c.state_dtype])
        name = repr(tile)
    return dict(asdict(c), H=H, P=P, N=N, G=G, window=WINDOW, act_dtype="bf16", impl=impl, route=name,
                block_p=tile.block_p, num_warps=tile.num_warps, us_per_step=us, bytes_per_step=nbytes,
                gbps=nbytes / us / 1e3, n_sets=bench.n_sets, reps=reps, sweep=sweep)


def print_sweep_winners(rows: list[dict]) -> None:
    """Per state dtype: each swept baseline tile's total µs over the cases, and the fastest."""
    for sd in dict.fromkeys(r["state_dtype"] for r in rows):
        totals: dict[str, float] = {}
        for r in rows:
            if r["sweep"] and r["state_dtype"] == sd:
                key = f"{r['block_p']}x{r['num_warps']}"
                totals[key] = totals.get(key, 0.0) + r["us_per_step"]
        ranked = sorted(totals.items(), key=lambda kv: kv[1])
        print(f"{sd} baseline tiles, total us over the cases: "
              + ", ".join(f"{k} {v:.1f}" for k, v in ranked) + f" -> winner {ranked[0][0]}", flush=True)


def git_commit() -> str:
    env = os.environ.get("REPLAYSSM_COMMIT")
    if env:
        return env
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return res.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--dtypes", default=",".join(STATE_DTYPES))
    ap.add_argument("--qs", default=",".join(map(str, QS)))
    ap.add_argument("--lockstep", action="store_true",
                    help="every row's cursor starts at the same place (a batch that began together: with one "
                         "token all rows flush on one step of the W); default: a few rows flush each step")
    ap.add_argument("--no-flush", action="store_true",
                    help="every cursor capped at W - q, so no row flushes (against the default mix, what the "
                         "flush rows cost)")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also time FlashInfer's kernels on fp32 cases (bench_flashinfer.py)")
    ap.add_argument("--fi-target", default="/tmp/fi", help="where flashinfer_build.py installed FlashInfer")
    ap.add_argument("--fi-workspace", default="/tmp/fiws")
    ap.add_argument("--sweep-baseline", default="", metavar="TILES",
                    help="comma-separated baseline tiles BLOCK_PxWARPS (e.g. 32x4,64x8) timed on every case; "
                         "prints the fastest per state dtype")
    args = ap.parse_args()
    sweep = [LaunchConfig(*map(int, t.split("x"))) for t in args.sweep_baseline.split(",") if t]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(commit=git_commit(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, command=" ".join([Path(sys.executable).name, *sys.argv]),
                window=WINDOW, act_dtype="bf16", copy_gbps=copy_bandwidth_gbps(), lockstep=args.lockstep,
                noflush=args.no_flush,
                baseline_tiles={k: f"{tssu.CONFIGS[v].block_p}x{tssu.CONFIGS[v].num_warps}"
                                for k, v in STATE_DTYPES.items()})
    print(f"copy bandwidth {meta['copy_gbps']:.0f} GB/s", flush=True)
    fi = None
    if args.flashinfer:
        from bench_flashinfer import FlashInferBench  # benchmarks/ is the script's folder on sys.path

        fi = FlashInferBench(Path(args.fi_target), Path(args.fi_workspace))
        fi.attach(meta)
    rows = []
    for shape in args.shapes.split(","):
        for sd in args.dtypes.split(","):
            for q in (int(v) for v in args.qs.split(",")):
                for b in (int(v) for v in args.batches.split(",")):
                    bench = Bench(Case(shape, b, sd, q, args.lockstep, args.no_flush))
                    runs = [("baseline", t) for t in sweep] + [("replay", None)] if sweep else [
                        (impl, None) for impl in IMPLS]
                    for impl, tile in runs:
                        r = measure(bench, impl, tile=tile)
                        rows.append(r)
                        at = f" {r['block_p']}x{r['num_warps']}" if tile else ""
                        print(f"{shape} {sd} q={q} b={b} {impl}{at}: {r['us_per_step']:.2f} us "
                              f"{r['gbps']:.0f} GB/s ({r['route']})", flush=True)
                    if fi is not None:
                        rows += fi.rows(bench, time_graph)
                    del bench
                    torch.cuda.empty_cache()
                    # Written after every case, so a run cut short still leaves its numbers.
                    name = "kernels_sweep.json" if sweep else "kernels.json"
                    (out / name).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    if sweep:
        print_sweep_winners(rows)
        return
    from report import write_report  # benchmarks/ is the script's own folder on sys.path

    print(write_report(out))


if __name__ == "__main__":
    main()
