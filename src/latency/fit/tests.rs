use proptest::prelude::*;

use super::*;

use super::testing::*;

fn online(config: OnlineFitConfig) -> OnlineFit {
    OnlineFit::try_new(config).unwrap()
}

// === the solver ===

#[test]
fn recovers_exact_coefficients_from_noiseless_samples() {
    let s = samples(1, 500, TRUE, 0.0);
    let report = fit_samples(&s).unwrap();
    assert_close(report.model.coefficients(), TRUE, 1e-6);
    assert!(report.r_squared.unwrap() > 1.0 - 1e-9);
    assert!(report.abs_error_ms.max < 1e-6, "{:?}", report.abs_error_ms);
    assert_eq!(report.samples, 500);

    let mut fit = online(OnlineFitConfig::default());
    for x in &s {
        fit.observe_sample(x).unwrap();
    }
    let e = fit.estimate().unwrap();
    assert_close(e.model.coefficients(), TRUE, 1e-6);
    assert!(e.relative_rms < 1e-6 && e.trusted, "{e:?}");
}

#[test]
fn recovers_coefficients_within_a_few_percent_under_5_percent_noise() {
    // Every term that carries real weight comes within 2.5%; where `base_ms` is a few percent
    // of a step (heavy steps) the noise hides it to within about 1 ms.
    for seed in [7, 8, 9, 10, 11, 12] {
        let heavy = fit_samples(&samples(seed, 3000, TRUE, 0.05)).unwrap();
        let c = heavy.model.coefficients();
        assert_close([TRUE[0], c[1], c[2], c[3]], TRUE, 0.025);
        assert!((c[0] - TRUE[0]).abs() < 1.0, "{c:?}");
        // Uniform ±5% noise: RMS ≈ 5%/√3 of a step's time.
        assert!(heavy.relative_rms < 0.04, "{heavy:?}");
        assert!(heavy.r_squared.unwrap() > 0.99);
        // The predictions, which are what the planner uses, are within 2% (RMS) of the truth.
        let fresh = samples(seed + 100, 1000, TRUE, 0.0);
        let err = fresh
            .iter()
            .map(|s| ((predict(&heavy.model.terms(), &s.x()) - s.ms) / s.ms).powi(2))
            .sum::<f64>()
            / fresh.len() as f64;
        assert!(err.sqrt() < 0.02, "{}", err.sqrt());

        let light = fit_samples(&samples_of(seed, 3000, TRUE, 0.05, LIGHT)).unwrap();
        let c = light.model.coefficients();
        assert_close([c[0], c[1], c[2], TRUE[3]], TRUE, 0.025);
    }
}

#[test]
fn a_column_the_data_never_exercises_gets_zero() {
    // No decode rows: K is 0 in every sample; the others are still recovered.
    let m = model([2.0, 0.05, 0.0, 1e-6]);
    let s: Vec<Sample> = (0..100u32)
        .map(|i| {
            let f = StepFeatures::EMPTY.with_chunk(i * 100, i * 100 + 50 + i);
            Sample::new(&f, m.predict_ms(&f)).unwrap()
        })
        .collect();
    let r = fit_samples(&s).unwrap();
    assert_close(r.model.coefficients(), [2.0, 0.05, 0.0, 1e-6], 1e-6);
    assert_eq!(r.model.per_kv_token_ms(), 0.0);
}

#[test]
fn coefficients_stay_non_negative_when_the_data_prefers_a_negative_one() {
    // Time that falls with context: least squares would give `per_kv_token_ms` < 0.
    let mut rng = TestRng::new(3);
    let s: Vec<Sample> = (0..400)
        .map(|_| {
            let f = random_step(&mut rng);
            let [t, k, a, _] = f.to_f64();
            let ms = (10.0 + 0.1 * t - 1e-5 * k + 2e-6 * a).max(0.0);
            Sample::new(&f, ms).unwrap()
        })
        .collect();
    let r = fit_samples(&s).unwrap();
    let c = r.model.coefficients();
    assert!(c.iter().all(|&v| v >= 0.0), "{c:?}");
    assert_eq!(c[2], 0.0, "{c:?}");
    // With K out, the optimum is the least-squares fit on the other three columns.
    let without_k: Vec<Sample> = s
        .iter()
        .map(|x| Sample {
            kv_tokens: 0.0,
            ..*x
        })
        .collect();
    let r3 = fit_samples(&without_k).unwrap();
    assert_close(c, r3.model.coefficients(), 1e-9);
}

#[test]
fn only_a_base_when_time_is_constant() {
    let s: Vec<Sample> = (1..50u32)
        .map(|i| Sample::new(&StepFeatures::EMPTY.with_chunk(0, i), 7.5).unwrap())
        .collect();
    let r = fit_samples(&s).unwrap();
    assert_close(r.model.coefficients(), [7.5, 0.0, 0.0, 0.0], 1e-9);
    assert_eq!(r.r_squared, None);
    assert_eq!(r.abs_error_ms.max, 0.0);
}

#[test]
fn identical_steps_give_the_same_base_however_many_there_are() {
    // Every step one chunk of 16 tokens from 0 (136 attention pairs): the constant, tokens and
    // pairs are the same column three times over, and any one of them fits exactly. Which one
    // came out lowest was rounding's choice (attention pairs alone at 300 steps, base at 400);
    // it is `base_ms`, whatever the count and the time.
    for ms in [2.0, 2.1, 7.3, 0.015] {
        for n in [2usize, 3, 300, 400, 1000, 4097, 100_000] {
            let f = StepFeatures::EMPTY.with_chunk(0, 16);
            let s = vec![Sample::new(&f, ms).unwrap(); n];
            for errors in [FitErrors::Absolute, FitErrors::Relative] {
                let r = fit_samples_with(&s, errors).unwrap();
                let c = r.model.terms();
                assert_eq!(c[1..], [0.0; 4], "{n} steps of {ms} ms, {errors:?}");
                assert!(
                    (c[0] - ms).abs() <= 1e-9 * ms,
                    "{n} steps of {ms} ms: {c:?}"
                );
                assert!(r.underdetermined(), "{r:?}");
            }
        }
    }
}

/// The KKT conditions of `min Σ (xᵀc − y)²` over `c >= 0`: an independent check of optimality.
fn assert_kkt(s: &[Sample], c: [f64; N]) {
    let mut grad = [0.0f64; N];
    let mut scale = [0.0f64; N];
    for x in s {
        let xs = x.x();
        let r = predict(&c, &xs) - x.ms;
        for j in 0..N {
            grad[j] += xs[j] * r;
            scale[j] += xs[j] * xs[j];
        }
    }
    let y_norm = s.iter().map(|x| x.ms * x.ms).sum::<f64>().sqrt();
    // A per-row term of 0 is the four-term optimum (the term is kept only where the steps
    // call for it, `Normal::solve`): optimal over the other columns.
    let columns = if c[ROWS] > 0.0 { N } else { ROWS };
    for j in 0..columns {
        // The gradient per unit of a scaled column, relative to the measurements' size. A zero
        // gradient is 0 however small the scale (an all-zero column or all-zero measurements
        // would otherwise give 0/0); a non-zero one over a zero scale is infinite, and fails.
        let denom = scale[j].sqrt() * y_norm;
        let g = if grad[j] == 0.0 {
            0.0
        } else {
            grad[j] / denom.max(f64::MIN_POSITIVE)
        };
        if c[j] > 0.0 {
            assert!(
                g.abs() < 1e-6,
                "coefficient {j} = {} but gradient {g}",
                c[j]
            );
        } else {
            assert!(g > -1e-6, "coefficient {j} is 0 but gradient {g} < 0");
        }
    }
}

/// The case the property below once found: every truth 0 and no noise, so every measurement
/// is 0 (the fit is refused as all zero), in steps where a column is 0 throughout (no continuing
/// row reads a context): the optimality check must hold there; it used to divide 0 by 0.
#[test]
fn all_zero_measurements_are_the_all_zero_optimum() {
    let s: Vec<Sample> = (1..6)
        .map(|i| {
            let f = StepFeatures::EMPTY.with_chunk(0, 100 * i);
            let [t, k, a, rows] = f.to_f64();
            assert_eq!(k, 0.0);
            Sample {
                tokens: t,
                kv_tokens: k,
                attention_pairs: a,
                rows,
                ms: 0.0,
            }
        })
        .collect();
    assert!(matches!(fit_samples(&s), Err(FitError::AllZero)));
    assert_kkt(&s, [0.0; N]);
    // The same column of zeros under measurements that are not 0.
    let mut s = s;
    for (i, x) in s.iter_mut().enumerate() {
        x.ms = 5.0 + i as f64;
    }
    assert_kkt(&s, fit_samples(&s).unwrap().model.terms());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn the_fit_is_the_constrained_optimum(
        seed in any::<u64>(),
        n in 5usize..200,
        c in prop::array::uniform4(prop_oneof![Just(0.0f64), 0.0f64..1.0]),
        signs in prop::array::uniform4(any::<bool>()),
        noise in prop_oneof![Just(0.0f64), 0.0f64..0.5],
    ) {
        // Signed truths scaled to the features' sizes: some fits must clamp.
        let scale = [10.0, 0.1, 1e-3, 1e-5];
        let truth: [f64; 4] = std::array::from_fn(|j| {
            let v = c[j] * scale[j];
            if signs[j] { v } else { -v }
        });
        let mut rng = TestRng::new(seed);
        let s: Vec<Sample> = (0..n)
            .map(|_| {
                let f = random_step(&mut rng);
                let [t, k, a, rows] = f.to_f64();
                let y = truth[0] + truth[1] * t + truth[2] * k + truth[3] * a;
                let y = (y * rng.uniform(1.0 - noise, 1.0 + noise)).max(0.0);
                Sample { tokens: t, kv_tokens: k, attention_pairs: a, rows, ms: y }
            })
            .collect();
        // An all-zero optimum (every truth clamped away) is refused, not returned: it must
        // then be the optimum.
        match fit_samples(&s) {
            Ok(r) => assert_kkt(&s, r.model.terms()),
            Err(FitError::AllZero) => assert_kkt(&s, [0.0; N]),
            Err(e) => panic!("{e}"),
        }
    }
}

// === the online fit ===

#[test]
fn the_trusted_rule_needs_enough_samples_and_a_small_error() {
    let s = samples(11, 200, TRUE, 0.0);
    let mut fit = online(OnlineFitConfig::default());
    assert_eq!(fit.estimate(), None);
    assert_eq!(fit.trusted_model(), None);
    for (i, x) in s.iter().enumerate() {
        fit.observe_sample(x).unwrap();
        let e = fit.estimate().unwrap();
        assert_eq!(e.samples, i as u64 + 1);
        // Exact data: only the count decides.
        assert_eq!(e.trusted, i + 1 >= 50, "after {} samples: {e:?}", i + 1);
    }
    assert_eq!(fit.trusted_model(), Some(fit.estimate().unwrap().model));

    // 60% noise: plenty of samples, but an error no planner should trust.
    let mut noisy = online(OnlineFitConfig::default());
    for x in samples(12, 500, TRUE, 0.6) {
        noisy.observe_sample(&x).unwrap();
    }
    let e = noisy.estimate().unwrap();
    assert!(e.relative_rms > 0.10 && !e.trusted, "{e:?}");
    assert_eq!(noisy.trusted_model(), None);

    // The threshold is the configured one.
    let mut lax = online(OnlineFitConfig {
        max_relative_rms: 0.5,
        min_samples: 10,
        ..OnlineFitConfig::default()
    });
    for x in samples(12, 500, TRUE, 0.6) {
        lax.observe_sample(&x).unwrap();
    }
    let e = lax.estimate().unwrap();
    assert!(e.relative_rms <= 0.5 && e.trusted, "{e:?}");

    fit.reset();
    assert_eq!(fit.samples(), 0);
    assert_eq!(fit.estimate(), None);
}

#[test]
fn forgetting_tracks_a_change_of_coefficients() {
    // The GPU gets 2× slower per token and attention after 1,000 steps.
    let after = [5.7, 0.1248, 3.3e-4, 6.8e-6];
    let before_samples = samples(21, 1000, TRUE, 0.0);
    let after_samples = samples(22, 1500, after, 0.0);
    let run = |forgetting: f64| {
        let mut fit = online(OnlineFitConfig {
            forgetting,
            ..OnlineFitConfig::default()
        });
        for x in before_samples.iter().chain(&after_samples) {
            fit.observe_sample(x).unwrap();
        }
        fit.estimate().unwrap()
    };
    // λ = 0.995: 1,500 steps leave the old data 0.05% of the weight.
    let e = run(DEFAULT_FORGETTING);
    assert_close(e.model.coefficients(), after, 0.01);
    assert!(e.trusted);
    // Without forgetting the old steps still pull the fit far off.
    let stuck = run(1.0);
    let c = stuck.model.coefficients();
    assert!((c[1] - after[1]).abs() > 0.1 * after[1], "{c:?}");
}

#[test]
fn bad_measurements_are_refused_and_change_nothing() {
    let mut fit = online(OnlineFitConfig::default());
    let f = StepFeatures::EMPTY.with_chunk(0, 100);
    fit.observe(&f, 12.0).unwrap();
    let before = fit.clone();
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.5] {
        let err = fit.observe(&f, bad).unwrap_err();
        assert!(matches!(err, FitError::BadMeasurement { .. }), "{err}");
        assert!(err.to_string().contains(">= 0"), "{err}");
        assert_eq!(fit, before);
    }
    let neg = Sample {
        tokens: -1.0,
        kv_tokens: 0.0,
        attention_pairs: 0.0,
        rows: 0.0,
        ms: 1.0,
    };
    let err = fit.observe_sample(&neg).unwrap_err();
    assert_eq!(
        err.to_string(),
        "step feature `tokens` must be a finite number >= 0, got -1"
    );
    let nan = Sample {
        attention_pairs: f64::NAN,
        ..neg
    };
    let err = fit_samples(&[nan]).unwrap_err();
    assert!(err.to_string().contains("`tokens`"), "{err}");
    let nan = Sample { tokens: 1.0, ..nan };
    let err = fit_samples(&[nan]).unwrap_err();
    assert!(err.to_string().contains("`attention_pairs`"), "{err}");
    assert_eq!(fit, before);
    // Zero is a measurement.
    fit.observe(&f, 0.0).unwrap();
    assert_eq!(fit.samples(), 2);
}

#[test]
fn settings_are_checked() {
    let bad = [
        (f64::NAN, 50, 0.1, "forgetting"),
        (0.0, 50, 0.1, "forgetting"),
        (1.01, 50, 0.1, "forgetting"),
        (0.99, 0, 0.1, "min_samples"),
        (0.99, 50, 0.0, "max_relative_rms"),
        (0.99, 50, f64::INFINITY, "max_relative_rms"),
    ];
    for (forgetting, min_samples, max_relative_rms, key) in bad {
        let err = OnlineFit::try_new(OnlineFitConfig {
            forgetting,
            min_samples,
            max_relative_rms,
            ..OnlineFitConfig::default()
        })
        .unwrap_err();
        assert!(
            err.to_string().starts_with(&format!("`{key}` must be")),
            "{err}"
        );
    }
    assert!(OnlineFit::try_new(OnlineFitConfig {
        forgetting: 1.0,
        min_samples: 1,
        max_relative_rms: 1e-9,
        ..OnlineFitConfig::default()
    })
    .is_ok());
}

#[test]
fn error_quantiles_are_nearest_rank() {
    // Empty steps: the fit is the mean, 5.5 ms.
    let ms = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
    let s: Vec<Sample> = ms
        .iter()
        .map(|&ms| Sample::new(&StepFeatures::EMPTY, ms).unwrap())
        .collect();
    let r = fit_samples(&s).unwrap();
    assert_close(r.model.coefficients(), [5.5, 0.0, 0.0, 0.0], 1e-12);
    // |errors| sorted: 0.5 0.5 1.5 1.5 2.5 2.5 3.5 3.5 4.5 4.5
    let q = r.abs_error_ms;
    for (got, want) in [(q.p50, 2.5), (q.p90, 4.5), (q.p99, 4.5), (q.max, 4.5)] {
        assert!((got - want).abs() < 1e-9, "{q:?}");
    }
    assert!(r.r_squared.unwrap().abs() < 1e-12);
    assert!(matches!(fit_samples(&[]), Err(FitError::NoSamples)));
}

#[test]
fn collinear_columns_give_one_of_the_optimal_fits() {
    // Decode-only steps whose rows all hold 30,000 tokens of context: K = 30,000·T exactly, so
    // only `per_token_ms + 30,000·per_kv_token_ms` is determined. Any split that predicts the
    // steps is right; it must be finite, non-negative and exact on the data.
    let m = model([4.0, 0.05, 2e-4, 0.0]);
    let s: Vec<Sample> = (1..200u32)
        .map(|rows| {
            let mut f = StepFeatures::EMPTY;
            for _ in 0..rows {
                f.add_continuing(1, 30_000);
            }
            Sample::new(&f, m.predict_ms(&f)).unwrap()
        })
        .collect();
    let r = fit_samples(&s).unwrap();
    let c = r.model.coefficients();
    assert!(
        (c[1] + 30_000.0 * c[2] - (0.05 + 30_000.0 * 2e-4)).abs() < 1e-9,
        "{c:?}"
    );
    assert!((c[0] - 4.0).abs() < 1e-6, "{c:?}");
    assert!(r.abs_error_ms.max < 1e-6, "{r:?}");
    assert_kkt(&s, r.model.terms());
}

#[test]
fn overflowing_sums_an_all_zero_fit_and_non_finite_fits_are_refused() {
    let sample = |t: f64, k: f64, a: f64, ms: f64| Sample {
        rows: 0.0,
        tokens: t,
        kv_tokens: k,
        attention_pairs: a,
        ms,
    };
    // 1e200 pairs: finite alone, but its square overflows the sums at the second sample.
    let s = [
        sample(10.0, 0.0, 10.0, 5.0),
        sample(20.0, 0.0, 1e200, 6.0),
        sample(30.0, 0.0, 10.0, 7.0),
    ];
    assert_eq!(fit_samples(&s), Err(FitError::SumsOverflow { index: 1 }));
    // A huge time overflows `Σ y²` as well.
    let s = [sample(1.0, 0.0, 0.0, 1e300), sample(2.0, 0.0, 0.0, 1.0)];
    assert_eq!(fit_samples(&s), Err(FitError::SumsOverflow { index: 0 }));
    // Every step took 0 ms: the fit is all zero, refused rather than printed as a table.
    let s: Vec<Sample> = (1..50)
        .map(|t| sample(f64::from(t), 100.0, 0.0, 0.0))
        .collect();
    assert_eq!(fit_samples(&s), Err(FitError::AllZero));
    assert!(FitError::AllZero.to_string().contains("all 0 ms"));
}

#[test]
fn too_few_or_collinear_steps_leave_the_fit_underdetermined() {
    let step = |start: u32, end: u32, ms: f64| {
        Sample::new(&StepFeatures::EMPTY.with_chunk(start, end), ms).unwrap()
    };
    // Two steps for three observed terms (constant, tokens, attention pairs): R² is a perfect 1
    // and means nothing.
    let two = [step(0, 100, 12.0), step(0, 300, 20.0)];
    let r = fit_samples(&two).unwrap();
    assert_eq!((r.samples, r.observed_terms), (2, 3));
    assert!(r.rank <= 2 && r.underdetermined(), "{r:?}");
    // Many steps, but every chunk the same size at different starts... still three terms that
    // vary independently: determined.
    let varied: Vec<Sample> = (0..20u32)
        .map(|i| step(i * 64, i * 64 + 16 + (i % 5) * 40, 10.0 + f64::from(i)))
        .collect();
    let r = fit_samples(&varied).unwrap();
    assert_eq!((r.rank, r.observed_terms), (3, 3));
    assert!(!r.underdetermined());
    // Tokens and attention pairs locked together (every chunk from 0 to the same end): the
    // steps cannot tell the two terms apart however many there are.
    let same: Vec<Sample> = (0..20)
        .map(|i| step(0, 128, 10.0 + f64::from(i % 3)))
        .collect();
    let r = fit_samples(&same).unwrap();
    assert_eq!(r.observed_terms, 3);
    assert_eq!(
        r.rank, 1,
        "a constant, and tokens and pairs that are constant too"
    );
    assert!(r.underdetermined());
}

// === the robust online fit against plain least squares ===

/// A four-term truth with a real intercept: steps of ~10–40 ms, where `base_ms` carries weight.
const FOUR: [f64; 4] = [8.0, 0.05, 2e-4, 2e-6];

/// `n` light steps of `truth` with ±`noise` uniform noise; every `every`-th step (from
/// `first`) takes 10 times as long (a pause, a page fault).
fn noisy_with_outliers(
    seed: u64,
    n: usize,
    truth: [f64; 4],
    noise: f64,
    every: Option<usize>,
) -> Vec<Sample> {
    let mut s = samples_of(seed, n, truth, noise, MEDIUM);
    if let Some(every) = every {
        for x in s.iter_mut().skip(every / 2).step_by(every) {
            x.ms *= 10.0;
        }
    }
    s
}

fn fit_online(estimator: Estimator, s: &[Sample]) -> OnlineEstimate {
    let mut fit = online(OnlineFitConfig {
        estimator,
        ..OnlineFitConfig::default()
    });
    for x in s {
        fit.observe_sample(x).unwrap();
    }
    fit.estimate().unwrap()
}

fn max_relative_gap(a: [f64; 4], b: [f64; 4]) -> f64 {
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(f64::MIN_POSITIVE))
        .fold(0.0, f64::max)
}

#[test]
fn the_robust_fit_is_within_10_percent_at_5_percent_noise_and_unmoved_by_outliers() {
    for seed in [31, 32, 33, 34] {
        let clean = noisy_with_outliers(seed, 3000, FOUR, 0.05, None);
        let dirty = noisy_with_outliers(seed, 3000, FOUR, 0.05, Some(100));
        let robust = fit_online(Estimator::Huber, &clean);
        let c = robust.model.coefficients();
        assert_close(c, FOUR, 0.10);
        assert_eq!(
            robust.model.per_row_ms(),
            0.0,
            "seed {seed}: {:?}",
            robust.model
        );
        assert!(robust.trusted, "{robust:?}");
        // 1% of the steps 10× as long: every coefficient within 2% of the fit without them,
        // and still trusted.
        let with_outliers = fit_online(Estimator::Huber, &dirty);
        let gap = max_relative_gap(with_outliers.model.coefficients(), c);
        assert!(
            gap <= 0.02,
            "seed {seed}: moved {gap} by outliers: {with_outliers:?} vs {robust:?}"
        );
        assert!(with_outliers.trusted, "{with_outliers:?}");
    }
}

#[test]
fn plain_least_squares_fails_the_same_test() {
    // The figures docs/cost-model.md quotes: `cargo test --lib plain_least_squares -- --nocapture`.
    for seed in [31, 32, 33, 34] {
        let clean = noisy_with_outliers(seed, 3000, FOUR, 0.05, None);
        let dirty = noisy_with_outliers(seed, 3000, FOUR, 0.05, Some(100));
        let [ls, ls_dirty, robust, robust_dirty] = [
            (Estimator::LeastSquares, &clean),
            (Estimator::LeastSquares, &dirty),
            (Estimator::Huber, &clean),
            (Estimator::Huber, &dirty),
        ]
        .map(|(e, s)| fit_online(e, s).model.coefficients());
        let moved = max_relative_gap(ls_dirty, ls);
        eprintln!(
            "seed {seed}: off the truth at 5% noise: least squares {:.3}, robust {:.3}; moved by 1% of 10x outliers: least squares {moved:.3}, robust {:.4}; base_ms with outliers: least squares {:.2}, robust {:.2}",
            max_relative_gap(ls, FOUR),
            max_relative_gap(robust, FOUR),
            max_relative_gap(robust_dirty, robust),
            ls_dirty[0],
            robust_dirty[0],
        );
        // Outliers move least squares far past 2% (and past 10% of the truth) on every seed.
        assert!(
            moved > 0.02,
            "seed {seed}: least squares moved only {moved}"
        );
        assert!(
            max_relative_gap(ls_dirty, FOUR) > 0.10,
            "seed {seed}: {ls_dirty:?}"
        );
    }
}

#[test]
fn the_robust_fit_follows_a_slower_engine_within_a_bounded_number_of_steps_and_says_when_it_is_not_trusted(
) {
    // After 2,000 steps every coefficient doubles (a slower engine after a model swap).
    let slower = FOUR.map(|c| 2.0 * c);
    let before = noisy_with_outliers(41, 2000, FOUR, 0.05, Some(100));
    let after = noisy_with_outliers(42, 1000, slower, 0.05, Some(100));
    let mut fit = online(OnlineFitConfig::default());
    for x in &before {
        fit.observe_sample(x).unwrap();
    }
    assert!(fit.estimate().unwrap().trusted);
    let mut untrusted = 0;
    let mut tracked_at = None;
    for (i, x) in after.iter().enumerate() {
        fit.observe_sample(x).unwrap();
        let e = fit.estimate().unwrap();
        untrusted += usize::from(!e.trusted);
        let gap = max_relative_gap(e.model.coefficients(), slower);
        if tracked_at.is_none() && gap <= 0.10 && e.trusted {
            tracked_at = Some(i + 1);
        }
    }
    let tracked_at = tracked_at.expect("the fit never followed the slower engine");
    eprintln!("followed after {tracked_at} steps, {untrusted} untrusted");
    assert!(tracked_at <= 800, "followed after {tracked_at} steps");
    assert!(
        untrusted > 0,
        "the fit never said it was off while the engine changed"
    );
    let e = fit.estimate().unwrap();
    assert_close(e.model.coefficients(), slower, 0.10);
    assert!(e.trusted);
}

#[test]
fn the_warm_up_is_robust_too_and_trust_waits_for_it() {
    // Outliers among the first steps (one in ten): the warm-up's batch fit is not pulled by
    // them.
    let s = noisy_with_outliers(51, 50, FOUR, 0.05, Some(10));
    let mut fit = online(OnlineFitConfig::default());
    for (i, x) in s.iter().enumerate() {
        fit.observe_sample(x).unwrap();
        if i + 1 < 50 {
            assert!(!fit.estimate().unwrap().trusted, "trusted in its warm-up");
        }
    }
    let e = fit.estimate().unwrap();
    let pred = |c: [f64; 5]| {
        let f = StepFeatures::EMPTY.with_chunk(0, 100);
        LatencyModel::from_terms(c).unwrap().predict_ms(&f)
    };
    let truth = pred([FOUR[0], FOUR[1], FOUR[2], FOUR[3], 0.0]);
    let got = pred(e.model.terms());
    assert!(
        (got - truth).abs() <= 0.05 * truth,
        "{got} vs {truth}: {e:?}"
    );
    let ls = fit_online(Estimator::LeastSquares, &s);
    let got_ls = pred(ls.model.terms());
    assert!(
        (got_ls - truth).abs() > 0.05 * truth,
        "least squares {got_ls} vs {truth}"
    );
}

#[test]
fn a_per_row_cost_is_learned_where_steps_pay_one_and_left_at_zero_where_they_do_not() {
    // Each row costs 3 ms on top of its tokens (logits, attention set up head by head).
    let truth = LatencyModel::from_terms([8.0, 0.05, 2e-4, 2e-6, 3.0]).unwrap();
    let mut rng = TestRng::new(61);
    let s: Vec<Sample> = (0..3000)
        .map(|_| {
            let f = random_step_of(&mut rng, LIGHT);
            Sample::new(&f, truth.predict_ms(&f) * rng.uniform(0.95, 1.05)).unwrap()
        })
        .collect();
    let offline = fit_samples(&s).unwrap();
    let c = offline.model.terms();
    assert!((c[4] - 3.0).abs() <= 0.3, "{c:?}");
    let online_fit = fit_online(Estimator::Huber, &s);
    let c = online_fit.model.terms();
    assert!((c[4] - 3.0).abs() <= 0.3, "{c:?}");
    assert!((c[0] - 8.0).abs() <= 0.8, "{c:?}");
    // The same steps priced without a per-row cost: none is fitted.
    let four = fit_samples(&samples_of(61, 3000, FOUR, 0.05, LIGHT)).unwrap();
    assert_eq!(four.model.per_row_ms(), 0.0, "{:?}", four.model);
}

#[test]
fn a_relative_fit_weighs_short_steps_as_much_as_long_ones() {
    // Short steps cost 10 ms + 1 ms a token; long steps 2 ms a token more than that line: the
    // absolute fit follows the long steps, the relative one the many short ones.
    let mut samples = Vec::new();
    for t in 1..=20u64 {
        samples.push(Sample {
            tokens: t as f64,
            kv_tokens: 0.0,
            attention_pairs: 0.0,
            rows: 1.0,
            ms: 10.0 + t as f64,
        });
    }
    for t in [1000u64, 2000] {
        samples.push(Sample {
            tokens: t as f64,
            kv_tokens: 0.0,
            attention_pairs: 0.0,
            rows: 1.0,
            ms: 10.0 + 3.0 * t as f64,
        });
    }
    let abs = fit_samples_with(&samples, FitErrors::Absolute)
        .unwrap()
        .model
        .terms();
    let rel = fit_samples_with(&samples, FitErrors::Relative)
        .unwrap()
        .model
        .terms();
    assert!((abs[1] - 3.0).abs() < 0.05, "{abs:?}");
    assert!((rel[0] - 10.0).abs() < 2.0 && rel[1] < 1.5, "{rel:?}");
    assert_eq!(
        fit_samples(&samples).unwrap().model,
        fit_samples_with(&samples, FitErrors::Absolute)
            .unwrap()
            .model
    );
}
