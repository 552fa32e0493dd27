#!/usr/bin/env bash
# The vLLM scheduler's cost comparison (python/tests/vllm/test_cost.py: the plugin's
# schedule() + update_from_output() per step against vLLM's own on W1-W3) on a wheel of the
# package built here, installed beside the cached vLLM venv (pip --target, first on PYTHONPATH)
# rather than into it, so the venv and any wheel installed there stay as they are. Not in CI.
#
#   PROFILE   release (default; what `pip install mstar-chunking` builds) or dev (what
#             `make test-vllm` builds: the crate unoptimised)
#   MSTAR_VLLM_COST_STEPS   steps measured per workload (default 60)
#
# Prints each workload's medians and ratios; writes target/vllm-cost.json.
set -euo pipefail
cd "$(dirname "$0")/../.."

PROFILE="${PROFILE:-release}"
case "$PROFILE" in
release) flags=(--release) ;;
dev) flags=() ;;
*) echo "vllm-cost: PROFILE is release or dev, not $PROFILE" >&2; exit 2 ;;
esac
venv="$(python/scripts/install-vllm.sh | tail -n 1)"
wheels="target/vllm-cost-wheels-$PROFILE"
site="target/vllm-cost-site-$PROFILE"
rm -rf "$wheels" "$site"
nice -n 10 "$venv/bin/maturin" build "${flags[@]}" -m python/Cargo.toml -i "$venv/bin/python" --out "$wheels"
"$venv/bin/pip" install -q --disable-pip-version-check --target "$site" --no-deps "$wheels"/mstar_chunking-*.whl
MSTAR_VLLM_COST_BUILD="$PROFILE" PYTHONPATH="$site" \
	"$venv/bin/python" -m pytest -q -s -p no:cacheprovider python/tests/vllm/test_cost.py
