#!/usr/bin/env bash
# Installs the vLLM release the mstar_chunking.vllm scheduler supports into a venv outside the
# clone, reused when it is already complete. Prints the venv's path on its last line.
#
#   MSTAR_VLLM_VENV   the venv (default ${XDG_CACHE_HOME:-$HOME/.cache}/mstar-chunking/vllm-venv)
#   MSTAR_VLLM_PYTHON the interpreter that creates it (default python3; vLLM 0.33 wants >= 3.11)
#
# vLLM pins its torch; PyPI carries only the CUDA build of that torch for Linux x86_64, so the
# venv is about 11 GB. The scheduler's tests run on the CPU and never touch a GPU.
set -euo pipefail

VLLM_VERSION="0.33.0"
VENV="${MSTAR_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/mstar-chunking/vllm-venv}"
PY="${MSTAR_VLLM_PYTHON:-python3}"
STAMP="$VENV/.mstar-vllm-$VLLM_VERSION"

# One install at a time: `make test` starts one in the background while it builds, and a vLLM
# target waits here for it to end, then finds the venv complete (or installs what is missing).
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
	echo "vLLM $VLLM_VERSION already installed" >&2
	echo "$VENV"
	exit 0
fi

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
	{ echo "install-vllm: $PY is older than 3.11, which vLLM $VLLM_VERSION needs (set MSTAR_VLLM_PYTHON)" >&2; exit 1; }

# An interrupted install leaves the venv without its stamp: pip resumes over it.
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
	"vllm==$VLLM_VERSION" "pytest>=7" "maturin>=1.5,<2"
"$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" ||
	{ echo "install-vllm: $VENV has no vLLM $VLLM_VERSION after the install" >&2; exit 1; }
touch "$STAMP"
echo "$VENV"
