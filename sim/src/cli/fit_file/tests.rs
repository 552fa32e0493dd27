use std::io::Write as _;

use super::*;
use crate::text::plain_decimal;
use mstar_chunking::latency::fit::fit_samples;
use mstar_chunking::latency::fit::testing::{assert_close, model, samples, TestRng, TRUE};
use mstar_chunking::latency::{LatencyModel, ModelSource};
use mstar_chunking::overrun::TimeOverrunReason;

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::File::create(&p)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    p
}

fn csv_text(s: &[Sample]) -> String {
    let mut out = String::from("ms, tokens,kv_tokens,attention_pairs,step\n");
    for (i, x) in s.iter().enumerate() {
        out += &format!(
            "{:?},{},{},{},{i}\n",
            x.ms, x.tokens, x.kv_tokens, x.attention_pairs
        );
    }
    out
}

#[test]
fn fits_a_csv() {
    let dir = tempfile::tempdir().unwrap();
    let s = samples(31, 300, TRUE, 0.0);
    let p = write(&dir, "steps.csv", &csv_text(&s));
    let (input, r) = fit_file(&p).unwrap();
    assert_eq!(input, FitInput::Csv);
    assert_eq!(r.samples, 300);
    assert_close(r.model.coefficients(), TRUE, 1e-6);
}

/// A step-log line as `replay --step-log` writes it (with the cost-aware keys).
fn log_line(step: u64, rows: &[(&str, u32, u32, u64)], ms: f64, ran: Option<u64>) -> String {
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|&(kind, a, b, ctx)| {
            if kind == "chunk" {
                serde_json::json!({"rid": 1, "walk": "prefill", "kind": "chunk", "tokens": b - a,
                    "start": a, "end": b, "total": b + 10, "stride": b - a, "final": false})
            } else {
                serde_json::json!({"rid": 2, "walk": "decode", "kind": "continue", "tokens": a,
                    "context": ctx})
            }
        })
        .collect();
    let mut v = serde_json::json!({"step": step, "t_ms": 0.0, "node": "llm", "walk": "mixed",
        "budget": 8192, "floor": 64, "caps": null, "rows": rows, "scheduled_tokens": 0,
        "overrun": null, "waiting": 0, "ms": ms, "predicted_ms": null, "max_step_ms": null,
        "time_overrun": null});
    if let Some(ran) = ran {
        v["ran_tokens"] = ran.into();
    }
    v.to_string()
}

#[test]
fn fits_a_step_log() {
    let m = model(TRUE);
    let mut rng = TestRng::new(41);
    let mut text = String::from("\n");
    for step in 0..300 {
        let mut rows = Vec::new();
        let mut f = StepFeatures::EMPTY;
        for _ in 0..rng.below(0, 20) {
            let ctx = rng.below(10, 30_000);
            rows.push(("continue", 1, 0, ctx));
            f.add_continuing(1, ctx);
        }
        if rng.chance(0.8) {
            let s = rng.below(0, 50_000) as u32;
            let e = s + rng.below(1, 2048) as u32;
            rows.push(("chunk", s, e, 0));
            f.add_chunk(s, e);
        }
        text += &log_line(step, &rows, m.predict_ms(&f), None);
        text += "\n";
    }
    let dir = tempfile::tempdir().unwrap();
    let p = write(&dir, "steps.jsonl", &text);
    let (input, r) = fit_file(&p).unwrap();
    assert_eq!(input, FitInput::StepLog);
    assert_eq!(r.samples, 300);
    assert_close(r.model.coefficients(), TRUE, 1e-6);
}

#[test]
fn a_step_log_counts_what_the_step_ran() {
    let text = log_line(
        0,
        &[
            ("continue", 3, 0, 500),
            ("continue", 1, 0, 20),
            ("chunk", 100, 164, 0),
        ],
        9.0,
        Some(70),
    );
    let step: LogStep = serde_json::from_str(&text).unwrap();
    let s = step_sample(&step).unwrap();
    assert_eq!(
        s,
        Sample {
            tokens: 70.0, // ran_tokens, not the 68 scheduled
            kv_tokens: 520.0,
            attention_pairs: chunk_attention_pairs(100, 164) as f64,
            rows: 3.0,
            ms: 9.0
        }
    );
}

fn file_error(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = write(&dir, "in.txt", text);
    fit_file(&p).unwrap_err().to_string()
}

#[test]
fn bad_lines_are_named() {
    let good = log_line(0, &[("chunk", 0, 64, 0)], 5.0, None);
    // A continuing row without its context.
    let no_ctx = good.replace(
        r#""rows":["#,
        r#""rows":[{"kind":"continue","tokens":1,"rid":3,"walk":"decode"},"#,
    );
    let e = file_error(&format!("{good}\n{no_ctx}\n"));
    assert!(
        e.ends_with(
            "in.txt:2: row 0: a continuing row needs its `context` to fit `per_kv_token_ms`"
        ),
        "{e}"
    );
    // Not JSON.
    let e = file_error(&format!("{good}\n\n{{oops\n"));
    assert!(e.contains("in.txt:3: not a step-log step"), "{e}");
    // No `ms`.
    let e = file_error(&good.replace(r#""ms":5.0"#, r#""ms":null"#));
    assert!(e.contains("in.txt:1: the step has no `ms`"), "{e}");
    // A negative time.
    let e = file_error(&good.replace(r#""ms":5.0"#, r#""ms":-5.0"#));
    assert!(e.contains("in.txt:1: a measured step time must be"), "{e}");
    // A chunk whose tokens do not match its range.
    let e = file_error(&good.replace(r#""tokens":64"#, r#""tokens":65"#));
    assert!(
        e.contains("in.txt:1: row 0: a chunk of 65 tokens cannot run [0, 64)"),
        "{e}"
    );
    // An unknown row kind.
    let e = file_error(&good.replace(r#""kind":"chunk""#, r#""kind":"verify""#));
    assert!(
        e.contains("in.txt:1: not a step-log step") && e.contains("verify"),
        "{e}"
    );

    // CSV: no header, a missing column, a bad number, a negative value, a short row.
    let e = file_error("100,0,5050,12.0\n");
    assert!(
        e.contains(
            "in.txt:1: the header must name the columns tokens,kv_tokens,attention_pairs,ms"
        ),
        "{e}"
    );
    let e = file_error("tokens,kv_tokens,ms\n1,2,3\n");
    assert!(e.ends_with("missing: attention_pairs"), "{e}");
    let e = file_error("tokens,kv_tokens,attention_pairs,ms\n1,2,3,4\n1,2,x,4\n");
    assert!(e.contains("in.txt:3:"), "{e}");
    let e = file_error("tokens,kv_tokens,attention_pairs,ms\n1,2,3,4\n1,2,3,-4\n");
    assert!(
        e.ends_with("in.txt:3: `ms` must be a finite number >= 0, got -4"),
        "{e}"
    );
    let e = file_error("tokens,kv_tokens,attention_pairs,ms\n1,2,3,NaN\n");
    assert!(
        e.ends_with("in.txt:2: `ms` must be a finite number >= 0, got NaN"),
        "{e}"
    );
    let e = file_error("tokens,kv_tokens,attention_pairs,ms\n1,2,3,4\n1,2\n");
    assert!(e.contains("in.txt:3:"), "{e}");

    // Nothing to fit.
    let e = file_error("  \n\n");
    assert!(e.ends_with("in.txt: no steps to fit"), "{e}");
    let e = file_error("tokens,kv_tokens,attention_pairs,ms\n");
    assert!(e.ends_with("in.txt: no steps to fit"), "{e}");
}

#[test]
fn inputs_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let small = Limits {
        file_bytes: 4096,
        line_bytes: 100,
        samples: 3,
    };
    let line = "tokens,kv_tokens,attention_pairs,ms\n";
    // A line longer than the limit, on line 3.
    let p = write(
        &dir,
        "long.csv",
        &format!("{line}1,2,3,4\n{}\n", "9".repeat(200)),
    );
    let e = read_samples_with(&p, small).unwrap_err();
    assert!(
        matches!(
            e,
            FitFileError::LineTooLong {
                line: 3,
                limit: 100,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .ends_with("long.csv:3: line longer than the 100 bytes `fit` reads"),
        "{e}"
    );
    // The same in a step log.
    let p = write(
        &dir,
        "long.jsonl",
        &format!("{{\"rows\": [], \"ms\": 1}}\n{{{}}}\n", " ".repeat(200)),
    );
    let e = read_samples_with(&p, small).unwrap_err();
    assert!(
        matches!(e, FitFileError::LineTooLong { line: 2, .. }),
        "{e}"
    );
    // Too many steps.
    let p = write(
        &dir,
        "many.csv",
        &format!("{line}{}", "1,2,3,4\n".repeat(4)),
    );
    let e = read_samples_with(&p, small).unwrap_err();
    assert!(
        matches!(e, FitFileError::TooManySamples { limit: 3, .. }),
        "{e}"
    );
    let p = write(
        &dir,
        "three.csv",
        &format!("{line}{}", "1,2,3,4\n".repeat(3)),
    );
    assert_eq!(read_samples_with(&p, small).unwrap().1.len(), 3);
    // Too large, by its size and while reading.
    let p = write(
        &dir,
        "big.csv",
        &format!("{line}{}", "1,2,3,4\n".repeat(600)),
    );
    let e = read_samples_with(&p, small).unwrap_err();
    assert!(
        matches!(e, FitFileError::FileTooLarge { limit: 4096, .. }),
        "{e}"
    );
    let mut capped = input::Bounded::new(std::fs::File::open(&p).unwrap(), small.input());
    let e = io::copy(&mut capped, &mut io::sink()).unwrap_err();
    assert!(matches!(
        limit_error(&p, e),
        FitFileError::FileTooLarge { .. }
    ));
    // Not a regular file: a directory, a device; and a missing file.
    for p in [dir.path(), Path::new("/dev/null")] {
        let e = fit_file(p).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("not a regular file; `fit` reads a step log or a CSV file"),
            "{e}"
        );
    }
    let e = fit_file(&dir.path().join("absent.csv")).unwrap_err();
    assert!(
        matches!(e, FitFileError::Io { .. }) && e.to_string().contains("absent.csv"),
        "{e}"
    );
}

#[test]
fn renders_a_toml_snippet_that_parses_back() {
    let r = fit_samples(&samples(51, 300, TRUE, 0.05)).unwrap();
    for node in ["llm", "my node \"x\"\nnext", "thinker-2"] {
        let text = render_toml(&r, node, "odd\nname.csv");
        // Comments stay comments: the name's newline is escaped.
        assert_eq!(
            text.lines().filter(|l| l.starts_with('[')).count(),
            1,
            "{text}"
        );
        let doc: toml::Table = toml::from_str(&text).unwrap();
        let table = &doc["chunking"]["cost"][node];
        let parsed: LatencyModel = table.clone().try_into().unwrap();
        assert_close(parsed.coefficients(), r.model.coefficients(), 1e-5);
    }
    let text = render_toml(&r, "llm", "steps.csv");
    assert!(text.contains("\n[chunking.cost.llm]\nbase_ms = "), "{text}");
    assert!(
        text.starts_with("# fitted by `mstar-chunking fit` from \"steps.csv\": 300 steps, R² 0.99"),
        "{text}"
    );
    assert_eq!(toml_float(3.5e-6), "3.5e-6");
    assert_eq!(toml_float(0.0623790322), "0.062379");
    assert_eq!(toml_float(5.0), "5.0");
    assert_eq!(toml_float(0.0), "0.0");
}

// === the latency model's serde forms (a format crate is at hand here) ===

#[test]
fn serde_uses_the_config_keys_and_validates() {
    let m: LatencyModel = toml::from_str(
        "base_ms = 5.7\nper_token_ms = 0.0624\nper_kv_token_ms = 0.00026\nper_attention_pair_ms = 3.5e-6\n",
    )
    .unwrap();
    assert_eq!(m.coefficients(), [5.7, 0.0624, 0.00026, 3.5e-6]);
    let json = serde_json::to_value(m).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"base_ms": 5.7, "per_token_ms": 0.0624,
                           "per_kv_token_ms": 0.00026, "per_attention_pair_ms": 3.5e-6})
    );
    let neg = toml::from_str::<LatencyModel>(
        "base_ms = 5.7\nper_token_ms = -1.0\nper_kv_token_ms = 0.0\nper_attention_pair_ms = 0.0\n",
    )
    .unwrap_err();
    assert!(neg.to_string().contains("`per_token_ms` must be"), "{neg}");
    let typo = toml::from_str::<LatencyModel>(
        "base_ms = 5.7\nper_tokens_ms = 1.0\nper_kv_token_ms = 0.0\nper_attention_pair_ms = 0.0\n",
    )
    .unwrap_err();
    assert!(typo.to_string().contains("per_tokens_ms"), "{typo}");
    let missing = toml::from_str::<LatencyModel>("base_ms = 5.7\n").unwrap_err();
    assert!(missing.to_string().contains("per_token_ms"), "{missing}");
}

#[test]
fn labels_serialise_as_their_names() {
    for s in ModelSource::ALL {
        assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
    }
    for r in TimeOverrunReason::ALL {
        assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
    }
}

#[test]
fn overflowing_and_all_zero_inputs_are_refused_naming_the_line() {
    // The third line's pairs square past f64::MAX: named by its line (the header is line 1).
    let csv = "tokens,kv_tokens,attention_pairs,ms\n10,0,10,5\n20,0,1e200,6\n30,0,10,7\n";
    let e = file_error(csv);
    assert!(
        e.ends_with("in.txt:3: the step's values are too large to fit: the fit's sums of squares overflow at this step"),
        "{e}"
    );
    // In a step log, by its line too.
    let good = log_line(0, &[("chunk", 0, 64, 0)], 5.0, None);
    let huge = log_line(1, &[("chunk", 0, 64, 0)], 1e300, None);
    let e = file_error(&format!("{good}\n\n{huge}\n"));
    assert!(e.contains("in.txt:3: "), "{e}");
    // Steps that all took 0 ms fit to an all-zero model: refused, never a table.
    let zero = "tokens,kv_tokens,attention_pairs,ms\n10,0,0,0\n20,0,0,0\n";
    let e = file_error(zero);
    assert!(e.contains("every coefficient fitted to 0"), "{e}");
}

#[test]
fn coefficients_print_in_plain_decimals() {
    for (x, want) in [
        (3.4e-6, "0.0000034"),
        (56.451_234_5, "56.4512"),
        (0.062_4, "0.0624"),
        (0.000_330_000_1, "0.00033"),
        (8.0, "8"),
        (1_234_567.0, "1234567"),
        (0.0, "0"),
        (1e-12, "0.000000000001"),
    ] {
        assert_eq!(plain_decimal(x), want, "{x}");
    }
}

// === the measured ÷ predicted spread for a replay ===

#[test]
fn noise_ratios_are_the_quantiles_of_measured_over_predicted() {
    let truth = model(TRUE);
    // Steps measured at exactly 1, 2, ..., 100 times their prediction, out of order.
    let mut s = samples(61, 100, TRUE, 0.0);
    for (i, x) in s.iter_mut().enumerate() {
        x.ms *= ((i * 37) % 100 + 1) as f64;
    }
    let r = noise_ratios(&truth, &s, 101).unwrap();
    assert_eq!(r.len(), 101);
    // Nearest rank: the least at 0, the p-th step at p%, the largest at 100%.
    assert_close([r[0], r[1], r[50], r[100]], [1.0, 1.0, 50.0, 100.0], 1e-9);
    assert_close([r[99], r[10], r[2], r[3]], [99.0, 10.0, 2.0, 3.0], 1e-9);
    assert!(r.windows(2).all(|w| w[0] <= w[1]), "{r:?}");
    assert_eq!(
        noise_ratios(&truth, &s, 2).unwrap(),
        vec![1.0, 100.0],
        "two points: the least and the largest"
    );
    // Rounded to 4 significant digits, and held in the range a replay takes.
    let mut odd = samples(62, 3, TRUE, 0.0);
    odd[0].ms *= 1.234_567;
    odd[1].ms *= 1e-4;
    odd[2].ms *= 1e4;
    assert_eq!(
        noise_ratios(&truth, &odd, 3).unwrap(),
        vec![0.01, 1.235, 100.0]
    );
    // A step measured at 0 ms, or priced at 0, says nothing of a ratio.
    let zero = LatencyModel::from_coefficients([0.0, 1.0, 0.0, 0.0]).unwrap();
    let mut few = samples(63, 3, TRUE, 0.0);
    few[0].ms = 0.0;
    few[1].tokens = 0.0;
    few[2].tokens = 4.0;
    few[2].ms = 8.0;
    assert_eq!(
        noise_ratios(&zero, &few, 5),
        None,
        "one step left: no spread"
    );
    few[1].tokens = 2.0;
    few[1].ms = 3.0;
    assert_eq!(noise_ratios(&zero, &few, 3).unwrap(), vec![1.5, 1.5, 2.0]);
    assert_eq!(
        noise_ratios(&zero, &few, 1),
        None,
        "one point is no quantile range"
    );
}

#[test]
fn renders_a_replay_cost_table_that_the_replay_settings_take() {
    let s = samples(64, 300, TRUE, 0.05);
    let r = fit_samples(&s).unwrap();
    let bands = noise_bands(&r.model, &s).unwrap();
    let text = render_replay_toml(&r, Some(&bands), "odd\nname.csv");
    assert!(
        text.starts_with("# fitted by `mstar-chunking fit` from \"odd\\nname.csv\": 300 steps"),
        "{text}"
    );
    let doc: toml::Table = toml::from_str(&text).unwrap();
    let cost = &doc["replay"]["cost"];
    let parsed: crate::config::CostSection = cost.clone().try_into().unwrap();
    assert_eq!(parsed.noise_bands.as_deref(), Some(&bands[..]));
    assert_close(
        [
            parsed.base_ms.unwrap(),
            parsed.per_token_ms.unwrap(),
            parsed.per_kv_token_ms.unwrap(),
            parsed.per_attention_pair_ms.unwrap(),
        ],
        r.model.coefficients(),
        1e-5,
    );
    // The replay's own check takes the table as written.
    let mut replay = crate::config::Settings::default().replay;
    replay.cost = parsed;
    let manifest = mstar_chunking::manifest::Manifest::from_toml(
        "name = \"m\"\nwalks = [\"prefill\", \"decode\", \"mixed\"]\n[combined_walks]\nmixed = [\"prefill\", \"decode\"]\n[nodes.llm]\n",
        "m.toml",
    )
    .unwrap();
    let setup = crate::replay::settings::check(&manifest, &replay).unwrap();
    assert_eq!(setup.noise_bands.as_deref(), Some(&bands[..]));
    // 5% noise: every band's middle is near 1 and its ends within 5% of it.
    for b in &bands {
        assert_eq!(b.ratios.len(), NOISE_RATIO_POINTS);
        assert!((b.ratios[500] - 1.0).abs() < 0.03, "{b:?}");
        assert!(b.ratios[0] > 0.9 && b.ratios[1000] < 1.1, "{b:?}");
    }
    let bare = render_replay_toml(&r, None, "steps.csv");
    assert!(!bare.contains("noise_bands"), "{bare}");
    assert!(bare.contains("\n[replay.cost]\nbase_ms = "), "{bare}");
}

#[test]
fn noise_bands_keep_the_short_steps_tail_off_the_long_steps() {
    // Steps of 10 ms (200 of them, 1 in 20 at 5 times its price) and of 1 s (100, within 2%).
    let per_token = LatencyModel::from_coefficients([0.0, 1.0, 0.0, 0.0]).unwrap();
    let step = |tokens: f64, ms: f64| Sample {
        tokens,
        kv_tokens: 0.0,
        attention_pairs: 0.0,
        rows: 1.0,
        ms,
    };
    let mut s: Vec<Sample> = (0..200)
        .map(|i| step(10.0, if i % 20 == 0 { 50.0 } else { 10.0 }))
        .collect();
    s.extend((0..100).map(|i| step(1000.0, 1000.0 * (0.98 + 0.0004 * f64::from(i)))));
    let bands = noise_bands(&per_token, &s).unwrap();
    assert_eq!(bands.len(), 2, "{bands:?}");
    assert_eq!(bands[0].up_to_ms, Some(20.0));
    assert_eq!(bands[1].up_to_ms, None);
    assert_eq!(
        (
            bands[0].ratios[0],
            bands[0].ratios[945],
            bands[0].ratios[955]
        ),
        (1.0, 1.0, 5.0)
    );
    assert!(
        bands[1].ratios[1000] <= 1.02 && bands[1].ratios[0] >= 0.98,
        "{bands:?}"
    );
    // The single spread would put the short steps' 5x on the long ones too.
    let all = noise_ratios(&per_token, &s, NOISE_RATIO_POINTS).unwrap();
    assert_eq!(all[1000], 5.0);
    // Too few long steps for a band of their own: they join the short ones.
    let few = &s[..200 + MIN_BAND_STEPS - 1];
    assert_eq!(noise_bands(&per_token, few).unwrap().len(), 1);
    // A band doubles its reach until it holds MIN_BAND_STEPS steps.
    let spread: Vec<Sample> = (0..400)
        .map(|i| step(f64::from(1 + i), f64::from(1 + i)))
        .collect();
    let bands = noise_bands(&per_token, &spread).unwrap();
    let ups: Vec<Option<f64>> = bands.iter().map(|b| b.up_to_ms).collect();
    assert_eq!(
        ups,
        [Some(64.0), Some(128.0), Some(256.0), None],
        "{bands:?}"
    );
    assert_eq!(noise_bands(&per_token, &spread[..1]), None);
    // At most MAX_FIT_BANDS bands: twenty doublings of 50 steps each make sixteen, the last
    // holding the rest.
    let doublings: Vec<Sample> = (0..20)
        .flat_map(|k| (0..50).map(move |_| f64::from(1u32 << k)))
        .map(|t| step(t, t))
        .collect();
    let bands = noise_bands(&per_token, &doublings).unwrap();
    assert_eq!(bands.len(), MAX_FIT_BANDS);
    // Bounds are rounded to 4 digits: 2^15 = 32768 is written 32770, so that band also takes
    // the steps priced 32768.
    assert_eq!(bands[14].up_to_ms, Some(32770.0));
    assert_eq!(bands[15].up_to_ms, None);
    assert_eq!(noise_bands(&per_token, &spread[..2]).unwrap().len(), 1);
}
