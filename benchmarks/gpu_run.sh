#!/usr/bin/env bash
# One device call (benchmarks/NOTES-kernels.md): `bash benchmarks/gpu_run.sh 1|2 COMMIT`.
#   1: replay GPU tests + headline tile/route sweep (8B, b=256, fp32/fp16, q=1/4).
#   2: route/tile sweep, diagnostics, the table (headline first; as much as fits), every CUDA-only test.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD REPLAYSSM_COMMIT=${2:-unknown}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
if [ "$1" = 1 ]; then
  timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu -k "not mma" tests/ops/test_triton_replay.py \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -4
  timeout 170 python3 benchmarks/bench_kernels.py --out "$OUT" --shapes nemotron-h-8b --batches 256 \
    --dtypes fp32,fp16 \
    --configs "baseline=64x8,replay=fused:32x4+fused:64x4+fused:64x8+split:32x4+split:64x8+mma:64x4" \
    2>&1 | tee "$OUT/bench.log"
else
  timeout 180 python3 benchmarks/bench_kernels.py --out "$OUT" --batches 256,32,1,512 \
    --configs "baseline=64x8,replay=fused:32x4+fused:16x2+mma:64x4" 2>&1 | tee "$OUT/bench.log"
  python3 benchmarks/report.py "$OUT" > /dev/null
  timeout 100 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m gpu tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
  grep -E "^(copy|read|sweep|diag|- )" "$OUT/bench.log"; grep -E "b=256" "$OUT/bench.log"
fi
