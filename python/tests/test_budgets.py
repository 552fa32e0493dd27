"""policy, set_policies, set_budgets and the budget answers, sentence by sentence."""

import pytest

from mstar_chunking import (
    DEFAULT_MIN_CHUNK_TOKENS,
    NO_CHUNKING,
    ChunkingError,
    ChunkingPolicy,
    ConflictError,
    RefusedSettingsError,
    SubmoduleCaps,
)

WALKS = ["prefill", "decode", "mixed", "encode"]
COMBINED = {"prefill": "mixed", "decode": "mixed"}


@pytest.fixture
def cm(make_cm):
    cm = make_cm(
        {
            "llm": SubmoduleCaps(["prefill", "mixed"], True),  # can cap member walks
            "talker": SubmoduleCaps(["prefill", "mixed"], False),
            "vision": SubmoduleCaps([], False),  # its image cannot be cut
            "audio": SubmoduleCaps(["prefill"], False),  # the model budgets nothing here
        }
    )
    cm.set_policies(
        {
            ("llm", "prefill"): ChunkingPolicy(2048, align=16),
            ("llm", "mixed"): ChunkingPolicy(2048, align=16),
            ("talker", "prefill"): ChunkingPolicy(1024),
            ("talker", "mixed"): ChunkingPolicy(1024),
            ("vision", "encode"): ChunkingPolicy(4096),
        }
    )
    return cm


def budgets(cm, overrides, **kw):
    kw.setdefault("combined_walk_of", COMBINED)
    cm.set_budgets(overrides, WALKS, **kw)


# policy: "The model's, or NO_CHUNKING where it declares none."


def test_policy_is_the_models_or_no_chunking(cm):
    assert cm.policy("llm", "mixed") == ChunkingPolicy(2048, align=16)
    assert cm.policy("llm", "decode") is NO_CHUNKING
    assert NO_CHUNKING == ChunkingPolicy(None) and NO_CHUNKING.align == 1


def test_policies_are_fixed_once_bound(cm):
    same = {
        ("llm", "prefill"): ChunkingPolicy(2048, align=16),
        ("llm", "mixed"): ChunkingPolicy(2048, align=16),
        ("talker", "prefill"): ChunkingPolicy(1024),
        ("talker", "mixed"): ChunkingPolicy(1024),
        ("vision", "encode"): ChunkingPolicy(4096),
    }
    cm.set_policies(same)  # the same policies again: a no-op
    with pytest.raises(RefusedSettingsError, match="fixed at load"):
        cm.set_policies({("llm", "mixed"): ChunkingPolicy(512)})
    assert cm.max_batch_tokens("llm", "mixed") == 2048


def test_bad_policies_are_refused_naming_node_and_walk(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill"])})
    with pytest.raises(RefusedSettingsError) as e:
        cm.set_policies(
            {("llm", "prefill"): ChunkingPolicy(8, align=16), ("ghost", "prefill"): ChunkingPolicy(8)}
        )
    assert isinstance(e.value, ValueError)
    assert len(e.value.problems) == 2
    assert "`llm`/`prefill`" in str(e.value) and "`ghost`" in str(e.value)


# set_budgets: "Overrides the budgets set_policies declared, so it runs after it."


def test_set_budgets_runs_after_set_policies(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill"])})
    with pytest.raises(ChunkingError, match="set_policies"):
        cm.set_budgets({"llm": 512}, ["prefill"])
    with pytest.raises(ConflictError, match="set_policies"):
        cm.max_batch_tokens("llm", "prefill")


def test_before_set_budgets_the_answers_are_the_models(cm):
    assert cm.max_batch_tokens("llm", "mixed") == 2048
    assert cm.max_batch_tokens("talker", "prefill") == 1024
    assert cm.max_batch_tokens("llm", "decode") is None
    assert cm.min_chunk_tokens(10_000) == DEFAULT_MIN_CHUNK_TOKENS == 64
    assert cm.walk_caps("llm", "mixed") is None


# "Per node, one budget for every walk the model budgets, or a mapping of walk -> budget"


def test_a_node_wide_budget_applies_to_every_walk_the_model_budgets(cm):
    budgets(cm, {"talker": 512})
    assert cm.max_batch_tokens("talker", "prefill") == 512
    assert cm.max_batch_tokens("talker", "mixed") == 512
    assert cm.max_batch_tokens("talker", "decode") is None  # not budgeted by the model
    assert cm.max_batch_tokens("llm", "mixed") == 2048  # other nodes keep the policy


def test_a_per_walk_budget_is_layered_over_the_policy(cm):
    budgets(cm, {"llm": {"mixed": 1024}})
    assert cm.max_batch_tokens("llm", "mixed") == 1024
    assert cm.max_batch_tokens("llm", "prefill") == 2048
    assert cm.policy("llm", "mixed") == ChunkingPolicy(2048, align=16), "the policy itself stays"


# "null turns chunking off."


def test_none_turns_a_walks_chunking_off(cm):
    budgets(cm, {"talker": {"mixed": None}})
    assert cm.max_batch_tokens("talker", "mixed") is None
    assert not cm.chunkable("talker", "mixed")
    assert cm.chunkable("llm", "mixed")


def test_a_node_wide_none_turns_every_budgeted_walk_off(cm):
    budgets(cm, {"talker": None})
    assert cm.max_batch_tokens("talker", "prefill") is None
    assert cm.max_batch_tokens("talker", "mixed") is None
    assert not cm.chunkable("talker", "prefill")


# "Only walks the model budgets can be overridden: elsewhere the setting would do nothing."


def test_a_walk_the_model_does_not_budget_cannot_be_overridden(cm):
    with pytest.raises(RefusedSettingsError) as e:
        budgets(cm, {"llm": {"encode": 100}})
    assert "`llm`/`encode`" in str(e.value) and "would do nothing" in str(e.value)


def test_a_node_wide_budget_on_a_node_the_model_budgets_nothing_on_is_refused(cm):
    with pytest.raises(RefusedSettingsError, match="budgets no walk on `audio`"):
        budgets(cm, {"audio": 100})


# "A walk inside a combined walk runs in the combined walk's steps, under the combined walk's
# budget, so its own budget applies there only on a node in override_mixed ... Elsewhere a
# per-walk override of such a walk would do nothing, so it is refused; the combined walk itself
# can be named instead."


def test_a_member_walk_override_is_refused_outside_override_mixed(cm):
    with pytest.raises(RefusedSettingsError) as e:
        budgets(cm, {"talker": {"prefill": 512}})
    msg = str(e.value)
    assert "`talker`/`prefill`" in msg and "runs inside `mixed`" in msg and "set `mixed` instead" in msg
    assert isinstance(e.value, ValueError)
    assert cm.max_batch_tokens("talker", "prefill") == 1024, "nothing changed"
    budgets(cm, {"talker": {"mixed": 512}})  # the combined walk itself
    assert cm.max_batch_tokens("talker", "mixed") == 512


def test_the_same_override_without_a_combined_walk_is_accepted(cm):
    cm.set_budgets({"talker": {"prefill": 512}}, WALKS)
    assert cm.max_batch_tokens("talker", "prefill") == 512


def test_override_mixed_caps_a_member_walks_rows_within_the_step(cm):
    budgets(cm, {"llm": {"prefill": 512, "mixed": 1024}}, override_mixed=["llm"])
    assert cm.max_batch_tokens("llm", "mixed") == 1024, "the step runs under the combined budget"
    assert cm.walk_caps("llm", "mixed") == {"prefill": 512}, "decode has no budget of its own: no cap"
    cm.admit(1, "llm", "prefill", [1] * 3000)
    b = cm.assemble("llm", "mixed")
    assert (b.budget, b.caps) == (1024, {"prefill": 512})
    assert [r.tokens for r in b.rows] == [512]
    assert b.rows[0].walk == "prefill"
    cm.complete(b.step, b.planned())


def test_walk_caps_is_none_otherwise(cm):
    budgets(cm, {"llm": {"prefill": 512}}, override_mixed=["llm"])
    assert cm.walk_caps("llm", "prefill") is None, "not a combined walk"
    assert cm.walk_caps("talker", "mixed") is None, "not in override_mixed"
    budgets(cm, {"llm": {"prefill": 512, "mixed": None}}, override_mixed=["llm"])
    assert cm.walk_caps("llm", "mixed") is None, "a step without a budget has no caps"


def test_without_overrides_the_caps_are_the_policies_budgets(cm):
    budgets(cm, {}, override_mixed=["llm"])
    assert cm.walk_caps("llm", "mixed") == {"prefill": 2048}


# "no_chunking names nodes this worker chunks nowhere ... A budget set on one is still
# validated but has no effect"


def test_no_chunking_nodes_are_validated_but_inert(cm):
    budgets(cm, {"talker": 512}, no_chunking=["talker"])
    assert cm.max_batch_tokens("talker", "mixed") is None
    assert cm.max_batch_tokens("talker", "prefill") is None
    assert not cm.chunkable("talker", "mixed")
    assert cm.max_batch_tokens("llm", "mixed") == 2048, "other nodes are untouched"
    with pytest.raises(RefusedSettingsError, match="`talker`/`prefill`"):
        budgets(cm, {"talker": {"prefill": 512}}, no_chunking=["talker"])
    with pytest.raises(RefusedSettingsError, match="`ghost`"):
        budgets(cm, {}, no_chunking=["ghost"])


def test_a_no_chunking_node_runs_rows_whole(cm):
    budgets(cm, {}, no_chunking=["talker"])
    cm.admit(1, "talker", "prefill", [1] * 3000)
    b = cm.assemble("talker", "mixed")
    assert b.budget is None and [r.range.tokens for r in b.rows] == [3000]
    cm.complete(b.step, b.planned())


# chunkable: "The submodule's say, unless the serving config turned the walk's chunking off (a
# null budget) or the worker chunks nothing on the node."


def test_chunkable_is_the_submodules_say(cm):
    assert cm.max_batch_tokens("vision", "encode") == 4096
    assert not cm.chunkable("vision", "encode"), "the submodule cuts nothing"
    assert cm.chunkable("llm", "prefill")
    assert not cm.chunkable("llm", "decode"), "no budget"


# min_chunk_tokens: "The fewest tokens the scheduler cuts a row to under budget, or the whole
# budget when that is smaller."


def test_min_chunk_tokens_is_the_floor_or_the_whole_budget(cm):
    assert cm.min_chunk_tokens(1000) == 64
    assert cm.min_chunk_tokens(10) == 10
    budgets(cm, {}, min_chunk_tokens=32)
    assert cm.min_chunk_tokens(1000) == 32
    assert cm.min_chunk_tokens(0) == 0


def test_a_floor_of_zero_or_below_is_refused(cm):
    with pytest.raises(RefusedSettingsError, match="min_chunk_tokens"):
        budgets(cm, {}, min_chunk_tokens=0)
    with pytest.raises(RefusedSettingsError, match="min_chunk_tokens"):
        budgets(cm, {}, min_chunk_tokens=-1)
    assert cm.min_chunk_tokens(1000) == 64


# Refusals: whole, every problem at once, each naming node, walk and key.


def test_refused_settings_change_nothing_and_name_every_problem(cm):
    budgets(cm, {"llm": {"mixed": 1024}})
    with pytest.raises(RefusedSettingsError) as e:
        budgets(cm, {"llm": {"mixed": 512}, "ghost": 100, "talker": {"decode": 5}})
    problems = e.value.problems
    assert len(problems) == 2, problems
    assert any("`ghost`" in p for p in problems) and any("`talker`/`decode`" in p for p in problems)
    assert e.value.kind == "refused_settings" and not e.value.retryable
    assert cm.max_batch_tokens("llm", "mixed") == 1024


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "512", 2**32])
def test_a_budget_must_be_a_positive_whole_number_or_none(cm, bad):
    with pytest.raises(RefusedSettingsError) as e:
        budgets(cm, {"llm": {"mixed": bad}})
    assert "overrides['llm']['mixed']" in str(e.value)
    assert e.value.kind == "refused_settings" and len(e.value.problems) == 1
    with pytest.raises(RefusedSettingsError, match=r"overrides\['talker'\]"):
        budgets(cm, {"talker": bad})


def test_a_walk_the_deployment_does_not_serve_is_refused(cm):
    with pytest.raises(RefusedSettingsError, match="not served"):
        cm.set_budgets({"llm": {"mixed": 512}}, ["prefill", "decode"])
    with pytest.raises(RefusedSettingsError, match="`combined_walk_of` names walk `mixed`"):
        cm.set_budgets({}, ["prefill", "decode"], combined_walk_of=COMBINED)


def test_a_budget_below_the_policys_align_is_refused(cm):
    with pytest.raises(RefusedSettingsError, match="align"):
        budgets(cm, {"llm": {"mixed": 8}})


def test_the_documentations_example(documented_example):
    cm = documented_example
    cm.set_budgets(
        {"llm": {"mixed": 1024}},
        ["prefill", "decode", "mixed"],
        combined_walk_of={"prefill": "mixed", "decode": "mixed"},
        override_mixed=["llm"],
    )
    assert cm.max_batch_tokens("llm", "mixed") == 1024
    assert cm.policy("llm", "mixed") == ChunkingPolicy(2048, align=16)
    assert cm.chunkable("llm", "mixed") and not cm.chunkable("llm", "decode")
    # No member walk has a budget of its own (the model budgets only `mixed`): no caps.
    assert cm.walk_caps("llm", "mixed") == {}
    cm.admit(1, "llm", "prefill", [1] * 3000)
    b = cm.assemble("llm", "mixed")
    assert b.rows[0].range == (0, 1024, 3000, 1024)
    cm.complete(b.step, b.planned())


# slots_per_row: input slots the engine adds to every row, charged to the token budget.


def test_slots_per_row_are_charged_to_every_row_of_a_step(cm):
    budgets(cm, {"talker": 100}, slots_per_row=2)
    cm.continue_row(1, "talker", "decode", 4)
    cm.admit(2, "talker", "prefill", [1] * 300)
    b = cm.assemble("talker", "mixed")
    # 4 + 2 for the decode row; the prompt's chunk is what is left after its own 2 slots.
    assert [r.range.tokens if r.range is not None else r.estimate for r in b.rows] == [4, 92]
    cm.complete(b.step, b.planned())


def test_slots_filling_a_budget_or_not_a_count_are_refused_naming_them(cm):
    with pytest.raises(RefusedSettingsError, match=r"`slots_per_row` 100 fills the budget of 100 tokens of `talker`/`mixed`"):
        budgets(cm, {"talker": 100}, slots_per_row=100)
    assert cm.max_batch_tokens("talker", "mixed") == 1024, "a refused setting changes nothing"
    with pytest.raises(RefusedSettingsError, match="slots_per_row"):
        budgets(cm, {}, slots_per_row=-1)
