# mstar-chunking: `make help` lists the targets.
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: help run test test-deps lint fmt doc bench soak fuzz

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

run: ## Replay the bundled trace with the default config and the demo model
	$(CARGO) run --release --bin mstar-chunking -- replay

lint: ## rustfmt check and clippy with warnings as errors
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings

fmt: ## Format the code
	$(CARGO) fmt

doc: ## Build the API docs
	$(CARGO) doc --no-deps

test: test-deps lint ## Install what the tests need, lint, then the whole test suite
	$(CARGO) test --all-targets

test-deps: ## Install what the tests need: prometheus + promtool (apt), python3, @grafana/schema + typescript (npm, into target/)
	scripts/install-test-deps.sh

bench: ## Criterion benchmarks of one step (not in CI), then their table
	$(CARGO) bench --bench step
	python3 scripts/bench_table.py

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
