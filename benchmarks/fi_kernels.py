"""FlashInfer's Mamba decode kernels called on this project's cache tensors (benchmarks only).

One place decides how `flashinfer.mamba.checkpointing_ssu` (its ReplaySSM kernel) and
`selective_state_update` (its baseline) are called, so the JIT build (flashinfer_build.py) and
the timing (bench_flashinfer.py) compile and load the same variants: a JIT key is the dtypes of
state/x/dt/D/A/indices, P, N, q, W, heads per group and groups, so any drift here rebuilds.
FlashInfer is never imported at module import time; `setup` puts an unpacked bundle on sys.path.

Our cache contract (replayssm/ops/replay.py) is FlashInfer's ring contract as is: ring_x
(S, H, R, P), ring_B (S, G, R, N), ring_dt (S, H, R) processed dt, R = W + q, ring_start and
committed (= its prev_num_accepted_tokens) int32 (S,), the same flush rule h + q > W and the
same append rows. Only per-head parameters need stride-0 views (A, D, dt_bias, dt).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

WINDOW = 16  # = bench_kernels.WINDOW (a JIT key: the ring is W + q rows)
SHAPES = {"nemotron-h-8b": (128, 64, 128, 8), "nemotron-3-super-tp8": (16, 64, 128, 1)}
QS = (1, 4)
ARCH = "9.0"  # H200
REPLAY_ALGOS = ("monolith", "two-kernel")


@dataclass(frozen=True)
class Variant:
    """One JIT module: the kernel, q, and the shapes that exercise it (the first one builds)."""

    name: str
    kernel: str  # "replay" (checkpointing_ssu) or "ssu" (selective_state_update)
    q: int
    shapes: tuple[str, ...]


def variants() -> list[Variant]:
    """checkpointing_ssu keys on groups (both shapes have 16 heads per group); SSU does not."""
    out = [Variant(f"replay-{s}-q{q}", "replay", q, (s,)) for s in SHAPES for q in QS]
    return out + [Variant(f"ssu-q{q}", "ssu", q, tuple(SHAPES)) for q in QS]


def setup(target: Path, arch: str = ARCH) -> None:
    """Put an unpacked bundle first on sys.path and PYTHONPATH (children inherit it)."""
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", arch)
    target = str(Path(target).resolve())
    if target not in sys.path:
        sys.path.insert(0, target)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != target]
    os.environ["PYTHONPATH"] = os.pathsep.join([target, *parts])


def install(bundle: Path, target: Path) -> str:
    """Unpack flashinfer-slim.tgz and the tvm-ffi wheel into target unless already there."""
    target.mkdir(parents=True, exist_ok=True)
    done = []
    if not (target / "flashinfer" / "__init__.py").exists():
        with tarfile.open(bundle / "flashinfer-slim.tgz") as tf:
            tf.extractall(target)
        done.append("flashinfer")
    if not (target / "tvm_ffi").exists():
        wheels = sorted(glob.glob(str(bundle / "apache_tvm_ffi-*.whl")))
        if not wheels:
            raise FileNotFoundError(f"no apache_tvm_ffi wheel in {bundle}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--target", str(target), wheels[-1]], check=True)
        done.append("tvm_ffi")
    return ", ".join(done) or "already installed"


def aot_dir(target: Path) -> Path:
    """A .so at aot/<uri>/<uri>.so loads without ninja (FlashInfer's prebuilt-module path)."""
    return Path(target) / "flashinfer" / "data" / "aot"


def restore(archives: list[Path], target: Path) -> list[str]:
    """Unpack fiws*.tgz (aot/<uri>/<uri>.so) into the bundle's AOT folder; returns the uris."""
    uris = []
    dest = aot_dir(target)
    for archive in archives:
        with tarfile.open(archive) as tf:
            for member in tf.getmembers():
                parts = Path(member.name).parts
                if not member.isfile() or len(parts) != 3 or parts[0] != "aot" or ".." in parts:
                    continue
                (dest / parts[1]).mkdir(parents=True, exist_ok=True)
                src = tf.extractfile(member)
                assert src is not None
                with open(dest / parts[1] / parts[2], "wb") as f:
                    shutil.copyfileobj(src, f)
                uris.append(parts[1])
    return uris


def load():
    """(flashinfer.mamba, version); raises ImportError without FlashInfer."""
    import flashinfer
    from flashinfer import mamba

    return mamba, flashinfer.__version__


def _views(t):
    """Stride-0 per-head views FlashInfer's checks ask for: A (H,P,N), D and dt_bias (H,P)."""
    H, P, N = t.state.shape[1:]
    return (t.A.view(H, 1, 1).expand(H, P, N), t.D.view(H, 1).expand(H, P),
            t.dt_bias.view(H, 1).expand(H, P))


def replay(mamba, t, start, committed, idx, out, algorithm: str, scratch=None) -> None:
    """checkpointing_ssu on t's pools (attributes as bench_kernels.Bench): one decode step."""
    b, q, H, P = t.x.shape
    A, D, dt_bias = _views(t)
    extra = {}
    if algorithm == "two-kernel":
        extra = dict(zip(("cb_scaled", "cumAdt_vec", "cb_old"), scratch))
    mamba.checkpointing_ssu(t.state, t.ring_x, t.ring_B, t.ring_dt, start, committed, t.x,
                            t.dt.unsqueeze(-1).expand(b, q, H, P), A, t.B, t.C, out, D=D,
                            dt_bias=dt_bias, dt_softplus=True, state_batch_indices=idx,
                            pad_slot_id=-1, algorithm=algorithm, **extra)


def replay_scratch(mamba, batch: int, H: int, q: int, device) -> tuple:
    """Scratch for the two-kernel path, allocated once outside the graph."""
    return mamba.allocate_checkpointing_ssu_scratch(batch, H, q, WINDOW, torch.bfloat16, device)


def ssu(mamba, t, idx, out, inter=None, inter_idx=None, algorithm: str = "auto") -> None:
    """selective_state_update: q = 1 updates the state in place; q > 1 is the verify pass that
    leaves the state alone and writes each draft's state to inter[inter_idx[i], t]."""
    b, q, H, P = t.x.shape
    A, D, dt_bias = _views(t)
    if q == 1:
        mamba.selective_state_update(
            t.state, t.x[:, 0], t.dt[:, 0].unsqueeze(-1).expand(b, H, P), A, t.B[:, 0], t.C[:, 0], D,
            dt_bias=dt_bias, dt_softplus=True, state_batch_indices=idx, pad_slot_id=-1,
            out=out[:, 0], algorithm=algorithm)
    else:
        mamba.selective_state_update(
            t.state, t.x, t.dt.unsqueeze(-1).expand(b, q, H, P), A, t.B, t.C, D, dt_bias=dt_bias,
            dt_softplus=True, state_batch_indices=idx, pad_slot_id=-1, out=out,
            disable_state_update=True, intermediate_states_buffer=inter,
            intermediate_state_indices=inter_idx, cache_steps=q, algorithm=algorithm)


def ssu_auto_algorithm(q: int, batch: int, H: int, sm_count: int) -> str:
    """What "auto" resolves to on sm_90 in 0.7.2.post1 (invoke_selective_state_update*.cuh)."""
    if q > 1:
        return "simple"
    return "simple" if batch * H < 2 * sm_count else "vertical"


def small_inputs(shape: str, q: int, batch: int = 2, device: str = "cuda"):
    """Pools with the dtypes bench_kernels.Bench uses, at a small batch (for the JIT build)."""
    H, P, N, G = SHAPES[shape]
    S, R = 4 * batch, WINDOW + q
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=g).to(device)

    t = SimpleNamespace(
        state=randn(S, H, P, N) * 0.5, ring_x=randn(S, H, R, P).to(torch.bfloat16),
        ring_B=randn(S, G, R, N).to(torch.bfloat16), ring_dt=randn(S, H, R).abs() * 0.1 + 0.01,
        x=randn(batch, q, H, P).to(torch.bfloat16), dt=randn(batch, q, H) - 2.0,
        B=(randn(batch, q, G, N) / N ** 0.5).to(torch.bfloat16),
        C=(randn(batch, q, G, N) / N ** 0.5).to(torch.bfloat16),
        A=-torch.exp(randn(H).abs()), D=randn(H), dt_bias=randn(H).abs() - 1.0)
    t.idx = torch.randperm(S, generator=g)[:batch].to(torch.int32).to(device)
    t.start = torch.randint(0, R, (S,), generator=g, dtype=torch.int32).to(device)
    t.committed = torch.randint(0, WINDOW + 1, (S,), generator=g, dtype=torch.int32).to(device)
    t.y = torch.full_like(t.x, float("nan"))
    t.inter = torch.empty(batch, q, H, P, N, device=device) if q > 1 else None
    t.inter_idx = torch.arange(batch, dtype=torch.int32, device=device) if q > 1 else None
    return t
