"""examples/engine_loop.py replays a trace through the step API with the step count of
`mstar-chunking replay` on the same settings (the binary runs in the same test)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "examples"))

import engine_loop  # noqa: E402


def replay_binary():
    given = os.environ.get("MSTAR_CHUNKING_BIN")
    if given:
        return given
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "mstar-chunking"
        if p.exists():
            return str(p)
    return shutil.which("mstar-chunking")


@pytest.mark.parametrize("budget", [None, 512])
def test_the_first_500_requests_take_as_many_steps_as_replay(tmp_path, budget):
    binary = replay_binary()
    if binary is None:
        pytest.skip("no mstar-chunking binary: `cargo build --bin mstar-chunking` or set MSTAR_CHUNKING_BIN")
    report = tmp_path / "report.json"
    cmd = [binary, "replay", "--requests", "500", "--report-json", str(report)]
    if budget is not None:
        cmd += ["--budget", str(budget)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    rust = json.loads(report.read_text())

    ours = engine_loop.replay(engine_loop.read_azure(engine_loop.TRACE, 500), budget)
    assert ours["requests"] == rust["requests"] == 500
    assert ours["steps"] == rust["steps"]
    assert ours["scheduled_tokens"] == rust["tokens"]["scheduled"]
    assert ours["prefill_tokens"] == rust["tokens"]["prefill"]
    assert ours["decode_tokens"] == rust["tokens"]["decode"]
    assert ours["chunks"] == rust["chunks"]["total"]
    assert ours["simulated_ms"] == pytest.approx(rust["simulated_ms"], abs=0.002)
    assert ours["prepared_left"] == 0
