#!/usr/bin/env bash
# The library's promises to an embedding engine that are not tests of behaviour:
# - `default-features = false` pulls in at most 50 crates (normal dependencies, this one included);
# - `rust-version` is at least what every locked dependency needs (scripts/check-msrv.py);
# - `cargo package` lists the crate and its docs, no test fixtures, and warns about nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}

crates=$($CARGO tree -e normal --prefix none --no-default-features | sed 's/ (\*)$//' | sort -u | wc -l)
if [ "$crates" -gt 50 ]; then
  echo "the core (--no-default-features) needs $crates crates; at most 50 are allowed:" >&2
  $CARGO tree -e normal --no-default-features >&2
  exit 1
fi
echo "core: $crates crates without default features (at most 50)"

python3 scripts/check-msrv.py

out=$($CARGO package --allow-dirty --no-verify 2>&1) || { echo "$out" >&2; exit 1; }
# The crate is not published (`publish = false`), so it links no docs.rs page, homepage or
# repository; cargo's warning about that metadata is the one expected.
unexpected=$(grep -i '^warning' <<<"$out" | grep -iv '^warning: manifest has no documentation, homepage or repository$' || true)
if [ -n "$unexpected" ]; then
  echo "cargo package warns:" >&2
  echo "$out" >&2
  exit 1
fi
if $CARGO package --allow-dirty --list 2>/dev/null | grep -E '^(tests/fixtures|dashboards|fuzz|scripts)/'; then
  echo "the package holds test fixtures or tooling (see include in Cargo.toml)" >&2
  exit 1
fi
echo "package: $($CARGO package --allow-dirty --list 2>/dev/null | wc -l) files, no warnings"
