//! The load pipeline on layered configs, good and bad.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use super::*;
use crate::budget::BudgetValue;

fn repo_config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("config")
}

fn opts(model: &str, env: &[(&str, &str)]) -> LoadOptions {
    LoadOptions {
        model: Some(repo_config().join("models").join(model)),
        config_dir: repo_config(),
        env: Some(
            env.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
        ..LoadOptions::default()
    }
}

fn problems(o: &LoadOptions) -> Vec<String> {
    load(o).unwrap_err().lines()
}

#[test]
fn default_toml_states_exactly_the_built_in_defaults() {
    let loaded = load(&opts("demo.toml", &[])).unwrap();
    assert_eq!(loaded.settings, Settings::default());
    let parsed: Settings = toml::from_str(DEFAULT_CONFIG_TOML).unwrap();
    assert_eq!(parsed, Settings::default());
    assert_eq!(loaded.manifest.name, "demo");
    assert_eq!(loaded.table.max_batch_tokens("llm", "mixed"), Some(2048));
}

#[test]
fn the_built_in_copies_load_from_an_empty_directory() {
    let dir = tempfile::tempdir().unwrap();
    let o = LoadOptions {
        config_dir: dir.path().to_path_buf(),
        env: Some(HashMap::new()),
        ..LoadOptions::default()
    };
    let loaded = load(&o).unwrap();
    assert_eq!(loaded.model_origin, "built-in config/models/demo.toml");
    assert_eq!(loaded.layers, ["built-in config/default.toml"]);
    assert!(o.config_files().is_empty());
}

#[test]
fn environment_overrides_are_typed_and_lowercased() {
    let o = opts(
        "omni.toml",
        &[
            ("MSTAR__CHUNKING__MIN_CHUNK_TOKENS", "32"),
            ("MSTAR__CHUNKING__MAX_BATCH_TOKENS__THINKER__MIXED", "4096"),
            ("MSTAR__CHUNKING__MAX_BATCH_TOKENS__VISION", "off"),
            ("MSTAR__CHUNKING__NO_CHUNKING", "talker"),
            ("MSTAR_ENV", "ignored: not an override"),
            ("OTHER", "x"),
        ],
    );
    let l = load(&o).unwrap();
    assert_eq!(l.settings.chunking.min_chunk_tokens, 32);
    assert_eq!(l.table.max_batch_tokens("thinker", "mixed"), Some(4096));
    assert_eq!(l.table.max_batch_tokens("vision", "prefill"), None);
    assert_eq!(l.table.max_batch_tokens("talker", "prefill"), None);
    assert_eq!(l.settings.chunking.no_chunking, ["talker"]);
}

#[test]
fn later_layers_win_and_errors_name_the_layer_that_set_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.toml");
    let b = dir.path().join("b.toml");
    std::fs::write(
        &a,
        "[chunking]\nmin_chunk_tokens = 0\nmax_row_tokens = 512\n",
    )
    .unwrap();
    std::fs::write(&b, "[chunking]\nmin_chunk_tokens = 16\n").unwrap();
    let mut o = opts("demo.toml", &[]);
    o.configs = vec![a.clone(), b.clone()];
    let l = load(&o).unwrap();
    assert_eq!(l.settings.chunking.min_chunk_tokens, 16);
    assert_eq!(l.settings.chunking.max_row_tokens, Some(512));
    o.configs = vec![b, a.clone()];
    let p = problems(&o);
    assert_eq!(
        p,
        [format!(
            "{}: `chunking.min_chunk_tokens` = 0: `min_chunk_tokens` must be at least 1, got 0 (docs/budgets.md#not-a-positive-whole-number)",
            a.display()
        )]
    );
    o.env = Some(HashMap::from([(
        "MSTAR__CHUNKING__MIN_CHUNK_TOKENS".into(),
        "8".into(),
    )]));
    assert!(load(&o).is_ok(), "the environment is the last layer");
}

#[test]
fn a_negative_budget_is_refused_at_the_boundary_naming_key_and_layer() {
    let o = opts(
        "demo.toml",
        &[("MSTAR__CHUNKING__MAX_BATCH_TOKENS__LLM__MIXED", "-1")],
    );
    assert_eq!(
        problems(&o),
        ["environment variable MSTAR__CHUNKING__MAX_BATCH_TOKENS__LLM__MIXED: `chunking.max_batch_tokens.llm.mixed` = -1: expected a positive whole number of tokens (at most 4294967295) or \"off\", got -1 (docs/budgets.md#not-a-positive-whole-number)"]
    );
    let l = load(&opts(
        "demo.toml",
        &[("MSTAR__CHUNKING__MAX_BATCH_TOKENS__LLM__MIXED", "512")],
    ))
    .unwrap();
    assert_eq!(
        l.settings.chunking.max_batch_tokens["llm"],
        NodeBudgetSetting::PerWalk(BTreeMap::from([(
            "mixed".into(),
            BudgetSetting(BudgetValue::tokens(512).unwrap())
        )]))
    );
}

#[test]
fn every_problem_of_one_load_is_reported() {
    let o = opts(
        "omni.toml",
        &[
            ("MSTAR__CHUNKING__MIN_CHUNK_TOKEN", "3"),
            ("MSTAR__CHUNKING__MAX_BATCH_TOKENS__TALKER__DECODE", "5"),
            ("MSTAR__LOG__LEVEL", "info,[[bad"),
            ("MSTAR__METRICS__LISTEN", "everywhere"),
        ],
    );
    let p = problems(&o);
    for want in [
        "`chunking.min_chunk_token`: unknown field `min_chunk_token`",
        "`metrics.listen` = \"everywhere\": expected an address",
        "`log.level` = \"info,[[bad\": not a tracing filter",
        "`chunking.max_batch_tokens.talker.decode` = 5: budget for `talker`/`decode` would do nothing",
    ] {
        assert!(p.iter().any(|l| l.contains(want)), "{want} not in {p:#?}");
    }
    assert_eq!(p.len(), 4, "{p:#?}");
    assert!(
        p.iter()
            .all(|l| l.starts_with("environment variable MSTAR__")),
        "{p:#?}"
    );
}

#[test]
fn load_settings_reloads_against_a_loaded_manifest() {
    let o = opts("omni.toml", &[]);
    let l = load(&o).unwrap();
    let mut o2 = o.clone();
    o2.configs = vec![repo_config().join("omni-worker.toml")];
    let (settings, _, table) = load_settings::<NoExtraSections>(&o2, &l.manifest).unwrap();
    assert_eq!(settings.chunking.no_chunking, ["talker"]);
    assert_eq!(table.max_batch_tokens("thinker", "mixed"), Some(6144));
    o2.env = Some(HashMap::from([(
        "MSTAR__CHUNKING__MAX_BATCH_TOKENS__GHOST".into(),
        "1".into(),
    )]));
    assert!(load_settings::<NoExtraSections>(&o2, &l.manifest).is_err());
}

#[test]
fn unknown_keys_are_named_and_their_values_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("layer.toml");
    std::fs::write(
        &layer,
        "[chunking]\napi_token = \"hunter2-secret\"\n[log]\npassword = \"pw-secret\"\n",
    )
    .unwrap();
    let mut o = opts("demo.toml", &[("MSTAR__METRICS__TOKEN", "env-secret")]);
    o.configs = vec![layer];
    let p = problems(&o);
    assert_eq!(p.len(), 3, "{p:#?}");
    for line in &p {
        assert!(!line.contains("secret"), "a value was printed: {line}");
    }
    assert!(p
        .iter()
        .any(|l| l.contains("`chunking.api_token`: unknown field `api_token`")));
    assert!(p
        .iter()
        .any(|l| l.contains("`metrics.token`: unknown field `token`")));
}

#[test]
fn mstar_env_outside_the_config_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("x.toml");
    std::fs::write(&outside, "[chunking]\nmin_chunk_tokens = 8\n").unwrap();
    for bad in ["../x", outside.with_extension("").to_str().unwrap(), "a.b"] {
        let mut o = opts("demo.toml", &[]);
        o.mstar_env = Some(bad.to_string());
        let p = problems(&o);
        assert_eq!(p.len(), 1, "{p:#?}");
        assert!(
            p[0].starts_with(
                "environment variable MSTAR_ENV: `MSTAR_ENV`: must be a name of 1 to 64 letters"
            ),
            "{p:#?}"
        );
    }
}

#[test]
fn hexadecimal_integers_and_yaml_aliases_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hex = dir.path().join("hex.toml");
    std::fs::write(&hex, "[chunking]\nmin_chunk_tokens = 0x40\n").unwrap();
    let mut o = opts("demo.toml", &[]);
    o.configs = vec![hex.clone()];
    assert_eq!(
        problems(&o),
        [format!("{}: `chunking.min_chunk_tokens` = 0x40: integers are written in decimal; hexadecimal, octal and binary are refused (docs/config.md#spellings)", hex.display())]
    );
    let yaml = dir.path().join("bomb.yaml");
    let mut text = String::from(
        "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
    );
    for (i, c) in ('b'..='i').enumerate() {
        let prev = char::from(b'a' + u8::try_from(i).unwrap());
        text.push_str(&format!(
            "{c}: &{c} [{}]\n",
            vec![format!("*{prev}"); 9].join(",")
        ));
    }
    std::fs::write(&yaml, &text).unwrap();
    o.configs = vec![yaml.clone()];
    assert_eq!(
        problems(&o),
        [format!("{}: YAML alias at line 2: aliases are refused in config files (docs/config.md#limits); write the value out", yaml.display())]
    );
}

#[test]
fn oversized_and_irregular_config_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.toml");
    let line = "# padding padding padding padding padding padding padding padding\n";
    let n = usize::try_from(MAX_CONFIG_BYTES).unwrap() / line.len() + 1;
    std::fs::write(&big, line.repeat(n)).unwrap();
    let mut o = opts("demo.toml", &[]);
    o.configs = vec![big.clone()];
    assert_eq!(
        problems(&o),
        [format!(
            "{}: is larger than the limit of 1048576 bytes (docs/config.md#limits)",
            big.display()
        )]
    );
    let sub = dir.path().join("sub.toml");
    std::fs::create_dir(&sub).unwrap();
    o.configs = vec![sub];
    let p = problems(&o);
    assert!(
        p[0].ends_with("is not a regular file (it is a directory); inputs must be regular files"),
        "{p:?}"
    );
    let mut o = opts("demo.toml", &[]);
    o.model = Some(PathBuf::from("/dev/zero"));
    let p = problems(&o);
    assert_eq!(p, ["model manifest /dev/zero: cannot be read: is not a regular file (it is a device); inputs must be regular files"]);
}

#[test]
fn many_unknown_node_names_give_a_capped_list_and_a_count() {
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("names.toml");
    let mut text = String::from("[chunking.max_batch_tokens]\n");
    for i in 0..20_000 {
        text.push_str(&format!("ghost{i} = 512\n"));
    }
    std::fs::write(&layer, text).unwrap();
    let mut o = opts("demo.toml", &[]);
    o.configs = vec![layer.clone()];
    let e = load(&o).unwrap_err();
    assert_eq!(e.problems.len(), problem::MAX_PROBLEMS);
    assert_eq!(e.total(), 20_000);
    let lines = e.lines();
    assert_eq!(
        lines.last().unwrap(),
        "… and 19936 more problems not listed"
    );
    assert!(
        lines[0].starts_with(&format!(
            "{}: `chunking.max_batch_tokens.ghost0` = 512: `max_batch_tokens` names node `ghost0`",
            layer.display()
        )),
        "{}",
        lines[0]
    );
}

#[test]
fn control_characters_in_keys_are_escaped() {
    let o = opts("demo.toml", &[("MSTAR__CHUNKING__X\u{1b}[31m\nFAKE", "1")]);
    let p = problems(&o);
    assert_eq!(p.len(), 1, "{p:#?}");
    assert!(!p[0].contains('\n') && !p[0].contains('\u{1b}'), "{p:?}");
    assert!(p[0].contains("\\u{1b}[31m\\nfake"), "{p:?}");
}

#[test]
fn a_time_margin_is_read_and_its_refusals_name_the_key_and_layer() {
    let timed = [
        ("MSTAR__CHUNKING__MAX_STEP_MS__LLM", "50"),
        ("MSTAR__CHUNKING__LEARN_COST", "true"),
    ];
    let with = |margin: &str| {
        let mut env = timed.to_vec();
        env.push(("MSTAR__CHUNKING__TIME_MARGIN", margin));
        opts("demo.toml", &env)
    };
    let l = load(&with("0.95")).unwrap();
    assert_eq!(l.settings.chunking.time_margin, Some(0.95));
    assert_eq!(l.table.settings().time.margin_quantile, Some(0.95));
    assert_eq!(
        problems(&with("1.5")),
        ["environment variable MSTAR__CHUNKING__TIME_MARGIN: `chunking.time_margin` = 1.5: time margin quantile must be a number in (0, 1], got 1.5 (docs/cost-model.md#the-time-margin)"]
    );
    let alone = opts("demo.toml", &[("MSTAR__CHUNKING__TIME_MARGIN", "0.9")]);
    assert_eq!(
        problems(&alone),
        ["environment variable MSTAR__CHUNKING__TIME_MARGIN: `chunking.time_margin`: a time margin does nothing without a time budget: set `max_step_ms` on a node (docs/cost-model.md#the-time-margin)"]
    );
}

#[test]
fn a_time_budget_refusal_names_its_own_key_not_the_token_budget_key() {
    // Refusals shared by both per-node settings (here a walk not served) carry the setting
    // they are about, so they are reported at `max_step_ms`.
    let o = opts(
        "omni.toml",
        &[
            ("MSTAR__CHUNKING__COST__THINKER", "llama2-7b-a100"),
            ("MSTAR__CHUNKING__MAX_STEP_MS__THINKER__SPEC_VERIFY", "40"),
        ],
    );
    let p = problems(&o);
    let want = "`chunking.max_step_ms.thinker.spec_verify` = 40: budget for `thinker`/`spec_verify`: walk `spec_verify` is not served by this deployment (docs/budgets.md#a-walk-not-served)";
    assert!(p.iter().any(|l| l.contains(want)), "{want} not in {p:#?}");
    assert!(
        p.iter().all(|l| !l.contains("chunking.max_batch_tokens")),
        "{p:#?}"
    );
}

#[test]
fn an_order_is_read_for_every_node_or_per_node_with_its_starvation_bound() {
    use crate::order::{Order, WaitBound};
    let l = load(&opts(
        "omni.toml",
        &[
            ("MSTAR__CHUNKING__ORDER", "shortest_first"),
            ("MSTAR__CHUNKING__MAX_WAIT_MS", "2000"),
            ("MSTAR__CHUNKING__MAX_WAIT_STEPS", "64"),
        ],
    ))
    .unwrap();
    for node in ["thinker", "vision", "talker"] {
        assert_eq!(l.table.order(node).order, Order::ShortestFirst, "{node}");
    }
    assert_eq!(
        l.table.order("thinker").bound,
        WaitBound {
            max_wait_ms: Some(2000.0),
            max_wait_steps: Some(64)
        }
    );
    let l = load(&opts(
        "omni.toml",
        &[("MSTAR__CHUNKING__ORDER__THINKER", "priority")],
    ))
    .unwrap();
    assert_eq!(l.table.order("thinker").order, Order::Priority);
    assert_eq!(
        l.table.order("talker").order,
        Order::Fcfs,
        "not named: fcfs"
    );
    assert!(l
        .rows()
        .iter()
        .any(|r| r.node == "thinker" && r.order == "priority"));
    assert!(load(&opts("omni.toml", &[]))
        .unwrap()
        .rows()
        .iter()
        .all(|r| r.order == "fcfs"));
}

#[test]
fn order_refusals_name_the_key_the_value_and_the_layer() {
    let one = |k: &str, v: &str| problems(&opts("omni.toml", &[(k, v)]));
    let p = one("MSTAR__CHUNKING__ORDER", "lpm");
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(p[0].contains("`chunking.order`"), "{p:?}");
    assert!(p[0].contains("unknown order \"lpm\""), "{p:?}");
    let p = one("MSTAR__CHUNKING__ORDER__CODEC", "priority");
    assert_eq!(
        p,
        ["environment variable MSTAR__CHUNKING__ORDER__CODEC: `chunking.order.codec` = priority: `order` names node `codec`, which the model does not have (docs/scheduling.md#the-order-of-waiting-prompts)"]
    );
    for bad in ["0", "-5", "nan", "inf"] {
        let p = one("MSTAR__CHUNKING__MAX_WAIT_MS", bad);
        assert_eq!(p.len(), 1, "{bad}: {p:?}");
        assert!(p[0].contains("`chunking.max_wait_ms`"), "{bad}: {p:?}");
    }
    assert_eq!(
        one("MSTAR__CHUNKING__MAX_WAIT_MS", "0"),
        ["environment variable MSTAR__CHUNKING__MAX_WAIT_MS: `chunking.max_wait_ms` = 0: `max_wait_ms` must be a finite number of milliseconds above 0, got 0 (docs/scheduling.md#the-order-of-waiting-prompts)"]
    );
    assert_eq!(
        one("MSTAR__CHUNKING__MAX_WAIT_STEPS", "0"),
        ["environment variable MSTAR__CHUNKING__MAX_WAIT_STEPS: `chunking.max_wait_steps` = 0: `max_wait_steps` must be at least 1, got 0 (docs/scheduling.md#the-order-of-waiting-prompts)"]
    );
}

/// A program's own section, `[sim]`, as the simulator adds `[replay]` (the reload's tests use
/// it too).
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct Sim {
    pub(crate) sim: SimSection,
}

/// `[sim]`: a node for flags, online learning, and a number.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct SimSection {
    pub(crate) node: Option<String>,
    pub(crate) learn: bool,
    pub(crate) level: u32,
}

impl ExtraSections for Sim {
    const NAMES: &'static [&'static str] = &["sim"];
    const NODE_KEY: Option<&'static str> = Some("sim.node");

    fn learns_cost(&self) -> bool {
        self.sim.learn
    }
}

fn with_layer(model: &str, text: &str) -> (tempfile::TempDir, LoadOptions) {
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("layer.toml");
    std::fs::write(&layer, text).unwrap();
    let mut o = opts(model, &[]);
    o.configs = vec![layer];
    (dir, o)
}

#[test]
fn a_programs_own_section_is_decoded_from_the_same_layers_and_refused_without_it() {
    let (_dir, o) = with_layer("demo.toml", "[sim]\nlevel = 3\n");
    let loaded = load_with::<Sim>(&o, &[]).unwrap();
    assert_eq!(loaded.extra.sim.level, 3);
    assert_eq!(loaded.settings, Settings::default());
    // The component alone does not know `[sim]`: refused, naming it.
    let p = problems(&o);
    assert!(
        p.iter()
            .any(|l| l.contains("`sim`: unknown field `sim`, expected one of")),
        "{p:#?}"
    );
    assert!(!NoExtraSections::default().learns_cost());
    assert_eq!(NoExtraSections::NAMES, &[] as &[&str]);
}

#[test]
fn the_programs_problems_are_reported_with_the_components_naming_key_and_layer() {
    let (dir, o) = with_layer(
        "demo.toml",
        "[chunking]\nmin_chunk_tokens = \"x\"\n[sim]\nlevel = \"high\"\ncolour = 1\n",
    );
    let layer = dir.path().join("layer.toml").display().to_string();
    let p = load_with::<Sim>(&o, &[]).unwrap_err().lines();
    assert_eq!(p.len(), 3, "{p:#?}");
    assert!(p[0].contains("`chunking.min_chunk_tokens`"), "{p:#?}");
    assert!(
        p.iter()
            .any(|l| l.starts_with(&layer) && l.contains("`sim.level`") && l.contains("\"high\"")),
        "{p:#?}"
    );
    assert!(
        p.iter().any(|l| l.contains("`sim.colour`: unknown field")),
        "{p:#?}"
    );
    // A reload reads them the same way.
    let manifest = load_manifest(&repo_config().join("models/demo.toml")).unwrap();
    assert_eq!(load_settings::<Sim>(&o, &manifest).unwrap_err().lines(), p);
    let (_dir, o) = with_layer("demo.toml", "[sim]\nlevel = 2\n");
    let (_, sim, _) = load_settings::<Sim>(&o, &manifest).unwrap();
    assert_eq!(sim.sim.level, 2);
}

#[test]
fn a_problem_the_budget_table_survives_still_refuses_a_reload() {
    let o = opts("demo.toml", &[("MSTAR__CHUNKING__NO_SUCH_KEY", "1")]);
    let manifest = load_manifest(&repo_config().join("models/demo.toml")).unwrap();
    let e = load_settings::<NoExtraSections>(&o, &manifest).unwrap_err();
    assert!(
        e.lines().iter().any(|l| l.contains("no_such_key")),
        "{:#?}",
        e.lines()
    );
}

#[test]
fn a_flags_node_is_the_one_the_programs_section_names_else_the_models_first() {
    let flags = [FlagSetting::max_step_ms("off")];
    let (_dir, o) = with_layer("omni.toml", "[sim]\nnode = \"talker\"\n");
    let loaded = load_with::<Sim>(&o, &flags).unwrap();
    assert_eq!(
        loaded
            .settings
            .chunking
            .max_step_ms
            .keys()
            .collect::<Vec<_>>(),
        ["talker"]
    );
    assert!(loaded.layers.iter().any(|l| l == flags::FLAGS_LAYER));
    // Without the section's node: the model's first.
    let (_dir, o) = with_layer("omni.toml", "[sim]\nlevel = 1\n");
    let loaded = load_with::<Sim>(&o, &flags).unwrap();
    assert_eq!(
        loaded
            .settings
            .chunking
            .max_step_ms
            .keys()
            .collect::<Vec<_>>(),
        ["thinker"]
    );
    // Without flags, no flags' layer and nothing set.
    let loaded = load_with::<Sim>(&o, &[]).unwrap();
    assert!(loaded.settings.chunking.max_step_ms.is_empty());
    assert!(!loaded.layers.iter().any(|l| l == flags::FLAGS_LAYER));
}

#[test]
fn a_section_that_learns_the_cost_lets_a_time_budget_without_a_model_load() {
    let text = "[chunking.max_step_ms]\nllm = 50\n";
    let (_dir, o) = with_layer("demo.toml", text);
    let p = problems(&o);
    assert!(
        p.iter().any(|l| l.contains("needs a latency model")),
        "{p:#?}"
    );
    let (_dir, o) = with_layer("demo.toml", &format!("{text}[sim]\nlearn = true\n"));
    let loaded = load_with::<Sim>(&o, &[]).unwrap();
    assert!(loaded.table.settings().time.learn);
    let manifest = load_manifest(&repo_config().join("models/demo.toml")).unwrap();
    let (_, _, table) = load_settings::<Sim>(&o, &manifest).unwrap();
    assert!(table.settings().time.learn);
    let (_dir, o) = with_layer("demo.toml", &format!("{text}[sim]\nlearn = false\n"));
    assert!(load_with::<Sim>(&o, &[]).is_err());
}

#[test]
fn a_long_refusal_is_cut_before_its_rule_never_through_it() {
    use crate::budget::{Refusal, Rule};
    use problem::{escape, MAX_SHOWN_CHARS};
    let rule = Rule::Budgets(Some(Refusal::MemberWalk));
    let tail = " (docs/budgets.md#a-member-walks-budget)";
    assert_eq!(budgets::with_rule("short", rule), format!("short{tail}"));
    // Exactly what a problem shows: whole.
    let fits = "m".repeat(MAX_SHOWN_CHARS - tail.len());
    assert_eq!(budgets::with_rule(&fits, rule), format!("{fits}{tail}"));
    // One more: the message is cut, the rule kept, and the display cuts nothing further.
    for long in [format!("{fits}x"), "é".repeat(3 * MAX_SHOWN_CHARS)] {
        let shown = budgets::with_rule(&long, rule);
        assert_eq!(shown.chars().count(), MAX_SHOWN_CHARS, "{shown}");
        assert!(shown.ends_with(&format!("…{tail}")), "{shown}");
        assert!(long.starts_with(shown.trim_end_matches(tail).trim_end_matches('…')));
        assert_eq!(escape(&shown), shown);
    }
}
