"""FlashInfer rows for bench_kernels.py (--flashinfer): its baseline and ReplaySSM kernels on our pools.

fi_baseline = flashinfer.mamba.selective_state_update (q = 1: in-place state update; q > 1: the
verify pass, state untouched, each draft's state written to an intermediate buffer), and
fi_replay = flashinfer.mamba.checkpointing_ssu, timed with algorithm "monolith" and "two-kernel"
(its scratch allocated once outside the graph); the faster is the row, both times are kept.
Both run on the Bench's own tensors (state pool, slot sets, tokens, rings and simulated cursors:
our cache contract is FlashInfer's ring contract, see fi_kernels.py) with the same CUDA-graph
whole-cycle timing and byte counts as ours. fp32 state only. Before timing, one step of each
kernel runs next to ours on copies of set 0's slots and the max abs differences go in the row.
"""

from __future__ import annotations

import math
import os
import traceback
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import fi_kernels as fk
import torch

from replayssm.ops.replay import replay_forward
from replayssm.ops.ssu import selective_state_update

IMPLS = ("fi_baseline", "fi_replay")


class FlashInferBench:
    """Loads FlashInfer once; `rows(bench, time_graph)` measures one Bench case."""

    def __init__(self, target: Path, workspace: Path):
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(workspace))
        fk.setup(target)
        self.mamba, self.version = fk.load()
        import tvm_ffi

        self.stream_ctx = tvm_ffi.use_torch_stream  # FFI launches on torch's current stream
        self.sm_count = torch.cuda.get_device_properties(0).multi_processor_count
        self.errors: list[str] = []

    def attach(self, meta: dict) -> None:
        """Record the version (and, as they happen, failures) in the run's meta."""
        meta["flashinfer"] = self.version
        meta["flashinfer_errors"] = self.errors

    def rows(self, bench, time_graph) -> list[dict]:
        """fi_baseline and fi_replay rows for this case ([] unless the state is fp32)."""
        if bench.state.dtype != torch.float32:
            return []
        assert bench.R == fk.WINDOW + bench.case.q, "bench_kernels.WINDOW != fi_kernels.WINDOW"
        try:
            check = self.cross_check(bench)
        except Exception as e:  # the timing still runs; the row says the check failed
            check = {"xcheck_error": f"{type(e).__name__}: {e}"}
            self._fail(bench, "cross-check", e)
        print(f"  flashinfer cross-check {self._label(bench)}: "
              + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in check.items()),
              flush=True)
        out = []
        for impl in IMPLS:
            try:
                r = self.measure(bench, impl, time_graph)
            except Exception as e:  # one variant failing must not stop the others
                self._fail(bench, impl, e)
                continue
            r["xcheck"] = check
            out.append(r)
            print(f"{self._label(bench)} {impl} [{r['algorithm']}]: {r['us_per_step']:.2f} us "
                  f"{r['gbps']:.0f} GB/s", flush=True)
        torch.cuda.empty_cache()
        return out

    def _label(self, bench) -> str:
        c = bench.case
        return f"{c.shape} {c.state_dtype} q={c.q} b={c.batch}"

    def _fail(self, bench, what: str, e: Exception) -> None:
        msg = f"{self._label(bench)} {what}: {type(e).__name__}: {e}"
        self.errors.append(msg)
        print(f"FLASHINFER FAILED {msg}", flush=True)
        traceback.print_exc()

    def measure(self, bench, impl: str, time_graph) -> dict:
        """Median us per step over graph replays of whole W-step cycles, as bench_kernels.measure."""
        c, m = bench.case, self.mamba
        b, q, H = c.batch, c.q, bench.H
        steps = fk.WINDOW * bench.n_sets
        times = {}
        if impl == "fi_replay":
            scratch = fk.replay_scratch(m, b, H, q, bench.x.device)
            for algo in fk.REPLAY_ALGOS:
                def run(algo=algo):
                    with self.stream_ctx():
                        for k in range(fk.WINDOW):
                            start, comm = bench.cursors[k]
                            for j in range(bench.n_sets):
                                fk.replay(m, bench, start, comm, bench.idx[j], bench.y, algo, scratch)
                times[algo] = self._time(bench, run, steps, time_graph)
            nbytes = bench.bytes_per_step("replay")
        else:
            inter, inter_idx = None, [None] * bench.n_sets
            if q > 1:  # one buffer entry per row of every slot set: (n_sets*b, q, H, P, N)
                inter = torch.empty(bench.n_sets * b, q, H, bench.P, bench.N, device=bench.state.device,
                                    dtype=bench.state.dtype)
                inter_idx = [torch.arange(j * b, (j + 1) * b, dtype=torch.int32, device=inter.device)
                             for j in range(bench.n_sets)]

            def run():
                with self.stream_ctx():
                    for _ in range(fk.WINDOW):
                        for j in range(bench.n_sets):
                            fk.ssu(m, bench, bench.idx[j], bench.y, inter, inter_idx[j])
            algo = "auto:" + fk.ssu_auto_algorithm(q, b, H, self.sm_count)  # what "auto" runs
            times[algo] = self._time(bench, run, steps, time_graph)
            del inter
            nbytes = bench.bytes_per_step("baseline")
        algo = min(times, key=lambda a: times[a][0])
        us, reps = times[algo]
        return dict(asdict(c), H=H, P=bench.P, N=bench.N, G=bench.G, window=fk.WINDOW, act_dtype="bf16",
                    impl=impl, route="flashinfer", block_p=0, num_warps=0, us_per_step=us,
                    bytes_per_step=nbytes, gbps=nbytes / us / 1e3, n_sets=bench.n_sets, reps=reps,
                    sweep=False, flashinfer=self.version, algorithm=algo,
                    algorithms_us={a: t[0] for a, t in times.items()})

    def _time(self, bench, run, steps: int, time_graph) -> tuple[float, int]:
        bench.y.fill_(float("nan"))
        us, reps = time_graph(run, steps)
        if bench.y.isnan().any():
            raise RuntimeError("NaN in the output after the timed graph")
        return us, reps

    def cross_check(self, bench) -> dict:
        """One step of ours and of FlashInfer's on copies of set 0's slots (cursor step 0)."""
        c, m = bench.case, self.mamba
        b, q = c.batch, c.q
        slots = bench.idx[0].long()
        start, comm = bench.cursors[0]
        idx = torch.arange(b, dtype=torch.int32, device=slots.device)

        def pool(extra: int = 0):
            state = bench.state[slots]
            if extra:
                state = torch.cat([state, torch.zeros((extra, *state.shape[1:]), device=state.device,
                                                      dtype=state.dtype)])
            return SimpleNamespace(
                state=state.contiguous(), ring_x=bench.ring_x[slots].contiguous(),
                ring_B=bench.ring_B[slots].contiguous(), ring_dt=bench.ring_dt[slots].contiguous(),
                start=start[slots].contiguous(), committed=comm[slots].contiguous(), x=bench.x,
                dt=bench.dt, B=bench.B, C=bench.C, A=bench.A, D=bench.D, dt_bias=bench.dt_bias)

        def diff(a, b_):
            return float((a.float() - b_.float()).abs().max())

        out = {}
        # ReplaySSM: y, the state (flush rows fold, others unchanged) and the appended ring rows.
        ours = pool()
        y = replay_forward(bench.x, bench.dt, bench.A, bench.B, bench.C, bench.D, bench.dt_bias, ours.state,
                           ours.ring_x, ours.ring_B, ours.ring_dt, ours.start, ours.committed, idx, fk.WINDOW)
        out["y_absmax"] = float(y.float().abs().max())
        flush = (ours.committed.long() + q > fk.WINDOW).float().mean()
        out["flush_fraction"] = float(flush)
        scratch = fk.replay_scratch(m, b, bench.H, q, bench.x.device)
        for algo in fk.REPLAY_ALGOS:
            theirs = pool()
            y_fi = torch.full_like(bench.x, float("nan"))
            with self.stream_ctx():
                fk.replay(m, theirs, theirs.start, theirs.committed, idx, y_fi, algo, scratch)
            out[f"fi_replay_{algo}_y"] = diff(y, y_fi)
            out[f"fi_replay_{algo}_state"] = diff(ours.state, theirs.state)
            names = ("ring_x", "ring_B", "ring_dt")
            out[f"fi_replay_{algo}_ring"] = max(diff(getattr(ours, n), getattr(theirs, n)) for n in names)
        # Baseline: y and the written states (q = 1: in place; q > 1: one per draft).
        ours = pool(extra=b * q if q > 1 else 0)
        dst = (torch.arange(b, b + b * q, dtype=torch.int32, device=idx.device).view(b, q) if q > 1 else None)
        y = selective_state_update(ours.state, bench.x, bench.dt, bench.A, bench.B, bench.C, bench.D,
                                   bench.dt_bias, idx, dst_indices=dst)
        theirs = pool()
        before = theirs.state.clone() if q > 1 else None
        inter = torch.empty((b, q, *theirs.state.shape[1:]), device=idx.device) if q > 1 else None
        y_fi = torch.full_like(bench.x, float("nan"))
        with self.stream_ctx():
            fk.ssu(m, theirs, idx, y_fi, inter, idx if q > 1 else None)
        out["fi_baseline_y"] = diff(y, y_fi)
        if q > 1:
            out["fi_baseline_states"] = diff(ours.state[b:].view(b, q, *ours.state.shape[1:]), inter)
            out["fi_baseline_state_untouched"] = bool(torch.equal(before, theirs.state))
        else:
            out["fi_baseline_states"] = diff(ours.state, theirs.state)
        return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v) for k, v in out.items()}
