"""What the plugin refuses: another vLLM release at import, unsupported features at start (by
name), streaming input and encoder inputs per request, and a chunking config vLLM's runner could not take."""

import os
import subprocess
import sys

import pytest
from harness import LLAVA, Driver, VllmScheduler, make_request, make_scheduler

from mstar_chunking.vllm import CONFIG_ENV, Scheduler, UnsupportedVllmFeature, _refusals


def test_other_vllm_releases_are_refused_at_import():
    versions = ["0.31.9", "0.34.0", "1.0.0", "dev"]
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
        assert "supports vLLM 0.32.x and 0.33.x" in line and f"found vLLM {v}." in line, line


def _config():
    s = make_scheduler(Scheduler)
    cfg = s.vllm_config
    s.shutdown()
    return cfg


# Each feature refused when the scheduler starts: how the test turns it on, and the name the
# refusal gives it. Where a real configuration turns it on, the test builds one (and vLLM's own
# scheduler starts with it: the refusal is the plugin's); the others are set on a configuration
# that started, as vLLM would carry them.
REAL = [
    (
        {"model": {"is_encoder_decoder": True}, "budget": 4096, "max_model_len": 4096},
        "encoder inputs (an encoder-decoder",
    ),
    ({"model": LLAVA}, "encoder inputs (an encoder-decoder or multimodal model)"),
    ({"runner": "pooling"}, "pooling models"),
    ({"model": {"canvas_length": 32}}, "diffusion models"),
    ({"chunked_prefill": False, "budget": 4096, "max_model_len": 4096}, "chunked prefill turned off"),
    ({"max_num_scheduled_tokens": 256}, "max_num_scheduled_tokens other than max_num_batched_tokens"),
    ({"mamba_align": True}, "Mamba's 'align' cache mode"),
]
SET = [
    (("ec_transfer_config",), "encoder-cache transfer"),
    (("parallel_config", "pipeline_parallel_size", 2), "pipeline parallelism"),
    (("scheduler_config", "long_prefill_token_threshold_adaptive", True), "the adaptive long-prefill threshold"),
]


@pytest.mark.parametrize(
    "how, name",
    REAL + SET,
    ids=[
        "encoder-decoder",
        "multimodal",
        "pooling",
        "diffusion",
        "no-chunked-prefill",
        "max_num_scheduled_tokens",
        "mamba-align",
        "ec-transfer",
        "pipeline-parallel",
        "adaptive-threshold",
    ],
)
def test_refused_at_start_by_name(how, name):
    if isinstance(how, dict):
        try:
            make_scheduler(Scheduler, **how)
        except UnsupportedVllmFeature as refused:
            message = str(refused)
        except ValueError as config_error:
            # vLLM's CPU build has no Triton, so no V2 model runner: its config refuses a
            # diffusion model before any scheduler is built.
            if "Model Runner V1 does not support: diffusion" not in str(config_error):
                raise
            pytest.skip(f"vLLM itself refuses the configuration: {config_error}")
        else:
            pytest.fail(f"the plugin started with {how}")
        try:
            theirs = make_scheduler(VllmScheduler, **how)
        except Exception as their_error:  # vLLM's own cannot start with it here (no tokenizer, ...)
            assert how.get("model") is not None or how.get("mamba_align"), their_error
        else:
            theirs.shutdown()
    else:
        cfg = _config()
        if len(how) == 1:
            object.__setattr__(cfg, how[0], object())
        else:
            object.__setattr__(getattr(cfg, how[0]), how[1], how[2])
        with pytest.raises(UnsupportedVllmFeature) as e:
            Scheduler(vllm_config=cfg, kv_cache_config=None, structured_output_manager=None, block_size=16)
        message = str(e.value)
    assert message.startswith("mstar_chunking.vllm.Scheduler does not support ") and name in message, message
    others = message.count(";")  # the features named besides: none, but what comes with it
    assert others == 0 or (name.startswith("encoder inputs") and "chunked prefill turned off" in message), message


def test_pipeline_parallelism_is_named_and_the_priority_policy_is_not():
    cfg = _config()
    object.__setattr__(cfg.parallel_config, "pipeline_parallel_size", 2)
    object.__setattr__(cfg.scheduler_config, "policy", "priority")
    problems = _refusals(cfg)
    assert len(problems) == 1 and "pipeline parallelism" in problems[0], problems


def test_start_refuses_with_every_name():
    cfg = _config()
    object.__setattr__(cfg, "ec_transfer_config", object())
    object.__setattr__(cfg.parallel_config, "pipeline_parallel_size", 2)
    with pytest.raises(UnsupportedVllmFeature, match="encoder-cache transfer.*pipeline parallelism"):
        Scheduler(vllm_config=cfg, kv_cache_config=None, structured_output_manager=None, block_size=16)


def _with_image(request):
    """A text model's request carrying an image placeholder (as vLLM's own scheduler tests make)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange

    request.mm_features = [
        MultiModalFeatureSpec(
            data=MultiModalKwargsItem.dummy(),
            mm_position=PlaceholderRange(offset=4, length=16),
            identifier="image-0",
            modality="image",
        )
    ]
    return request


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: _with_image(make_request("refused", [5] * 40, 8)), "encoder inputs"),
    ],
    ids=["encoder-inputs"],
)
def test_refused_per_request_by_name(make, name, caplog):
    """The request finishes with a validation error naming the feature (vLLM 0.32, whose errors
    carry no message: with an error, and the feature named in the log); the engine serves on and
    the component never holds the request."""
    caplog.set_level("WARNING", logger="mstar_chunking.vllm")
    s = make_scheduler(Scheduler)
    d = Driver(s)
    s.add_request(make())
    d.add("plain", [6] * 40, 3)
    run = d.drain(limit=200)
    assert run.finished["refused"] == "error" and run.outputs["refused"] == 0
    message = f"{name} is not supported by mstar_chunking.vllm.Scheduler"
    if isinstance(s.grammar_compile_error_reqs, dict):
        error = run.errors["refused"]
        assert error.code == "validation_error"
        assert error.message == message, error
    else:
        assert "refused" not in run.errors
        assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == [
            f"request refused refused: {message}"
        ]
    assert run.outputs["plain"] == 3 and "plain" not in run.errors
    assert s.mstar_stats.refused_requests == 1
    assert len(s.chunking.prepared) == 0 and not s._rid_of and not s.requests
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
