#!/usr/bin/env bash
# Installs what the integration tests need and is idempotent:
# - `prometheus` and `promtool` (Debian's `prometheus` package) for the live metrics tests;
# - `valgrind` (Debian) and `gungraun-runner` (cargo install) for `make bench-check`;
# - `python3` for the step-log checker;
# - `shellcheck` (Debian) for the Slurm script, and `ip` (Debian's iproute2) for the loopback-only
#   network namespace the Ray test runs in, and GNU `parallel` (Debian) (`make test-ray`);
# - `@grafana/schema` and `typescript` (npm) into a scratch folder for the dashboard type-check.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
scratch="${DASHBOARD_TYPECHECK_DIR:-$root/target/dashboard-typecheck}"

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo -n "$@"
    else
        echo "install-test-deps: need root (or sudo) to run: $*" >&2
        return 1
    fi
}

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    if ! command -v apt-get >/dev/null; then
        echo "install-test-deps: prometheus/promtool missing and no apt-get; install Prometheus 2.x so both are on PATH" >&2
        exit 1
    fi
    echo "install-test-deps: installing Debian's prometheus package (prometheus, promtool)"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq
    # The package's service is not wanted: the tests start their own server.
    as_root apt-get install -y -qq --no-install-recommends prometheus
    if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
        as_root systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
fi
prometheus --version 2>&1 | head -n1
promtool --version 2>&1 | head -n1

# The step-log checker (tests/fixtures/shared/tools/check_step_log.py) needs a Python 3.
if ! command -v python3 >/dev/null; then
    echo "install-test-deps: installing Debian's python3"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq
    as_root apt-get install -y -qq --no-install-recommends python3
fi
python3 --version

# `make test-ray` runs a sweep's cells with GNU parallel: Debian's parallel.
if ! command -v parallel >/dev/null; then
    echo "install-test-deps: installing Debian's parallel"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq
    as_root apt-get install -y -qq --no-install-recommends parallel
fi

# `make test-ray` brings up loopback in a network namespace of its own: Debian's iproute2.
if ! command -v ip >/dev/null; then
    echo "install-test-deps: installing Debian's iproute2"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq
    as_root apt-get install -y -qq --no-install-recommends iproute2
fi

# The Slurm script is linted by `make test-ray`: Debian's shellcheck.
if ! command -v shellcheck >/dev/null; then
    echo "install-test-deps: installing Debian's shellcheck"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq
    as_root apt-get install -y -qq --no-install-recommends shellcheck
fi
shellcheck --version | sed -n 2p

# Instruction counts (make bench-check): valgrind (Debian) and gungraun-runner, the exact
# version of the `gungraun` crate in Cargo.lock (the harness refuses any other).
if ! command -v valgrind >/dev/null; then
    echo "install-test-deps: installing Debian's valgrind"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq
    as_root apt-get install -y -qq --no-install-recommends valgrind
fi
valgrind --version
gungraun="$(awk '/^name = "gungraun"$/ { getline; gsub(/[^0-9.]/, ""); print; exit }' "$root/Cargo.lock")"
if [ -z "$gungraun" ]; then
    echo "install-test-deps: no gungraun package in Cargo.lock" >&2
    exit 1
fi
if ! gungraun-runner --version 2>/dev/null | grep -qF "$gungraun"; then
    echo "install-test-deps: installing gungraun-runner $gungraun (cargo install)"
    cargo install gungraun-runner --version "$gungraun" --locked
fi
gungraun-runner --version

if ! command -v npm >/dev/null; then
    echo "install-test-deps: npm missing; install Node.js (Debian: apt-get install nodejs npm)" >&2
    exit 1
fi
mkdir -p "$scratch"
src="$root/dashboards/typecheck"
# Reinstall when the pinned versions changed (the lock file is newer than the install).
if [ ! -f "$scratch/node_modules/typescript/bin/tsc" ] || [ ! -d "$scratch/node_modules/@grafana/schema" ] \
    || [ "$src/package-lock.json" -nt "$scratch/node_modules/.package-lock.json" ]; then
    echo "install-test-deps: installing @grafana/schema and typescript into $scratch"
    cp "$src/package.json" "$src/package-lock.json" "$scratch/"
    (cd "$scratch" && npm ci --no-audit --no-fund --loglevel=error)
fi
echo "install-test-deps: typescript $(node "$scratch/node_modules/typescript/bin/tsc" --version)," \
    "@grafana/schema $(node -p "require('$scratch/node_modules/@grafana/schema/package.json').version")"
