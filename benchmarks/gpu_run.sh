#!/usr/bin/env bash
# One device call for the decode kernels (benchmarks/NOTES-kernels.md):
#   bash benchmarks/gpu_run.sh COMMIT [fi]
# 1. the kernel GPU tests (replay routes, norms, SSU, conv), 2. the route/tile sweep at the
# headline case and the full table (both shapes, batches 256 first, fp32 and fp16, q = 1 and 4),
# with FlashInfer beside ours when the second argument is "fi" (carry .fi: see flashinfer_build.py).
# Everything lands in $OUT (the table is rewritten after every case, so a cut-short call keeps it).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD REPLAYSSM_COMMIT=${1:-unknown}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
timeout 180 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/ops > "$OUT/gpu-tests.log" 2>&1
tail -3 "$OUT/gpu-tests.log"
FI=""
if [ "$2" = fi ]; then
  timeout 60 python3 benchmarks/flashinfer_build.py --bundle .fi --workspace /tmp/fiws --out /tmp/fi-out \
    --restore .fi/fiws.tgz > "$OUT/fi-restore.log" 2>&1
  FI=--flashinfer
fi
# The measured defaults (lean.a.y:32x4 for one token, stream-list.c.y.b.t.p2:64x4 for several) and their
# nearest rivals (NOTES-kernels.md, sessions 4-12): .c = flush launches on a side stream, .a = small
# launches beside the output launch, .y = high-priority side stream, .b = bf16 hi + lo products,
# .t = B·C as tensor-core products, .o = every row's outputs then a fold-only launch, .pN = persistent
# flush programs per SM, .gN = the flush launch's register cap, .nN / .fN = streaming / flush pieces in
# N column parts.
CFG="baseline=64x8,replay=lean.a.y:32x4+lean.c:32x4"
CFG="$CFG+stream-list.c.y.b.t.p2:64x4+stream-list.c.y.b.t:64x4+stream-list.c.y.b.t.g128.p2:64x4"
# .nN.sS / .fN: streaming / flush pieces in N column parts, S pipeline stages (session 12; not yet
# measured: sm_90 builds .n2.s3 74 registers and 40 KB vs 104 and 49 KB; .f2.g128 128 and 33 KB vs 172 and 59 KB)
CFG="$CFG+stream-list.c.y.b.t.p2.n2.s3:64x4+stream-list.c.y.b.t.p2.n2.s2:64x4+stream-list.c.y.b.t.p2.n4.s5:64x4"
CFG="$CFG+stream-list.c.y.b.t.f2.g128.p4:64x4+stream-list.c.y.b.t.f2.g128.p3:64x4+stream-list.c.y.b.t.n2.s3.f2.g128.p4:64x4"
timeout 340 python3 benchmarks/bench_kernels.py $FI --out "$OUT" --batches 256,512,128,32,8,1 --configs "$CFG" \
  2>&1 | tee "$OUT/bench.log" | grep -E "^(copy|read|sweep|diag)|b=256"
