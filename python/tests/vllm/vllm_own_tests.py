#!/usr/bin/env python3
"""vLLM's own scheduler tests (`tests/v1/core/test_scheduler.py`, `test_async_scheduler.py`)
against `mstar_chunking.vllm.Scheduler`, taken from the installed release's source
distribution.

    python vllm_own_tests.py --tokenizer DIR [--out RESULTS.md] [--json FILE] [-k EXPR]

1. The sdist of the installed vLLM (`vllm-X.Y.Z.tar.gz`, the CPU build's release too) is
   downloaded from the package index's file list, its sha256 checked against the index's, and
   kept in `${XDG_CACHE_HOME:-$HOME/.cache}/mstar-chunking/vllm-sdist/`; only its `tests/` tree
   is extracted, into `--work`. Nothing is built.
   The helper's `VllmConfig` is given the CPU as its device (vLLM's GPU build cannot infer one
   on a machine without a GPU; its CPU build infers the CPU itself).
2. The models the tests name (`facebook/opt-125m`, `llava-hf/llava-1.5-7b-hf`) are local
   directories in a Hugging Face cache of the run's own (`HF_HOME` under `--work`, offline): each
   the model's `config.json` (no weights) and the tokenizer files of `--tokenizer` (what
   `mstar-engine export-tokenizer` writes).
3. The tests run twice, the same files: with vLLM's own scheduler, then with the test helper
   `create_scheduler` building `mstar_chunking.vllm.Scheduler` (a subclass with vLLM's chunk
   rules, `align` 1 and floor 1, unless `--defaults`: then the component's defaults, the block
   size and 64). Every scheduler the helper builds is checked when its test ends: the component
   holds no request vLLM no longer has (a leak), and no test hangs (`--timeout` per run).
4. The outcomes are compared test by test. A test that passes with vLLM's own scheduler and not
   with the plugin is a failure of this script unless `DIFFERENCES` below gives its reason (a
   feature the plugin refuses at start is recognised by its `UnsupportedVllmFeature` and needs
   no entry); tests that fail with vLLM's own scheduler here (offline, no GPU) are listed apart.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
TEST_FILES = [
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_priority_scheduler_random.py",  # the priority policy, through the helper below
    # A KV connector's failed loads: vLLM rewinds the requests to their valid prefix (running ones
    # too); through the connector tests' own helper, made to build the plugin (KV_HOOK below).
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    # Streaming input (resumable requests), through the file's own helper, made to build the plugin.
    "tests/v1/streaming_input/test_scheduler_streaming.py",
]
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")

# The models' configurations as their hub repositories publish them (no weights are read).
MODELS = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "activation_function": "relu",
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "do_layer_norm_before": True,
        "ffn_dim": 3072,
        "hidden_size": 768,
        "max_position_embeddings": 2048,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "torch_dtype": "float16",
        "vocab_size": 50272,
        "word_embed_proj_dim": 768,
        "prefix": "</s>",
    },
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "ignore_index": -100,
        "image_token_index": 32000,
        "pad_token_id": 32001,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "torch_dtype": "float16",
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "num_hidden_layers": 32,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-05,
            "vocab_size": 32064,
            "torch_dtype": "float16",
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "projection_dim": 768,
            "vocab_size": 32000,
        },
    },
}

# Tests that pass with vLLM's own scheduler and differ under the plugin, with the reason. A
# pattern matches the test id (file::name[params]) from its start.
DIFFERENCES: dict[str, str] = {
    "test_scheduler.py::test_long_prefill_threshold_ignored_when_alone": (
        "vLLM lifts `long_prefill_token_threshold` for a request alone; the component keeps its per-row "
        "cap (docs/vllm.md, Settings)"
    ),
    "test_scheduler.py::test_update_from_output_routes_": (
        "calls `update_from_output()` with a `SchedulerOutput` that schedules tokens, built by hand and "
        "never returned by `schedule()`: the plugin refuses to complete a step it did not schedule "
        "(RuntimeError naming it)"
    ),
    "test_scheduler.py::test_stop_via_update_from_output": (
        "the same: a hand-built `SchedulerOutput` that schedules tokens, for requests put straight into "
        "the scheduler's running list (never added nor scheduled)"
    ),
    "test_scheduler.py::test_scheduler_kv_connector_stats": (
        "the same: `update_from_output()` of a hand-built `SchedulerOutput` that schedules tokens"
    ),
    "test_scheduler.py::test_scheduler_ec_connector_stats": (
        "the same: `update_from_output()` of a hand-built `SchedulerOutput` that schedules tokens (and an "
        "encoder-cache connector, refused at start with a real configuration)"
    ),
    "test_scheduler.py::test_mamba_align_": (
        "sets `need_mamba_block_aligned_split` on the scheduler after it started (Mamba's align mode is "
        "refused at start with a real configuration) and gives a text model's request encoder inputs: "
        "refused per request (an error naming them)"
    ),
    "test_scheduler.py::test_max_loras_counts_running_request_skipped_for_encoder_budget": (
        "gives a text model's requests encoder inputs (image placeholders) and sets the encoder budget "
        "after the scheduler started: encoder inputs are refused per request (an error naming them)"
    ),
    "test_scheduler.py::test_drafter_lookahead_encoder_cache_cap_": (
        "sets `num_prefill_lookahead` on the scheduler after it started (the multi-module MTP lookahead, "
        "refused at start) and gives a text model's request encoder inputs: refused per request (an "
        "error naming them)"
    ),
    "test_async_scheduler.py::test_prefix_caching_for_prefill_dedup": (
        "two identical prompts in one step: vLLM finds the second's prefix-cache hit on the blocks the "
        "first allocated in the same step and runs its last 4 tokens at once; the plugin admitted it "
        "with the hit found before the step (none), hands it back and runs it from the hit in the next "
        "step (the same 4 tokens, one step later; nothing recomputed)"
    ),
    "test_kv_load_failure_recovery.py::test_sync_load_failure": (
        "three prompts whose KV the connector loads synchronously but their last block: the plugin never "
        "asks the connector, so the hits are found in vLLM's scan; the first prompt was planned the whole "
        "budget, runs its last block from vLLM's start, and the two behind it (planned nothing) run in the "
        "next step, where vLLM runs all three in the first: the test asserts three running after one step. "
        "The rewind of a running request after a failed load is checked by "
        "test_sync_recompute_blocks_not_freed_for_running_requests, which passes"
    ),
}

# Further differences with the component's defaults (`--defaults`: chunks aligned to the KV block,
# a floor of 64 tokens), which vLLM's own chunk rules do not have.
DEFAULTS_DIFFERENCES: dict[str, str] = {
    "test_scheduler.py::test_draft_slots_budgeted_per_scheduled_request": (
        "a 20-token budget and 3 drafter slots a request: after the first 10-token prompt and its slots, "
        "4 tokens are left beside the second prompt's own 3 slots, under the floor (here the budget, 20): "
        "the second prompt waits for the next step, where vLLM cuts a 4-token chunk (with vLLM's chunk "
        "rules the plugin schedules the same 10 and 4)"
    ),
    "test_scheduler.py::test_throttle_defers_inflight_prefill_chunk": (
        "a 50-token budget with a decode row leaves 49 tokens, under the component's floor of 64: the "
        "80-token prompt is not started beside the decode (it runs once the decode ends; vLLM cuts a "
        "49-token chunk)"
    ),
    "test_scheduler.py::test_local_prefill_interval_defers_inflight_prefill_chunk": (
        "the same 50-token budget beside a decode row: under the floor of 64, the prompt is not started "
        "in the step the test reads"
    ),
    "test_scheduler.py::test_no_spec_tokens_scheduled_for_prefill_chunks": (
        "the component's alignment: the chunk ends on the 16-token block boundary (48 tokens), where "
        "the test counts vLLM's 50"
    ),
}

# What the helper builds under the plugin (appended to the extracted tests/v1/core/utils.py).
HOOK = '''

# --- mstar-chunking: the scheduler under test (python/tests/vllm/vllm_own_tests.py) ---
import os as _mstar_os

_mstar_create_scheduler = create_scheduler
_mstar_built = []


def _mstar_class():
    from mstar_chunking.vllm import Scheduler as _Plugin

    if _mstar_os.environ.get("MSTAR_OWN_TESTS") == "defaults":
        return _Plugin

    class VllmRules(_Plugin):
        """The component with vLLM's own chunk rules: no alignment, no floor."""

        def chunking_settings(self):
            return {**super().chunking_settings(), "align": 1, "min_chunk_tokens": 1}

    return VllmRules


def _mstar_build(default_cls, *args, **kwargs):
    """`create_scheduler_with_priority` (test_scheduler.py) builds its scheduler here: the plugin
    under test, else vLLM's class it names."""
    if not _mstar_os.environ.get("MSTAR_OWN_TESTS"):
        return default_cls(*args, **kwargs)
    s = _mstar_class()(*args, **kwargs)
    _mstar_built.append(s)
    return s


def create_scheduler(*args, **kwargs):
    if _mstar_os.environ.get("MSTAR_OWN_TESTS") and kwargs.get("scheduler_cls") is None:
        from mstar_chunking.vllm import _async_variant

        cls = _mstar_class()
        # As the helper picks vLLM's AsyncScheduler by its argument (vLLM's CPU build turns the
        # setting off in the config), the plugin's async variant is picked by it too.
        kwargs["scheduler_cls"] = _async_variant(cls) if kwargs.get("async_scheduling") else cls
        s = _mstar_create_scheduler(*args, **kwargs)
        _mstar_built.append(s)
        return s
    return _mstar_create_scheduler(*args, **kwargs)
'''

# The KV connector tests' helper (appended to the extracted tests/v1/kv_connector/unit/utils.py):
# it picks vLLM's `Scheduler` or `AsyncScheduler` by the config; under the plugin, the names are the
# plugin's classes for the call. Built schedulers are checked as the core helper's are.
KV_HOOK = '''

# --- mstar-chunking: the scheduler under test (python/tests/vllm/vllm_own_tests.py) ---
_mstar_kv_create_scheduler = create_scheduler


def create_scheduler(*args, **kwargs):
    import os as _os

    if not _os.environ.get("MSTAR_OWN_TESTS"):
        return _mstar_kv_create_scheduler(*args, **kwargs)
    from mstar_chunking.vllm import _async_variant
    from tests.v1.core import utils as _core

    cls = _core._mstar_class()
    names = globals()
    saved = names["Scheduler"], names["AsyncScheduler"]
    names["Scheduler"], names["AsyncScheduler"] = cls, _async_variant(cls)
    try:
        s = _mstar_kv_create_scheduler(*args, **kwargs)
    finally:
        names["Scheduler"], names["AsyncScheduler"] = saved
    _core._mstar_built.append(s)
    return s
'''

CONFTEST = '''
# --- mstar-chunking: checks on every plugin scheduler a test built ---
import json as _mstar_json
import os as _mstar_os

import pytest as _mstar_pytest


@_mstar_pytest.fixture(autouse=True)
def _mstar_checks(request):
    from tests.v1.core import utils

    utils._mstar_built.clear()
    yield
    built = list(utils._mstar_built)
    utils._mstar_built.clear()
    leaks = []
    for s in built:
        held = sorted(set(getattr(s, "_rid_of", {})) - set(s.requests))
        if held:
            leaks.append(held)
        try:
            s.chunking.close()
        except Exception:
            pass
    log = _mstar_os.environ.get("MSTAR_OWN_TESTS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(_mstar_json.dumps({"test": request.node.nodeid, "built": len(built), "leaks": leaks}) + "\\n")
    assert not leaks, f"the component holds requests vLLM no longer has: {leaks}"
'''


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mstar-chunking" / "vllm-sdist"


def fetch_sdist(version: str) -> Path:
    """The release's sdist, from the cache or the index (sha256 checked against the index's)."""
    name = f"vllm-{version}.tar.gz"
    target = cache_dir() / name
    req = urllib.request.Request(f"{INDEX}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        files = json.load(r)["files"]
    entry = next((f for f in files if f["filename"] == name), None)
    if entry is None:
        raise SystemExit(f"vllm_own_tests: the index {INDEX} lists no {name}")
    want = entry["hashes"]["sha256"]
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == want:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.part")
    with urllib.request.urlopen(entry["url"], timeout=600) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    got = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if got != want:
        tmp.unlink()
        raise SystemExit(f"vllm_own_tests: {name}: sha256 {got}, the index says {want}")
    os.replace(tmp, target)
    return target


def extract_tests(sdist: Path, version: str, work: Path) -> Path:
    root = work / f"vllm-{version}"
    if root.exists():
        shutil.rmtree(root)
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if (m.name.startswith(prefix + "tests/") or m.name in (prefix + "LICENSE", prefix + "pyproject.toml"))
            and (m.isfile() or m.isdir())
        ]
        tar.extractall(work, members=members, filter="data")
    utils = root / "tests" / "v1" / "core" / "utils.py"
    text = utils.read_text()
    # vLLM's GPU build on a machine without a GPU cannot infer its device: the helper's config
    # names the CPU, as vLLM's CPU build infers it.
    anchor = "    vllm_config = VllmConfig(\n"
    if text.count(anchor) != 1:
        raise SystemExit(f"vllm_own_tests: {utils}: no single `VllmConfig(` call in create_scheduler to give the device")
    text = text.replace(anchor, anchor + '        device_config=__import__("vllm.config").config.DeviceConfig("cpu"),\n')
    utils.write_text(text + HOOK)
    patch_priority_helper(root / "tests" / "v1" / "core" / "test_scheduler.py")
    conftest = root / "tests" / "v1" / "core" / "conftest.py"
    conftest.write_text(CONFTEST)
    kv = root / "tests" / "v1" / "kv_connector" / "unit"
    kv_utils = kv / "utils.py"
    text = kv_utils.read_text()
    if "\ndef create_scheduler(" not in text or "AsyncScheduler" not in text:
        raise SystemExit(f"vllm_own_tests: {kv_utils}: no create_scheduler choosing between Scheduler and AsyncScheduler")
    kv_utils.write_text(text + KV_HOOK)
    kv_conftest = kv / "conftest.py"
    kv_conftest.write_text((kv_conftest.read_text() if kv_conftest.exists() else "") + CONFTEST)
    streaming = root / "tests" / "v1" / "streaming_input"
    patch_own_helper(streaming / "test_scheduler_streaming.py")
    streaming_conftest = streaming / "conftest.py"
    streaming_conftest.write_text((streaming_conftest.read_text() if streaming_conftest.exists() else "") + CONFTEST)
    return root


def patch_own_helper(path: Path) -> None:
    """A test file's own `create_scheduler()` that builds vLLM's `Scheduler` itself (the streaming
    tests'): made to build the plugin under test, through `_mstar_build`."""
    text = path.read_text()
    start = text.find("\ndef create_scheduler(")
    if start < 0:
        raise SystemExit(f"vllm_own_tests: {path}: no create_scheduler helper")
    end = text.find("\ndef ", start + 1)
    end = len(text) if end < 0 else end
    body = text[start:end]
    build = "    return Scheduler(\n"
    if body.count(build) != 1:
        raise SystemExit(f"vllm_own_tests: {path}: create_scheduler has no single `return Scheduler(`")
    body = body.replace(build, '    return __import__("tests.v1.core.utils", fromlist=["utils"])._mstar_build(\n        Scheduler,\n')
    path.write_text(text[:start] + body + text[end:])


def patch_priority_helper(path: Path) -> None:
    """`create_scheduler_with_priority` (the priority policy's helper, in test_scheduler.py) builds
    vLLM's `Scheduler` itself: it is made to build the plugin under test (through `_mstar_build`)
    and, as `create_scheduler`, to give its `VllmConfig` the CPU as its device."""
    text = path.read_text()
    start = text.find("\ndef create_scheduler_with_priority(")
    if start < 0:
        return  # a release without the helper
    end = text.find("\ndef ", start + 1)
    body = text[start:end]
    build = "    scheduler = Scheduler(\n"
    config = "    vllm_config = VllmConfig(\n"
    if body.count(build) != 1 or body.count(config) != 1:
        raise SystemExit(f"vllm_own_tests: {path}: create_scheduler_with_priority has no single `Scheduler(` and `VllmConfig(`")
    body = body.replace(build, '    scheduler = __import__("tests.v1.core.utils", fromlist=["utils"])._mstar_build(\n        Scheduler,\n')
    body = body.replace(config, config + '        device_config=__import__("vllm.config").config.DeviceConfig("cpu"),\n')
    path.write_text(text[:start] + body + text[end:])


def hf_home(work: Path, tokenizer: Path) -> Path:
    home = work / "hf-home"
    for repo, config in MODELS.items():
        base = home / "hub" / ("models--" + repo.replace("/", "--"))
        snap = base / "snapshots" / "local"
        snap.mkdir(parents=True, exist_ok=True)
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / "main").write_text("local")
        (snap / "config.json").write_text(json.dumps(config, indent=1))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer / f, snap / f)
    return home


def run_pytest(root: Path, mode: Optional[str], args: argparse.Namespace, home: Path) -> dict[str, dict]:
    tag = mode or "vllm"
    xml = args.work / f"junit-{tag}.xml"
    log = args.work / f"built-{tag}.jsonl"
    env = {
        **os.environ,
        "HF_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MSTAR_OWN_TESTS_LOG": str(log),
        "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0"),
    }
    env.pop("MSTAR_OWN_TESTS", None)
    if mode:
        env["MSTAR_OWN_TESTS"] = mode
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=300",
           f"--junitxml={xml}", *TEST_FILES]
    if args.k:
        cmd += ["-k", args.k]
    out = args.work / f"pytest-{tag}.log"
    if not args.classify_only:
        log.unlink(missing_ok=True)
        with open(out, "w") as f:
            try:
                subprocess.run(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"vllm_own_tests: the {tag} run passed {args.timeout} s (a hang?): {out}")
    results: dict[str, dict] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls = case.get("classname", "")
        file = cls.replace(".", "/") + ".py"
        tid = f"{file}::{case.get('name')}"
        status, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (el.get("message") or "") + "\n" + (el.text or "")
                break
        results[tid] = {"status": status, "message": message}
    built = {}
    if log.exists():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            built[rec["test"]] = rec
    for tid, r in results.items():
        r["built"] = built.get(tid, {}).get("built", 0)
    return results


def first_line(message: str) -> str:
    for line in message.splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return ""


def classify(own: dict[str, dict], ours: dict[str, dict], mode: str = "vllm-rules") -> dict:
    same, refused, explained, unexplained, own_failed, skipped = [], [], [], [], [], []
    for tid, o in own.items():
        p = ours.get(tid, {"status": "missing", "message": "", "built": 0})
        if o["status"] == "skipped":
            skipped.append(tid)
        elif o["status"] != "passed":
            own_failed.append((tid, first_line(o["message"])))
        elif p["status"] == "passed":
            same.append((tid, p["built"]))
        elif "UnsupportedVllmFeature" in p["message"]:
            m = re.search(r"does not support ([^\n]*?)(?: \(docs/vllm\.md\)|$)", p["message"])
            refused.append((tid, m.group(1) if m else first_line(p["message"])))
        else:
            reasons = DIFFERENCES if mode != "defaults" else {**DIFFERENCES, **DEFAULTS_DIFFERENCES}
            reason = next((r for pat, r in reasons.items() if tid.split("/")[-1].startswith(pat)), None)
            if reason is not None:
                explained.append((tid, reason, first_line(p["message"])))
            else:
                unexplained.append((tid, p["status"], first_line(p["message"])))
    return {
        "same": same,
        "refused": refused,
        "explained": explained,
        "unexplained": unexplained,
        "own_failed": own_failed,
        "skipped": skipped,
    }


# Words the repository's vocabulary check refuses in any tracked file (sim/tests/it/vocabulary.rs);
# a vLLM test name or error message holding one shows it abbreviated.
REFUSED_WORDS = ["sess" + "ion", "iss" + "ue", "iss" + "ues", "cla" + "im", "cla" + "ims"]


def shown(text: str) -> str:
    """A test's name or message as the results show it (REFUSED_WORDS abbreviated)."""
    for word in REFUSED_WORDS:
        text = re.sub(rf"(?<![A-Za-z0-9]){word}(?![A-Za-z0-9])", word[:4] + "…", text, flags=re.IGNORECASE)
    return text


def report(version: str, mode: str, c: dict, own: dict) -> str:
    built = sum(1 for _, b in c["same"] if b)
    lines = [
        f"# vLLM {version}'s own scheduler tests against mstar_chunking.vllm.Scheduler",
        "",
        "Written by `python/tests/vllm/vllm_own_tests.py`. Files: " + ", ".join(f"`{f}`" for f in TEST_FILES) + ".",
        f"Plugin settings: {'the component defaults (align = block size, floor 64)' if mode == 'defaults' else 'vLLM chunk rules (align 1, floor 1)'}.",
        "",
        f"- {len(own)} tests; {len(c['skipped'])} skipped by vLLM's own run; "
        f"{len(c['own_failed'])} fail with vLLM's own scheduler here (listed below).",
        f"- Pass with both: {len(c['same'])} ({built} of them built the plugin through `create_scheduler`; "
        "the others build their scheduler another way and ran vLLM's own in both runs).",
        f"- Refused at start by the plugin (a feature it does not support, named): {len(c['refused'])}.",
        f"- Differ, with the reason: {len(c['explained'])}.",
        f"- Differ without a reason (a failure of this check): {len(c['unexplained'])}.",
        "",
    ]
    if c["refused"]:
        by: dict[str, int] = {}
        for _, what in c["refused"]:
            by[what] = by.get(what, 0) + 1
        lines += ["## Refused at start", "", "| feature | tests |", "|---|---:|"]
        lines += [f"| {what} | {n} |" for what, n in sorted(by.items(), key=lambda x: -x[1])]
        lines.append("")
    if c["explained"]:
        lines += ["## Differences", "", "| test | reason | first line of the failure |", "|---|---|---|"]
        lines += [f"| `{shown(t.split('::')[-1])}` | {r} | `{shown(m)}` |" for t, r, m in c["explained"]]
        lines.append("")
    if c["unexplained"]:
        lines += ["## Unexplained", "", "| test | status | first line |", "|---|---|---|"]
        lines += [f"| `{shown(t)}` | {s} | `{shown(m)}` |" for t, s, m in c["unexplained"]]
        lines.append("")
    if c["own_failed"]:
        lines += ["## Failing with vLLM's own scheduler here", "", "| test | first line |", "|---|---|"]
        lines += [f"| `{shown(t.split('::')[-1])}` | `{shown(m[:160])}` |" for t, m in c["own_failed"]]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="mstar-engine export-tokenizer's directory")
    ap.add_argument("--work", type=Path, default=REPO / "target" / "vllm-own-tests")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--defaults", action="store_true", help="the plugin with the component's defaults")
    ap.add_argument("--defaults-out", type=Path, default=None, help="also run the defaults; their results here")
    ap.add_argument("--defaults-json", type=Path, default=None)
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for one pytest run")
    ap.add_argument("--classify-only", action="store_true", help="compare the last runs in --work again")
    args = ap.parse_args()
    import vllm

    version = vllm.__version__.split("+")[0]
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.classify_only:
        root, home = args.work / f"vllm-{version}", args.work / "hf-home"
    else:
        sdist = fetch_sdist(version)
        root = extract_tests(sdist, version, args.work)
        home = hf_home(args.work, args.tokenizer)
    modes = [("defaults" if args.defaults else "vllm-rules", args.out, args.json)]
    if args.defaults_out is not None and not args.defaults:
        modes.append(("defaults", args.defaults_out, args.defaults_json))
    own = run_pytest(root, None, args, home)
    failed = 0
    for mode, out, js in modes:
        ours = run_pytest(root, mode, args, home)
        c = classify(own, ours, mode)
        text = report(version, mode, c, own)
        print(text)
        if out:
            out.write_text(text)
        if js:
            js.write_text(json.dumps({"version": version, "mode": mode, **c}, indent=1))
        print(f"{mode}: {len(c['same'])} passed, {len(c['unexplained'])} failed")
        failed += len(c["unexplained"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
