//! `fit FILE`: the offline fit of the latency model (`docs/fitting.md#offline`).

use std::process::ExitCode;

use super::*;

/// `fit FILE`: fits the latency model and prints it with its quality, then the TOML table for
/// the serving config. Exit codes: 0 done, 2 a file that cannot be fitted, a refused config,
/// or a `--node` the model does not have.
pub fn fit(args: &FitArgs) -> ExitCode {
    let loaded = match load_or_report(&args.config.load_options()) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let nodes = &loaded.manifest.nodes;
    let node = match &args.node {
        // The table must be one the config can take: `chunking.cost.<node>` of a model node.
        Some(n) if !nodes.contains_key(n) => {
            say(&format!(
                "error: `--node` = {}: the model `{}` ({}) has no such node; its nodes: {}",
                config::problem::quote(n),
                config::problem::escape(&loaded.manifest.name),
                config::problem::escape(&loaded.model_origin),
                nodes
                    .keys()
                    .map(|k| config::problem::escape(k))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            return ExitCode::from(EXIT_CONFIG);
        }
        Some(n) => n.clone(),
        None => match nodes.keys().next() {
            Some(n) => n.clone(),
            None => {
                say("error: the model has no node to name the cost table after; give `--node`");
                return ExitCode::from(EXIT_CONFIG);
            }
        },
    };
    let (input, fit, samples) = match super::fit_file::fit_file_samples(&args.file, args.errors) {
        Ok(r) => r,
        Err(e) => {
            say(&format!("error: cannot fit the latency model: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let source = args.file.display().to_string();
    // The replay prices a step with `base_ms` or `per_token_ms` above 0, so that every step
    // takes some time (`replay.cost`): a table without either would be refused by it.
    if matches!(args.table, FitFor::Replay) && fit.model.coefficients()[..2] == [0.0, 0.0] {
        say(&format!(
            "error: cannot fit a `[replay.cost]` table to {}: the fit puts `base_ms` and `per_token_ms` both at 0 (the steps' times are carried by their contexts, attention pairs or rows alone), and a replay's step cost must make every step take some time; `--for serve` prints the serving table, or fit on steps that include short ones",
            config::problem::escape(&source)
        ));
        return ExitCode::from(EXIT_CONFIG);
    }
    let kind = match input {
        super::fit_file::FitInput::StepLog => "a replay step log",
        super::fit_file::FitInput::Csv => "a CSV of step features",
    };
    let kind = match args.errors {
        mstar_chunking::latency::fit::FitErrors::Absolute => kind.to_owned(),
        mstar_chunking::latency::fit::FitErrors::Relative => format!("{kind}, relative errors"),
    };
    let mut out = format!(
        "fit of {} ({kind}): {}\n",
        config::problem::escape(&source),
        crate::text::plural(fit.samples as u64, "step")
    );
    for (k, v) in mstar_chunking::latency::COEFFICIENT_KEYS
        .iter()
        .zip(fit.model.coefficients())
    {
        out.push_str(&format!("  {k:<24} {}\n", crate::text::plain_decimal(v)));
    }
    if fit.model.per_row_ms() > 0.0 {
        out.push_str(&format!(
            "  {:<24} {}\n",
            "per_row_ms",
            crate::text::plain_decimal(fit.model.per_row_ms())
        ));
    }
    let underdetermined = fit.underdetermined();
    out.push_str(&format!(
        "  {:<24} {}\n",
        "R²",
        match fit.r_squared {
            _ if underdetermined => "n/a (the fit is underdetermined)".to_string(),
            None => "n/a (every step took the same time)".to_string(),
            Some(r) => format!("{r:.4}"),
        }
    ));
    if underdetermined {
        say(&format!(
            "warning: the fit is underdetermined: {} for {} of the model's terms that vary, which the steps determine only {} of; several models fit these steps equally well, so the coefficients are one of them and R² means nothing. Fit on more steps, with varied token counts, contexts and chunk positions.",
            crate::text::plural(fit.samples as u64, "step"),
            fit.observed_terms,
            fit.rank
        ));
    }
    out.push_str(&format!(
        "  {:<24} {:.1}%\n",
        "relative RMS error",
        fit.relative_rms * 100.0
    ));
    let e = &fit.abs_error_ms;
    out.push_str(&format!(
        "  {:<24} p50 {:.3}, p90 {:.3}, p99 {:.3}, max {:.3}\n",
        "|error| ms", e.p50, e.p90, e.p99, e.max
    ));
    let ratios =
        super::fit_file::noise_ratios(&fit.model, &samples, super::fit_file::NOISE_RATIO_POINTS);
    if let Some(r) = &ratios {
        let at = |u| crate::replay::settings::ratio_at(r, u);
        out.push_str(&format!(
            "  {:<24} p1 {:.3}, p50 {:.3}, p99 {:.3}, max {:.3}\n",
            "measured ÷ predicted",
            at(0.01),
            at(0.5),
            at(0.99),
            at(1.0)
        ));
    }
    out.push('\n');
    out.push_str(&match args.table {
        FitFor::Serve => super::fit_file::render_toml(&fit, &node, &source),
        FitFor::Replay => {
            let bands = super::fit_file::noise_bands(&fit.model, &samples);
            super::fit_file::render_replay_toml(&fit, bands.as_deref(), &source)
        }
    });
    print_stdout(&out)
}
