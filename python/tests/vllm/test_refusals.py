"""What the plugin refuses: another vLLM release at import, unsupported features at start (by
name), structured output per request, and a chunking config vLLM's runner could not take."""

import os
import subprocess
import sys

import pytest
from harness import Driver, make_request, make_scheduler
from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from mstar_chunking.vllm import CONFIG_ENV, Scheduler, UnsupportedVllmFeature, _refusals


def test_other_vllm_releases_are_refused_at_import():
    versions = ["0.32.0", "0.34.0", "1.0.0", "dev"]
    code = (
        "import vllm\n"
        f"for v in {versions!r}:\n"
        "    vllm.__version__ = v\n"
        "    try:\n"
        "        import mstar_chunking.vllm\n"
        "        print('imported', v)\n"
        "    except ImportError as e:\n"
        "        print(e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert len(lines) == len(versions), p.stdout
    for v, line in zip(versions, lines):
        assert "supports vLLM 0.33.x" in line and f"found vLLM {v}." in line, line


def _config():
    s = make_scheduler(Scheduler)
    cfg = s.vllm_config
    s.shutdown()
    return cfg


@pytest.mark.parametrize(
    "attr, value, name",
    [
        ("lora_config", object(), "LoRA"),
        ("speculative_config", object(), "speculative decoding"),
        ("kv_transfer_config", object(), "KV transfer"),
        ("ec_transfer_config", object(), "encoder-cache transfer"),
    ],
)
def test_unsupported_features_are_named(attr, value, name):
    cfg = _config()
    object.__setattr__(cfg, attr, value)
    problems = _refusals(cfg)
    assert any(p.startswith(name) for p in problems), problems


def test_pipeline_parallelism_and_other_policies_are_named():
    cfg = _config()
    object.__setattr__(cfg.parallel_config, "pipeline_parallel_size", 2)
    object.__setattr__(cfg.scheduler_config, "policy", "priority")
    problems = _refusals(cfg)
    assert any("pipeline parallelism" in p for p in problems) and any("'priority'" in p for p in problems)


def test_start_refuses_with_every_name():
    cfg = _config()
    object.__setattr__(cfg, "lora_config", object())
    object.__setattr__(cfg.parallel_config, "pipeline_parallel_size", 2)
    with pytest.raises(UnsupportedVllmFeature, match="LoRA.*pipeline parallelism"):
        Scheduler(vllm_config=cfg, kv_cache_config=None, structured_output_manager=None, block_size=16)


def test_structured_output_is_refused_per_request():
    s = make_scheduler(Scheduler)
    d = Driver(s)
    req = make_request("json", [5] * 40, 8)
    req.sampling_params = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(json={"type": "object"})
    )
    from vllm.v1.structured_output.request import StructuredOutputRequest

    req.structured_output_request = StructuredOutputRequest.from_sampling_params(req.sampling_params)
    s.add_request(req)
    d.add("plain", [6] * 40, 3)
    run = d.drain(limit=200)
    assert run.finished["json"] == "error" and run.outputs["json"] == 0
    assert run.outputs["plain"] == 3
    assert s.mstar_stats.refused_requests == 1
    assert len(s.chunking.prepared) == 0
    s.shutdown()


@pytest.fixture
def config_env(tmp_path, monkeypatch):
    def use(text):
        path = tmp_path / "chunking.toml"
        path.write_text(text)
        monkeypatch.setenv(CONFIG_ENV, str(path))

    return use


def test_config_budget_above_vllms_is_refused(config_env):
    config_env("[chunking.max_batch_tokens]\nllm = { mixed = 1024 }\n")
    with pytest.raises(UnsupportedVllmFeature, match=r"max_batch_tokens\.llm\.mixed is 1024.*\(512\)"):
        make_scheduler(Scheduler, budget=512)


def test_config_budget_is_the_components(config_env, monkeypatch):
    config_env("[chunking]\nmin_chunk_tokens = 32\n[chunking.max_batch_tokens]\nllm = { mixed = 256 }\n")
    monkeypatch.setenv("MSTAR__CHUNKING__MAX_ROW_TOKENS", "128")
    s = make_scheduler(Scheduler, budget=512)
    d = Driver(s)
    for i in range(4):
        d.add(f"r{i}", [10 + i] * 1000, 2)
    run = d.drain()
    assert max(run.step_tokens()) <= 256
    assert max(c.tokens for st in run.steps for c in st) <= 128
    assert all(run.outputs[f"r{i}"] == 2 for i in range(4))
    s.shutdown()


def test_threshold_beside_a_config_is_refused(config_env):
    config_env("[chunking]\nmin_chunk_tokens = 32\n")
    with pytest.raises(UnsupportedVllmFeature, match="long_prefill_token_threshold=128 with MSTAR_CHUNKING_CONFIG"):
        make_scheduler(Scheduler, threshold=128)


def test_metrics_on_the_components_endpoint():
    """MSTAR_CHUNKING_METRICS serves the component's series, labelled with vLLM's model name (in a
    process of its own: the endpoint is served once per process, before any manager starts)."""
    code = """
import os, sys, urllib.request
sys.path.insert(0, sys.argv[1])
os.environ["MSTAR_CHUNKING_METRICS"] = "127.0.0.1:0"
from harness import Driver, make_scheduler
from mstar_chunking.vllm import Scheduler
s = make_scheduler(Scheduler)
d = Driver(s)
d.add("a", [9] * 300, 3)
d.drain()
print(urllib.request.urlopen(f"http://{s.metrics_address}/metrics", timeout=10).read().decode())
s.shutdown()
"""
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    steps = [line for line in p.stdout.splitlines() if line.startswith("mstar_chunking_steps_total{")]
    assert steps and all('node="llm"' in line and "model=" in line for line in steps), p.stdout[-2000:]
    assert any(float(line.rsplit(" ", 1)[1]) >= 3 for line in steps), steps
