#!/usr/bin/env bash
# Runs the vLLM scheduler plugin under `vllm serve` on a GPU machine (not in CI): a small model,
# vLLM's own load generator (`vllm bench serve`, random prompts of mixed lengths at a fixed
# request rate), and the TBT (inter-token latency) and TTFT percentiles of three runs:
#
#   vllm     vLLM's own scheduler
#   tokens   mstar_chunking.vllm.Scheduler with the token budget only (max_num_batched_tokens)
#   time     the same under a time budget of MAX_STEP_MS, the latency model learned online
#            (async scheduling off for this run: see docs/vllm.md#step-times)
#
# Settings (environment): MODEL (default Qwen/Qwen2.5-0.5B-Instruct), PORT (8011),
# MAX_STEP_MS (40), BUDGET (max_num_batched_tokens, 2048), PROMPTS (400), RATE (requests/s, 8),
# INPUT_LEN (2048, +-90%), OUTPUT_LEN (128), OUT (target/vllm-serve-bench), RUNS ("vllm tokens time").
# Each run's server log and results are under OUT; the table goes to stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
PORT="${PORT:-8011}"
MAX_STEP_MS="${MAX_STEP_MS:-40}"
BUDGET="${BUDGET:-2048}"
PROMPTS="${PROMPTS:-400}"
RATE="${RATE:-8}"
INPUT_LEN="${INPUT_LEN:-2048}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
OUT="${OUT:-target/vllm-serve-bench}"
RUNS="${RUNS:-vllm tokens time}"

command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 ||
	{ echo "vllm-serve-bench: no GPU here (nvidia-smi finds none)" >&2; exit 1; }

venv="$(python/scripts/install-vllm.sh | tail -n 1)"
rm -rf target/vllm-wheels
"$venv/bin/maturin" build --release -m python/Cargo.toml -i "$venv/bin/python" --out target/vllm-wheels
"$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps target/vllm-wheels/mstar_chunking-*.whl
mkdir -p "$OUT"

server=""
stop_server() {
	if [[ -n "$server" ]]; then
		kill "$server" 2>/dev/null || true
		wait "$server" 2>/dev/null || true
		server=""
	fi
}
trap stop_server EXIT INT TERM

run() {
	local name="$1"
	shift
	local -a env_args=() serve_args=()
	case "$name" in
	vllm) ;;
	tokens) serve_args=(--scheduler-cls mstar_chunking.vllm.Scheduler) ;;
	time)
		serve_args=(--scheduler-cls mstar_chunking.vllm.Scheduler --no-async-scheduling)
		env_args=("MSTAR__CHUNKING__MAX_BATCH_TOKENS__LLM__MIXED=$BUDGET"
			"MSTAR__CHUNKING__MAX_STEP_MS__LLM__MIXED=$MAX_STEP_MS"
			"MSTAR__CHUNKING__LEARN_COST=true")
		;;
	*) echo "vllm-serve-bench: unknown run $name (vllm, tokens, time)" >&2; exit 2 ;;
	esac
	echo "== $name" >&2
	env "${env_args[@]}" "$venv/bin/vllm" serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
		--max-num-batched-tokens "$BUDGET" "${serve_args[@]}" >"$OUT/$name.serve.log" 2>&1 &
	server=$!
	# Bounded wait for the server (model download and start-up): 10 minutes.
	if ! curl -fsS --retry 120 --retry-delay 5 --retry-connrefused --max-time 5 \
		"http://127.0.0.1:$PORT/health" >/dev/null; then
		echo "vllm-serve-bench: the $name server did not come up (see $OUT/$name.serve.log)" >&2
		exit 1
	fi
	"$venv/bin/vllm" bench serve --backend vllm --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
		--dataset-name random --random-input-len "$INPUT_LEN" --random-range-ratio 0.9 \
		--random-output-len "$OUTPUT_LEN" --num-prompts "$PROMPTS" --request-rate "$RATE" \
		--ignore-eos --percentile-metrics ttft,itl --metric-percentiles 50,99 \
		--save-result --result-dir "$OUT" --result-filename "$name.json" >"$OUT/$name.bench.log" 2>&1
	curl -fsS --max-time 10 "http://127.0.0.1:$PORT/metrics" >"$OUT/$name.metrics.txt" || true
	stop_server
}

for name in $RUNS; do run "$name"; done

"$venv/bin/python" - "$OUT" $RUNS <<'PY'
import json, sys
out, runs = sys.argv[1], sys.argv[2:]
print(f"{'run':8} {'TBT p50':>9} {'TBT p99':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>8}")
for name in runs:
    r = json.load(open(f"{out}/{name}.json"))
    print(f"{name:8} {r['median_itl_ms']:9.1f} {r['p99_itl_ms']:9.1f} {r['median_ttft_ms']:9.1f} "
          f"{r['p99_ttft_ms']:9.1f} {r['output_throughput']:8.0f}")
PY
