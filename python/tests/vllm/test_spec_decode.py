"""Speculative decoding (vLLM's n-gram drafter, and drafters that take input slots of their own)
under the plugin. Each step vLLM's scan offers a decoding request 1 + the drafts it holds, and
charges its budget that many tokens; a verify step accepts some drafts and rewinds the rest. The
plugin gives each decode row the estimate 1 + the drafts vLLM holds for it (at most 1 + k), so
the plan charges the budget what vLLM's scan will; a row run with fewer tokens reports what it
ran. A new decode row (a prompt's last token after a full prefix-cache hit) that vLLM pads to
1 + k placeholder rows is taken whole.

The fabricated model proposes 0 to k drafts per request and step and accepts a deterministic
share of them. With vLLM's chunk rules the plugin schedules step for step as vLLM's own
scheduler: the same tokens and drafts for every request. With its defaults every request
completes with its `max_tokens`, no step runs more than the budget, and nothing is held."""

import pytest
from harness import Driver, VllmScheduler, kv_all_free, make_scheduler
from vllm.config import SpeculativeConfig

from mstar_chunking.vllm import Scheduler, UnsupportedVllmFeature

K = 3
BUDGET = 96


class VllmRules(Scheduler):
    """The plugin with vLLM's chunk rules (no alignment, no floor): vLLM's exact chunks."""

    def chunking_settings(self):
        return {**super().chunking_settings(), "align": 1, "min_chunk_tokens": 1}


def drafts(req_id, step):
    """(drafts to propose next, accepted of the n drafts this step scheduled)."""
    i = int(req_id[1:])
    return (step + i) % (K + 1), (lambda n: n if (step + i) % 3 == 0 else n // 2)


PROMPTS = {f"r{i}": n for i, n in enumerate([120, 300, 60, 210, 161, 90])}
MAX_TOKENS = {f"r{i}": 20 + 7 * i for i in range(len(PROMPTS))}


def prompt(req_id):
    if req_id == "r6":  # r4's prompt again: a full prefix-cache hit but its last token
        req_id = "r4"
    i, n = int(req_id[1:]), PROMPTS[req_id]
    return [60 + i] * 5 + list(range(4000 * i, 4000 * i + n - 5))


def run(cls, slots=0):
    s = make_scheduler(cls, budget=BUDGET, num_spec_tokens=K)
    d = Driver(s, drafts=drafts)
    for r in PROMPTS:
        d.add(r, prompt(r), MAX_TOKENS[r])
    spec = []
    k = 0
    while s.has_requests() and k < 2_000:
        if k == 12:
            d.add("r6", prompt("r6"), 9)
        out = None
        orig = s.schedule

        def grab(*a, **kw):
            nonlocal out
            out = orig(*a, **kw)
            return out

        s.schedule = grab
        d.step()
        s.schedule = orig
        spec.append({r: len(t) for r, t in out.scheduled_spec_decode_tokens.items()})
        # vLLM charges each scheduled request its tokens and the drafter's slots.
        assert out.total_num_scheduled_tokens + slots * len(out.num_scheduled_tokens) <= BUDGET
        k += 1
    run = d.drain()
    for r, n in {**MAX_TOKENS, "r6": 9}.items():
        assert run.outputs[r] == n, (r, dict(run.outputs))
    assert kv_all_free(s, 10_000)
    if isinstance(s, Scheduler):
        assert not s._rid_of and len(s.chunking.prepared) == 0 and not s._row_estimate
    stats = getattr(s, "mstar_stats", None)
    s.shutdown()
    return [sorted((c.req_id, c.start, c.tokens) for c in st) for st in run.steps], spec, stats


def test_the_plugin_schedules_drafts_as_vllm():
    theirs, their_spec, _ = run(VllmScheduler)
    ours, our_spec, stats = run(VllmRules)
    assert sum(n for st in their_spec for n in st.values()) > 100  # drafts were run
    assert any(st.get("r6") == K for st in their_spec)  # r6's new decode row padded to 1 + k
    for i, (a, b) in enumerate(zip(theirs, ours)):
        assert a == b, (i, a, b)
    assert len(ours) == len(theirs) and our_spec == their_spec
    assert stats.handed_back == 0  # every decode row planned at what vLLM gave it


def test_the_defaults_run_every_draft_within_the_budget():
    steps, spec, stats = run(Scheduler)
    assert sum(n for st in spec for n in st.values()) > 100
    assert stats.handed_back == 0


@pytest.fixture
def drafter_slots(monkeypatch):
    """A drafter that takes input slots of its own (a draft model: 1; parallel drafting: k - 1
    or k), as vLLM's config reports it; the n-gram drafter proposes the drafts."""

    def use(n):
        monkeypatch.setattr(SpeculativeConfig, "max_num_new_slots_for_drafting", property(lambda self: n))

    return use


@pytest.mark.parametrize("slots", [1, K])
def test_a_drafters_input_slots_are_charged_as_vllm_charges_them(drafter_slots, slots):
    drafter_slots(slots)
    theirs, their_spec, _ = run(VllmScheduler, slots)
    ours, our_spec, stats = run(VllmRules, slots)
    assert sum(n for st in their_spec for n in st.values()) > 100
    for i, (a, b) in enumerate(zip(theirs, ours)):
        assert a == b, (i, a, b)
    assert len(ours) == len(theirs) and our_spec == their_spec
    # With the component's defaults every step stays within the budget with the slots charged.
    run(Scheduler, slots)


def test_slots_other_than_the_drafters_are_refused_naming_the_setting(drafter_slots):
    drafter_slots(2)

    class NoSlots(Scheduler):
        def chunking_settings(self):
            return {**super().chunking_settings(), "slots_per_row": 0}

    with pytest.raises(UnsupportedVllmFeature, match=r"chunking_settings\(\)\['slots_per_row'\] is 0: .* 2 input slots"):
        make_scheduler(NoSlots, num_spec_tokens=K)
