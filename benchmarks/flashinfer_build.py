"""JIT-build every FlashInfer module the kernel benchmark uses, in parallel, and pack the results.

    python3 benchmarks/flashinfer_build.py --bundle .fi --workspace /tmp/fiws --out $OUT \
        [--restore .fi/fiws.tgz] [--target /tmp/fi] [--jobs 20] [--timeout 420]

Installs the slim bundle (shared/tools/flashinfer-bundle) into --target unless it is there,
unpacks --restore archives (fiws*.tgz next to it too) into the bundle's prebuilt-module folder,
then starts one child per variant (fi_kernels.variants()): each calls its kernel once on small
CUDA inputs with the benchmark's dtypes, which builds (or loads) exactly the module the benchmark
loads later. Prints per-variant seconds and status, copies every built .so to the bundle's
prebuilt-module folder (--target/flashinfer/data/aot/<uri>/<uri>.so, loaded from there without
ninja or nvcc) and packs them the same way into $OUT/fiws.tgz (fiws-2.tgz, ... past 15 MiB).
The benchmark (bench_kernels.py --flashinfer) then runs in the same machine session.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

import fi_kernels as fk

PART_BYTES = 15 * 2**20  # the device tool returns files of at most 16 MiB


def toolchain_env(work: Path) -> list[str]:
    """Make ninja, nvcc and an unversioned libcuda findable; returns notes to print."""
    notes = []
    bindirs = [str(Path(sys.executable).parent)]
    try:
        import ninja  # the pip package ships the binary

        bindirs.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    if not shutil.which("nvcc"):
        for home in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
            if home and Path(home, "bin", "nvcc").exists():
                bindirs.append(str(Path(home, "bin")))
    os.environ["PATH"] = os.pathsep.join([*bindirs, os.environ.get("PATH", "")])
    ninja_bin, nvcc = shutil.which("ninja"), shutil.which("nvcc")
    notes.append(f"ninja={ninja_bin} nvcc={nvcc} c++={shutil.which('c++')}")
    default = Path(nvcc).resolve().parent.parent if nvcc else "/usr/local/cuda"
    home = Path(os.environ.get("CUDA_HOME") or default)
    if not os.environ.get("CUDA_HOME") and (home / "include" / "cuda.h").exists():
        os.environ["CUDA_HOME"] = str(home)  # FlashInfer would take `which nvcc`/../.. unresolved
    notes.append(f"CUDA_HOME={os.environ.get('CUDA_HOME', '(unset)')}")
    # FlashInfer links with -L$CUDA_HOME/lib64{,/stubs} -lcudart -lcuda: give it a libcuda.so if
    # neither folder has one (the driver's libcuda.so.1 then serves).
    if not any(Path(home, d, "libcuda.so").exists() for d in ("lib64", "lib64/stubs")):
        dirs = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64", "/usr/lib/wsl/lib",
                str(home / "lib64/stubs"), str(home / "targets/x86_64-linux/lib/stubs"))
        found = [p for d in dirs for p in sorted(glob.glob(f"{d}/libcuda.so*"))]
        if found:
            ld = work / "ld"
            ld.mkdir(parents=True, exist_ok=True)
            link = ld / "libcuda.so"
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(found[0])
            extra = os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "")
            os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"{extra} -L{ld}".strip()
            notes.append(f"no libcuda.so under {home}; linking against {found[0]} via {ld}")
        else:
            notes.append(f"WARNING: no libcuda.so found (CUDA_HOME={home}); the link step may fail")
    return notes


def child(name: str) -> int:
    """Build/load one variant by calling it; prints one JSON line."""
    import torch

    v = {x.name: x for x in fk.variants()}[name]
    t0 = time.time()
    res = dict(name=name, ok=False, checks=[])
    try:
        mamba, version = fk.load()
        res["version"] = version
        for shape in v.shapes:
            t = fk.small_inputs(shape, v.q)
            algos = fk.REPLAY_ALGOS if v.kernel == "replay" else ("auto",)
            for algo in algos:
                t.y.fill_(float("nan"))
                if v.kernel == "replay":
                    scratch = fk.replay_scratch(mamba, t.x.shape[0], t.x.shape[2], v.q, t.x.device)
                    fk.replay(mamba, t, t.start, t.committed, t.idx, t.y, algo, scratch)
                else:
                    fk.ssu(mamba, t, t.idx, t.y, t.inter, t.inter_idx, algo)
                torch.cuda.synchronize()
                finite = bool(torch.isfinite(t.y.float()).all())
                res["checks"].append(f"{shape}/{algo}: {'ok' if finite else 'NON-FINITE output'}")
                if "seconds_first_call" not in res:
                    res["seconds_first_call"] = round(time.time() - t0, 1)
        res["ok"] = all(c.endswith(": ok") for c in res["checks"])
    except Exception as e:  # report and exit non-zero; the parent keeps the other variants going
        res["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    res["seconds"] = round(time.time() - t0, 1)
    print("RESULT " + json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


def built_modules(workspace: Path, target: Path) -> dict[str, Path]:
    """uri -> .so for every JIT-built module under the workspace and every restored one."""
    found = {}
    for so in glob.glob(str(fk.aot_dir(target) / "*" / "*.so")):
        found[Path(so).parent.name] = Path(so)
    for so in glob.glob(str(workspace / ".cache" / "flashinfer" / "*" / "*" / "cached_ops" / "*" / "*.so")):
        p = Path(so)
        if p.stem == p.parent.name:
            found[p.parent.name] = p
    return found


def pack(mods: dict[str, Path], out: Path, manifest: dict) -> list[Path]:
    """aot/<uri>/<uri>.so in parts of at most PART_BYTES (compressed size estimated as raw)."""
    parts, cur, size = [], [], 0
    for uri, so in sorted(mods.items()):
        n = so.stat().st_size
        if cur and size + n > PART_BYTES:
            parts.append(cur)
            cur, size = [], 0
        cur.append((uri, so))
        size += n
    if cur:
        parts.append(cur)
    paths = []
    for i, group in enumerate(parts):
        path = out / ("fiws.tgz" if i == 0 else f"fiws-{i + 1}.tgz")
        with tarfile.open(path, "w:gz") as tf:
            for uri, so in group:
                tf.add(so, arcname=f"aot/{uri}/{uri}.so")
            if i == 0:
                data = json.dumps(manifest, indent=1).encode()
                info = tarfile.TarInfo("manifest.json")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path(".fi"))
    ap.add_argument("--workspace", type=Path, default=Path("/tmp/fiws"))
    ap.add_argument("--target", type=Path, default=Path("/tmp/fi"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--restore", type=Path, default=None)
    ap.add_argument("--jobs", type=int, default=20, help="parallel compile jobs in total")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per variant")
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    fk.setup(args.target)
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(args.workspace.resolve())
    if args.child:
        return child(args.child)

    t0 = time.time()
    args.workspace.mkdir(parents=True, exist_ok=True)
    print(f"install: {fk.install(args.bundle, args.target)} ({args.target})", flush=True)
    for note in toolchain_env(args.workspace):
        print(note, flush=True)
    if args.restore is not None:
        found = set(glob.glob(str(args.restore))) | set(glob.glob(str(args.restore.parent / "fiws*.tgz")))
        archives = sorted(found)
        uris = fk.restore([Path(a) for a in archives], args.target)
        print(f"restored {len(uris)} modules from {archives}: {uris}", flush=True)
    chosen = [v for v in fk.variants() if not args.only or v.name in args.only.split(",")]
    per_job = max(1, args.jobs // max(1, len(chosen)))
    env = dict(os.environ, MAX_JOBS=str(per_job), FLASHINFER_NVCC_THREADS="1", PYTHONUNBUFFERED="1")
    logs = args.workspace / "logs"
    logs.mkdir(exist_ok=True)
    procs = {}
    for v in chosen:
        log = open(logs / f"{v.name}.log", "w")
        cmd = [sys.executable, __file__, "--child", v.name, "--target", str(args.target),
               "--workspace", str(args.workspace)]
        # Own session, so a timeout also stops the child's ninja and nvcc (its process group).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs[v.name] = (proc, log, time.time())
    print(f"building {len(chosen)} variants, MAX_JOBS={per_job} each", flush=True)
    results = {}
    for name, (proc, log, start) in procs.items():
        try:
            proc.wait(timeout=max(1.0, args.timeout - (time.time() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        text = (logs / f"{name}.log").read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        res = (json.loads(lines[-1][7:]) if lines
               else dict(name=name, ok=False, error=f"no result (rc {proc.returncode})"))
        res["wall_seconds"] = round(time.time() - start, 1)
        results[name] = res
        status = "ok" if res["ok"] else "FAILED"
        print(f"{name}: {status} {res['wall_seconds']:.0f} s  {'; '.join(res.get('checks', []))} "
              f"{res.get('error', '')}", flush=True)
        if not res["ok"]:
            print("  log tail:\n    " + "\n    ".join(text.splitlines()[-25:]), flush=True)
    mods = built_modules(args.workspace, args.target)
    for uri, so in sorted(mods.items()):
        # Later processes (the benchmark) then load it directly, without ninja's freshness check.
        dest = fk.aot_dir(args.target) / uri / so.name
        if dest != so:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, dest)
        print(f"module {uri}: {so.stat().st_size / 2**20:.1f} MiB", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        version = next((r["version"] for r in results.values() if "version" in r), "unknown")
        manifest = dict(version=version, arch=fk.ARCH, modules=sorted(mods), results=results)
        for path in pack(mods, args.out, manifest):
            print(f"packed {path} {path.stat().st_size / 2**20:.1f} MiB", flush=True)
        (args.out / "flashinfer_build.json").write_text(json.dumps(manifest, indent=1))
    n_ok = sum(r["ok"] for r in results.values())
    print(f"flashinfer build: {n_ok}/{len(results)} variants ok in {time.time() - t0:.0f} s", flush=True)
    return 0 if n_ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
