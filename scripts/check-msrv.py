#!/usr/bin/env python3
"""Checks `rust-version` in Cargo.toml against the locked dependencies.

The machine has one toolchain, so the minimum supported Rust version cannot be proven by
building with an older compiler here. Instead: every locked dependency the crate builds with
(normal dependencies, every feature, on this platform) declares the oldest Rust it supports,
and our `rust-version` must be at least the highest of those, and at most the toolchain that
builds and tests it in CI. Exits 1 naming the dependency that needs a newer Rust.
"""
import json
import subprocess
import sys


def version(s):
    return tuple(int(x) for x in s.split(".")[:3]) + (0,) * (3 - len(s.split(".")))


def main():
    target = subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout
    host = next(l.split(": ")[1] for l in target.splitlines() if l.startswith("host: "))
    rustc = next(l.split(": ")[1] for l in target.splitlines() if l.startswith("release: "))
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--all-features", "--locked",
         "--filter-platform", host],
        capture_output=True, text=True, check=True).stdout)
    packages = {p["id"]: p for p in meta["packages"]}
    root = meta["resolve"]["root"]
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    # Normal and build dependencies reachable from the crate (dev-dependencies only build tests).
    seen, stack = set(), [root]
    while stack:
        nid = stack.pop()
        for dep in nodes[nid]["deps"]:
            kinds = {k["kind"] for k in dep["dep_kinds"]}
            if nid == root and kinds == {"dev"}:
                continue
            if dep["pkg"] not in seen:
                seen.add(dep["pkg"])
                stack.append(dep["pkg"])
    ours = packages[root].get("rust_version")
    if not ours:
        print("Cargo.toml has no rust-version")
        return 1
    needs = sorted(((version(packages[p]["rust_version"]), packages[p]["name"], packages[p]["rust_version"])
                    for p in seen if packages[p].get("rust_version")), reverse=True)
    top = needs[0]
    problems = []
    if version(ours) < top[0]:
        problems.append(f"rust-version = {ours}, but {top[1]} needs Rust {top[2]}")
    if version(ours) > version(rustc):
        problems.append(f"rust-version = {ours} is newer than the toolchain here ({rustc})")
    if problems:
        print("\n".join(problems))
        return 1
    print(f"rust-version {ours}: the newest a dependency needs is {top[2]} ({top[1]}); built with {rustc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
