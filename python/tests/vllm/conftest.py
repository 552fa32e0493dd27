"""The vLLM scheduler's tests need vLLM (`make test-vllm` installs it into a cached venv): where it
is not installed (the package's own `make test-python` venv) they are not collected at all, but
for `test_unit_*.py`, which test the plugin's parts that import without vLLM."""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("vllm.v1") is None:
    collect_ignore = [
        p.name for p in Path(__file__).parent.glob("test_*.py") if not p.name.startswith("test_unit_")
    ]
else:
    sys.path.insert(0, str(Path(__file__).parent))
