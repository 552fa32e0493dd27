"""Time budgets from Python: `set_budgets`' keyword arguments and their refusals, the latency
model in force, the measured time fed back (time overruns, the margin), and an online fit
learned from a synthetic four-term truth."""

from __future__ import annotations

import random

import pytest

from mstar_chunking import (
    ChunkingError,
    ChunkingPolicy,
    LatencyModel,
    RefusedSettingsError,
    SubmoduleCaps,
    TimeSettingsError,
    preset_cost,
    preset_names,
)

WALKS = ["prefill", "decode", "mixed"]
COMBINED = {"prefill": "mixed", "decode": "mixed"}


@pytest.fixture
def cm(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill", "mixed"])})
    p = ChunkingPolicy(2048, align=16)
    cm.set_policies({("llm", "prefill"): p, ("llm", "mixed"): p})
    return cm


def budgets(cm, **kw):
    cm.set_budgets({}, WALKS, combined_walk_of=COMBINED, **kw)


def test_a_time_budget_cuts_steps_to_the_preset_s_prediction(cm):
    budgets(cm, max_step_ms={"llm": {"mixed": 60.0}}, cost="llama2-7b-a100")
    cm.admit(1, "llm", "prefill", [7] * 4000)
    b = cm.assemble("llm", "mixed")
    assert b.max_step_ms == 60.0 and b.predicted_ms is not None and b.predicted_ms <= 60.0
    assert b.scheduled_tokens < 2048, "the time budget, not the token budget, ends the chunk"
    model = preset_cost("llama2-7b-a100")
    (row,) = b.rows
    predicted = model.predict_ms(row.tokens, 0, LatencyModel.attention_pairs(row.range.start, row.range.end))
    assert predicted == b.predicted_ms
    out = cm.complete(b.step, b.planned(), measured_ms=b.predicted_ms)
    assert (out.max_step_ms, out.predicted_ms, out.time_overrun, out.time_margin) == (60.0, b.predicted_ms, None, None)
    b = cm.assemble("llm", "mixed")
    out = cm.complete(b.step, b.planned(), measured_ms=90.0)
    assert out.time_overrun == "misprediction"


def test_one_number_and_one_model_for_every_node(cm):
    budgets(cm, max_step_ms={"llm": 60.0}, cost=tuple(preset_cost("llama2-7b-a100")))
    state = cm.latency_model("llm")
    assert state.source == "config" and state.model == preset_cost("llama2-7b-a100")
    assert state.configured == state.model and not state.learn_cost and state.fit is None
    cm.admit(1, "llm", "prefill", [7] * 4000)
    assert cm.assemble("llm", "mixed").max_step_ms == 60.0


def test_the_latency_model_without_one_is_none(cm):
    budgets(cm)
    state = cm.latency_model("llm")
    assert (state.model, state.source, state.configured, state.fit) == (None, "none", None, None)
    with pytest.raises(ChunkingError, match="ghost"):
        cm.latency_model("ghost")


@pytest.mark.parametrize(
    "kw, argument, node, walk, match",
    [
        (dict(max_step_ms={"llm": {"mixed": float("inf")}}, cost="llama2-7b-a100"), "max_step_ms", "llm", "mixed", "finite"),
        (dict(max_step_ms={"llm": {"mixed": float("nan")}}, cost="llama2-7b-a100"), "max_step_ms", "llm", "mixed", "finite"),
        (dict(max_step_ms={"llm": {"mixed": -5}}, cost="llama2-7b-a100"), "max_step_ms", "llm", "mixed", "finite"),
        (dict(max_step_ms={"llm": {"mixed": 1.0}}, cost="llama2-7b-a100"), "max_step_ms", "llm", "mixed", "base_ms"),
        (dict(max_step_ms={"llm": {"mixed": 50.0}}), "max_step_ms", "llm", None, "needs a latency model"),
        (dict(max_step_ms={"llm": {"mixed": "50"}}, cost="llama2-7b-a100"), "max_step_ms", "llm", "mixed", "number of milliseconds"),
        (dict(max_step_ms={"llm": {"mixed": 50.0}}, cost=(0, 0, 0, 0)), "cost", "llm", None, "all zero"),
        (dict(max_step_ms={"llm": {"mixed": 50.0}}, cost="a100"), "cost", "llm", None, "unknown latency model preset"),
        (dict(max_step_ms={"llm": {"mixed": 50.0}}, cost=(1.0, -0.1, 0, 0)), "cost", "llm", None, "per_token_ms"),
        (dict(max_step_ms={"llm": {"mixed": 50.0}}, cost=(1.0, float("inf"), 0, 0)), "cost", "llm", None, "per_token_ms"),
        (dict(max_step_ms={"llm": {"mixed": 50.0}}, cost={"llm": (1, 2)}), "cost", "llm", None, "base_ms, per_token_ms"),
        (dict(time_margin=0.9), "time_margin", None, None, "without a time budget"),
        (dict(max_step_ms={"llm": {"mixed": 50.0}}, cost="llama2-7b-a100", time_margin=1.5), "time_margin", None, None, r"\(0, 1\]"),
        (dict(max_step_ms={"llm": {"mixed": 50.0}}, cost="llama2-7b-a100", time_margin=float("nan")), "time_margin", None, None, r"\(0, 1\]"),
        (dict(max_step_ms={"llm": {"mixed": 50.0}}, cost="llama2-7b-a100", time_margin="high"), "time_margin", None, None, "number"),
        (dict(learn_cost="yes"), "learn_cost", None, None, "True or False"),
        (dict(max_step_ms={"llm": {"prefill": 50.0}}, cost="llama2-7b-a100"), "max_step_ms", "llm", "prefill", "inside `mixed`"),
    ],
)
def test_each_refusal_is_a_time_settings_error_naming_argument_node_and_walk(cm, kw, argument, node, walk, match):
    budgets(cm, max_step_ms={"llm": {"mixed": 80.0}}, cost="llama2-7b-a100")
    with pytest.raises(TimeSettingsError, match=match) as e:
        budgets(cm, **kw)
    err = e.value
    assert isinstance(err, RefusedSettingsError) and isinstance(err, ChunkingError) and isinstance(err, ValueError)
    assert (err.argument, err.node, err.walk) == (argument, node, walk), err.refusals
    assert err.refusals[0] == (argument, node, walk) and err.problems
    # Refused whole: the settings before stay.
    cm.admit(1, "llm", "prefill", [7] * 4000)
    b = cm.assemble("llm", "mixed")
    assert b.max_step_ms == 80.0
    cm.abandon(b.step)
    cm.forget_request(1)


def test_preset_names_and_their_models():
    assert "llama2-7b-a100" in preset_names()
    m = preset_cost("llama2-7b-a100")
    assert isinstance(m, LatencyModel) and m.base_ms > 0 and m.per_attention_pair_ms > 0
    with pytest.raises(TimeSettingsError, match="known: llama2-7b-a100"):
        preset_cost("nope")


def features(batch):
    """`(tokens, kv_tokens, attention_pairs)` of a batch as it is planned (every row runs)."""
    t = k = a = 0
    for row in batch.rows:
        t += row.tokens
        if row.kind == "continue":
            k += row.context
        else:
            a += LatencyModel.attention_pairs(row.range.start, row.range.end)
    return t, k, a


def test_an_online_fit_learns_a_four_term_truth_from_measured_times(cm):
    truth = LatencyModel(6.0, 0.05, 0.0004, 2e-6)
    budgets(cm, max_step_ms={"llm": {"mixed": 120.0}}, learn_cost=True, time_margin=0.95)
    rng = random.Random(7)
    rid, decoding, contexts = 0, [], {}
    margins, trusted_at = [], None
    for step in range(600):
        # Prompts of many lengths arrive; decode rows come and go with many contexts, so the
        # four features vary independently.
        if rng.random() < 0.3:
            rid += 1
            cm.admit(rid, "llm", "prefill", [1] * rng.randrange(64, 4000))
        while len(decoding) < rng.randrange(0, 40):
            rid += 1
            contexts[rid] = rng.randrange(100, 6000)
            cm.continue_row(rid, "llm", "decode", 1, context=contexts[rid])
            decoding.append(rid)
        if decoding and rng.random() < 0.2:
            cm.forget_request(decoding.pop(rng.randrange(len(decoding))))
        b = cm.assemble("llm", "mixed")
        if len(b) == 0:
            cm.complete(b.step, [])
            continue
        ms = truth.predict_ms(*features(b)) * rng.uniform(0.98, 1.02)
        out = cm.complete(b.step, b.planned(), measured_ms=ms)
        state = cm.latency_model("llm")
        if state.source == "online" and trusted_at is None:
            trusted_at = step
        if trusted_at is not None and out.max_step_ms is not None:
            margins.append(out.time_margin)
    state = cm.latency_model("llm")
    assert state.learn_cost and state.source == "online" and state.fit is not None and state.fit.trusted
    assert trusted_at is not None and trusted_at < 200
    for got, want, name in zip(state.model, truth, LatencyModel._fields):
        assert got == pytest.approx(want, rel=0.10), (name, state.model)
    # Once timed steps run, each reports the margin it was planned with.
    assert len(margins) > 100 and all(m is not None and m > 0 for m in margins)


def test_steps_without_their_time_budget_show_in_the_outcome_and_the_latency_model_state(cm):
    # Learning, no configured model: no step is planned in time before the fit is trusted.
    budgets(cm, max_step_ms={"llm": {"mixed": 60.0}}, learn_cost=True)
    state = cm.latency_model("llm")
    assert (state.time_budget_inactive_steps, state.time_budget_inactive_reason) == (0, None)
    seen = []
    for rid, ms in enumerate([None, None, 30.0, 40.0], start=1):
        cm.admit(rid, "llm", "prefill", [7] * 4000)
        b = cm.assemble("llm", "mixed")
        assert b.max_step_ms is None and b.scheduled_tokens == 2048
        out = cm.complete(b.step, b.planned(), measured_ms=ms)
        seen.append(out.time_inactive)
        cm.forget_request(rid)
    # Read before each step's own time is learned: the third step's is the first measured.
    assert seen == ["no_measurements"] * 3 + ["untrusted_fit"]
    state = cm.latency_model("llm")
    assert (state.time_budget_inactive_steps, state.time_budget_inactive_reason) == (4, "untrusted_fit")
    # With a prior (a configured model), the first step is planned in time and nothing is counted.
    budgets(cm, max_step_ms={"llm": {"mixed": 60.0}}, learn_cost=True, cost="llama2-7b-a100")
    cm.admit(9, "llm", "prefill", [7] * 4000)
    b = cm.assemble("llm", "mixed")
    assert b.max_step_ms == 60.0
    out = cm.complete(b.step, b.planned(), measured_ms=50.0)
    assert out.time_inactive is None
    state = cm.latency_model("llm")
    assert (state.time_budget_inactive_steps, state.time_budget_inactive_reason) == (4, None)


def test_a_time_reported_after_the_completion_feeds_the_fit_once(cm):
    # An engine one step behind (asynchronous scheduling): each step completes without its
    # time, which comes with the next step.
    truth = LatencyModel(6.0, 0.05, 0.0, 0.0)
    budgets(cm, max_step_ms={"llm": {"mixed": 120.0}}, learn_cost=True)
    late = []
    for rid in range(1, 80):
        cm.admit(rid, "llm", "prefill", [1] * (64 + 37 * rid % 1500))
        b = cm.assemble("llm", "mixed")
        out = cm.complete(b.step, b.planned())
        assert out.measured_ms is None and out.time_overrun is None
        ms = truth.predict_ms(*features(b))
        m = cm.measured(b.step, ms)
        assert (m["step"], m["node"], m["walk"], m["measured_ms"]) == (b.step, "llm", "mixed", ms)
        late.append(m)
        with pytest.raises(ChunkingError, match="step"):
            cm.measured(b.step, ms)
        cm.forget_request(rid)
    state = cm.latency_model("llm")
    assert state.source == "online", state
    assert state.model[1] == pytest.approx(0.05, rel=0.05)
    with pytest.raises(ValueError, match="measured_ms"):
        cm.measured(late[-1]["step"], float("nan"))
