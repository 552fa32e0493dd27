"""examples/engine_loop.py replays a trace through the step API, one message a step, with the
step count (and under a time budget, the time-overrun count) of `mstar-chunking replay` on the
same settings (the binary runs in the same test)."""

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


def run_replay(tmp_path, *args, config=None):
    binary = replay_binary()
    if binary is None:
        pytest.skip("no mstar-chunking binary: `cargo build --bin mstar-chunking` or set MSTAR_CHUNKING_BIN")
    report = tmp_path / "report.json"
    cmd = [binary, "replay", "--requests", "500", "--report-json", str(report), *args]
    if config is not None:
        layer = tmp_path / "layer.toml"
        layer.write_text(config)
        cmd += ["--config", str(layer)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSTAR")}
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600, env=env)
    return json.loads(report.read_text())


def assert_same(ours, rust):
    assert ours["requests"] == rust["requests"] == 500
    assert ours["steps"] == rust["steps"]
    assert ours["scheduled_tokens"] == rust["tokens"]["scheduled"]
    assert ours["prefill_tokens"] == rust["tokens"]["prefill"]
    assert ours["decode_tokens"] == rust["tokens"]["decode"]
    assert ours["chunks"] == rust["chunks"]["total"]
    assert ours["time_overruns"] == rust["time_overruns"]["total"]
    assert ours["simulated_ms"] == pytest.approx(rust["simulated_ms"], abs=0.002)
    assert ours["prepared_left"] == 0


@pytest.mark.parametrize("budget", [None, 512])
def test_the_first_500_requests_take_as_many_steps_as_replay(tmp_path, budget):
    rust = run_replay(tmp_path, *([] if budget is None else ["--budget", str(budget)]))
    ours = engine_loop.replay(engine_loop.read_azure(engine_loop.TRACE, 500), budget)
    assert_same(ours, rust)


@pytest.mark.parametrize("max_step_ms, overruns", [(12.0, True), (100.0, False)])
def test_under_a_time_budget_the_steps_and_time_overruns_are_replay_s(tmp_path, max_step_ms, overruns):
    preset = "llama2-7b-a100"
    rust = run_replay(
        tmp_path,
        config=f'[chunking]\nmax_step_ms = {{ llm = {max_step_ms} }}\ncost = {{ llm = "{preset}" }}\n[replay]\ncost = "{preset}"\n',
    )
    ours = engine_loop.replay(
        engine_loop.read_azure(engine_loop.TRACE, 500), max_step_ms=max_step_ms, cost=preset
    )
    # 12 ms is tight enough for the floor to run over it: time overruns are counted alike.
    assert (rust["time_overruns"]["total"] > 0) == overruns
    assert_same(ours, rust)


def test_the_example_runs_as_a_script_with_the_time_budget_flags():
    out = subprocess.run(
        [sys.executable, str(ROOT / "python" / "examples" / "engine_loop.py"), "--requests", "50",
         "--max-step-ms", "100", "--cost", "llama2-7b-a100"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    lines = dict(line.split(": ", 1) for line in out.splitlines())
    assert int(lines["steps"]) > 0 and lines["requests"] == "50" and lines["prepared_left"] == "0"
