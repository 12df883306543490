"""Gated DeltaNet decode kernels on the GPU: the baseline state update vs the ReplaySSM forward.

    python3 benchmarks/bench_gdn_kernels.py [--out benchmarks/results] [--shapes qwen3.5-27b,...]
        [--batches 32,256] [--qs 1,4] [--dtypes fp32,bf16] [--sweep 16x4,32x4,...] [--quick]

Shapes are the linear-attention layers of the published configs (linear_num_key_heads,
linear_num_value_heads, linear_key_head_dim, linear_value_head_dim): Qwen3.5-27B (16, 48, 128, 128)
and Qwen3-Next-80B-A3B (16, 32, 128, 128); bf16 activations, W = 16. "baseline" is
`gdn_state_update` (q = 1: the state read and written in place; q > 1: verify, the state after each
token written to its own slot); "replay" is `gdn_replay_forward` (checkpoint + ring, flush rows write
the checkpoint). On CUDA both launch the Triton kernels the public ops dispatch to, at the engine's tile
for (state dtype, q > 1) (`gdn_state.py: CONFIGS`, `ops/triton/gdn.py: REPLAY_CONFIGS`; the md header
names them); elsewhere they run the public ops (the PyTorch references).

Method (as `bench_kernels.py`): every number is the median over CUDA-graph replays of whole W-step
cycles; the cursors of each step are simulated ahead with the reference commit (q = 1 accepts 1,
q > 1 accepts uniform in [1, q]), so a graph replays the steady mix of flush and non-flush rows;
slot sets rotate so a graph touches >= 4x L2 of state. Bytes per step are the fewest each op must
move (module docstring of `ops/gdn.py`), GB/s is bytes / time and "% copy" divides it by the
device-to-device copy rate measured in the same run.

Writes gdn-kernels.json (commit, device, versions, copy bandwidth, one row per case and op,
rewritten after every case) and gdn-kernels.md. --quick runs one tiny case per op on the CPU with
the PyTorch references and wall-clock timing: a smoke test of the script, not a measurement.

--sweep TILES (BLOCK_VxWARPS, comma-separated) times both ops at every listed tile on every case (rows
"baseline 64x4", "replay 64x4"), the same way, writes gdn-kernels_sweep.json (no md) and prints per
(op, state dtype, q) the tile with the least total time over the cases: the candidate for that row
of the op's table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_kernels sits beside this script
from bench_kernels import (  # noqa: E402
    copy_bandwidth_gbps,
    git_commit,
    pool_slots,
    simulate_cursors,
    slot_sets,
    time_graph,
)

from replayssm.ops.gdn import gdn_replay_forward, gdn_state_update  # noqa: E402
from replayssm.ops.rounding import seed_tensor  # noqa: E402
from replayssm.ops.triton import gdn as tgdn  # noqa: E402
from replayssm.ops.triton.gdn_replay import launch_replay_forward  # noqa: E402
from replayssm.ops.triton.gdn_state import CONFIGS, LaunchConfig, launch_state_update  # noqa: E402

SHAPES = {"qwen3.5-27b": (16, 48, 128, 128), "qwen3-next-80b-a3b": (16, 32, 128, 128)}  # Hk, Hv, Dk, Dv
QUICK_SHAPE = {"tiny": (1, 2, 16, 16)}
BATCHES = [32, 256]
QS = [1, 4]
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WINDOW = 16
ACT = torch.bfloat16
ROTATE_BYTES = 240e6  # 4x the H200's 60 MB L2
MAX_SETS = 64
IMPLS = ("baseline", "replay")
TABLES = {"baseline": CONFIGS, "replay": tgdn.REPLAY_CONFIGS}  # the tile tables the dispatch reads


def engine_tile(impl: str, state_dtype: torch.dtype, q: int) -> LaunchConfig:
    """The tile the public op launches impl at: its table's row for (state dtype, q > 1)."""
    return TABLES[impl][state_dtype, q > 1]


def tile_name(tile: LaunchConfig) -> str:
    return f"{tile.block_v}x{tile.num_warps}"


def parse_tiles(text: str) -> list[LaunchConfig]:
    """'32x4,64x8' -> LaunchConfigs; block_v and warps powers of two (ValueError names the bad one)."""
    tiles = []
    for item in filter(None, text.split(",")):
        parts = item.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 and int(p) & (int(p) - 1) == 0
                                      for p in parts):
            raise ValueError(f"--sweep: tile {item!r} is not BLOCK_VxWARPS with powers of two (e.g. 64x4)")
        tiles.append(LaunchConfig(block_v=int(parts[0]), num_warps=int(parts[1])))
    if not tiles:
        raise ValueError("--sweep: no tiles given (e.g. --sweep 32x4,64x4)")
    return tiles


@dataclass(frozen=True)
class Case:
    shape: str
    batch: int
    state_dtype: str
    q: int


class Bench:
    """Pools, tokens and simulated cursors for one case; `body` issues one graph's launches."""

    def __init__(self, case: Case, shapes: dict, device: str, rotate: bool = True):
        torch.manual_seed(0)
        Hk, Hv, Dk, Dv = shapes[case.shape]
        self.case, self.shape = case, (Hk, Hv, Dk, Dv)
        b, q, W = case.batch, case.q, WINDOW
        sd = STATE_DTYPES[case.state_dtype]
        self.R = W + q
        slot_bytes = Hv * Dk * Dv * sd.itemsize
        self.n_sets = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / (b * slot_bytes)))) if rotate else 1
        S = pool_slots(self.n_sets, b, q)
        dev = device
        self.state = (torch.randn(S, Hv, Dk, Dv, device=dev) * 0.1).to(sd)
        self.ring_k = torch.randn(S, Hk, self.R, Dk, device=dev).to(ACT)
        self.ring_e = torch.randn(S, Hv, self.R, Dv, device=dev) * 0.5  # deltas: fp32
        self.ring_g = -torch.rand(S, Hv, self.R, device=dev) * 0.5 - 0.01
        self.idx, self.dst, live = slot_sets(self.n_sets, b, q, dev)
        self.q = torch.randn(b, q, Hk, Dk, device=dev).to(ACT)
        self.k = torch.randn(b, q, Hk, Dk, device=dev).to(ACT)
        self.v = torch.randn(b, q, Hv, Dv, device=dev).to(ACT)
        self.g = -torch.rand(b, q, Hv, device=dev) * 0.5 - 0.01
        self.beta = torch.rand(b, q, Hv, device=dev) * 0.9 + 0.05
        self.o = torch.empty_like(self.v)
        self.seed = seed_tensor(1, dev)
        self.cursors, self.hist = simulate_cursors(S, live, q, W, self.R, dev)

    def bytes_per_step(self, impl: str) -> float:
        """Fewest bytes one step must move, averaged over the recorded cycle."""
        Hk, Hv, Dk, Dv = self.shape
        b, q = self.case.batch, self.case.q
        s, a = STATE_DTYPES[self.case.state_dtype].itemsize, ACT.itemsize
        token = Hk * Dk * a + Hv * Dv * a + 8 * Hv  # the step's k, v, g, beta of one token
        tokens = b * q * (token + Hk * Dk * a + Hv * Dv * a)  # + q in, o out
        state = Hv * Dk * Dv * s
        if impl == "baseline":
            return tokens + b * state * (1 + q)  # read once; written once (plain) or q times (verify)
        h = torch.stack(self.hist).double()  # (W, rows)
        flush = (h + q > WINDOW).double()
        entry = Hk * Dk * a + 4 * Hv * Dv + 4 * Hv  # a ring entry, read and appended alike: k, e fp32, g
        per_row = state * (1 + flush) + (h + q) * entry  # checkpoint, flush, history, appends
        return tokens + float(per_row.sum(1).mean()) / self.n_sets

    def body(self, impl: str, tile: LaunchConfig):
        """The launches of one graph: W recorded steps over every slot set. On CUDA the op's kernel at
        `tile`; on the CPU the public op (its reference, which has no tile)."""
        cuda = self.state.is_cuda
        step = (self.q, self.k, self.v, self.g, self.beta)
        ring = (self.ring_k, self.ring_e, self.ring_g)

        def run():
            for k in range(WINDOW):
                start, comm = self.cursors[k]
                for j in range(self.n_sets):
                    idx, dst = self.idx[j], self.dst[j]
                    if impl == "baseline" and cuda:
                        launch_state_update(self.state, *step, idx, dst, self.seed, self.o, tile)
                    elif impl == "baseline":
                        gdn_state_update(self.state, *step, idx, dst_indices=dst, rand_seed=self.seed,
                                         out=self.o)
                    elif cuda:
                        launch_replay_forward(*step, self.state, *ring, start, comm, idx, WINDOW, self.seed,
                                              self.o, tile)
                    else:
                        gdn_replay_forward(*step, self.state, *ring, start, comm, idx, WINDOW,
                                           rand_seed=self.seed, out=self.o)
        return run


def time_wall(run, steps: int) -> tuple[float, int]:
    """Median µs per step of `run` by wall clock (the --quick CPU path)."""
    run()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / steps, 3


def measure(bench: Bench, impl: str, copy_gbps: float | None, quick: bool,
            tile: LaunchConfig | None = None) -> dict:
    """One row: µs per step of impl on the bench's case, its bytes, GB/s and % of copy bandwidth (None
    without a copy measurement). tile: a swept tile (the row's impl reads "baseline 64x4"); None: the
    engine's (`engine_tile`)."""
    bench.o.fill_(float("nan"))
    timer = time_wall if quick else time_graph
    c = bench.case
    at = tile or engine_tile(impl, STATE_DTYPES[c.state_dtype], c.q)
    us, reps = timer(bench.body(impl, at), WINDOW * bench.n_sets)
    assert not bench.o.isnan().any(), f"{impl}: NaN output"
    Hk, Hv, Dk, Dv = bench.shape
    nbytes = bench.bytes_per_step(impl)
    gbps = nbytes / us / 1e3
    name = f"{impl} {tile_name(at)}" if tile else impl
    return dict(asdict(bench.case), Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, window=WINDOW, act_dtype="bf16", impl=name,
                op=impl, tile=tile_name(at), sweep=tile is not None, us_per_step=us, bytes_per_step=nbytes,
                gbps=gbps,
                pct_copy=100 * gbps / copy_gbps if copy_gbps else None,
                n_sets=bench.n_sets, reps=reps)


def sweep_winners(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per "op dtype q=Q": each swept tile's total µs per step over the cases, fastest first."""
    totals: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["sweep"]:
            per = totals.setdefault(f"{r['op']} {r['state_dtype']} q={r['q']}", {})
            per[r["tile"]] = per.get(r["tile"], 0.0) + r["us_per_step"]
    return {key: dict(sorted(per.items(), key=lambda kv: kv[1])) for key, per in totals.items()}


def print_sweep_winners(winners: dict[str, dict[str, float]]) -> None:
    for key, ranked in winners.items():
        listed = ", ".join(f"{t} {us:.1f}" for t, us in ranked.items())
        print(f"{key} tiles, total us over the cases: {listed} -> winner {next(iter(ranked))}", flush=True)


def table_tiles(dtypes: list[str]) -> dict[str, str]:
    """The engine's tile of each op, state dtype and q > 1 (the md header and the json's meta)."""
    return {f"{impl} {sd} {'q>1' if several else 'q=1'}": tile_name(TABLES[impl][STATE_DTYPES[sd], several])
            for impl in IMPLS for sd in dtypes for several in (False, True)}


def render(meta: dict, rows: list[dict]) -> str:
    """gdn-kernels.md: one line per case, baseline and replay side by side, with the byte limit."""
    copy = f"{meta['copy_gbps']:.0f} GB/s" if meta["copy_gbps"] else "not measured"
    out = [f"# Gated DeltaNet decode kernels ({meta['device']})", "",
           f"commit {meta['commit']}, torch {meta['torch']}, W = {meta['window']}, bf16 activations, "
           f"copy {copy}. Bytes: the fewest each step must move (MiB per step). Tiles (block_v x warps): "
           + (", ".join(f"{k} {v}" for k, v in meta["tiles"].items()) if meta["tiles"] else
              "none (PyTorch references)") + ".", "",
           "| shape | state | q | batch | baseline µs | MiB | % copy | replay µs | MiB | % copy "
           "| speed-up | byte limit |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["shape"], r["state_dtype"], r["q"], r["batch"], r["impl"]): r for r in rows}
    for key in dict.fromkeys(k[:4] for k in by):
        base, rep = by.get((*key, "baseline")), by.get((*key, "replay"))
        if not (base and rep):
            continue
        cells = [f"{r['us_per_step']:.1f} | {r['bytes_per_step'] / 2**20:.2f} | "
                 + (f"{r['pct_copy']:.0f}%" if r["pct_copy"] is not None else "-") for r in (base, rep)]
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {cells[0]} | {cells[1]} "
                   f"| {base['us_per_step'] / rep['us_per_step']:.2f}x "
                   f"| {base['bytes_per_step'] / rep['bytes_per_step']:.2f}x |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--dtypes", default=",".join(STATE_DTYPES))
    ap.add_argument("--qs", default=",".join(map(str, QS)))
    ap.add_argument("--sweep", default="", metavar="TILES",
                    help="comma-separated tiles BLOCK_VxWARPS (e.g. 16x4,32x4,64x8) timed for both ops on "
                         "every case; writes gdn-kernels_sweep.json, prints the fastest per (op, dtype, q)")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke run: one tiny shape, batch 2, PyTorch references, wall-clock timing")
    args = ap.parse_args(argv)
    try:
        sweep = parse_tiles(args.sweep) if args.sweep else []
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        shapes, batches, device, copy_gbps, device_name = QUICK_SHAPE, [2], "cpu", None, "cpu (quick)"
    else:
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
        batches = [int(v) for v in args.batches.split(",")]
        device, copy_gbps, device_name = "cuda", copy_bandwidth_gbps(), torch.cuda.get_device_name()
    meta = dict(commit=git_commit(), device=device_name,
                torch=torch.__version__, command=" ".join([Path(sys.executable).name, *sys.argv]),
                window=WINDOW, act_dtype="bf16", copy_gbps=copy_gbps, shapes=shapes,
                tiles=None if args.quick else table_tiles(args.dtypes.split(",")),
                sweep=[tile_name(t) for t in sweep])
    name = "gdn-kernels_sweep.json" if sweep else "gdn-kernels.json"
    runs = [(impl, t) for impl in IMPLS for t in sweep] if sweep else [(impl, None) for impl in IMPLS]
    rows = []
    for shape in shapes:
        for sd in args.dtypes.split(","):
            for q in (int(v) for v in args.qs.split(",")):
                for b in batches:
                    bench = Bench(Case(shape, b, sd, q), shapes, device, rotate=not args.quick)
                    for impl, tile in runs:
                        r = measure(bench, impl, copy_gbps, args.quick, tile)
                        rows.append(r)
                        print(f"{shape} {sd} q={q} b={b} {r['impl']}: {r['us_per_step']:.2f} us "
                              f"{r['bytes_per_step'] / 2**20:.2f} MiB {r['gbps']:.0f} GB/s", flush=True)
                    del bench
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    # Written after every case, so a run cut short still leaves its numbers.
                    (out / name).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    if sweep:
        winners = sweep_winners(rows)
        (out / name).write_text(json.dumps(dict(meta=meta, rows=rows, winners=winners), indent=1))
        print_sweep_winners(winners)
        return
    md = render(meta, rows)
    (out / "gdn-kernels.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
