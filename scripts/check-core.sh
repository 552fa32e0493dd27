#!/usr/bin/env bash
# The component's promises to an embedding engine that are not tests of behaviour:
# - its default features are the engine core, and pull in at most 50 crates (normal
#   dependencies, this one included), no more than `default-features = false` does;
# - it depends on nothing of the simulator (`mstar-chunking-sim`);
# - `rust-version` is at least what every locked dependency needs (scripts/check-msrv.py);
# - `cargo package` lists the crate and its docs, no test fixtures, and warns about nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}

count() { $CARGO tree -p mstar-chunking -e normal --prefix none "$@" | sed 's/ (\*)$//' | sort -u | wc -l; }
crates=$(count --no-default-features)
if [ "$crates" -gt 50 ]; then
  echo "the core (--no-default-features) needs $crates crates; at most 50 are allowed:" >&2
  $CARGO tree -p mstar-chunking -e normal --no-default-features >&2
  exit 1
fi
default=$(count)
if [ "$default" -gt "$crates" ]; then
  echo "the component's default features need $default crates, more than the core's $crates" >&2
  exit 1
fi
if $CARGO tree -p mstar-chunking -e normal --all-features --prefix none | grep -q '^mstar-chunking-sim '; then
  echo "the component depends on the simulator" >&2
  exit 1
fi
echo "core: $crates crates without default features, $default with them (at most 50)"

python3 scripts/check-msrv.py

out=$($CARGO package -p mstar-chunking --allow-dirty --no-verify 2>&1) || { echo "$out" >&2; exit 1; }
# The crate is not published (`publish = false`), so it links no docs.rs page, homepage or
# repository; cargo's warning about that metadata is the one expected.
unexpected=$(grep -i '^warning' <<<"$out" | grep -iv '^warning: manifest has no documentation, homepage or repository$' || true)
if [ -n "$unexpected" ]; then
  echo "cargo package warns:" >&2
  echo "$out" >&2
  exit 1
fi
if $CARGO package -p mstar-chunking --allow-dirty --list 2>/dev/null | grep -E '^(tests/fixtures|dashboards|fuzz|scripts)/'; then
  echo "the package holds test fixtures or tooling (see include in Cargo.toml)" >&2
  exit 1
fi
echo "package: $($CARGO package -p mstar-chunking --allow-dirty --list 2>/dev/null | wc -l) files, no warnings"
