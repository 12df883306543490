#!/usr/bin/env bash
# End-to-end benchmark device calls (benchmarks/NOTES-e2e.md): `bash benchmarks/gpu_run_e2e.sh tests|a|bc`.
#   tests: the CUDA-only tests of the e2e path (graphs, sync-free decode, Triton attention, grouped MoE).
#   a, bc: `replayssm bench --modes ...`; GRAPHS=1 adds --cuda-graphs. Results go to benchmarks/results
#          (rewritten after every run, so a cut-short call keeps what it measured) and are copied to
#          $OUT. To merge the second call's modes into the first's file, put the fetched e2e.json
#          back under benchmarks/results before that call (--merge keeps the other modes' rows).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" benchmarks/results
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv
if [ "$1" = tests ]; then
  timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cuda_graph.py \
    tests/engine/test_decode_sync_free.py tests/ops/test_triton_attention.py tests/models/test_moe_sync_free.py \
    2>&1 | tee "$OUT/e2e-gpu-tests.log" | tail -40
else
  timeout 570 python3 -m replayssm bench --modes "$1" --merge ${GRAPHS:+--cuda-graphs} 2>&1 \
    | tee "$OUT/e2e-$1.log" | tail -40
  cp benchmarks/results/e2e.* "$OUT"/
fi
