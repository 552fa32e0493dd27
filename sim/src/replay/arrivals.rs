//! Generated arrivals for traces that carry only request lengths (see
//! `docs/traces.md#generated-arrivals`).
//!
//! `poisson:QPS` draws exponential gaps with mean `1/QPS` seconds: arrivals without memory, the
//! usual model of many independent users. `gamma:QPS:CV` draws gamma gaps with the same mean and
//! a coefficient of variation `CV` (standard deviation / mean of the gaps): `CV = 1` is Poisson,
//! `CV > 1` bursty traffic, `CV < 1` traffic more regular than Poisson. The first request arrives
//! at 0 ms; each later one a drawn gap after the one before. The same spec, count and seed always
//! give the same times.

use std::fmt;
use std::str::FromStr;

use rand::rngs::SmallRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Exp, Gamma};

/// The lowest request rate accepted, in requests per second (one request every ~17 minutes).
pub const MIN_QPS: f64 = 1e-3;
/// The highest request rate accepted, in requests per second.
pub const MAX_QPS: f64 = 1e6;
/// The lowest coefficient of variation accepted for gamma gaps.
pub const MIN_CV: f64 = 0.1;
/// The highest coefficient of variation accepted for gamma gaps.
pub const MAX_CV: f64 = 10.0;
/// The latest arrival a trace may have, in ms (about 31.7 years): generated or read times past
/// it are refused rather than left to lose precision.
pub const MAX_ARRIVAL_MS: f64 = 1e12;

/// How generated arrivals are spaced: `poisson:QPS` or `gamma:QPS:CV`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// Exponential gaps with mean `1000 / qps` ms.
    Poisson {
        /// Requests per second, in `[MIN_QPS, MAX_QPS]`.
        qps: f64,
    },
    /// Gamma gaps with mean `1000 / qps` ms and coefficient of variation `cv`.
    Gamma {
        /// Requests per second, in `[MIN_QPS, MAX_QPS]`.
        qps: f64,
        /// Standard deviation of the gaps over their mean, in `[MIN_CV, MAX_CV]`.
        cv: f64,
    },
}

/// Why an arrivals spec was refused, or times could not be generated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ArrivalsError {
    /// The arrivals value does not have the `kind:value[:value]` shape, or names an unknown kind.
    #[error("`--arrivals` {spec:?}: {problem}; expected `poisson:QPS` or `gamma:QPS:CV`, e.g. `poisson:4` or `gamma:4:2`")]
    Syntax {
        /// The arrivals value as given.
        spec: String,
        /// What was wrong with its shape.
        problem: String,
    },
    /// A number in the arrivals value is not a number, not finite, or out of range.
    #[error(
        "`--arrivals` {spec:?}: {what} must be a finite number in [{min}, {max}], got {value:?}"
    )]
    Value {
        /// The arrivals value as given.
        spec: String,
        /// `QPS` or `CV`.
        what: &'static str,
        /// The text given for it.
        value: String,
        /// The accepted range.
        min: f64,
        /// The accepted range.
        max: f64,
    },
    /// The generated times would pass [`MAX_ARRIVAL_MS`].
    #[error("{spec}: request {index} would arrive after {MAX_ARRIVAL_MS} ms; use a higher rate or fewer requests")]
    TooLate {
        /// The arrivals value, as displayed.
        spec: String,
        /// The 0-based request whose arrival is too late.
        index: usize,
    },
}

impl fmt::Display for Arrivals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Poisson { qps } => write!(f, "poisson:{qps}"),
            Self::Gamma { qps, cv } => write!(f, "gamma:{qps}:{cv}"),
        }
    }
}

impl FromStr for Arrivals {
    type Err = ArrivalsError;

    /// Parses `poisson:QPS` or `gamma:QPS:CV` (the kind in any case, spaces around parts
    /// ignored).
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let syntax = |problem: &str| ArrivalsError::Syntax {
            spec: spec.to_owned(),
            problem: problem.to_owned(),
        };
        let parts: Vec<&str> = spec.split(':').map(str::trim).collect();
        let kind = parts[0].to_ascii_lowercase();
        let number = |what: &'static str, text: &str, min: f64, max: f64| {
            let bad = || ArrivalsError::Value {
                spec: spec.to_owned(),
                what,
                value: text.to_owned(),
                min,
                max,
            };
            let v: f64 = text.parse().map_err(|_| bad())?;
            if v.is_finite() && (min..=max).contains(&v) {
                Ok(v)
            } else {
                Err(bad())
            }
        };
        match (kind.as_str(), &parts[1..]) {
            ("poisson", [qps]) => Ok(Self::Poisson {
                qps: number("QPS", qps, MIN_QPS, MAX_QPS)?,
            }),
            ("gamma", [qps, cv]) => Ok(Self::Gamma {
                qps: number("QPS", qps, MIN_QPS, MAX_QPS)?,
                cv: number("CV", cv, MIN_CV, MAX_CV)?,
            }),
            ("poisson", _) => Err(syntax("`poisson` takes one value, the rate")),
            ("gamma", _) => Err(syntax(
                "`gamma` takes two values, the rate and the coefficient of variation",
            )),
            _ => Err(syntax("unknown kind of arrivals")),
        }
    }
}

impl Arrivals {
    /// The mean request rate, in requests per second.
    pub fn qps(&self) -> f64 {
        match *self {
            Self::Poisson { qps } | Self::Gamma { qps, .. } => qps,
        }
    }

    /// Generates `n` arrival times in ms, non-decreasing, the first at 0, from `seed`.
    ///
    /// # Errors
    /// A time past [`MAX_ARRIVAL_MS`] (a low rate with very many requests), or a value out of
    /// range in an [`Arrivals`] built by hand rather than parsed.
    pub fn times_ms(&self, n: usize, seed: u64) -> Result<Vec<f64>, ArrivalsError> {
        let mut rng = SmallRng::seed_from_u64(seed);
        match *self {
            Self::Poisson { qps } => {
                let qps = self.checked(qps, "QPS", MIN_QPS, MAX_QPS)?;
                // Rate per ms; the range check above keeps it finite and positive.
                let exp = Exp::new(qps / 1000.0).map_err(|_| self.value("QPS", qps))?;
                self.accumulate(n, || exp.sample(&mut rng))
            }
            Self::Gamma { qps, cv } => {
                let qps = self.checked(qps, "QPS", MIN_QPS, MAX_QPS)?;
                let cv = self.checked(cv, "CV", MIN_CV, MAX_CV)?;
                // Gamma(shape k, scale θ) has mean kθ and CV 1/√k.
                let shape = 1.0 / (cv * cv);
                let scale = 1000.0 / qps / shape;
                let gamma = Gamma::new(shape, scale).map_err(|_| self.value("CV", cv))?;
                self.accumulate(n, || gamma.sample(&mut rng))
            }
        }
    }

    fn value(&self, what: &'static str, v: f64) -> ArrivalsError {
        let (min, max) = if what == "QPS" {
            (MIN_QPS, MAX_QPS)
        } else {
            (MIN_CV, MAX_CV)
        };
        ArrivalsError::Value {
            spec: self.to_string(),
            what,
            value: v.to_string(),
            min,
            max,
        }
    }

    fn checked(
        &self,
        v: f64,
        what: &'static str,
        min: f64,
        max: f64,
    ) -> Result<f64, ArrivalsError> {
        if v.is_finite() && (min..=max).contains(&v) {
            Ok(v)
        } else {
            Err(self.value(what, v))
        }
    }

    /// Sums `n - 1` drawn gaps into times, refusing any sum past [`MAX_ARRIVAL_MS`].
    fn accumulate(
        &self,
        n: usize,
        mut gap: impl FnMut() -> f64,
    ) -> Result<Vec<f64>, ArrivalsError> {
        let mut times = Vec::with_capacity(n);
        let mut t = 0.0_f64;
        for index in 0..n {
            if index > 0 {
                let g = gap();
                // A gap is finite and >= 0 by construction; a bad one is refused, not summed.
                t += if g.is_finite() && g > 0.0 { g } else { 0.0 };
            }
            if !(t.is_finite() && t <= MAX_ARRIVAL_MS) {
                return Err(ArrivalsError::TooLate {
                    spec: self.to_string(),
                    index,
                });
            }
            times.push(t);
        }
        Ok(times)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(times: &[f64]) -> Vec<f64> {
        times.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn mean_cv(v: &[f64]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn specs_parse_in_any_case_with_spaces() {
        assert_eq!(
            "poisson:4".parse::<Arrivals>().unwrap(),
            Arrivals::Poisson { qps: 4.0 }
        );
        assert_eq!(
            " Gamma : 0.5 : 2 ".parse::<Arrivals>().unwrap(),
            Arrivals::Gamma { qps: 0.5, cv: 2.0 }
        );
        assert_eq!(
            Arrivals::Gamma { qps: 0.5, cv: 2.0 }.to_string(),
            "gamma:0.5:2"
        );
    }

    #[test]
    fn bad_specs_are_refused_naming_the_value_and_range() {
        for (spec, what) in [
            ("poisson:0", "QPS"),
            ("poisson:-1", "QPS"),
            ("poisson:NaN", "QPS"),
            ("poisson:inf", "QPS"),
            ("poisson:1e400", "QPS"),
            ("poisson:2e6", "QPS"),
            ("poisson:four", "QPS"),
            ("gamma:4:0", "CV"),
            ("gamma:4:11", "CV"),
            ("gamma:4:-inf", "CV"),
        ] {
            match spec.parse::<Arrivals>() {
                Err(ArrivalsError::Value { what: w, .. }) => assert_eq!(w, what, "{spec}"),
                other => panic!("{spec}: {other:?}"),
            }
        }
        for spec in [
            "",
            "poisson",
            "poisson:1:2",
            "gamma:4",
            "uniform:4",
            "gamma:1:2:3",
        ] {
            assert!(
                matches!(spec.parse::<Arrivals>(), Err(ArrivalsError::Syntax { .. })),
                "{spec}"
            );
        }
        let msg = "poisson:0".parse::<Arrivals>().unwrap_err().to_string();
        assert_eq!(
            msg,
            "`--arrivals` \"poisson:0\": QPS must be a finite number in [0.001, 1000000], got \"0\""
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_times_and_another_seed_others() {
        for a in [
            Arrivals::Poisson { qps: 4.0 },
            Arrivals::Gamma { qps: 4.0, cv: 3.0 },
        ] {
            let t1 = a.times_ms(1000, 7).unwrap();
            assert_eq!(t1, a.times_ms(1000, 7).unwrap());
            assert_ne!(t1, a.times_ms(1000, 8).unwrap());
            assert_eq!(t1[0], 0.0);
            assert!(t1.windows(2).all(|w| w[0] <= w[1]));
            assert_eq!(a.times_ms(0, 7).unwrap(), Vec::<f64>::new());
        }
    }

    #[test]
    fn poisson_gaps_have_the_asked_rate_and_cv_one() {
        let t = Arrivals::Poisson { qps: 4.0 }
            .times_ms(200_001, 42)
            .unwrap();
        let (mean, cv) = mean_cv(&gaps(&t));
        // 250 ms mean gap; the standard error at 200k samples is ~0.2%.
        assert!((mean / 250.0 - 1.0).abs() < 0.02, "mean gap {mean}");
        assert!((cv - 1.0).abs() < 0.03, "cv {cv}");
    }

    #[test]
    fn gamma_gaps_have_the_asked_rate_and_cv() {
        for (qps, want_cv) in [(2.0, 0.5), (10.0, 2.0)] {
            let t = Arrivals::Gamma { qps, cv: want_cv }
                .times_ms(200_001, 3)
                .unwrap();
            let (mean, cv) = mean_cv(&gaps(&t));
            assert!(
                (mean / (1000.0 / qps) - 1.0).abs() < 0.02,
                "qps {qps}: mean gap {mean}"
            );
            assert!((cv / want_cv - 1.0).abs() < 0.05, "cv {cv} for {want_cv}");
        }
    }

    #[test]
    fn times_past_the_limit_are_refused_and_hand_built_values_checked() {
        // 1e-3 qps: a 1e6 ms mean gap; 2e6 requests would need ~2e12 ms.
        let err = Arrivals::Poisson { qps: MIN_QPS }
            .times_ms(2_000_000, 1)
            .unwrap_err();
        assert!(
            matches!(err, ArrivalsError::TooLate { index, .. } if index > 900_000),
            "{err:?}"
        );
        assert!(matches!(
            Arrivals::Poisson { qps: f64::NAN }.times_ms(3, 1),
            Err(ArrivalsError::Value { what: "QPS", .. })
        ));
        assert!(matches!(
            Arrivals::Gamma { qps: 1.0, cv: 0.0 }.times_ms(3, 1),
            Err(ArrivalsError::Value { what: "CV", .. })
        ));
    }
}
