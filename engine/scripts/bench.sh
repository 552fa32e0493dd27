#!/usr/bin/env bash
# The reference engine's measurements (docs/engine-measuring.md#measurements-make-engine-bench), with SmolLM2-135M-Instruct
# (MODEL=small: the random 25M model) on this machine's CPU. Writes everything under target/engine-bench/ and prints the summary table.
#
#   A  token budget 256        -> step log for `fit` (R^2, coefficients), TBT p99 "token budget"
#   B  time budget X (X = X_FACTOR x the median decode-only step of A; A's fit to start, then
#      the online fit) -> p99 step vs 1.2 X, time overruns by reason
#   C  chunking off            -> TBT p99 "off"
#   R  `mstar-chunking replay` of A's scaled trace with A's fitted coefficients, each step drawn
#      from A's measured ÷ predicted spread (`fit --for replay`) -> vs A
#
# Knobs (environment): MODEL, KV_TOKENS, REPLAY_NOISE (measured or none), X_FACTOR, B_FLOOR, TIME_MARGIN, ENGINE_THREADS, REQUESTS, RATE_SCALE, LENGTH_SCALE, MAX_PROMPT, MAX_OUTPUT, TRACE, PORT,
# OUT (the directory written; `make engine-bench` runs one per load), RUNS (a subset of "A B C R";
# B and R need A's files in OUT).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/engine-bench}
RUNS=${RUNS:-A B C R}
mkdir -p "$OUT"
TRACE=${TRACE:-data/traces/AzureLLMInferenceTrace_conv.head500.csv}
REQUESTS=${REQUESTS:-40}
RATE_SCALE=${RATE_SCALE:-0.3}
LENGTH_SCALE=${LENGTH_SCALE:-1}
MAX_PROMPT=${MAX_PROMPT:-2048}
MAX_OUTPUT=${MAX_OUTPUT:-128}
PORT=${PORT:-8317}
MODEL=${MODEL:-smollm2}
KV_TOKENS=${KV_TOKENS:-65536}
# On a CPU a step of 2-16 tokens costs about twice a 1-token decode step (docs/engine-model.md#the-cost-of-a-step),
# so a time budget of 2 x the decode-only step leaves a long-context chunk no room at all.
X_FACTOR=${X_FACTOR:-3}
# B's floor (--min-chunk-tokens). A prompt alone in its step runs at least the floor, over X if it
# must (counted `floor`): where a 4-token chunk at a long context costs more than X, set it to 1.
B_FLOOR=${B_FLOOR:-4}
# B plans against X over this quantile of its recent measured / predicted step times.
TIME_MARGIN=${TIME_MARGIN:-0.99}
CARGO=${CARGO:-cargo}
# The model's matrix products run on ENGINE_THREADS threads (candle reads RAYON_NUM_THREADS);
# on a 2-core machine one core computes and the other serves HTTP and runs the load generator,
# as a GPU engine's device is not shared with its HTTP server.
ENGINE_THREADS=${ENGINE_THREADS:-1}

# ENGINE / CHUNKING: prebuilt binaries to use instead of building release ones.
if [[ -z "${ENGINE:-}" || -z "${CHUNKING:-}" ]]; then
  $CARGO build --release -p mstar-engine -p mstar-chunking-sim --bins
  BIN=${CARGO_TARGET_DIR:-target}/release
  ENGINE=$BIN/mstar-engine
  CHUNKING=$BIN/mstar-chunking
fi

# run NAME SERVE-FLAGS...: serve, replay the trace against it, stop it with SIGTERM.
run() {
  local name=$1; shift
  RAYON_NUM_THREADS=$ENGINE_THREADS "$ENGINE" serve --model "$MODEL" --listen "127.0.0.1:$PORT" --step-log "$OUT/$name.steps.jsonl" \
    --kv-tokens "$KV_TOKENS" "$@" >"$OUT/$name.serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do
    grep -q "listening on" "$OUT/$name.serve.log" && break
    sleep 0.2
  done
  "$ENGINE" bench --url "http://127.0.0.1:$PORT" --trace "$TRACE" --requests "$REQUESTS" \
    --rate-scale "$RATE_SCALE" --length-scale "$LENGTH_SCALE" --max-prompt "$MAX_PROMPT" \
    --max-output "$MAX_OUTPUT" --report-json "$OUT/$name.bench.json" \
    --write-trace "$OUT/scaled.csv" --timeout-secs 1800 >/dev/null
  kill -TERM "$pid"
  wait "$pid"
}

wants() { [[ " $RUNS " == *" $1 "* ]]; }

if wants A; then
  echo "== A: token budget 256"
  run A --budget 256 --align 16 --min-chunk-tokens 16
  "$CHUNKING" fit --errors relative "$OUT/A.steps.jsonl" --node llm | tee "$OUT/A.fit.txt"
  # The same fit as a replay's cost: each simulated step drawn from A's measured ÷ predicted
  # spread (REPLAY_NOISE=none replays the fitted line alone).
  "$CHUNKING" fit --errors relative --for replay "$OUT/A.steps.jsonl" >"$OUT/A.replay-cost.txt"
fi

X=$(python3 engine/scripts/analyze.py decode-ms "$OUT/A.steps.jsonl" "$X_FACTOR")
COST=$(python3 engine/scripts/analyze.py cost "$OUT/A.fit.txt")
if wants B; then
  echo "== B: time budget ${X} ms (${X_FACTOR} x the decode-only step), A's fit refined online"
  run B --budget 2048 --align 1 --min-chunk-tokens "$B_FLOOR" --max-step-ms "$X" --cost "$COST" --learn-cost \
    --time-margin "$TIME_MARGIN"
fi

if wants C; then
  echo "== C: chunking off"
  run C --budget off
fi

if wants R; then
  echo "== R: replay with A's fitted coefficients"
  if [[ "${REPLAY_NOISE:-measured}" == measured ]]; then
    python3 engine/scripts/analyze.py replay-config "$OUT/A.replay-cost.txt" >"$OUT/replay.toml"
  else
    python3 engine/scripts/analyze.py replay-config "$OUT/A.fit.txt" >"$OUT/replay.toml"
  fi
  "$CHUNKING" replay --model engine/scripts/engine-model.toml --config "$OUT/replay.toml" \
    --trace "$OUT/scaled.csv" --format generic --report-json "$OUT/R.replay.json" --no-progress >/dev/null
fi

if wants A && wants B && wants R; then
  python3 engine/scripts/analyze.py summary "$OUT" "$X" | tee "$OUT/summary.md"
fi
