//! `check` and `budgets`: the configuration loaded and validated, and the effective budget
//! table as text or JSON.

use std::process::ExitCode;

use super::replay_cmd::replay_problems;
use super::*;

/// `check`: loads and validates everything, prints the layers and the effective table.
pub fn check(args: &ConfigArgs) -> ExitCode {
    let loaded = match load_or_report(&args.load_options()) {
        Ok(l) => l,
        Err(code) => return code,
    };
    // The `[replay]` settings are refused as `replay` refuses them; a model that replay cannot
    // drive at all is only noted: serving it needs no replay.
    if let Err(problems) = crate::replay::settings::check(&loaded.manifest, &loaded.settings.replay)
    {
        let (settings, model) = replay_problems(&loaded, problems);
        if !settings.is_empty() {
            let mut errors = ConfigErrors::default();
            errors.extend(settings);
            report(&errors);
            return ExitCode::from(EXIT_CONFIG);
        }
        for p in model {
            say(&format!("note: `replay` cannot drive this model: {p}"));
        }
    }
    let rows = loaded.rows();
    let mut out = format!(
        "model `{}` from {}\nlayers: {}\n\n{}",
        config::problem::escape(&loaded.manifest.name),
        config::problem::escape(&loaded.model_origin),
        config::problem::escape_join(&loaded.layers, " -> "),
        render_table(&rows)
    );
    out.push_str(&format!(
        "\nok: {}, {}, min_chunk_tokens {}\n",
        crate::text::plural(loaded.manifest.nodes.len() as u64, "node"),
        crate::text::plural(loaded.manifest.walks.len() as u64, "walk"),
        loaded.settings.chunking.min_chunk_tokens
    ));
    print_stdout(&out)
}

/// `budgets`: the effective table only, or its JSON.
pub fn budgets(args: &BudgetsArgs) -> ExitCode {
    let loaded = match load_or_report(&args.config.load_options()) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let rows = loaded.rows();
    let out = if args.json {
        rows_json(&rows)
    } else {
        render_table(&rows)
    };
    print_stdout(&out)
}

/// The effective table as aligned text columns; `-` where there is none.
pub fn render_table(rows: &[BudgetRow]) -> String {
    let opt = |v: Option<u32>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
    let mut cells = vec![[
        "node",
        "walk",
        "policy",
        "budget",
        "chunkable",
        "floor",
        "caps",
        "step ms",
        "model",
        "order",
    ]
    .map(String::from)];
    for r in rows {
        let caps = r.walk_caps.as_ref().map_or_else(
            || "-".to_string(),
            |caps| {
                let parts: Vec<String> = caps
                    .iter()
                    .map(|(w, c)| format!("{}={c}", config::problem::escape(w)))
                    .collect();
                if parts.is_empty() {
                    "{}".to_string()
                } else {
                    parts.join(",")
                }
            },
        );
        let budget = match (r.max_batch_tokens, r.policy_budget) {
            (Some(b), _) => b.to_string(),
            // Distinguish a budget the config turned off from one the model never declared.
            (None, Some(_)) => "off".to_string(),
            (None, None) => "-".to_string(),
        };
        cells.push([
            config::problem::escape(&r.node),
            config::problem::escape(&r.walk),
            opt(r.policy_budget),
            budget,
            if r.chunkable { "yes" } else { "no" }.to_string(),
            opt(r.min_chunk_tokens),
            caps,
            r.max_step_ms
                .map_or_else(|| "-".to_string(), |ms| ms.to_string()),
            // Where the node's latency model comes from (its coefficients: `budgets --json`).
            match (r.cost.is_some(), r.learn_cost) {
                (true, true) => "config+learned",
                (true, false) => "config",
                (false, true) => "learned",
                (false, false) => "-",
            }
            .to_string(),
            r.order.to_string(),
        ]);
    }
    let mut widths = [0usize; 10];
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for row in &cells {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// The JSON of `budgets --json` (`docs/config.md#the-command-line`): an array, one object per row, and a newline.
pub fn rows_json(rows: &[BudgetRow]) -> String {
    // BudgetRow holds only strings, numbers, booleans and string-keyed maps: it always
    // serializes.
    let mut s = serde_json::to_string_pretty(rows).unwrap_or_else(|_| "[]".to_string());
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn row(node: &str, walk: &str) -> BudgetRow {
        BudgetRow {
            node: node.into(),
            walk: walk.into(),
            policy_budget: Some(8192),
            max_batch_tokens: Some(6144),
            chunkable: true,
            min_chunk_tokens: Some(64),
            walk_caps: Some(BTreeMap::from([
                ("decode".into(), 192),
                ("prefill".into(), 4096),
            ])),
            max_step_ms: None,
            cost: None,
            learn_cost: false,
            order: "fcfs",
        }
    }

    #[test]
    fn the_table_marks_off_budgets_and_lists_caps() {
        let mut off = row("talker", "prefill");
        off.max_batch_tokens = None;
        off.min_chunk_tokens = None;
        off.chunkable = false;
        off.walk_caps = None;
        let mut timed = row("llm", "mixed");
        timed.max_step_ms = Some(50.5);
        timed.cost = Some(BTreeMap::from([("base_ms", 8.0)]));
        let mut learned = row("llm", "decode");
        learned.learn_cost = true;
        learned.order = "shortest_first";
        learned.walk_caps = None;
        let mut both = learned.clone();
        both.walk = "prefill".into();
        both.cost = timed.cost.clone();
        let text = render_table(&[row("thinker", "mixed"), off, timed, learned, both]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "node     walk     policy  budget  chunkable  floor  caps                     step ms  model           order"
        );
        assert_eq!(
            lines[1],
            "thinker  mixed    8192    6144    yes        64     decode=192,prefill=4096  -        -               fcfs"
        );
        assert_eq!(
            lines[2],
            "talker   prefill  8192    off     no         -      -                        -        -               fcfs"
        );
        assert_eq!(
            lines[3],
            "llm      mixed    8192    6144    yes        64     decode=192,prefill=4096  50.5     config          fcfs"
        );
        assert_eq!(
            lines[4],
            "llm      decode   8192    6144    yes        64     -                        -        learned         shortest_first"
        );
        assert!(
            lines[5].ends_with("config+learned  shortest_first"),
            "{}",
            lines[5]
        );
    }

    #[test]
    fn json_rows_have_the_contract_keys() {
        let v: serde_json::Value =
            serde_json::from_str(&rows_json(&[row("thinker", "mixed")])).unwrap();
        assert_eq!(
            v,
            serde_json::json!([{
                "node": "thinker", "walk": "mixed", "policy_budget": 8192,
                "max_batch_tokens": 6144, "chunkable": true, "min_chunk_tokens": 64,
                "walk_caps": {"decode": 192, "prefill": 4096},
                "max_step_ms": null, "cost": null, "learn_cost": false, "order": "fcfs"
            }])
        );
    }
}
