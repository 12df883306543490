"""Decode hot-path kernels on the GPU: baseline selective state update vs ReplaySSM (Triton).

    PYTHONPATH=. python3 benchmarks/bench_kernels.py [--out DIR] [--shapes ..] [--batches ..] [--dtypes ..]

Then benchmarks/report.py renders the JSON into kernels.md and kernels.png.

Writes kernels.json (commit, device, versions, command, copy bandwidth, one row per
measurement), kernels.md (tables, targets) and kernels.png (plot, if matplotlib imports).
Method (shared/DESIGN.md §6): every number is the median over CUDA-graph replays of whole
W-step cycles, flush steps included; the cursors of each cycle step are simulated ahead with
the reference commit (q=1 accepts 1; q>1 accepts uniform in [1, q]), so the graph replays the
same per-row mix of flush and non-flush rows every time. Slot sets rotate so each graph
touches >= 4x L2 of state. Bytes are the fewest each kernel must move (NOTES-kernels.md).
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
import triton.language as tl

from replayssm.ops.replay import replay_commit_ref
from replayssm.ops.triton import replay as treplay
from replayssm.ops.triton import ssu as tssu
from replayssm.ops.triton.ssu import LaunchConfig

SHAPES = {"nemotron-h-8b": (128, 64, 128, 8), "nemotron-3-super-tp8": (16, 64, 128, 1)}
BATCHES = [1, 8, 32, 128, 256, 512]
STATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
QS = [1, 4]
WINDOW = 16
ACT = torch.bfloat16
ROTATE_BYTES = 240e6  # 4x the H200's 60 MB L2
MAX_SETS = 512
IMPLS = ("baseline", "replay")


@dataclass(frozen=True)
class Tile:
    """A replay route ("" for the baseline, else fused | split | mma) and its tile config."""

    route: str
    config: LaunchConfig | None  # None: the route picks (route "auto": what the public op runs)

    @staticmethod
    def parse(text: str) -> Tile:
        if text == "auto":
            return Tile("auto", None)
        route, _, cfg = text.rpartition(":")
        return Tile(route, LaunchConfig(*map(int, cfg.split("x"))))

    @property
    def name(self) -> str:
        if self.config is None:
            return self.route
        prefix = f"{self.route}:" if self.route else ""
        return f"{prefix}{self.config.block_p}x{self.config.num_warps}w"


TILES = ((32, 4), (64, 4), (64, 8))
SWEEP = {
    "baseline": [Tile("", LaunchConfig(p, w)) for p, w in TILES],
    "replay": [Tile(r, LaunchConfig(p, w)) for r in ("fused", "split") for p, w in TILES],
}


@dataclass(frozen=True)
class Case:
    shape: str
    batch: int
    state_dtype: str
    q: int
    # Every row's cursor starts at the same place, as in a batch that began decoding together: with one
    # token all rows then flush on the same step of the W (e2e mode (a)); else each starts anywhere in
    # its window and rows flush at random steps, a few each step (continuous arrivals).
    lockstep: bool = False
    # Every cursor capped at W - q, so no row flushes (the history kept): with the random mix, what the
    # flush rows cost a step (a diagnostic; NOTES-kernels.md, session 21).
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


def read_bandwidth_gbps() -> float:
    """Read-only bandwidth: a full reduction over 2 GiB (bytes read only)."""
    a = torch.randn(2**29, device="cuda")
    times = []
    for _ in range(12):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.sum(a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return a.numel() * 4 / statistics.median(times[2:]) / 1e9


@triton.jit
def _slot_read_kernel(state_ptr, idx_ptr, out_ptr, H, P: tl.constexpr, N: tl.constexpr,
                      BLOCK_P: tl.constexpr):
    # The ReplaySSM output launch's state traffic alone: gather each row's (BLOCK_P, N) tile by
    # slot index, reduce it over N, write BLOCK_P floats. A ceiling for that launch.
    pid_p, h, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = tl.load(idx_ptr + i).to(tl.int64)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N)
    S0 = tl.load(state_ptr + (s * H + h) * (P * N) + p[:, None] * N + n[None, :])
    tl.store(out_ptr + (i * H + h) * P + p, tl.sum(S0, axis=1))


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
        writes = q if q > 1 else 0  # per-draft destination slots of the baseline verify
        S = self.n_sets * b * (1 + writes)
        dev = device
        self.state = (torch.randn(S, H, P, N, device=dev) * 0.5).to(sd)
        self.ring_x = torch.randn(S, H, self.R, P, device=dev).to(ACT)
        self.ring_B = torch.randn(S, G, self.R, N, device=dev).to(ACT)
        self.ring_dt = torch.rand(S, H, self.R, device=dev) * 0.1 + 0.01
        perm = torch.randperm(S, device=dev).to(torch.int32)
        nb = self.n_sets * b
        self.idx = [perm[j * b:(j + 1) * b].contiguous() for j in range(self.n_sets)]
        self.dst = [perm[nb + j * b * q: nb + (j + 1) * b * q].view(b, q).contiguous() if writes else None
                    for j in range(self.n_sets)]
        self.x = torch.randn(b, q, H, P, device=dev).to(ACT)
        self.dt = torch.randn(b, q, H, device=dev) - 2.0
        self.B = torch.randn(b, q, G, N, device=dev).to(ACT) / math.sqrt(N)
        self.C = torch.randn(b, q, G, N, device=dev).to(ACT) / math.sqrt(N)
        self.A = -torch.exp(torch.rand(H, device=dev))
        self.D = torch.randn(H, device=dev)
        self.dt_bias = torch.rand(H, device=dev) - 1.0
        self.y = torch.empty_like(self.x)
        self._simulate_cursors(S, perm[:nb])

    def _simulate_cursors(self, S: int, live: torch.Tensor) -> None:
        q, W = self.case.q, WINDOW
        gen = torch.Generator().manual_seed(1)
        start = torch.randint(0, self.R, (S,), dtype=torch.int32, generator=gen)
        comm = torch.randint(1 if q == 1 else 0, W + 1, (S,), dtype=torch.int32, generator=gen)
        if self.case.lockstep:
            comm.fill_(1 if q == 1 else 0)
        live = live.cpu()
        self.cursors, self.hist = [], []
        for k in range(3 * W):  # 2W steps to reach the steady mix, then W recorded steps
            if k >= 2 * W:
                c = comm.clamp(max=W - q) if self.case.noflush else comm.clone()
                self.cursors.append((start.clone().to(self.state.device), c.to(self.state.device)))
                self.hist.append(c[live.long()].clone())
            acc = torch.randint(1, q + 1, (live.numel(),), dtype=torch.int32, generator=gen)
            replay_commit_ref(start, comm, live, acc, q, W, ring_rows=self.R)

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

    def body(self, impl: str, tile: Tile, orders=None, cursors=None):
        """orders[k][j]: slot set j's row order at recorded step k (default: as drawn); cursors: the
        recorded steps' cursors (default: the simulated mix). bench_order.py times other row orders."""
        config, route = tile.config, tile.route or "auto"
        cursors = cursors or self.cursors

        def run():
            if impl == "slot_read":
                sums = torch.empty(self.case.batch, self.H, self.P, device=self.state.device)
                for _ in range(WINDOW):
                    for j in range(self.n_sets):
                        _slot_read_kernel[(self.P // 32, self.H, self.case.batch)](
                            self.state, self.idx[j], sums, self.H, P=self.P, N=self.N, BLOCK_P=32,
                            num_warps=4)
                return
            for k in range(WINDOW):
                start, comm = cursors[k]
                for j in range(self.n_sets):
                    idx = self.idx[j] if orders is None else orders[k][j]
                    if impl == "baseline":
                        tssu.launch_ssu(self.state, self.x, self.dt, self.A, self.B, self.C, self.D,
                                        self.dt_bias, idx, self.dst[j], True, k, self.y, config)
                    else:
                        treplay.launch_replay_forward(
                            self.x, self.dt, self.A, self.B, self.C, self.D, self.dt_bias, self.state,
                            self.ring_x, self.ring_B, self.ring_dt, start, comm, idx, WINDOW, True, k,
                            self.y, config, route)
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


def measure(bench: Bench, impl: str, tile: Tile, sweep: bool = False) -> dict:
    bench.y.fill_(float("nan"))
    us, reps = time_graph(bench.body(impl, tile), WINDOW * bench.n_sets)
    diag = impl == "slot_read" or tile.route.startswith("weights")
    assert diag or not bench.y.isnan().any(), f"{impl}: NaN output"
    c = bench.case
    if impl == "slot_read":
        nbytes = c.batch * bench.H * bench.P * (bench.N * STATE_DTYPES[c.state_dtype].itemsize + 4)
    else:
        nbytes = bench.bytes_per_step(impl)
    H, P, N, G = SHAPES[bench.case.shape]
    return dict(asdict(bench.case), H=H, P=P, N=N, G=G, window=WINDOW, act_dtype="bf16", impl=impl,
                route=tile.route, block_p=tile.config.block_p if tile.config else None,
                num_warps=tile.config.num_warps if tile.config else None,
                us_per_step=us, bytes_per_step=nbytes, gbps=nbytes / us / 1e3, n_sets=bench.n_sets, reps=reps,
                sweep=sweep)


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
    ap.add_argument("--configs", default="",
                    help="sweep override, e.g. replay=fused:64x8+split:32x4,baseline=64x8")
    ap.add_argument("--qs", default=",".join(map(str, QS)))
    ap.add_argument("--extra", default="",
                    help="replay tiles also timed at every case, e.g. mono:64x4+lean.c:32x4 (rows marked "
                         "extra, left out of the tables)")
    ap.add_argument("--sweep-extra", default="",
                    help="replay tiles also timed at the headline sweep only, beside the chosen one and not "
                         "candidates for the table, e.g. the previous default (rows marked sweep and extra)")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also time FlashInfer's kernels on fp32 cases (bench_flashinfer.py)")
    ap.add_argument("--fi-shapes", default="",
                    help="FlashInfer beside these shapes only (default: all; modules are built per shape)")
    ap.add_argument("--fi-target", default="/tmp/fi", help="where flashinfer_build.py installed FlashInfer")
    ap.add_argument("--fi-workspace", default="/tmp/fiws")
    ap.add_argument("--lockstep", action="store_true",
                    help="every row's cursor starts at the same place (a batch that began together: with one "
                         "token all rows flush on one step of the W); default: random, a few rows each step")
    ap.add_argument("--no-flush", action="store_true",
                    help="every cursor capped at W - q, so no row flushes (a diagnostic: against the default "
                         "mix, what the flush rows cost a step)")
    args = ap.parse_args()
    for item in filter(None, args.configs.split(",")):
        impl, cfg = item.split("=")
        SWEEP[impl] = [Tile.parse(c) for c in cfg.split("+")]
    qs = [int(v) for v in args.qs.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(commit=git_commit(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, command=" ".join([Path(sys.executable).name, *sys.argv]),
                window=WINDOW, act_dtype="bf16", copy_gbps=copy_bandwidth_gbps(), lockstep=args.lockstep,
                noflush=args.no_flush)
    print(f"copy bandwidth {meta['copy_gbps']:.0f} GB/s", flush=True)
    fi = None
    if args.flashinfer:
        from bench_flashinfer import FlashInferBench  # benchmarks/ is the script's folder on sys.path

        fi = FlashInferBench(Path(args.fi_target), Path(args.fi_workspace))
        fi.attach(meta)
    rows = []
    best = {}
    for q in qs:  # tile sweep at the headline case
        bench = Bench(Case("nemotron-h-8b", 256, "fp32", q, args.lockstep, args.no_flush))
        for impl in IMPLS:
            trials, desc = [], []
            for c in SWEEP[impl]:
                try:
                    trials.append((measure(bench, impl, c, sweep=True), c))
                    desc.append(f"{c.name} {trials[-1][0]['us_per_step']:.1f}")
                except ValueError as e:  # a tile the route refuses at this q (e.g. 8 warps, q > 1)
                    desc.append(f"{c.name} refused ({e})")
            rows += [r for r, _ in trials]
            best[(impl, q)] = min(trials, key=lambda rc: rc[0]["us_per_step"])[1]
            for c in map(Tile.parse, filter(None, args.sweep_extra.split("+")) if impl == "replay" else ()):
                try:
                    rows.append(dict(measure(bench, impl, c, sweep=True), extra=True))
                    desc.append(f"(beside: {c.name} {rows[-1]['us_per_step']:.1f})")
                except ValueError as e:
                    desc.append(f"(beside: {c.name} refused ({e}))")
            desc = ", ".join(desc)
            print(f"sweep q={q} {impl}: {desc}", flush=True)
        del bench
        torch.cuda.empty_cache()
    meta["chosen_configs"] = {f"{k[0]} q={k[1]}": v.name for k, v in best.items()}
    meta["read_gbps"] = read_bandwidth_gbps()
    for q in qs:  # where the time goes at the headline: weights launch alone, state reads alone
        bench = Bench(Case("nemotron-h-8b", 256, "fp32", q, args.lockstep, args.no_flush))
        # The weights launch as the measured default runs it (.t: B·C on tensor cores for q > 1; its
        # .vN warps, replay.AUTO_ROUTES).
        warps = treplay.route_options(treplay.AUTO_ROUTES[q > 1][0]).get("weights_warps", 4)
        weights = Tile(f"weights{'.t' if q > 1 else ''}.v{warps}", LaunchConfig())
        diags = (("replay", weights), ("slot_read", Tile("", LaunchConfig())))
        for impl, tile in diags:
            r = dict(measure(bench, impl, tile), diag=True, sweep=False)
            rows.append(r)
            print(f"diag q={q} {impl} {tile.route}: {r['us_per_step']:.1f} us {r['gbps']:.0f} GB/s",
                  flush=True)
        del bench
    print(f"read-only bandwidth {meta['read_gbps']:.0f} GB/s", flush=True)
    shapes = args.shapes.split(",")
    batches = [int(v) for v in args.batches.split(",")]
    for shape in shapes:
        for sd in args.dtypes.split(","):
            for q in qs:
                for b in batches:
                    bench = Bench(Case(shape, b, sd, q, args.lockstep, args.no_flush))
                    for impl in IMPLS:
                        tile = best[(impl, q)]
                        if tile.route == "fused" and sd != "fp32":  # as the "auto" route picks
                            tile = Tile("split", tile.config)
                        r = measure(bench, impl, tile)
                        rows.append(r)
                        print(f"{shape} {sd} q={q} b={b} {impl}: {r['us_per_step']:.2f} us "
                              f"{r['gbps']:.0f} GB/s", flush=True)
                    extras = []
                    for tile in map(Tile.parse, filter(None, args.extra.split("+"))):
                        try:
                            r = dict(measure(bench, "replay", tile), extra=True)
                        except ValueError as e:  # a tile the route refuses at this case
                            extras.append(f"{tile.name} refused ({e})")
                            continue
                        except Exception as e:  # e.g. a kernel that fails to compile: the rest still run
                            extras.append(f"{tile.name} failed ({type(e).__name__}: {str(e)[:200]})")
                            continue
                        rows.append(r)
                        extras.append(f"{tile.name} {r['us_per_step']:.2f}")
                    if extras:
                        print(f"{shape} {sd} q={q} b={b} extra: {', '.join(extras)}", flush=True)
                    if fi is not None and (not args.fi_shapes or shape in args.fi_shapes.split(",")):
                        rows += fi.rows(bench, time_graph)
                    del bench
                    torch.cuda.empty_cache()
                    # Written after every case, so a run cut short still leaves its numbers.
                    (out / "kernels.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / "kernels.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    from report import write_report  # benchmarks/ is the script's own folder on sys.path

    print(write_report(out))


if __name__ == "__main__":
    main()
