#!/usr/bin/env bash
# End-to-end benchmark device call (benchmarks/NOTES-e2e.md). One call does everything:
#   bash benchmarks/gpu_run_e2e.sh all        # tests, modes a, b, c, the step profile, the prefill profile
# or one phase: tests | a | b | c | profile | prefill-profile. Results go to benchmarks/results (e2e.json/md rewritten
# after every run, so a phase cut short keeps what it measured) and are copied to $OUT after each
# phase. Every phase runs under `timeout` inside a whole-call budget (TOTAL seconds, default 570: the
# wants below; run it with the run tool's timeout_s 600);
# each later phase keeps a reserve, so an overrun early shortens a phase instead of losing the last.
# Knobs: TOTAL, A_SCALE (1.0), B_SCALE (1.0; runs of 128 tokens were too short to repeat), C_SCALE
# (1.0; 0.5 when eager), GRAPHS (1 = --cuda-graphs; set to 0 when a graph-vs-eager test fails). A mode whose graph run crashes (not a
# timeout) before writing any row is run again eagerly in what is left of its budget.
# Set REPLAYSSM_COMMIT to the hash as text, made here: the device's git HEAD can be stale.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
RES=benchmarks/results
mkdir -p "$OUT" "$RES"
TOTAL=${TOTAL:-570}
GRAPHS=${GRAPHS:-1}
START=$SECONDS
# phase -> seconds wanted; the reserve of a phase is the sum wanted by the phases after it.
# (a) took 173 s before the warm-ups, 165 s with them (~92 s with async scheduling); (b) at 256 output
# tokens took ~155 s (session 9 call 6). WANT_<PHASE>
# (tests, a, b, c, profile, prefill) overrides a phase's want.
declare -A WANT=([tests]=${WANT_TESTS:-45} [a]=${WANT_A:-235} [b]=${WANT_B:-175} [c]=${WANT_C:-75}
                 [profile]=${WANT_PROFILE:-55} [prefill-profile]=${WANT_PREFILL:-40})
ORDER=(tests a b c profile prefill-profile)

log() { echo "[gpu_run_e2e +$((SECONDS - START))s] $*" | tee -a "$OUT/e2e-run.log"; }

budget() {  # seconds phase $1 may take now: its want, cut so that later phases keep theirs
  local reserve=0 later=0 p
  for p in "${ORDER[@]}"; do
    [ "$later" = 1 ] && [[ " $PHASES " == *" $p "* ]] && reserve=$((reserve + WANT[$p]))
    [ "$p" = "$1" ] && later=1
  done
  local left=$((TOTAL - (SECONDS - START) - reserve)) want=${WANT[$1]}
  [ "$left" -lt "$want" ] && want=$left
  echo $((want < 10 ? 0 : want))  # callers skip a phase at 0 (timeout 0 would mean no limit)
}

rows_of() {  # rows of mode $1 in e2e.json written after time $2 (0 when the file is older)
  python3 - "$1" "$2" <<'EOF'
import json, os, sys
p = "benchmarks/results/e2e.json"
try:
    ok = os.path.getmtime(p) >= float(sys.argv[2])
    print(sum(r["mode"] == sys.argv[1] for r in json.load(open(p))["rows"]) if ok else 0)
except (OSError, ValueError, KeyError):
    print(0)
EOF
}

save() { cp "$RES"/e2e.* "$RES"/e2e-profile.* "$RES"/e2e-prefill-profile.* "$OUT"/ 2>/dev/null; true; }

run_tests() {
  local t; t=$(budget tests)
  log "tests: budget ${t}s"
  [ "$t" = 0 ] && return
  timeout -k 5 "$t" python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cuda_graph.py \
    tests/engine/test_decode_sync_free.py tests/ops/test_triton_attention.py tests/models/test_moe_sync_free.py \
    > "$OUT/e2e-gpu-tests.log" 2>&1
  log "tests: rc $? ($(tail -1 "$OUT/e2e-gpu-tests.log"))"
  if grep -q "^FAILED tests/engine/test_cuda_graph.py" "$OUT/e2e-gpu-tests.log"; then
    GRAPHS=0
    log "tests: a graph-vs-eager test failed: the modes run eagerly"
  fi
}

run_mode() {  # $1 = a | b | c
  local m=$1 t scale want t0 rc
  case $m in  # eager decode steps of (c) (batch 1) are launch-bound: half its outputs without graphs
    a) scale=${A_SCALE:-1.0}; want=4 ;;
    b) scale=${B_SCALE:-1.0}; want=8 ;;
    *) scale=${C_SCALE:-$([ "$GRAPHS" = 1 ] && echo 1.0 || echo 0.5)}; want=4 ;;
  esac
  t=$(budget "$m"); t0=$(date +%s); local s0=$SECONDS
  local flags="--modes $m --merge --scale $scale"
  if [ "$GRAPHS" = 1 ]; then flags="$flags --cuda-graphs"; else flags="$flags --no-cuda-graphs"; fi
  log "mode $m: budget ${t}s: replayssm bench $flags"
  [ "$t" = 0 ] && return
  timeout -k 5 "$t" python3 -m replayssm bench $flags > "$OUT/e2e-$m.log" 2>&1
  rc=$?
  local n; n=$(rows_of "$m" "$t0")
  log "mode $m: rc $rc, $n of $want rows; $(grep -c 'bench: (' "$OUT/e2e-$m.log") runs logged"
  save
  if [ "$GRAPHS" = 1 ] && [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$rc" != 137 ] && [ "$n" = 0 ]; then
    t=$((t - (SECONDS - s0)))
    log "mode $m: the graph run crashed (tail below); again eagerly in ${t}s"
    tail -5 "$OUT/e2e-$m.log" | tee -a "$OUT/e2e-run.log"
    [ "$t" -ge 20 ] && timeout -k 5 "$t" python3 -m replayssm bench --modes "$m" --merge --scale "$scale" \
      > "$OUT/e2e-$m-eager.log" 2>&1
    log "mode $m eager: rc $?, $(rows_of "$m" "$t0") rows"
    save
  fi
}

run_profile() {
  local t; t=$(budget profile)
  log "profile: budget ${t}s"
  [ "$t" = 0 ] && return
  local flags="--profile --profile-steps 16"
  if [ "$GRAPHS" = 1 ]; then flags="$flags --cuda-graphs"; else flags="$flags --no-cuda-graphs"; fi
  timeout -k 5 "$t" python3 -m replayssm bench $flags > "$OUT/e2e-profile.log" 2>&1
  log "profile: rc $?"
  save
}

run_prefill_profile() {  # one (c) ON prefix-hit prefill step under the profiler, against OFF (~30 s)
  local t; t=$(budget prefill-profile)
  log "prefill-profile: budget ${t}s"
  [ "$t" = 0 ] && return
  local flags="--profile-prefill --scale ${C_SCALE:-1.0}"
  if [ "$GRAPHS" = 1 ]; then flags="$flags --cuda-graphs"; else flags="$flags --no-cuda-graphs"; fi
  timeout -k 5 "$t" python3 -m replayssm bench $flags > "$OUT/e2e-prefill-profile.log" 2>&1
  log "prefill-profile: rc $?"
  save
}

PHASES=${1:-all}
[ "$PHASES" = all ] && PHASES="${ORDER[*]}"
PHASES=" $PHASES "
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv | tee -a "$OUT/e2e-run.log"
for p in "${ORDER[@]}"; do
  [[ "$PHASES" == *" $p "* ]] || continue
  case $p in tests) run_tests ;; profile) run_profile ;; prefill-profile) run_prefill_profile ;; *) run_mode "$p" ;; esac
done
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,memory.used --format=csv | tee -a "$OUT/e2e-run.log"
save
log "done"
