#!/usr/bin/env bash
# The time budget under interference (docs/engine-measuring.md#the-time-budget-under-interference): the
# engine on one pinned core under a time budget X, a steady load, and a CPU hog on the same core
# from HOG_ON to HOG_OFF seconds into the load. Writes target/engine-interference/ and prints the
# step p99 against X before, during and after, the overruns by reason, and the margin.
#
# X and the planner's cost come from engine/scripts/capacity.sh's calibration (CAP, run first
# if missing): X = its time budget, the cost its relative fit, refined online (--learn-cost),
# planned with the time margin (--time-margin).
#
# Knobs (environment): CAP, OUT, TRACE, REQUESTS, RATE, LENGTH_SCALE, MAX_PROMPT, MAX_OUTPUT,
# HOG_ON, HOG_OFF, HOG_NICE, FLOOR, TIME_MARGIN, LEARN (1: --learn-cost), ENGINE_CPU, ENGINE_NICE, PORT,
# ENGINE/CHUNKING.
set -euo pipefail
cd "$(dirname "$0")/../.."
CAP=${CAP:-target/engine-capacity}
OUT=${OUT:-target/engine-interference}
TRACE=${TRACE:-data/traces/AzureLLMInferenceTrace_conv.head500.csv}
# 200 requests at a quarter of their length, arriving over 3.5 minutes at RATE (about one a
# second, more than the time budget's capacity): a queue keeps every step filled to the budget,
# the steps a time budget is for.
REQUESTS=${REQUESTS:-200}
RATE=${RATE:-0.3}
LENGTH_SCALE=${LENGTH_SCALE:-0.25}
MAX_PROMPT=${MAX_PROMPT:-512}
MAX_OUTPUT=${MAX_OUTPUT:-64}
HOG_ON=${HOG_ON:-70}
HOG_OFF=${HOG_OFF:-140}
FLOOR=${FLOOR:-4}
TIME_MARGIN=${TIME_MARGIN:-0.99}
LEARN=${LEARN:-1}
ENGINE_CPU=${ENGINE_CPU:-1}
ENGINE_NICE=${ENGINE_NICE:-0}
# The hog's niceness: at the engine's the two share the core evenly (steps take twice as long);
# a higher one takes a smaller share.
HOG_NICE=${HOG_NICE:-$ENGINE_NICE}
PORT=${PORT:-8328}
CARGO=${CARGO:-cargo}
mkdir -p "$OUT"

if [[ -z "${ENGINE:-}" || -z "${CHUNKING:-}" ]]; then
  $CARGO build --release -p mstar-engine -p mstar-chunking-sim --bins
  BIN=${CARGO_TARGET_DIR:-target}/release
  ENGINE=$BIN/mstar-engine
  CHUNKING=$BIN/mstar-chunking
fi
export ENGINE CHUNKING
if [[ ! -f "$CAP/objective.env" ]]; then
  OUT=$CAP STAGES=cal engine/scripts/capacity.sh
fi
# shellcheck disable=SC2046
export $(cat "$CAP/objective.env")
LOAD_CPUS=$(python3 -c "import os; print(','.join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != $ENGINE_CPU) or '$ENGINE_CPU')")

SERVER=""
LOADGEN=""
HOG=""
cleanup() {
  for p in "$HOG" "$LOADGEN"; do
    if [[ -n "$p" ]]; then kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; fi
  done
  if [[ -n "$SERVER" ]]; then
    kill -TERM "$SERVER" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The wall clock without starting a process (a python3 start can take seconds on a loaded machine).
now() { echo "$EPOCHREALTIME"; }
scrape() { curl -s --max-time 5 "http://127.0.0.1:$PORT/metrics" | grep -E '^(mstar_chunking_time_overruns_total|mstar_chunking_time_margin|mstar_chunking_latency_model|engine_step_seconds_count)' >"$OUT/metrics-$1.txt" || true; }

learn=()
[[ $LEARN == 1 ]] && learn=(--learn-cost)
rm -f "$OUT/steps.jsonl" "$OUT/bench.json" "$OUT/times.txt"
echo "== time budget $X_MS ms, rate x $RATE, hog on core $ENGINE_CPU from ${HOG_ON} s to ${HOG_OFF} s (load $(cut -d' ' -f1-3 /proc/loadavg))"
RAYON_NUM_THREADS=1 taskset -c "$ENGINE_CPU" nice -n "$ENGINE_NICE" "$ENGINE" serve --model smollm2 \
  --listen "127.0.0.1:$PORT" --step-log "$OUT/steps.jsonl" --grace-secs 1 --budget 2048 --align 1 \
  --min-chunk-tokens "$FLOOR" --max-step-ms "$X_MS" --cost "$COST" "${learn[@]}" --time-margin "$TIME_MARGIN" \
  >"$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do
  grep -q "listening on" "$OUT/serve.log" && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/serve.log" >&2; exit 1; }
  sleep 0.2
done
echo "bench $(now)" >>"$OUT/times.txt"
taskset -c "$LOAD_CPUS" "$ENGINE" bench --url "http://127.0.0.1:$PORT" --trace "$TRACE" \
  --requests "$REQUESTS" --rate-scale "$RATE" --length-scale "$LENGTH_SCALE" --max-prompt "$MAX_PROMPT" \
  --max-output "$MAX_OUTPUT" --timeout-secs 900 --report-json "$OUT/bench.json" \
  --write-trace "$OUT/scaled.csv" >"$OUT/bench.log" 2>&1 &
LOADGEN=$!
sleep "$HOG_ON"
scrape before
echo "load_hog_on $(cut -d' ' -f1 /proc/loadavg)" >>"$OUT/times.txt"
taskset -c "$ENGINE_CPU" nice -n "$HOG_NICE" sh -c 'while :; do :; done' &
HOG=$!
echo "hog_on $(now)" >>"$OUT/times.txt"
sleep "$((HOG_OFF - HOG_ON))"
kill -TERM "$HOG"
echo "hog_off $(now)" >>"$OUT/times.txt"
wait "$HOG" 2>/dev/null || true
HOG=""
echo "load_hog_off $(cut -d' ' -f1 /proc/loadavg)" >>"$OUT/times.txt"
scrape during
wait "$LOADGEN" || true
LOADGEN=""
echo "load_end $(cut -d' ' -f1 /proc/loadavg)" >>"$OUT/times.txt"
scrape after
cleanup
SERVER=""
python3 engine/scripts/interference.py "$OUT" "$X_MS" | tee "$OUT/summary.md"
