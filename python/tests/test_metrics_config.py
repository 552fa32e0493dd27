"""The process's metrics from Python (served and rendered, every series the core describes
present from the first render, each with its `model` label), `from_config` over the same
layered files as the binary, and the package's Python face: reprs, `help()`, `Row.is_final`."""

from __future__ import annotations

import pydoc
import re
import urllib.request
from pathlib import Path

import pytest

import mstar_chunking
from mstar_chunking import (
    ChunkingManagement,
    ChunkingPolicy,
    ConfigError,
    ConflictError,
    SubmoduleCaps,
    render_metrics,
    serve_metrics,
)

ROOT = Path(__file__).resolve().parents[2]


def described_metrics() -> list[str]:
    """Every metric name the core describes: `metrics::ALL` in `src/metrics.rs`."""
    src = (ROOT / "src" / "metrics.rs").read_text()
    listed = src[src.index("pub const ALL") :]
    listed = listed[: listed.index("];")]
    consts = re.findall(r"\b([A-Z][A-Z_]+),", listed)
    names = [re.search(rf'pub const {c}: &str = "([^"]+)"', src).group(1) for c in consts]  # type: ignore[union-attr]
    assert len(names) >= 20, names
    return names


def samples(text: str, model: str) -> dict[str, list[str]]:
    """Sample lines of `model`, by metric name (histogram suffixes folded in)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or f'model="{model}"' not in line:
            continue
        name = re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0].split(" ")[0])
        out.setdefault(name, []).append(line)
    return out


def test_every_described_series_is_rendered_from_the_first_render_with_its_model(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill", "mixed"])}, model="first-render")
    cm.set_policies({("llm", "mixed"): ChunkingPolicy(256)})
    cm.set_budgets(
        {}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"},
        max_step_ms={"llm": {"mixed": 80.0}}, cost="llama2-7b-a100",
    )
    text = render_metrics()
    got = samples(text, "first-render")
    missing = [n for n in described_metrics() if n not in got]
    assert missing == [], f"not rendered before the first step: {missing}"
    # Every sample line of the process carries a model label.
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert 'model="' in line, line


def test_serve_metrics_serves_the_same_text_and_only_once():
    addr = serve_metrics("127.0.0.1:0")
    host, port = addr.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    cm = ChunkingManagement({"llm": SubmoduleCaps(["prefill"])}, model="served")
    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            assert r.status == 200
            body = r.read().decode()
        assert 'model="served"' in body and "mstar_chunking_prepared_inputs" in body
    finally:
        cm.close()
    with pytest.raises(ConflictError, match="already served"):
        serve_metrics("127.0.0.1:0")
    with pytest.raises(ValueError, match="addr"):
        serve_metrics("not an address")


def test_from_config_reads_the_binary_s_layers_and_variables(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    layer = tmp_path / "serving.toml"
    layer.write_text("[chunking]\nmax_batch_tokens = { llm = { mixed = 1024 } }\nmax_step_ms = { llm = { mixed = 70.0 } }\ncost = { llm = \"llama2-7b-a100\" }\n")
    monkeypatch.setenv("MSTAR__CHUNKING__MIN_CHUNK_TOKENS", "32")
    cm = ChunkingManagement.from_config([layer], model="from-config", manifest=ROOT / "config" / "models" / "demo.toml")
    try:
        assert cm.model == "from-config"
        assert cm.max_batch_tokens("llm", "mixed") == 1024
        assert cm.min_chunk_tokens(1024) == 32
        assert cm.latency_model("llm").source == "config"
        info = cm.config
        assert info["walks"] == ["prefill", "decode", "mixed"] and info["combined_walk"] == "mixed"
        assert any("serving.toml" in layer_ for layer_ in info["layers"]), info["layers"]
        assert info["metrics_listen"] == "127.0.0.1:9464"
        cm.admit(1, "llm", "prefill", [1] * 3000)
        b = cm.assemble("llm", "mixed")
        assert b.budget == 1024 and b.max_step_ms == 70.0
        cm.complete(b.step, b.planned(), measured_ms=50.0)
    finally:
        cm.close()
    # The manifest's name labels the series when no model is given.
    cm = ChunkingManagement.from_config()
    assert cm.model == "demo"
    cm.close()


def test_from_config_refuses_a_bad_layer_naming_its_key_and_file(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    layer = tmp_path / "bad.toml"
    layer.write_text("[chunking]\nmin_chunk_tokens = 0\nmax_step_ms = { llm = { mixed = -1.0 } }\n")
    with pytest.raises(ConfigError) as e:
        ChunkingManagement.from_config([layer])
    assert any("min_chunk_tokens" in p for p in e.value.problems), e.value.problems
    assert "bad.toml" in str(e.value)
    with pytest.raises(ConfigError, match="nope.toml"):
        ChunkingManagement.from_config([tmp_path / "nope.toml"])
    with pytest.raises(TypeError, match="not one path"):
        ChunkingManagement.from_config(str(layer))  # type: ignore[arg-type]


def test_reprs_are_python(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill", "mixed"])})
    cm.set_policies({("llm", "mixed"): ChunkingPolicy(1024, align=16)})
    cm.set_budgets({}, ["prefill", "decode", "mixed"], combined_walk_of={"prefill": "mixed", "decode": "mixed"})
    cm.admit(1, "llm", "prefill", [1] * 100)
    cm.continue_row(2, "llm", "decode", 1, context=50)
    b = cm.assemble("llm", "mixed")
    text = repr(b) + repr(b.rows) + repr(cm.complete(b.step, b.planned()))
    assert "budget=1024" in text and "overrun=False" in text and "is_final=True" in text
    assert "walk='mixed'" in text and "kind='continue'" in text
    for rust in ("Some(", "None)", "false", "true", '"'):
        assert rust not in text.replace("None)", ""), (rust, text)
    assert "max_step_ms=None" in repr(b)


def test_help_lists_every_method():
    text = pydoc.render_doc(ChunkingManagement, renderer=pydoc.plaintext)
    for method in [
        "admit", "assemble", "complete", "complete_and_assemble", "abandon", "continue_row", "release",
        "forget_request", "check_budget", "set_policies", "set_budgets", "policy", "chunkable",
        "max_batch_tokens", "min_chunk_tokens", "walk_caps", "latency_model", "queue_stats",
        "overrun_count", "begin_drain", "drain", "close", "from_config",
    ]:
        assert re.search(rf"^ \|  {method}\(", text, re.M), method
    for cls in (mstar_chunking.Batch, mstar_chunking.Row, mstar_chunking.StepOutcome, mstar_chunking.NextStep):
        doc = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        assert cls.__doc__ and len(doc) > 200
    assert "is_final" in pydoc.render_doc(mstar_chunking.Row, renderer=pydoc.plaintext)


def test_a_subclass_override_of_a_step_call_is_kept(make_cm):
    calls = []

    class Counting(ChunkingManagement):
        def assemble(self, node_name, graph_walk):  # type: ignore[no-untyped-def]
            calls.append((node_name, graph_walk))
            return super().assemble(node_name, graph_walk)

    cm = Counting({"llm": SubmoduleCaps(["prefill"])})
    try:
        cm.set_policies({("llm", "prefill"): ChunkingPolicy(256)})
        b = cm.assemble("llm", "prefill")
        cm.complete(b.step, [])
        assert calls == [("llm", "prefill")]
        assert cm.complete.__self__ is not cm  # not overridden: the native method, bound
    finally:
        cm.close()
