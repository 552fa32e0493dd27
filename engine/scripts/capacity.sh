#!/usr/bin/env bash
# Capacity under a latency objective on the reference engine (docs/engine-measuring.md#capacity-on-the-engine):
# the replay's verdict (a time budget set from the objective against the best token budgets)
# checked on real compute. Writes everything under target/engine-capacity/ and prints the summary.
#
#   cal     a calibration run (token budget CAL_BUDGET) -> `fit --errors relative` (the planner's
#           cost), `fit --for replay` of its steps that run a decode row (the replay's cost and
#           noise bands), the decode-only median,
#           and the trace the engine ran (bench --write-trace, at rate CAL_RATE)
#   obj     TBT p99 <= TBT_FACTOR x the decode-only median; TTFT p90 <= TTFT_FACTOR x the fitted
#           time of the trace's p90 prompt prefilled alone; time budget X = TIME_SHARE x the TBT bound
#   replay  `mstar-chunking sweep` of that trace priced by the fit with its noise: capacity of
#           every token budget of REPLAY_BUDGETS, and of X in a sweep of its own, each the median
#           over REPLAY_SEEDS seeds of the noise
#   engine  capacity of the replay's best two token budgets (or TOKEN_SETTINGS) and of X on the
#           engine: from the replay's capacity, up or down by STEP until one rate meets and one
#           misses, then bisection to TOL, at most MAX_PROBES probes a setting; each probe a
#           fresh server and REQUESTS requests, bounded in time
#
# Knobs (environment): TRACE, REQUESTS, LENGTH_SCALE, MAX_PROMPT, MAX_OUTPUT, CAL_RATE,
# CAL_BUDGET, TBT_FACTOR, TTFT_FACTOR, TIME_SHARE, FLOOR, TIME_MARGIN, REPLAY_BUDGETS, REPLAY_NOISE
# (decode, all or off: the noise bands of the steps with a decode row, of every step, none), REPLAY_SEEDS,
# TOKEN_SETTINGS, STEP, TOL, MAX_PROBES, REPEAT (1: the capacity found probed again),
# ENGINE_CPU, ENGINE_NICE, PORT, OUT, STAGES (a subset of "cal replay engine summary"; later
# stages read the earlier ones' files in OUT; the engine stage adds to OUT/probes.tsv and
# continues a search already there), ENGINE/CHUNKING (prebuilt binaries).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/engine-capacity}
STAGES=${STAGES:-cal replay engine summary}
TRACE=${TRACE:-data/traces/AzureLLMInferenceTrace_conv.head500.csv}
# 60 requests of the conversation trace at a quarter of their length (prompts 8-512 tokens,
# outputs 1-64): a probe near capacity spans about a minute on SmolLM2 on one core.
REQUESTS=${REQUESTS:-60}
LENGTH_SCALE=${LENGTH_SCALE:-0.25}
MAX_PROMPT=${MAX_PROMPT:-512}
MAX_OUTPUT=${MAX_OUTPUT:-64}
CAL_RATE=${CAL_RATE:-0.4}
# Chunks of the size the objective leaves room for (a TBT bound of about ten decode steps holds
# 12 to 24 prompt tokens of SmolLM2 on one core): the fit is made where the settings run. A token
# costs less in short chunks on this CPU: a fit at 32 priced the settings' steps about 15% high
# (engine/results/capacity-2026-12-06-quiet.md).
CAL_BUDGET=${CAL_BUDGET:-12}
# The objective, scaled to this engine: make capacity's 100 ms TBT bound is about ten decode
# steps of the Llama-2-7B/A100 preset; a TTFT p90 of three times the p90 prompt's own prefill
# lets such a prompt wait twice its prefill time behind others.
TBT_FACTOR=${TBT_FACTOR:-10}
TTFT_FACTOR=${TTFT_FACTOR:-3}
# X leaves 5% of the TBT bound to what a token's time holds beyond its step (sampling, the
# component's call, HTTP), as 95 ms does for 100 ms.
TIME_SHARE=${TIME_SHARE:-0.95}
FLOOR=${FLOOR:-4}
TIME_MARGIN=${TIME_MARGIN:-0.99}
# Fine near the largest chunk the TBT bound holds, so that the best token budget is well tuned.
REPLAY_BUDGETS=${REPLAY_BUDGETS:-8,12,16,20,24,32,64,256}
REPLAY_NOISE=${REPLAY_NOISE:-decode}
REPLAY_SEEDS=${REPLAY_SEEDS:-21}
case $REPLAY_NOISE in decode | all | off) ;; *)
  echo "REPLAY_NOISE is decode, all or off, not '$REPLAY_NOISE'" >&2; exit 2 ;;
esac
# Each seed is two sweeps: at most 100, so that a typo cannot run for days.
if ! [[ $REPLAY_SEEDS =~ ^[0-9]+$ ]] || ((10#$REPLAY_SEEDS < 1 || 10#$REPLAY_SEEDS > 100)); then
  echo "REPLAY_SEEDS is a whole number from 1 to 100, not '$REPLAY_SEEDS'" >&2; exit 2
fi
TOKEN_SETTINGS=${TOKEN_SETTINGS:-}
STEP=${STEP:-1.25}
TOL=${TOL:-0.05}
MAX_PROBES=${MAX_PROBES:-8}
REPEAT=${REPEAT:-1}
# The model on one thread pinned to ENGINE_CPU (the load generator on the other cores), both at
# ENGINE_NICE (a negative value needs root: it keeps other work on a shared machine from taking
# their turns; the load generator's timestamps are the TBT and TTFT measured).
ENGINE_CPU=${ENGINE_CPU:-1}
ENGINE_NICE=${ENGINE_NICE:-0}
# Where the kernel groups tasks into autogroups (sched_autogroup: one a login or setsid), a nice
# weighs a task only against its own autogroup's: another autogroup's build at nice 19 takes the
# engine's core in turns with it. This script's autogroup (the engine, the load generator, the
# script, and whatever else runs in it) is set to ENGINE_NICE as well, and put back on exit.
GROUP_NICE=""
if [[ $ENGINE_NICE != 0 && -e /proc/self/autogroup ]]; then
  GROUP_NICE=$(sed 's/.*nice //' /proc/self/autogroup)
  echo "$ENGINE_NICE" 2>/dev/null >/proc/self/autogroup || { echo "could not set the autogroup's nice to $ENGINE_NICE" >&2; GROUP_NICE=""; }
fi
PORT=${PORT:-8327}
CARGO=${CARGO:-cargo}
mkdir -p "$OUT"

if [[ -z "${ENGINE:-}" || -z "${CHUNKING:-}" ]]; then
  $CARGO build --release -p mstar-engine -p mstar-chunking-sim --bins
  BIN=${CARGO_TARGET_DIR:-target}/release
  ENGINE=$BIN/mstar-engine
  CHUNKING=$BIN/mstar-chunking
fi
LOAD_CPUS=$(python3 -c "import os; print(','.join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != $ENGINE_CPU) or '$ENGINE_CPU')")

SERVER=""
LOADGEN=""
stop_server() {
  if [[ -n "$SERVER" ]]; then
    kill -TERM "$SERVER" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    SERVER=""
  fi
}
cleanup() {
  if [[ -n "$LOADGEN" ]]; then kill -TERM "$LOADGEN" 2>/dev/null || true; wait "$LOADGEN" 2>/dev/null || true; fi
  stop_server
  if [[ -n "$GROUP_NICE" ]]; then echo "$GROUP_NICE" 2>/dev/null >/proc/self/autogroup || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

load1() { cut -d' ' -f1 /proc/loadavg; }

# run DIR RATE TIMEOUT_S SERVE-FLAGS...: serve on one pinned core, send the first REQUESTS
# requests at RATE, stop the server. The report lands in DIR/bench.json unless the run
# passed TIMEOUT_S.
run() {
  local dir=$1 rate=$2 timeout=$3; shift 3
  mkdir -p "$dir"
  rm -f "$dir/bench.json" "$dir/steps.jsonl"
  RAYON_NUM_THREADS=1 taskset -c "$ENGINE_CPU" nice -n "$ENGINE_NICE" "$ENGINE" serve --model smollm2 \
    --listen "127.0.0.1:$PORT" --step-log "$dir/steps.jsonl" --grace-secs 1 "$@" >"$dir/serve.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 300); do
    grep -q "listening on" "$dir/serve.log" && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$dir/serve.log" >&2; exit 1; }
    sleep 0.2
  done
  taskset -c "$LOAD_CPUS" nice -n "$ENGINE_NICE" "$ENGINE" bench --url "http://127.0.0.1:$PORT" --trace "$TRACE" \
    --requests "$REQUESTS" --rate-scale "$rate" --length-scale "$LENGTH_SCALE" \
    --max-prompt "$MAX_PROMPT" --max-output "$MAX_OUTPUT" --timeout-secs "$timeout" \
    --report-json "$dir/bench.json" --write-trace "$dir/scaled.csv" >"$dir/bench.log" 2>&1 &
  LOADGEN=$!
  wait "$LOADGEN" || true
  LOADGEN=""
  stop_server
}

wants() { [[ " $STAGES " == *" $1 "* ]]; }

if wants cal; then
  echo "== calibration: token budget $CAL_BUDGET at rate x $CAL_RATE (load $(load1))"
  run "$OUT/cal" "$CAL_RATE" 1800 --budget "$CAL_BUDGET" --align 1 --min-chunk-tokens "$FLOOR"
  test -s "$OUT/cal/bench.json" || { echo "the calibration run did not finish" >&2; exit 1; }
  "$CHUNKING" fit --errors relative "$OUT/cal/steps.jsonl" --node llm | tee "$OUT/cal/fit.txt"
  # The replay's cost and noise bands from the steps that run a decode row, whose times are the
  # gaps TBT is made of (REPLAY_NOISE=decode), or from every step (all). The steps that run
  # prompt chunks alone (a busy period's first steps, a long prompt's last chunks) scatter past
  # 1.1 x the fit two to seven times as often; drawn onto steps of several decode rows, they set
  # the replay's TBT p99 (engine/results/capacity-2026-12-06-fidelity.md).
  "$CHUNKING" fit --errors relative --for replay "$OUT/cal/steps.jsonl" --node llm >"$OUT/cal/replay-cost.txt"
  python3 engine/scripts/capacity.py decode-steps "$OUT/cal/steps.jsonl" "$OUT/cal/steps-decode.jsonl"
  "$CHUNKING" fit --errors relative --for replay "$OUT/cal/steps-decode.jsonl" --node llm >"$OUT/cal/replay-cost-decode.txt"
  python3 engine/scripts/capacity.py objective "$OUT/cal" "$TBT_FACTOR" "$TTFT_FACTOR" "$TIME_SHARE" \
    >"$OUT/objective.env"
  # The rate the calibration ran at, for the later stages (its trace's rates are relative to it).
  echo "CAL_RATE=$CAL_RATE" >>"$OUT/objective.env"
fi
if [[ ! -f "$OUT/objective.env" ]]; then
  echo "no calibration in $OUT (objective.env): run the cal stage first (STAGES=cal, or the defaults)" >&2
  exit 2
fi
# shellcheck disable=SC2046
export $(cat "$OUT/objective.env")
echo "objective: TBT p99 <= $TBT_MS ms, TTFT p90 <= $TTFT_MS ms; time budget X = $X_MS ms (decode-only median $DECODE_MS ms)"

if wants replay; then
  # The replay's config: the engine's floor, the planner's cost, and each step priced from the
  # calibration's fit with its noise bands (none with REPLAY_NOISE=off). The time budget runs in
  # a sweep of its own whose config sets it with the margin (a margin is refused where no node
  # has a time budget, as in the token budgets' cells); its one cell runs under the token budget
  # of 2048, as the engine's.
  case $REPLAY_NOISE in
    decode) cost=$(sed -n '/^\[replay.cost\]/,$p' "$OUT/cal/replay-cost-decode.txt"); seeds=$REPLAY_SEEDS ;;
    all) cost=$(sed -n '/^\[replay.cost\]/,$p' "$OUT/cal/replay-cost.txt"); seeds=$REPLAY_SEEDS ;;
    off) cost=$(sed -n '/^\[replay.cost\]/,$p' "$OUT/cal/replay-cost.txt" | sed '/^\[\[replay.cost.noise_bands\]\]/,$d' | grep -v '^#')
      seeds=1 ;;
    *) echo "REPLAY_NOISE is decode, all or off, not '$REPLAY_NOISE'" >&2; exit 2 ;;
  esac
  { printf '[chunking]\nmin_chunk_tokens = %s\n\n' "$FLOOR"
    sed -n '/^\[chunking.cost.llm\]/,$p' "$OUT/cal/fit.txt"; echo
    echo "$cost"; } >"$OUT/replay.toml"
  printf '[chunking]\ntime_margin = %s\n\n[chunking.max_step_ms]\nllm = %s\n' "$TIME_MARGIN" "$X_MS" >"$OUT/replay-time.toml"
  sweep() {
    local out=$1; shift
    "$CHUNKING" sweep --no-progress --jobs 1 --out "$out" --model engine/scripts/capacity-model.toml \
      --config "$OUT/replay.toml" --trace "$OUT/cal/scaled.csv" --format generic --rates 0.5,1,2 \
      --slo-tbt-p99 "$TBT_MS" --slo-ttft-p90 "$TTFT_MS" "$@" >"$out.txt" 2>&1 || { cat "$out.txt" >&2; exit 1; }
  }
  # Once per noise seed: a TBT p99 rests on the few largest draws, so one seed moves a setting
  # whose steps sit near the TBT bound by a third; the capacity is the median over the seeds.
  echo "== replay: sweep of token budgets $REPLAY_BUDGETS and of $X_MS ms, $seeds seed(s) (load $(load1))"
  rm -rf "$OUT"/replay-seeds.txt "$OUT"/replay-tokens-s* "$OUT"/replay-time-s*
  for seed in $(seq 1 "$seeds"); do
    export MSTAR__REPLAY__SPECULATION__SEED=$seed
    sweep "$OUT/replay-tokens-s$seed" --budgets "$REPLAY_BUDGETS"
    sweep "$OUT/replay-time-s$seed" --config "$OUT/replay-time.toml" --budgets 2048
    { python3 engine/scripts/capacity.py replay "$OUT/replay-tokens-s$seed" "$CAL_RATE"
      python3 engine/scripts/capacity.py replay "$OUT/replay-time-s$seed" "$CAL_RATE" time; } | sed "s/^/$seed /" >>"$OUT/replay-seeds.txt"
  done
  unset MSTAR__REPLAY__SPECULATION__SEED
  python3 engine/scripts/capacity.py median "$OUT/replay-seeds.txt" | tee "$OUT/replay-capacity.txt"
fi

if wants engine || wants summary; then
  TOKEN_SETTINGS=${TOKEN_SETTINGS:-$(python3 engine/scripts/capacity.py best-tokens "$OUT/replay-capacity.txt" 2)}
  SETTINGS="$TOKEN_SETTINGS,time"
fi

if wants engine; then
  test -f "$OUT/probes.tsv" || printf 'setting\trate\toutcome\tttft_p90_ms\ttbt_p99_ms\tcompleted\tload_start\tload_end\tstarted_utc\tsecs\n' >"$OUT/probes.tsv"
  for s in ${SETTINGS//,/ }; do
    if [[ $s == time ]]; then
      flags=(--budget 2048 --align 1 --min-chunk-tokens "$FLOOR" --max-step-ms "$X_MS" --cost "$COST"
        --learn-cost --time-margin "$TIME_MARGIN")
    else
      flags=(--budget "$s" --align 1 --min-chunk-tokens "$FLOOR")
    fi
    start=$(awk -v s="$s" '$1 == s {print $2}' "$OUT/replay-capacity.txt")
    [[ -n "$start" && "$start" != 0.0000 ]] || start=$CAL_RATE
    while rate=$(python3 engine/scripts/capacity.py next "$OUT/probes.tsv" "$s" "$start" "$STEP" "$TOL" "$MAX_PROBES") \
      && [[ -n "$rate" ]]; do
      # A probe is bounded: its arrivals, then three TTFT bounds and a whole output at the TBT
      # bound; a run still going then has left most of its last requests past the objective.
      timeout=$(python3 -c "print(round($SPAN_S * $CAL_RATE / $rate + 3 * $TTFT_MS / 1000 + $MAX_OUTPUT * $TBT_MS / 1000 + 10))")
      l0=$(load1); t0=$(date -u +%H:%M:%S); s0=$SECONDS
      run "$OUT/$s/r$rate" "$rate" "$timeout" "${flags[@]}"
      read -r outcome ttft tbt finished < <(python3 engine/scripts/capacity.py probe "$OUT/$s/r$rate/bench.json" "$TTFT_MS" "$TBT_MS")
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$s" "$rate" "$outcome" "$ttft" "$tbt" "$finished" \
        "$l0" "$(load1)" "$t0" "$((SECONDS - s0))" | tee -a "$OUT/probes.tsv"
    done
    # The capacity found is probed once more (as setting `<s>-repeat`): a second miss or meet
    # says how much the shared machine moved the edge.
    lo=$(python3 engine/scripts/capacity.py capacity "$OUT/probes.tsv" "$s")
    if [[ $REPEAT == 1 && -n "$lo" && ! -d "$OUT/$s-repeat/r$lo" ]]; then
      timeout=$(python3 -c "print(round($SPAN_S * $CAL_RATE / $lo + 3 * $TTFT_MS / 1000 + $MAX_OUTPUT * $TBT_MS / 1000 + 10))")
      l0=$(load1); t0=$(date -u +%H:%M:%S); s0=$SECONDS
      run "$OUT/$s-repeat/r$lo" "$lo" "$timeout" "${flags[@]}"
      read -r outcome ttft tbt finished < <(python3 engine/scripts/capacity.py probe "$OUT/$s-repeat/r$lo/bench.json" "$TTFT_MS" "$TBT_MS")
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$s-repeat" "$lo" "$outcome" "$ttft" "$tbt" "$finished" \
        "$l0" "$(load1)" "$t0" "$((SECONDS - s0))" | tee -a "$OUT/probes.tsv"
    fi
  done
fi

if wants summary; then
  python3 engine/scripts/capacity.py summary "$OUT" "$SETTINGS" | tee "$OUT/summary.md"
fi
