//! `set_budgets` validation and the budget answers, rule by rule.

use std::num::NonZeroU32;

use super::*;
use crate::policy::SubmoduleCaps;

fn n(s: &str) -> Name {
    Name::from(s)
}

/// The omni-demo model of `config/models/omni.toml`.
fn omni() -> Arc<ModelPolicies> {
    let subs = BTreeMap::from([
        (n("thinker"), SubmoduleCaps::new(["prefill", "mixed"], true)),
        (n("vision"), SubmoduleCaps::new::<_, &str>([], false)),
        (n("talker"), SubmoduleCaps::new(["prefill"], false)),
        (n("llm"), SubmoduleCaps::new(["prefill", "mixed"], false)),
    ]);
    let pols = BTreeMap::from([
        (
            (n("thinker"), n("prefill")),
            ChunkingPolicy::budget(4096).aligned(16),
        ),
        (
            (n("thinker"), n("mixed")),
            ChunkingPolicy::budget(8192).aligned(16),
        ),
        ((n("thinker"), n("decode")), ChunkingPolicy::budget(256)),
        ((n("vision"), n("prefill")), ChunkingPolicy::budget(8192)),
        ((n("talker"), n("prefill")), ChunkingPolicy::budget(2048)),
        ((n("llm"), n("prefill")), ChunkingPolicy::budget(2048)),
        ((n("llm"), n("mixed")), ChunkingPolicy::budget(4096)),
    ]);
    ModelPolicies::new(subs, pols).unwrap().shared()
}

fn settings() -> BudgetSettings {
    BudgetSettings {
        overrides: BTreeMap::new(),
        walks: [n("prefill"), n("decode"), n("mixed")].into(),
        combined_walk_of: BTreeMap::from([(n("prefill"), n("mixed")), (n("decode"), n("mixed"))]),
        override_mixed: [n("thinker")].into(),
        no_chunking: BTreeSet::new(),
        min_chunk_tokens: 64,
        max_row_tokens: None,
        max_partial_prefills: None,
        slots_per_row: 0,
        time: TimeSettings::default(),
        order: Default::default(),
    }
}

fn tok(n: u32) -> BudgetValue {
    BudgetValue::tokens(n).unwrap()
}

fn per_walk(node: &str, walks: &[(&str, BudgetValue)]) -> BTreeMap<Name, NodeBudget> {
    BTreeMap::from([(
        n(node),
        NodeBudget::PerWalk(walks.iter().map(|(w, v)| (n(w), *v)).collect()),
    )])
}

fn refused(s: BudgetSettings) -> Vec<BudgetError> {
    BudgetTable::from_policies(omni())
        .with_settings(s)
        .unwrap_err()
        .0
}

/// One node `llm` that cuts `prefill` and `mixed`, with a policy on `mixed` only (the
/// README's model), and a node `enc` that cuts `prefill` with no policy at all.
fn mixed_only() -> Arc<ModelPolicies> {
    let subs = BTreeMap::from([
        (n("llm"), SubmoduleCaps::new(["prefill", "mixed"], false)),
        (n("enc"), SubmoduleCaps::new(["prefill"], false)),
    ]);
    let pols = BTreeMap::from([((n("llm"), n("mixed")), ChunkingPolicy::budget(2048))]);
    ModelPolicies::new(subs, pols).unwrap().shared()
}

#[test]
fn a_chunkable_walk_no_combined_walk_takes_is_refused_where_another_walk_runs_alone() {
    let walks = BudgetSettings::new(["prefill", "decode", "mixed"]);
    let errors = BudgetTable::build(mixed_only(), walks.clone())
        .unwrap_err()
        .0;
    // `enc` has no budget at all: its rows run uncut by the model's decision.
    assert_eq!(
        errors,
        vec![BudgetError::WalkNeverChunked {
            node: n("llm"),
            walk: n("prefill"),
            combined: n("mixed"),
        }]
    );
    assert_eq!(
        errors[0].to_string(),
        "walk `prefill` on `llm` runs inside no combined walk: `mixed` steps would never run \
         its rows, and `prefill` steps would run them uncut (the model gives `prefill` no \
         budget on `llm`); combine it (`combined_walk_of`: `prefill` -> `mixed`) or name \
         `llm` in `no_chunking`"
    );
    // Combined as a member, not served, on a no_chunking node, or with the budgeted walk
    // not served: accepted.
    let combined = walks.clone().combined("mixed", ["prefill", "decode"]);
    assert!(BudgetTable::build(mixed_only(), combined).is_ok());
    let unserved = BudgetSettings::new(["decode", "mixed"]);
    assert!(BudgetTable::build(mixed_only(), unserved).is_ok());
    let llm_off = walks.clone().no_chunking("llm");
    assert!(BudgetTable::build(mixed_only(), llm_off).is_ok());
    let no_mixed = BudgetSettings::new(["prefill", "decode"]);
    assert!(BudgetTable::build(mixed_only(), no_mixed).is_ok());
    // A walk that is itself combined runs its members in its own steps: no stall.
    let prefill_combines = walks.clone().combined("prefill", ["decode"]);
    assert!(BudgetTable::build(mixed_only(), prefill_combines).is_ok());
    // The budgeted walk as a member of another combined walk takes no rows of its own.
    let mixed_member = walks.combined("decode", ["mixed"]);
    assert!(BudgetTable::build(mixed_only(), mixed_member).is_ok());
}

#[test]
fn policy_budgets_apply_without_overrides() {
    let t = BudgetTable::build(omni(), settings()).unwrap();
    assert_eq!(t.max_batch_tokens("thinker", "mixed"), Some(8192));
    assert_eq!(t.max_batch_tokens("thinker", "spec_verify"), None);
    assert!(t.chunkable("thinker", "prefill"));
    assert!(
        !t.chunkable("vision", "prefill"),
        "the submodule cuts nothing"
    );
    assert!(
        !t.chunkable("thinker", "decode"),
        "not a chunkable walk of the submodule"
    );
}

#[test]
fn per_walk_override_and_off() {
    let mut s = settings();
    s.overrides = per_walk(
        "thinker",
        &[("mixed", tok(6144)), ("prefill", BudgetValue::Off)],
    );
    let t = BudgetTable::build(omni(), s).unwrap();
    assert_eq!(t.max_batch_tokens("thinker", "mixed"), Some(6144));
    assert_eq!(t.max_batch_tokens("thinker", "prefill"), None);
    assert!(!t.chunkable("thinker", "prefill"), "off turns chunking off");
    assert_eq!(
        t.walk_caps("thinker", "mixed"),
        Some(BTreeMap::from([(n("decode"), 256)]))
    );
}

#[test]
fn node_wide_budget_covers_every_budgeted_walk() {
    let mut s = settings();
    s.overrides = BTreeMap::from([(n("llm"), NodeBudget::All(tok(1000)))]);
    let t = BudgetTable::build(omni(), s).unwrap();
    assert_eq!(t.max_batch_tokens("llm", "prefill"), Some(1000));
    assert_eq!(t.max_batch_tokens("llm", "mixed"), Some(1000));
    assert_eq!(
        t.max_batch_tokens("llm", "decode"),
        None,
        "not budgeted by the model"
    );
}

#[test]
fn no_chunking_node_has_no_budget_but_its_budget_is_still_validated() {
    let mut s = settings();
    s.no_chunking = [n("talker")].into();
    s.overrides = BTreeMap::from([(n("talker"), NodeBudget::All(tok(512)))]);
    let t = BudgetTable::build(omni(), s.clone()).unwrap();
    assert_eq!(t.max_batch_tokens("talker", "prefill"), None);
    assert!(!t.chunkable("talker", "prefill"));
    s.overrides = BTreeMap::from([(n("ghost"), NodeBudget::All(tok(512)))]);
    assert!(matches!(refused(s)[..], [BudgetError::UnknownNode { .. }]));
}

#[test]
fn min_chunk_tokens_is_capped_by_the_budget() {
    let t = BudgetTable::build(omni(), settings()).unwrap();
    assert_eq!(t.min_chunk_tokens(4096), 64);
    assert_eq!(t.min_chunk_tokens(16), 16);
}

#[test]
fn walk_caps_only_under_a_combined_walk_on_an_override_node() {
    let t = BudgetTable::build(omni(), settings()).unwrap();
    let caps = t.walk_caps("thinker", "mixed").unwrap();
    assert_eq!(
        caps,
        BTreeMap::from([(n("decode"), 256), (n("prefill"), 4096)])
    );
    assert_eq!(
        t.walk_caps("thinker", "prefill"),
        None,
        "not a combined walk"
    );
    assert_eq!(
        t.walk_caps("llm", "mixed"),
        None,
        "llm cannot cap member walks"
    );
    let mut s = settings();
    s.no_chunking = [n("thinker")].into();
    let t = BudgetTable::build(omni(), s).unwrap();
    assert_eq!(t.walk_caps("thinker", "mixed"), None, "no_chunking node");
}

#[test]
fn an_unknown_node() {
    let mut s = settings();
    s.overrides = BTreeMap::from([(n("ghost"), NodeBudget::All(tok(5)))]);
    let e = refused(s);
    assert_eq!(
        e[0].to_string(),
        "`max_batch_tokens` names node `ghost`, which the model does not have"
    );
}

#[test]
fn a_walk_this_deployment_does_not_run() {
    let mut s = settings();
    s.overrides = per_walk("thinker", &[("spec_verify", tok(5))]);
    assert!(
        matches!(&refused(s)[..], [BudgetError::WalkNotServed { walk, .. }] if &**walk == "spec_verify")
    );
}

#[test]
fn a_budget_the_model_gives_no_meaning() {
    let mut s = settings();
    s.walks.insert(n("spec_verify"));
    s.overrides = per_walk("thinker", &[("spec_verify", tok(5))]);
    assert!(matches!(
        &refused(s)[..],
        [BudgetError::WalkNotBudgeted { .. }]
    ));
}

#[test]
fn a_node_wide_budget_on_a_node_without_budgets() {
    let subs = BTreeMap::from([(n("enc"), SubmoduleCaps::default())]);
    let model = ModelPolicies::new(subs, BTreeMap::new()).unwrap().shared();
    let mut s = BudgetSettings::defaults_for(&model);
    s.overrides = BTreeMap::from([(n("enc"), NodeBudget::All(tok(5)))]);
    let e = BudgetTable::build(model, s).unwrap_err().0;
    assert!(matches!(&e[..], [BudgetError::NodeBudgetsNothing { .. }]));
}

#[test]
fn a_member_walks_budget_on_a_node_that_cannot_use_it_suggests_the_combined_walk() {
    let mut s = settings();
    s.overrides = per_walk("llm", &[("prefill", tok(512))]);
    let e = refused(s);
    assert_eq!(
        e[0].to_string(),
        "budget for `llm`/`prefill` would do nothing: `prefill` runs inside `mixed` and `llm` cannot cap member walks; set `mixed` instead"
    );
    // The same override on the override_mixed node is a cap, and accepted.
    let mut s = settings();
    s.overrides = per_walk("thinker", &[("prefill", tok(512))]);
    assert!(BudgetTable::build(omni(), s).is_ok());
}

#[test]
fn a_budget_or_floor_that_is_not_a_positive_whole_number() {
    assert_eq!(BudgetValue::tokens(0), None, "0 is not a budget");
    let mut s = settings();
    s.min_chunk_tokens = 0;
    assert_eq!(
        refused(s)[0].to_string(),
        "`min_chunk_tokens` must be at least 1, got 0"
    );
    let mut s = settings();
    s.overrides = per_walk("thinker", &[("mixed", tok(u32::MAX))]);
    assert!(
        BudgetTable::build(omni(), s).is_ok(),
        "u32::MAX is a valid budget"
    );
}

#[test]
fn a_budget_below_the_align_is_refused() {
    let mut s = settings();
    s.overrides = per_walk("thinker", &[("mixed", tok(8))]);
    assert_eq!(
        refused(s)[0].to_string(),
        "budget for `thinker`/`mixed` is 8, below the policy's `align` of 16 tokens: no aligned chunk would fit"
    );
}

#[test]
fn a_row_cap_below_an_align_is_refused() {
    let mut s = settings();
    s.max_row_tokens = Some(8);
    assert!(matches!(
        &refused(s)[..],
        [BudgetError::RowCapBelowAlign { align: 16, .. }]
    ));
}

#[test]
fn unknown_nodes_in_lists_and_a_walk_in_two_combined_walks() {
    let mut s = settings();
    s.override_mixed.insert(n("ghost"));
    s.no_chunking.insert(n("phantom"));
    s.walks.insert(n("super"));
    s.combined_walk_of.insert(n("mixed"), n("super"));
    let e = refused(s);
    assert_eq!(e.len(), 4, "{e:?}");
    assert!(e
        .iter()
        .any(|e| matches!(e, BudgetError::WalkInTwoCombined { .. })));
}

#[test]
fn every_problem_is_reported_and_the_previous_table_stays() {
    let first = BudgetTable::build(omni(), settings()).unwrap();
    let mut s = settings();
    s.overrides = per_walk("thinker", &[("mixed", tok(100)), ("ghost_walk", tok(1))]);
    s.min_chunk_tokens = 0;
    let e = first.with_settings(s).unwrap_err();
    assert_eq!(e.0.len(), 2);
    assert_eq!(first.max_batch_tokens("thinker", "mixed"), Some(8192));
}

#[test]
fn time_budgets_are_refused_where_they_would_do_nothing_and_applied_otherwise() {
    let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
    let time_walks = |walks: &[(&str, TimeBudget)]| {
        NodeSetting::PerWalk(walks.iter().map(|(w, v)| (n(w), *v)).collect())
    };
    let mut s = settings().cost("llm", model).cost("thinker", model);
    s.time.max_step_ms = BTreeMap::from([
        (n("llm"), time_walks(&[("mixed", TimeBudget::Ms(40.0))])),
        (n("thinker"), NodeSetting::All(TimeBudget::Ms(60.0))),
    ]);
    let t = BudgetTable::build(omni(), s.clone()).unwrap();
    assert_eq!(t.max_step_ms("llm", "mixed"), Some(40.0));
    assert_eq!(t.max_step_ms("llm", "prefill"), None);
    assert_eq!(t.max_step_ms("thinker", "decode"), Some(60.0));

    // A member walk, a walk without a token budget, an unknown node, a bad value and a node
    // without a model: every one refused, each naming its node.
    let mut bad = settings();
    bad.overrides = BTreeMap::from([(
        n("llm"),
        NodeSetting::PerWalk(BTreeMap::from([(n("mixed"), BudgetValue::Off)])),
    )]);
    bad.time.max_step_ms = BTreeMap::from([
        (
            n("llm"),
            time_walks(&[
                ("decode", TimeBudget::Ms(40.0)),
                ("mixed", TimeBudget::Ms(40.0)),
            ]),
        ),
        (
            n("thinker"),
            time_walks(&[("mixed", TimeBudget::Ms(f64::NAN))]),
        ),
        (n("ghost"), NodeSetting::All(TimeBudget::Ms(10.0))),
        (n("talker"), NodeSetting::All(TimeBudget::Ms(10.0))),
    ]);
    bad = bad.cost("llm", model);
    let errs = BudgetTable::build(omni(), bad).unwrap_err().0;
    let has = |f: &dyn Fn(&BudgetError) -> bool| errs.iter().any(f);
    assert!(
        has(&|e| matches!(e, BudgetError::TimeMemberWalk { walk, .. } if &**walk == "decode")),
        "{errs:?}"
    );
    assert!(
        has(
            &|e| matches!(e, BudgetError::TimeBudgetDoesNothing { walk, .. } if &**walk == "mixed")
        ),
        "{errs:?}"
    );
    assert!(
        has(
            &|e| matches!(e, BudgetError::BadTimeBudget { node, walk: Some(w), .. } if &**node == "thinker" && &**w == "mixed")
        ),
        "{errs:?}"
    );
    assert!(
        has(
            &|e| matches!(e, BudgetError::UnknownNode { setting: SettingKey::MaxStepMs, node } if &**node == "ghost")
        ),
        "{errs:?}"
    );
    assert!(
        has(&|e| matches!(e, BudgetError::NoLatencyModel { node } if &**node == "talker")),
        "{errs:?}"
    );
    assert_eq!(errs.len(), 5, "{errs:?}");
    // With learning on, a node without a model is accepted.
    let learn = s.max_step_ms("talker", 10.0).learn_cost(true);
    assert!(BudgetTable::build(omni(), learn).is_ok());
}

#[test]
fn an_all_zero_model_and_a_time_budget_below_base_ms_are_refused_with_the_numbers() {
    let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
    let s = settings()
        .cost("llm", model)
        .cost("thinker", LatencyModel::ZERO)
        .max_step_ms("llm", 4.5);
    let errs = BudgetTable::build(omni(), s).unwrap_err().0;
    let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert!(
        errs.iter()
            .any(|e| matches!(e, BudgetError::ZeroLatencyModel { node } if &**node == "thinker")),
        "{text:?}"
    );
    assert!(
        text.iter()
            .any(|t| t.contains("4.5 ms is below the latency model's `base_ms` of 5 ms")),
        "{text:?}"
    );
    assert!(
        errs.iter().all(|e| matches!(
            e,
            BudgetError::ZeroLatencyModel { .. } | BudgetError::TimeBudgetBelowBase { .. }
        )),
        "{text:?}"
    );
    // At `base_ms` exactly, a step of nothing else fits: accepted.
    let at_base = settings().cost("llm", model).max_step_ms("llm", 5.0);
    assert!(BudgetTable::build(omni(), at_base).is_ok());
}

#[test]
fn budget_values_and_time_budgets_print_as_a_config_writes_them() {
    assert_eq!(tok(2048).to_string(), "2048");
    assert_eq!(BudgetValue::Off.to_string(), "off");
    assert_eq!(TimeBudget::Ms(42.5).to_string(), "42.5");
    assert_eq!(TimeBudget::Off.to_string(), "off");
    assert_eq!(tok(3).get(), Some(3));
    assert_eq!(BudgetValue::Off.get(), None);
    assert_eq!(BudgetValue::from(NonZeroU32::new(3).unwrap()), tok(3));
    assert_eq!(TimeBudget::from(7.5), TimeBudget::Ms(7.5));
}

#[test]
fn the_builder_sets_each_field() {
    let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
    let one = NonZeroU32::MIN;
    let s = BudgetSettings::new(["prefill"])
        .combined("mixed", ["decode"])
        .budget("llm", tok(7))
        // A per-walk budget replaces a node-wide one; a second one keeps the first.
        .walk_budget("llm", "mixed", tok(100))
        .walk_budget("thinker", "mixed", tok(100))
        .walk_budget("thinker", "prefill", BudgetValue::Off)
        .min_chunk_tokens(NonZeroU32::new(32).unwrap())
        .max_row_tokens(NonZeroU32::new(512).unwrap())
        .max_partial_prefills(one)
        .override_mixed("thinker")
        .no_chunking("vision")
        .max_step_ms("llm", 50.0)
        .cost("llm", model)
        .learn_cost(true);
    assert_eq!(
        s.walks,
        BTreeSet::from([n("decode"), n("mixed"), n("prefill")])
    );
    assert_eq!(
        s.combined_walk_of,
        BTreeMap::from([(n("decode"), n("mixed"))])
    );
    assert_eq!(
        s.overrides["llm"],
        NodeBudget::PerWalk(BTreeMap::from([(n("mixed"), tok(100))]))
    );
    assert_eq!(
        s.overrides["thinker"],
        NodeBudget::PerWalk(BTreeMap::from([
            (n("mixed"), tok(100)),
            (n("prefill"), BudgetValue::Off)
        ]))
    );
    assert_eq!(s.min_chunk_tokens, 32);
    assert_eq!(s.max_row_tokens, Some(512));
    assert_eq!(s.max_partial_prefills, Some(1));
    assert_eq!(s.override_mixed, BTreeSet::from([n("thinker")]));
    assert_eq!(s.no_chunking, BTreeSet::from([n("vision")]));
    assert_eq!(
        s.time.max_step_ms["llm"],
        NodeTimeBudget::All(TimeBudget::Ms(50.0))
    );
    assert_eq!(s.time.cost["llm"], model);
    assert!(s.time.learn);
    let defaults = BudgetSettings::defaults_for(&omni());
    assert_eq!(
        defaults,
        BudgetSettings::new(["decode", "mixed", "prefill"])
    );
}

#[test]
fn the_table_answers_what_it_was_built_from() {
    let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
    let s = settings().cost("llm", model);
    let t = BudgetTable::build(omni(), s.clone()).unwrap();
    assert_eq!(t.model(), &omni());
    assert_eq!(t.settings(), &s);
    assert_eq!(
        t.policy("thinker", "mixed"),
        ChunkingPolicy::budget(8192).aligned(16)
    );
    assert_eq!(
        t.policy("thinker", "spec_verify"),
        crate::policy::NO_CHUNKING
    );
    assert_eq!(t.cost("llm"), Some(model));
    assert_eq!(t.cost("thinker"), None);
    assert_eq!(t.members("mixed"), [n("decode"), n("prefill")]);
    assert!(t.members("prefill").is_empty());
    assert_eq!(t.combined_walk_of("prefill"), Some(&n("mixed")));
    assert_eq!(t.combined_walk_of("mixed"), None);
    // Before any setting, the table is the model's.
    let bare = BudgetTable::from_policies(omni());
    assert_eq!(bare.settings(), &BudgetSettings::defaults_for(&omni()));
    assert_eq!(bare.max_batch_tokens("llm", "prefill"), Some(2048));
}

#[test]
fn a_budget_equal_to_the_align_is_accepted() {
    let mut s = settings();
    s.overrides = per_walk("thinker", &[("mixed", tok(16))]);
    let t = BudgetTable::build(omni(), s).unwrap();
    assert_eq!(t.max_batch_tokens("thinker", "mixed"), Some(16));
    let mut s = settings();
    s.overrides = per_walk("thinker", &[("mixed", tok(15))]);
    assert!(matches!(
        &refused(s)[..],
        [BudgetError::BelowAlign {
            budget: 15,
            align: 16,
            ..
        }]
    ));
}

#[test]
fn a_row_cap_equal_to_the_widest_align_is_accepted_and_zero_is_refused_once() {
    let mut s = settings();
    s.max_row_tokens = Some(16);
    assert!(BudgetTable::build(omni(), s).is_ok());
    let mut s = settings();
    s.max_row_tokens = Some(15);
    assert_eq!(
        refused(s)[0].to_string(),
        "`max_row_tokens` 15 is below the `align` of 16 tokens of `thinker`/`prefill`: rows \
         there could never be cut"
    );
    // 0 is refused as 0, not also as below every align.
    let mut s = settings();
    s.max_row_tokens = Some(0);
    s.max_partial_prefills = Some(0);
    assert_eq!(
        refused(s),
        vec![
            BudgetError::ZeroSetting {
                setting: SettingKey::MaxRowTokens
            },
            BudgetError::ZeroSetting {
                setting: SettingKey::MaxPartialPrefills
            },
        ]
    );
}

#[test]
fn a_time_margin_is_a_quantile_in_zero_one_and_needs_a_time_budget() {
    let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
    let timed = || settings().cost("llm", model).max_step_ms("llm", 50.0);
    for bad in [
        0.0,
        -0.0,
        -0.5,
        1.0 + f64::EPSILON,
        2.0,
        f64::INFINITY,
        f64::NAN,
    ] {
        let errs = refused(timed().time_margin(bad));
        assert!(
            matches!(errs[..], [BudgetError::BadTimeMargin { value }] if value.to_bits() == bad.to_bits()),
            "{bad}: {errs:?}"
        );
        assert!(
            errs[0]
                .to_string()
                .starts_with("time margin quantile must be a number in (0, 1], got "),
            "{}",
            errs[0]
        );
    }
    for good in [f64::MIN_POSITIVE, 0.5, 0.95, 1.0] {
        let table = BudgetTable::from_policies(omni())
            .with_settings(timed().time_margin(good))
            .unwrap();
        assert_eq!(table.settings().time.margin_quantile, Some(good));
    }
    // Without a time budget on any node (none, or every one off), a margin does nothing.
    assert_eq!(
        refused(settings().time_margin(0.9)),
        vec![BudgetError::TimeMarginWithoutBudget]
    );
    let off = settings()
        .cost("llm", model)
        .max_step_ms("llm", TimeBudget::Off)
        .time_margin(0.9);
    assert_eq!(refused(off), vec![BudgetError::TimeMarginWithoutBudget]);
    // A bad quantile is refused as bad, not also as doing nothing.
    assert_eq!(
        refused(settings().time_margin(2.0)),
        vec![BudgetError::BadTimeMargin { value: 2.0 }]
    );
}

#[test]
fn a_time_budget_must_be_finite_and_above_zero() {
    let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
    for bad in [0.0, -0.0, -1.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN] {
        let s = settings().cost("llm", model).max_step_ms("llm", bad);
        let errs = refused(s);
        assert!(
            matches!(&errs[..], [BudgetError::BadTimeBudget { node, walk: None, .. }] if &**node == "llm"),
            "{bad}: {errs:?}"
        );
        assert!(
            errs[0].to_string().starts_with(
                "time budget for `llm` must be a finite number of milliseconds above 0, got "
            ),
            "{}",
            errs[0]
        );
    }
    // The smallest positive time is a time budget (with a learned model, no `base_ms` is
    // known to be over it).
    let tiny = settings()
        .learn_cost(true)
        .max_step_ms("llm", f64::MIN_POSITIVE);
    let t = BudgetTable::build(omni(), tiny).unwrap();
    assert_eq!(t.max_step_ms("llm", "mixed"), Some(f64::MIN_POSITIVE));
    // Off needs no model.
    let off = settings().max_step_ms("llm", TimeBudget::Off);
    let t = BudgetTable::build(omni(), off).unwrap();
    assert_eq!(t.max_step_ms("llm", "mixed"), None);
}

#[test]
fn a_walk_is_refused_only_where_a_served_standalone_walk_could_take_it() {
    // `mixed` has the budget on `llm` but is not served: nothing waits on it.
    assert!(BudgetTable::build(mixed_only(), BudgetSettings::new(["prefill"])).is_ok());
    // `mixed` is served but a member of another combined walk: its steps are not assembled.
    let member = BudgetSettings::new(["prefill", "decode"]).combined("decode", ["mixed"]);
    assert!(BudgetTable::build(mixed_only(), member).is_ok());
    // Served and standalone: refused, naming it.
    let standalone = BudgetSettings::new(["prefill", "mixed"]);
    assert_eq!(
        BudgetTable::build(mixed_only(), standalone).unwrap_err().0,
        vec![BudgetError::WalkNeverChunked {
            node: n("llm"),
            walk: n("prefill"),
            combined: n("mixed"),
        }]
    );
}

#[test]
fn a_budget_is_written_off_or_as_decimal_digits_and_refusals_quote_the_text() {
    let tokens = |n: u32| BudgetValue::tokens(n).unwrap();
    for (text, want) in [
        ("off", BudgetValue::Off),
        ("OFF", BudgetValue::Off),
        (" Off ", BudgetValue::Off),
        ("1", tokens(1)),
        ("+7", tokens(7)),
        (" 42 ", tokens(42)),
        ("4294967295", tokens(u32::MAX)),
        // 30 digits is the longest text read as a number.
        ("000000000000000000000000000001", tokens(1)),
    ] {
        assert_eq!(text.parse::<BudgetValue>(), Ok(want), "{text:?}");
    }
    let refused = |text: &str| text.parse::<BudgetValue>().unwrap_err().written;
    // Whole numbers out of range are quoted as numbers.
    assert_eq!(refused("0"), "0");
    assert_eq!(refused("-5"), "-5");
    assert_eq!(refused("4294967296"), "4294967296");
    // Anything else is quoted as text, and only a text longer than 200 characters is cut.
    for text in [
        "", "-", "+", "1.5", "1e3", "0x10", "none", "false", "1 2", "-off",
    ] {
        assert_eq!(refused(text), format!("{text:?}"), "{text:?}");
    }
    let thirty_one = format!("{}1", "0".repeat(30));
    assert_eq!(refused(&thirty_one), format!("{thirty_one:?}"));
    let long = "x".repeat(250);
    assert_eq!(refused(&long), format!("{:?}…", "x".repeat(200)));
    let exactly = "y".repeat(200);
    assert_eq!(refused(&exactly), format!("{exactly:?}"));
    assert_eq!(
        "1.5".parse::<BudgetValue>().unwrap_err().to_string(),
        "expected a positive whole number of tokens (at most 4294967295) or \"off\", got \"1.5\""
    );
}

#[test]
fn a_refusal_names_its_setting_node_walk_rule_and_value() {
    let (llm, mixed) = (n("llm"), n("mixed"));
    fn subject<'a>(
        setting: SettingKey,
        node: Option<&'a Name>,
        walk: Option<&'a Name>,
    ) -> Option<Subject<'a>> {
        Some(Subject {
            setting,
            node,
            walk,
        })
    }
    let zero = BudgetError::ZeroSetting {
        setting: SettingKey::MinChunkTokens,
    };
    assert_eq!(
        zero.subject(),
        subject(SettingKey::MinChunkTokens, None, None)
    );
    assert_eq!(zero.value().as_deref(), Some("0"));
    assert_eq!(
        zero.rule().to_string(),
        "docs/budgets.md#not-a-positive-whole-number"
    );
    let row_cap = BudgetError::RowCapBelowAlign {
        max_row: 100,
        node: llm.clone(),
        walk: mixed.clone(),
        align: 128,
    };
    assert_eq!(
        row_cap.subject(),
        subject(SettingKey::MaxRowTokens, None, None)
    );
    assert_eq!(row_cap.value().as_deref(), Some("100"));
    assert_eq!(
        row_cap.rule().to_string(),
        "docs/budgets.md#max_row_tokens-below-an-align"
    );
    let time = BudgetError::BadTimeBudget {
        node: llm.clone(),
        walk: Some(mixed.clone()),
        value: -1.0,
    };
    assert_eq!(
        time.subject(),
        subject(SettingKey::MaxStepMs, Some(&llm), Some(&mixed))
    );
    // A per-node value is quoted from where it was written, not by the refusal.
    assert_eq!(time.value(), None);
    assert_eq!(time.rule().to_string(), "docs/cost-model.md#time-budgets");
    let margin = BudgetError::BadTimeMargin { value: 1.5 };
    assert_eq!(
        margin.subject(),
        subject(SettingKey::TimeMargin, None, None)
    );
    assert_eq!(margin.value().as_deref(), Some("1.5"));
    assert_eq!(
        margin.rule().to_string(),
        "docs/cost-model.md#the-time-margin"
    );
    assert_eq!(BudgetError::PoliciesNotSet.subject(), None);
    assert_eq!(BudgetError::PoliciesNotSet.value(), None);
    assert_eq!(
        BudgetError::PoliciesNotSet.rule().to_string(),
        "docs/budgets.md#refusals"
    );
}

/// One refusal of every kind (every setting for the kinds whose rule depends on it), with the
/// rule it cites. The `match` in the test makes a new kind fail to compile until it is here.
fn every_refusal() -> Vec<(BudgetError, Rule)> {
    use BudgetError as E;
    use Refusal as R;
    use SettingKey as K;
    let (node, walk, combined) = (n("llm"), n("prefill"), n("mixed"));
    let b = |r| Rule::Budgets(Some(r));
    let unknown = |setting| E::UnknownNode {
        setting,
        node: node.clone(),
    };
    let zero = |setting| E::ZeroSetting { setting };
    vec![
        (E::PoliciesNotSet, Rule::Budgets(None)),
        (unknown(K::MaxBatchTokens), b(R::UnknownNode)),
        (unknown(K::MaxStepMs), b(R::UnknownNode)),
        (unknown(K::Cost), b(R::UnknownNode)),
        (unknown(K::NoChunking), b(R::UnknownNode)),
        (unknown(K::OverrideMixed), b(R::UnknownNode)),
        (unknown(K::Order), Rule::Order),
        (
            E::WalkNotServed {
                setting: K::MaxBatchTokens,
                node: node.clone(),
                walk: walk.clone(),
            },
            b(R::WalkNotServed),
        ),
        (
            E::CombinedWalkNotServed { walk: walk.clone() },
            b(R::WalkNotServed),
        ),
        (
            E::WalkNotBudgeted {
                node: node.clone(),
                walk: walk.clone(),
            },
            b(R::WalkNotBudgeted),
        ),
        (
            E::NodeBudgetsNothing {
                setting: K::MaxBatchTokens,
                node: node.clone(),
            },
            b(R::NodeBudgetsNothing),
        ),
        (
            E::MemberWalk {
                node: node.clone(),
                walk: walk.clone(),
                combined: combined.clone(),
            },
            b(R::MemberWalk),
        ),
        (zero(K::MinChunkTokens), b(R::NotPositive)),
        (zero(K::MaxRowTokens), b(R::ZeroLimit)),
        (zero(K::MaxPartialPrefills), b(R::ZeroLimit)),
        (zero(K::MaxWaitSteps), Rule::Order),
        (
            E::BelowAlign {
                node: node.clone(),
                walk: walk.clone(),
                budget: 8,
                align: 16,
            },
            b(R::BelowAlign),
        ),
        (
            E::RowCapBelowAlign {
                max_row: 8,
                node: node.clone(),
                walk: walk.clone(),
                align: 16,
            },
            b(R::RowCapBelowAlign),
        ),
        (
            E::SlotsFillBudget {
                slots: 8,
                node: node.clone(),
                walk: walk.clone(),
                budget: 8,
            },
            b(R::SlotsFillBudget),
        ),
        (
            E::BadTimeBudget {
                node: node.clone(),
                walk: None,
                value: 0.0,
            },
            Rule::TimeBudgets,
        ),
        (
            E::TimeBudgetDoesNothing {
                node: node.clone(),
                walk: walk.clone(),
            },
            Rule::TimeBudgets,
        ),
        (
            E::TimeBudgetWithoutTokenBudget {
                node: node.clone(),
                walk: walk.clone(),
            },
            Rule::TimeBudgets,
        ),
        (
            E::TimeMemberWalk {
                node: node.clone(),
                walk: walk.clone(),
                combined: combined.clone(),
            },
            Rule::TimeBudgets,
        ),
        (E::NoLatencyModel { node: node.clone() }, Rule::TimeBudgets),
        (
            E::WalkNeverChunked {
                node: node.clone(),
                walk: walk.clone(),
                combined: combined.clone(),
            },
            b(R::WalkNeverChunked),
        ),
        (
            E::ZeroLatencyModel { node: node.clone() },
            Rule::TimeBudgets,
        ),
        (
            E::LatencyModelTooLarge {
                node: node.clone(),
                key: "base_ms",
                value: 1e300,
            },
            Rule::TimeBudgets,
        ),
        (
            E::TimeBudgetBelowBase {
                node: node.clone(),
                walk: walk.clone(),
                max_step_ms: 1.0,
                base_ms: 2.0,
            },
            Rule::TimeBudgets,
        ),
        (E::BadTimeMargin { value: 2.0 }, Rule::TimeMargin),
        (E::TimeMarginWithoutBudget, Rule::TimeMargin),
        (E::BadMaxWait { value: 0.0 }, Rule::Order),
        (
            E::WalkInTwoCombined {
                walk: walk.clone(),
                first: combined.clone(),
                second: n("other"),
            },
            b(R::WalkInTwoCombined),
        ),
    ]
}

/// `rule ` followed by a digit: a rule cited by its number.
fn cites_a_number(text: &str) -> bool {
    text.match_indices("rule ")
        .any(|(i, m)| text[i + m.len()..].starts_with(|c: char| c.is_ascii_digit()))
}

#[test]
fn every_refusal_cites_its_rule_by_the_anchor_of_its_heading_never_a_number() {
    let all = every_refusal();
    let mut kinds = [false; 24];
    for (e, want) in &all {
        // Every kind of refusal is sampled: a new one fails to compile here until it is.
        let kind = match e {
            BudgetError::PoliciesNotSet => 0,
            BudgetError::UnknownNode { .. } => 1,
            BudgetError::WalkNotServed { .. } => 2,
            BudgetError::CombinedWalkNotServed { .. } => 3,
            BudgetError::WalkNotBudgeted { .. } => 4,
            BudgetError::NodeBudgetsNothing { .. } => 5,
            BudgetError::MemberWalk { .. } => 6,
            BudgetError::ZeroSetting { .. } => 7,
            BudgetError::BelowAlign { .. } => 8,
            BudgetError::RowCapBelowAlign { .. } => 9,
            BudgetError::SlotsFillBudget { .. } => 10,
            BudgetError::BadTimeBudget { .. } => 11,
            BudgetError::TimeBudgetDoesNothing { .. } => 12,
            BudgetError::TimeBudgetWithoutTokenBudget { .. } => 13,
            BudgetError::TimeMemberWalk { .. } => 14,
            BudgetError::NoLatencyModel { .. } => 15,
            BudgetError::WalkNeverChunked { .. } => 16,
            BudgetError::ZeroLatencyModel { .. } => 17,
            BudgetError::LatencyModelTooLarge { .. } => 18,
            BudgetError::TimeBudgetBelowBase { .. } => 19,
            BudgetError::BadTimeMargin { .. } => 20,
            BudgetError::TimeMarginWithoutBudget => 21,
            BudgetError::BadMaxWait { .. } => 22,
            BudgetError::WalkInTwoCombined { .. } => 23,
        };
        kinds[kind] = true;
        assert_eq!(e.rule(), *want, "{e}");
        assert!(Rule::ALL.contains(&e.rule()), "{e}: {:?}", e.rule());
        // As the config loader reports it: the message, then the rule.
        let message = format!("{e} ({})", e.rule());
        assert!(!cites_a_number(&message), "{message}");
        let rule = e.rule().to_string();
        assert_eq!(rule, format!("{}#{}", want.page(), want.anchor()));
    }
    assert!(kinds.iter().all(|k| *k), "{kinds:?}");
    // Every rule a refusal may cite is cited by one; each is a heading of its page.
    for rule in Rule::ALL {
        assert!(
            all.iter().any(|(_, r)| *r == rule),
            "{rule} is cited by none"
        );
        let page = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rule.page()),
        )
        .unwrap();
        let headings: Vec<String> = page
            .lines()
            .filter_map(|l| l.strip_prefix("## ").or_else(|| l.strip_prefix("### ")))
            .map(github_anchor)
            .collect();
        assert!(
            headings.iter().any(|h| h == rule.anchor()),
            "{rule}: no such heading in {}",
            rule.page()
        );
        assert!(!cites_a_number(&rule.to_string()), "{rule}");
    }
    assert!(cites_a_number("see rule 6") && !cites_a_number("rule six, rules"));
}

/// GitHub's anchor for a heading: lower case, spaces as `-`, other punctuation than `-` and `_`
/// dropped.
fn github_anchor(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => c.to_lowercase().next(),
            _ => None,
        })
        .collect()
}

#[test]
fn a_latency_model_coefficient_above_the_bound_is_refused() {
    // 1e308 ms per token would predict any step of two tokens as infinity.
    let huge = LatencyModel::try_new(0.0, 1e308, 0.0, 0.0).unwrap();
    let errs = BudgetTable::build(omni(), settings().cost("llm", huge))
        .unwrap_err()
        .0;
    assert!(
        errs.iter().any(|e| matches!(
            e,
            BudgetError::LatencyModelTooLarge { node, key: "per_token_ms", value }
                if &**node == "llm" && *value == 1e308
        )),
        "{errs:?}"
    );
    let text = errs[0].to_string();
    assert!(
        text.contains("`per_token_ms` is 1e308 ms, above the 1e6 ms"),
        "{text}"
    );
    let sub = errs[0].subject().unwrap();
    assert_eq!(sub.setting, SettingKey::Cost);
    // At the bound: accepted.
    let at = LatencyModel::try_new(crate::latency::MAX_COEFFICIENT_MS, 0.0, 0.0, 0.0).unwrap();
    assert!(BudgetTable::build(omni(), settings().cost("llm", at)).is_ok());
}

#[test]
fn a_yielding_floor_waits_for_the_starvation_bound_or_a_hundred_steps() {
    let order = |bound| OrderSettings {
        bound,
        ..OrderSettings::default()
    };
    let time = TimeSettings::default();
    assert_eq!(time.floor, TimeFloor::Yield, "the default");
    assert_eq!(
        time.floor_yield(&OrderSettings::default()),
        Some(crate::order::WaitBound {
            max_wait_ms: None,
            max_wait_steps: Some(DEFAULT_FLOOR_WAIT_STEPS),
        })
    );
    let bound = crate::order::WaitBound {
        max_wait_ms: Some(250.0),
        max_wait_steps: None,
    };
    assert_eq!(time.floor_yield(&order(bound)), Some(bound));
    let run = TimeSettings {
        floor: TimeFloor::Run,
        ..TimeSettings::default()
    };
    assert_eq!(run.floor_yield(&order(bound)), None);
    assert_eq!(
        (TimeFloor::Yield.as_str(), TimeFloor::Run.as_str()),
        ("yield", "run")
    );
    assert_eq!(
        BudgetSettings::new(["prefill"])
            .time_floor(TimeFloor::Run)
            .time
            .floor,
        TimeFloor::Run
    );
}

#[test]
fn a_node_wide_time_budget_is_refused_where_every_step_walk_has_its_token_budget_off() {
    let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
    let timed = |s: BudgetSettings| {
        let mut s = s.cost("llm", model);
        s.time.max_step_ms = BTreeMap::from([(n("llm"), NodeSetting::All(TimeBudget::Ms(40.0)))]);
        s
    };
    let off_rule = |s: BudgetSettings| -> Vec<BudgetError> {
        BudgetTable::build(omni(), s)
            .err()
            .map_or_else(Vec::new, |e| {
                e.0.into_iter()
                    .filter(|e| matches!(e, BudgetError::TimeBudgetWithoutTokenBudget { .. }))
                    .collect()
            })
    };
    // `mixed`, llm's only step walk (`prefill` runs inside it), off: per walk or node-wide.
    for overrides in [
        per_walk("llm", &[("mixed", BudgetValue::Off)]),
        BTreeMap::from([(n("llm"), NodeSetting::All(BudgetValue::Off))]),
    ] {
        let mut s = timed(settings());
        s.overrides = overrides;
        let e = BudgetTable::build(omni(), s.clone()).unwrap_err().0;
        assert_eq!(e.len(), 1, "{e:?}");
        let want = BudgetError::TimeBudgetWithoutTokenBudget {
            node: n("llm"),
            walk: n("mixed"),
        };
        assert_eq!(e[0], want);
        assert_eq!(
            e[0].to_string(),
            "`chunking.max_step_ms.llm` would do nothing: `chunking.max_batch_tokens.llm.mixed` is off, so no step is cut; set a token budget there or the time budget off"
        );
        let subject = e[0].subject().unwrap();
        assert_eq!(
            (subject.setting, subject.node, subject.walk),
            (SettingKey::MaxStepMs, Some(&n("llm")), None)
        );
        assert_eq!(e[0].rule(), Rule::TimeBudgets);
        // Learning instead of a configured model: the same.
        s.time.cost.clear();
        s.time.learn = true;
        assert_eq!(off_rule(s), [want]);
    }
    // With `mixed` budgeted, accepted; the time budget applies to it.
    let t = BudgetTable::build(omni(), timed(settings())).unwrap();
    assert_eq!(t.max_step_ms("llm", "mixed"), Some(40.0));
    // A node whose budgeted walks all run inside a combined walk it does not budget (talker's
    // `prefill`): no step walk, not this rule.
    let mut s = settings().cost("talker", model);
    s.time.max_step_ms = BTreeMap::from([(n("talker"), NodeSetting::All(TimeBudget::Ms(40.0)))]);
    assert!(off_rule(s).is_empty());
    // Standalone walks, one of them still budgeted: the time budget bounds that one.
    let mut s = timed(settings());
    s.combined_walk_of.clear();
    s.overrides = per_walk("llm", &[("mixed", BudgetValue::Off)]);
    assert!(off_rule(s.clone()).is_empty());
    // Both off: refused, naming the first.
    s.overrides = BTreeMap::from([(n("llm"), NodeSetting::All(BudgetValue::Off))]);
    let e = off_rule(s.clone());
    assert_eq!(
        e,
        [BudgetError::TimeBudgetWithoutTokenBudget {
            node: n("llm"),
            walk: n("mixed"),
        }]
    );
    // A walk not served is not a step walk: `mixed` off and not served, `prefill` budgeted.
    s.overrides = per_walk("llm", &[("mixed", BudgetValue::Off)]);
    s.walks.remove(&n("mixed"));
    assert!(off_rule(s.clone()).is_empty());
    // ... and `prefill` off too: refused, naming it.
    s.overrides = BTreeMap::from([(n("llm"), NodeSetting::All(BudgetValue::Off))]);
    let e = off_rule(s);
    assert!(
        matches!(&e[..], [BudgetError::TimeBudgetWithoutTokenBudget { walk, .. }] if &**walk == "prefill"),
        "{e:?}"
    );
    // A node that chunks nothing, an off time budget and a per-walk one are not this rule.
    let mut s = timed(settings());
    s.overrides = per_walk("llm", &[("mixed", BudgetValue::Off)]);
    s.no_chunking.insert(n("llm"));
    assert!(off_rule(s.clone()).is_empty());
    s.no_chunking.clear();
    s.time.max_step_ms = BTreeMap::from([(n("llm"), NodeSetting::All(TimeBudget::Off))]);
    assert!(off_rule(s.clone()).is_empty());
    s.time.max_step_ms = BTreeMap::from([(
        n("llm"),
        NodeSetting::PerWalk(BTreeMap::from([(n("mixed"), TimeBudget::Ms(40.0))])),
    )]);
    let e = BudgetTable::build(omni(), s).unwrap_err().0;
    assert!(
        e.iter()
            .all(|e| matches!(e, BudgetError::TimeBudgetDoesNothing { .. })),
        "{e:?}"
    );
    // A node-wide time budget on a node the model does not have is `UnknownNode`.
    let mut s = settings();
    s.time.max_step_ms = BTreeMap::from([(n("ghost"), NodeSetting::All(TimeBudget::Ms(40.0)))]);
    assert!(off_rule(s).is_empty());
}

#[test]
fn slots_per_row_at_or_above_a_budget_are_refused_naming_node_walk_and_budget() {
    let mut s = settings();
    s.overrides = BTreeMap::from([(n("llm"), NodeBudget::All(tok(128)))]);
    s.slots_per_row = 127;
    assert!(BudgetTable::build(omni(), s.clone()).is_ok());
    s.slots_per_row = 128;
    let err = BudgetTable::build(omni(), s.clone()).unwrap_err();
    let refused: Vec<_> = err
        .0
        .iter()
        .filter_map(|e| match e {
            BudgetError::SlotsFillBudget {
                slots,
                node,
                walk,
                budget,
            } => Some((*slots, node.to_string(), walk.to_string(), *budget)),
            _ => None,
        })
        .collect();
    assert_eq!(
        refused,
        vec![
            (128, "llm".into(), "mixed".into(), 128),
            (128, "llm".into(), "prefill".into(), 128)
        ],
        "{err}"
    );
    assert_eq!(err.0.len(), 2, "{err}");
    let e = &err.0[0];
    assert_eq!(
        e.to_string(),
        "`slots_per_row` 128 fills the budget of 128 tokens of `llm`/`mixed`: no row there could run a token"
    );
    assert_eq!(e.value().as_deref(), Some("128"));
    assert_eq!(
        e.rule().to_string(),
        "docs/budgets.md#slots-that-fill-a-budget"
    );
    // The thinker's decode budget (256) is over 128: only the llm's steps are named.
    s.slots_per_row = 0;
    assert!(BudgetTable::build(omni(), s).is_ok());
}
