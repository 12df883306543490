#!/usr/bin/env python3
"""Compile a decode kernel for sm_90 on a CPU-only host and count what it does (no GPU needed).

Kernels: replay_stream.py's `_stream_kernel` (default) and `_flush_kernel`, replay_step.py's
`_weights_kernel`, replay_flush.py's `_lean_flush_kernel` fold-only ("fold") or with outputs
("leanflush"), replay_mono.py's
`_mono_kernel`, replay_mono_mma.py's `_mono_mma_kernel` ("monot"), replay_lean.py's output launch
`_lean_kernel` ("lean", bare products) with its `_lean_finish_kernel` ("finish") and replay_ring.py's
`_ring_term_kernel` ("ring"). Triton ships
ptxas and cuobjdump, so registers, shared memory, spills, layout conversions, async copies, MMA
instructions and barriers can be read off before a device call (benchmarks/NOTES-kernels.md, session
12). Private Triton APIs (native_specialize_impl): written
against Triton 3.9; the device's 3.6 compiles the same kernels with somewhat different counts.

Mirrors `launch_stream`'s specialization for a contiguous (b, q, H, P) x / y and (b, q, G, N) C:
the signature, int specializations (== 1 -> constexpr, % 16 == 0 -> tt.divisibility) and pointer
alignment are computed with Triton's own `native_specialize_impl`, as a real launch would.
Writes ttir/ttgir/llir/ptx/cubin/sass + ptxas -v log to --out and prints a summary.

    python3 benchmarks/compile_sm90.py                 # headline: 8B, q=4, W=16, MMA=2
    python3 benchmarks/compile_sm90.py --mma 1 --out /tmp/sm90_mma1
    python3 benchmarks/compile_sm90.py --kernel flush --maxnreg 128
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launch's default (fusion on)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend, get_ptxas  # noqa: E402

from replayssm.ops.triton.replay_stream import _flush_kernel, _stream_kernel, stream_items  # noqa: E402
from replayssm.ops.triton.rounding import max_finite, seed_mix, tl_dtype  # noqa: E402

TDT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32"}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def args_parse():
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--kernel", default="stream",
                   choices=["stream", "flush", "weights", "fold", "leanflush", "mono", "monot", "lean",
                            "ring", "finish"])
    a.add_argument("--H", type=int, default=128)
    a.add_argument("--P", type=int, default=64)
    a.add_argument("--N", type=int, default=128)
    a.add_argument("--G", type=int, default=8)
    a.add_argument("--window", type=int, default=16)
    a.add_argument("--q", type=int, default=4)
    a.add_argument("--block-p", type=int, default=64)
    a.add_argument("--num-warps", type=int, default=4)
    a.add_argument("--num-stages", type=int, default=None, help="compile option (launch leaves the default)")
    a.add_argument("--stages", type=int, default=2, help="STAGES constexpr (tl.range num_stages)")
    a.add_argument(
        "--items", type=int, default=8, help="requested items; ITEMS = stream_items(H, P, BLOCK_P, items)"
    )
    a.add_argument("--mma", type=int, choices=[0, 1, 2], default=2)
    a.add_argument("--all", action="store_true", help="ALL constexpr (outputs_all)")
    a.add_argument("--split", type=int, default=1, help="SPLIT constexpr (flush launch)")
    a.add_argument("--pdl", action="store_true", help="PDL constexpr (streaming / weights launch)")
    a.add_argument("--hoist-c", action="store_true", help="HOIST_C constexpr (streaming launch, option .h)")
    a.add_argument("--join", type=int, default=0, help="monot: option .jN (JOIN, FP = N rows)")
    a.add_argument("--order", action="store_true", help="mono / monot: option .o (ORDER)")
    a.add_argument("--flush-split", type=int, default=1, help="monot: option .fM (SPLIT)")
    a.add_argument("--state-dtype", choices=list(TDT), default="fp32")
    a.add_argument("--act-dtype", choices=list(TDT), default="bf16", help="x, B/C, y, ring_x, ring_B")
    a.add_argument("--seed", type=int, default=0, help="rand_seed (seed_mix >= 2^31 specializes to i64)")
    a.add_argument("--arch", type=int, default=90)
    a.add_argument("--out", default=None, help="output folder (default: the temp dir's replayssm-sm90/<tag>)")
    a.add_argument("--maxnreg", type=int, default=0)
    a.add_argument(
        "--no-alloc",
        action="store_true",
        help="skip the shared-memory allocation table (a second compile with MLIR_ENABLE_DUMP)",
    )
    a.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    return a.parse_args()


def spec(value, kp):
    """(type string, attr string or None) exactly as the JIT launcher would compute it."""
    return native_specialize_impl(
        CUDABackend, value, kp.is_const, not kp.do_not_specialize, not kp.do_not_specialize_on_alignment
    )


class FakePtr:
    """Stand-in for a CUDA tensor: dtype + a 16-byte-aligned data_ptr (the caching allocator's)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def data_ptr(self):
        return 1 << 20


def build(a):
    H, P, N, G, W, q = a.H, a.P, a.N, a.G, a.window, a.q
    R = W + q
    QB, HB = triton.next_power_of_2(q), triton.next_power_of_2(W)
    act, sdt_t = TDT[a.act_dtype], TDT[a.state_dtype]
    sdt = tl_dtype(sdt_t)
    mma = int(q > 1 and a.block_p >= 16)
    bf16 = a.mma == 2 and mma
    mma = 2 if bf16 else (a.mma if mma else 0)
    sx = (q * H * P, H * P, P)  # x / y contiguous (b, q, H, P)
    sC = (q * G * N, G * N, N)  # C contiguous (b, q, G, N)
    f32, i32 = torch.float32, torch.int32
    meta = dict(
        Q=q,
        QB=QB,
        HB=HB,
        P=P,
        N=N,
        BLOCK_P=a.block_p,
        NS=min(N, 32),
        MMA=mma,
        STATE_DTYPE=sdt,
        MAXV=max_finite(sdt),
    )
    if a.kernel == "stream":
        fn = _stream_kernel
        items = stream_items(H, P, a.block_p, a.items)
        meta.update(ITEMS=items, STAGES=a.stages, ALL=bool(a.all))
        if a.pdl:
            meta.update(PDL=True)
        if a.hoist_c:
            meta.update(HOIST_C=True)
    elif a.kernel == "weights":
        from replayssm.ops.triton.replay_step import _weights_kernel as fn

        meta = dict(
            Q=q,
            QB=QB,
            HB=HB,
            HPB=triton.next_power_of_2(H // G),
            N=N,
            BLOCK_N=triton.next_power_of_2(N),
            DT_SOFTPLUS=True,
            BC_DOT=bool(a.mma),
            TT=max(QB, 16) if a.mma else QB,
            JJ=max(HB, 16) if a.mma else HB,
        )
    elif a.kernel in ("fold", "leanflush"):
        # replay_flush.py's persistent launch: fold-only (lean.o, stream-list.o), or with the flush rows'
        # outputs ("leanflush": the lean route's flush launch, .nN's FEW on)
        from replayssm.ops.triton.replay_flush import _lean_flush_kernel as fn

        del meta["MMA"]
        meta.update(DOT=True, OUT=a.kernel == "leanflush", FEW=a.kernel == "leanflush")
    elif a.kernel == "mono":
        from replayssm.ops.triton.replay_mono import _mono_kernel as fn

        del meta["MMA"]
        meta.update(BLOCK_N=triton.next_power_of_2(N), DT_SOFTPLUS=True, ORDER=a.order)
    elif a.kernel == "monot":  # replay_mono_mma.py's one-launch step with tensor-core products (mono.t)
        from replayssm.ops.triton.replay_mono_mma import _mono_mma_kernel as fn

        del meta["MMA"]
        meta.update(QB=max(16, QB), HB=max(16, HB), BLOCK_N=triton.next_power_of_2(N), DT_SOFTPLUS=True,
                    OUT16=a.act_dtype != "fp32", JOIN=a.join > 0, FP=a.join or 16, ORDER=a.order,
                    SPLIT=a.flush_split)
    elif a.kernel == "lean":  # replay_lean.py's output launch, bare products (lean.a: RAW)
        from replayssm.ops.triton.replay_lean import _lean_kernel as fn

        meta = dict(Q=q, QB=QB, P=P, N=N, BLOCK_P=a.block_p, NS=min(N, 32), ITEMS=a.items, STAGES=a.stages,
                    MMA=mma, ALL=bool(a.all), RAW=True)
    elif a.kernel == "finish":  # replay_lean.py's last launch (lean.a): y = e^{Λ_t} u_t + r_t
        from replayssm.ops.triton.replay_lean import _lean_finish_kernel as fn

        meta = dict(Q=q, P=P, BLOCK=1024)
    elif a.kernel == "ring":  # replay_ring.py's ring-term launch, CUDA-core form (one token)
        from replayssm.ops.triton.replay_ring import _ring_term_kernel as fn

        meta = dict(Q=q, QB=QB, HB=HB, HT=4, P=P, BP=triton.next_power_of_2(P))
    else:
        fn = _flush_kernel
        meta.update(SPLIT=a.split, STAGES=a.stages)
    # Pointer arguments by name: activations (x, B, C, y, ring rows), the state, fp32 scratch and
    # parameters, int32 indices.
    kinds = dict(x=act, B=act, C=act, y=act, rx=act, rB=act, state=sdt_t, list=i32, count=i32, ring_start=i32,
                 committed=i32, idx=i32, flag=i32)
    ptrs = {kp.name: kinds.get(kp.name[:-4], f32) for kp in fn.params if kp.name.endswith("_ptr")}
    # Scalars by name: contiguous (b, q, H, P) x / y, (b, q, G, N) B / C and (b, q, H) dt.
    scalars = dict(sx_b=sx[0], sx_t=sx[1], sx_h=sx[2], sy_b=sx[0], sy_t=sx[1], sy_h=sx[2], sC_b=sC[0],
                   sC_t=sC[1], sC_g=sC[2], sB_b=sC[0], sB_t=sC[1], sB_g=sC[2], sdt_b=q * H, sdt_t=H, sdt_h=1,
                   H=H, G=G, R=R, window=W, seed_mix=seed_mix(a.seed), b=256, few=0, total=256 * q * H * P)
    # Arguments with defaults keep them, as a launch that leaves them out does.
    values = {kp.name: kp.default if kp.default is not inspect.Parameter.empty
              else FakePtr(ptrs[kp.name]) if kp.name in ptrs else scalars[kp.name]
              for kp in fn.params if not kp.is_constexpr}
    signature, constexprs, attrs = {}, {}, {}
    for idx, kp in enumerate(fn.params):
        if kp.is_constexpr:
            signature[kp.name] = "constexpr"
            constexprs[(idx,)] = meta[kp.name] if kp.name in meta else kp.default  # e.g. PDL=False
            continue
        if values[kp.name] is None:  # a None argument is a constexpr
            signature[kp.name] = "constexpr"
            constexprs[(idx,)] = None
            continue
        ty, attr = spec(values[kp.name], kp)
        signature[kp.name] = ty
        if ty == "constexpr":  # an int == 1
            constexprs[(idx,)] = attr
        elif isinstance(attr, str):
            parsed = CUDABackend.parse_attr(attr)
            if parsed:
                attrs[(idx,)] = parsed
    # Every constexpr without a default is given (the defaulted ones, e.g. PDL, may be left out).
    required = {kp.name for kp in fn.params if kp.is_constexpr and kp.default is inspect.Parameter.empty}
    assert required <= set(meta) <= {kp.name for kp in fn.params if kp.is_constexpr}, "constexpr mismatch"
    return fn, signature, constexprs, attrs, meta, values


def alloc_table(a, name):
    """Re-run this script's compile in a child with MLIR_ENABLE_DUMP and read the IR after
    AllocateSharedMemoryNv: every shared buffer / convert_layout scratch with its offset."""
    argv = [x for x in sys.argv[1:]]
    env = dict(os.environ, TRITON_ALWAYS_COMPILE="1", MLIR_ENABLE_DUMP=name)
    with tempfile.TemporaryDirectory() as td:
        argv += ["--compile-only", "--out", td]
        r = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True)
    txt = r.stderr
    i = txt.find("IR Dump Before TritonTensorMemoryAllocationPass")
    if i < 0:
        return ["(no allocation dump found)"]
    sec = txt[i : txt.find("// -----//", i + 10)]
    rows = []
    for ln in sec.splitlines():
        if "allocation.offset" not in ln:
            continue
        res = re.match(r"\s*(%[\w#:]+)\s*=", ln)
        op = re.search(r"\b(ttg\.\w+|ttng\.\w+|tt\.\w+)", ln).group(1)
        off = int(re.search(r"allocation.offset = (\d+)", ln).group(1))
        ty = re.findall(r"(?:memdesc|tensor)<[^>]*>", ln)
        size = ""
        md = [t for t in ty if t.startswith("memdesc")]
        if md:
            mm = re.match(r"memdesc<((?:\d+x)+)(f32|bf16|f16|i32|i8|i1|f8\w*)", md[-1])
            if mm:
                n = 1
                for d in mm.group(1).rstrip("x").split("x"):
                    n *= int(d)
                size = n * {"f32": 4, "i32": 4, "bf16": 2, "f16": 2}.get(mm.group(2), 1)
        rows.append(
            f"{off:>6}  {str(size):>6}  {(res.group(1) if res else ''):<14} {op:<20} {' -> '.join(ty)}"
        )
    return sorted(rows, key=lambda x: int(x.split()[0]))


def count(pat, text, flags=re.M):
    return len(re.findall(pat, text, flags))


def main():
    a = args_parse()
    fn, signature, constexprs, attrs, meta, values = build(a)
    tag = f"mma{meta.get('MMA', a.mma)}_{a.kernel}_bp{a.block_p}_w{a.num_warps}_q{a.q}" + (
        f"_s{a.stages}_i{meta['ITEMS']}" if a.kernel == "stream" else ""
    )
    out = Path(a.out or Path(tempfile.gettempdir()) / "replayssm-sm90" / tag)
    out.mkdir(parents=True, exist_ok=True)
    options = dict(num_warps=a.num_warps)
    if a.maxnreg:
        options["maxnreg"] = a.maxnreg
    if a.num_stages is not None:
        options["num_stages"] = a.num_stages
    src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", a.arch, 32), options=options)

    asm = k.asm
    name = k.metadata.name
    if a.compile_only:
        return
    for ext in ("ttir", "ttgir", "llir", "ptx"):
        (out / f"{name}.{ext}").write_text(asm[ext])
    cubin = out / f"{name}.cubin"
    cubin.write_bytes(asm["cubin"])
    sass = subprocess.run(
        [str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True
    ).stdout
    if not sass.strip():
        sass = subprocess.run(
            [str(BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True
        ).stdout
    (out / f"{name}.sass").write_text(sass)
    res = subprocess.run(
        [str(BIN / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True
    ).stdout
    # ptxas -v with make_cubin's flags (the compile itself swallows the log).
    arch = f"sm_{a.arch}a" if a.arch >= 90 else f"sm_{a.arch}"
    with tempfile.TemporaryDirectory() as td:
        p = Path(td) / "k.ptx"
        p.write_text(asm["ptx"])
        log = subprocess.run(
            [
                get_ptxas(a.arch).path,
                "-lineinfo",
                "-v",
                "--regAllocOptLevel=2",
                f"--gpu-name={arch}",
                str(p),
                "-o",
                str(Path(td) / "k.o"),
            ],
            capture_output=True,
            text=True,
        )
    ptxas_log = log.stdout + log.stderr
    (out / "ptxas.log").write_text(ptxas_log + "\n" + res)
    (out / "signature.json").write_text(
        json.dumps(
            dict(
                signature=signature,
                constexprs={str(k_): str(v) for k_, v in constexprs.items()},
                attrs={str(k_): v for k_, v in attrs.items()},
                options=options,
                tag=tag,
            ),
            indent=1,
        )
    )

    ttgir, ptx = asm["ttgir"], asm["ptx"]
    sass_ins = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", ln)]
    sass_txt = "\n".join(sass_ins)
    sass_nonop = [ln for ln in sass_ins if not re.search(r"\bNOP\b", ln)]
    m = re.search(r"Used (\d+) registers", ptxas_log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    stack = re.search(r"(\d+) bytes stack frame", ptxas_log)

    def row(label, val):
        print(f"  {label:<34} {val}")

    print(f"{fn.__name__} sm_{a.arch} num_warps={a.num_warps} -> {out}")
    print("  constexprs: " + ", ".join(f"{k_}={v}" for k_, v in meta.items()))
    print("  signature:  " + " ".join(f"{k_}:{v}" for k_, v in signature.items() if v != "constexpr"))
    print("  div16 args: " + ",".join(fn.params[i[0]].name for i in attrs))
    row("registers/thread (ptxas -v)", m.group(1) if m else "?")
    row("shared mem bytes (dynamic, metadata)", k.metadata.shared)
    row(
        "spill stores/loads, stack (bytes)",
        f"{spill.groups() if spill else '?'}, {stack.group(1) if stack else '?'}",
    )
    print(" TTGIR:")
    for op in (
        "ttg.convert_layout",
        "ttg.local_alloc",
        "ttg.local_store",
        "ttg.local_load",
        "ttg.local_dealloc",
        "ttg.memdesc_index",
        "ttg.async_copy_global_to_local",
        "ttg.async_commit_group",
        "ttg.async_wait",
        "tt.dot",
        "ttng.warp_group_dot",
        "ttng.warp_group_dot_wait",
    ):
        row(op, count(re.escape(op) + r"\b", ttgir))
    print(" PTX:")
    for lbl, pat in (
        ("cp.async (all)", r"\bcp\.async\.(?:ca|cg)"),
        ("cp.async.commit/wait", r"\bcp\.async\.(?:commit|wait)"),
        ("mma.sync", r"\bmma\.sync"),
        ("wgmma.mma_async", r"\bwgmma\.mma_async"),
        ("ldmatrix", r"\bldmatrix"),
        ("stmatrix", r"\bstmatrix"),
        ("st.shared", r"\bst\.shared"),
        ("ld.shared", r"\bld\.shared"),
        ("bar.sync", r"\bbar\.sync"),
        ("shfl.sync", r"\bshfl\.sync"),
    ):
        row(lbl, count(pat, ptx))
    print(" SASS:")
    for lbl, pat in (
        ("LDGSTS (cp.async)", r"\bLDGSTS"),
        ("HMMA", r"\bHMMA"),
        ("HGMMA", r"\bHGMMA"),
        ("LDSM", r"\bLDSM"),
        ("STSM", r"\bSTSM"),
        ("STS", r"\bSTS\b"),
        ("LDS", r"\bLDS\b"),
        ("BAR.SYNC", r"\bBAR\.SYNC"),
        ("SHFL", r"\bSHFL"),
        ("LDG", r"\bLDG\b"),
        ("STG", r"\bSTG\b"),
        ("LDL/STL (spill)", r"\b(?:LDL|STL)\b"),
    ):
        row(lbl, count(pat, sass_txt))
    row("total SASS instructions (non-NOP)", f"{len(sass_ins)} ({len(sass_nonop)})")
    if not a.no_alloc:
        rows = alloc_table(a, name)
        (out / "smem_alloc.txt").write_text("\n".join(rows) + "\n")
        print(" shared memory allocation (offset, bytes, value, op, types):")
        for r in rows:
            print("   " + re.sub(r", #smem(, mutable)?>", ">", r)[:150])


if __name__ == "__main__":
    main()
