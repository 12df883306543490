#!/usr/bin/env bash
# One device call for the decode kernels (benchmarks/NOTES-kernels.md):
#   bash benchmarks/gpu_run.sh COMMIT [fi]        (TESTS=0: the table only)
# COMMIT: the hash as text, made here (the device's copy of the tree is current, but its git HEAD
# can be stale: `$(git rev-parse HEAD)` evaluated there recorded an older commit in session 15).
# 1. the kernel GPU tests (replay routes, norms, SSU, conv), 2. the route/tile sweep at the
# headline case and the full table (both shapes, batches 256 first, fp32 and fp16, q = 1 and 4),
# with FlashInfer beside ours when the second argument is "fi" (carry .fi: see flashinfer_build.py).
# Everything lands in $OUT (the table is rewritten after every case, so a cut-short call keeps it).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD REPLAYSSM_COMMIT=${1:-unknown}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
# The ops GPU suite took ~280 s at 351 cases (session 20) and the table with FlashInfer beside both shapes
# ~315 s: together more than one device call's 600 s. TESTS=0 skips the suite (run it in its own call).
if [ "${TESTS:-1}" = 1 ]; then
  timeout 330 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/ops > "$OUT/gpu-tests.log" 2>&1
  tail -3 "$OUT/gpu-tests.log"
fi
FI=""
if [ "$2" = fi ]; then
  timeout 60 python3 benchmarks/flashinfer_build.py --bundle .fi --workspace /tmp/fiws --out /tmp/fi-out \
    --restore .fi/fiws.tgz > "$OUT/fi-restore.log" 2>&1
  FI="--flashinfer"  # .fi/fiws*.tgz hold the modules of both shapes (the TP8 ones from session 15)
fi
# The table takes route "auto" (what the public op runs: mono / mono.t for small steps, lean.a.y.v1 for
# one token (.n2 / .n1 on large fp32 steps), stream-list.c.y.b.t.p2.l.v1.h.g160.r72 or
# .f2.g96.p4.v1.h.r80 for several by state dtype, .i2 on small steps; replay.auto_route).
# EXTRA (replay tiles timed beside it at the headline case, both q) is empty: the one-token options
# (.p2, .nN) need the lock-step mix to judge them (bench_kernels.py --lockstep; NOTES-kernels.md,
# session 16), and a one-token route's q = 4 row means nothing.
CFG="baseline=64x8,replay=auto"
EXTRA=""
timeout 480 python3 benchmarks/bench_kernels.py $FI --out "$OUT" --batches 256,512,128,32,8,1 --configs "$CFG" \
  --sweep-extra "$EXTRA" 2>&1 | tee "$OUT/bench.log" | grep -E "^(copy|read|sweep|diag)|b=256"
