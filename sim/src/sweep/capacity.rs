//! Capacity under a latency objective (see `docs/sweep.md#capacity-under-an-slo`): the highest
//! rate scale at which a budget still meets the SLO, found by bracketing and bisection.
//!
//! The search assumes that latency grows with load: a rate that misses the SLO is never followed
//! by a higher one that meets it. Starting from what the grid already measured, it doubles (or
//! halves) the rate until one meets and one misses, then bisects geometrically until the two are
//! within [`TOLERANCE`] of each other, and answers the one that meets.
//!
//! When the grid itself contradicts that assumption (a rate misses while a higher one meets),
//! the search says so ([`Search::non_monotone`]) and never answers a rate above a miss: it
//! brackets below the lowest miss the grid measured, so the capacity is the highest rate below
//! the first miss.

use serde::Serialize;

use super::grid::{MAX_RATE_SCALE, MIN_RATE_SCALE};
use super::{RunSummary, SweepError};

/// The relative precision of a capacity: the rate that misses is at most this much above it
/// (or 0.001 above it, below a rate of 0.05, since probes are multiples of 0.001).
pub const TOLERANCE: f64 = 0.02;
/// The lowest rate scale a search probes. Probes are made at multiples of 0.001, the precision
/// every output gives a rate scale in, so that a capacity printed can be replayed as printed.
pub const MIN_PROBE: f64 = 0.001;

/// A probe's rate: `r` rounded to 0.001.
fn snap(r: f64) -> f64 {
    crate::text::round3(r)
}

/// The most probes one search runs (the bracket needs at most 11 doublings and the bisection at
/// most 6 halvings at [`TOLERANCE`]; the limit only guards the loop).
pub const MAX_PROBES: usize = 64;

/// A latency objective: a bound on TBT p99 and/or on TTFT p90, in simulated ms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    /// The highest acceptable p99 time between tokens.
    pub tbt_p99_ms: Option<f64>,
    /// The highest acceptable p90 time to first token.
    pub ttft_p90_ms: Option<f64>,
}

/// The SLO as a sentence: `TBT p99 <= 60 ms and TTFT p90 <= 5000 ms`.
pub fn slo_text(slo: &Slo) -> String {
    let mut parts = Vec::new();
    if let Some(t) = slo.tbt_p99_ms {
        parts.push(format!("TBT p99 <= {t} ms"));
    }
    if let Some(t) = slo.ttft_p90_ms {
        parts.push(format!("TTFT p90 <= {t} ms"));
    }
    parts.join(" and ")
}

impl Slo {
    /// Checks the bounds: each given one a finite number > 0, and at least one given.
    ///
    /// # Errors
    /// [`SweepError::Slo`] naming the flag and the value.
    pub fn new(tbt_p99_ms: Option<f64>, ttft_p90_ms: Option<f64>) -> Result<Self, SweepError> {
        for (flag, v) in [
            ("--slo-tbt-p99", tbt_p99_ms),
            ("--slo-ttft-p90", ttft_p90_ms),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    return Err(SweepError::Slo(format!(
                        "`{flag}` must be a finite number of ms > 0, got {v}"
                    )));
                }
            }
        }
        if tbt_p99_ms.is_none() && ttft_p90_ms.is_none() {
            return Err(SweepError::Slo(
                "an SLO needs `--slo-tbt-p99` or `--slo-ttft-p90` (or both)".into(),
            ));
        }
        Ok(Self {
            tbt_p99_ms,
            ttft_p90_ms,
        })
    }

    /// Whether a run meets every given bound. A run without TTFT samples (no request) meets no
    /// TTFT bound; a run without TBT samples (every request generated one token) meets any TBT
    /// bound, since no token waited after a first one.
    pub fn meets(&self, s: &RunSummary) -> bool {
        let tbt_ok = match (self.tbt_p99_ms, s.tbt_p99_ms) {
            (None, _) | (Some(_), None) => true,
            (Some(bound), Some(v)) => v <= bound,
        };
        let ttft_ok = match (self.ttft_p90_ms, s.ttft_p90_ms) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(bound), Some(v)) => v <= bound,
        };
        tbt_ok && ttft_ok
    }
}

/// Where a search ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// The capacity was bracketed and bisected to [`TOLERANCE`].
    Found,
    /// Even [`MAX_RATE_SCALE`] meets the SLO: the capacity is at least that.
    AtLeastMax,
    /// Even [`MIN_RATE_SCALE`] misses the SLO: no capacity.
    BelowMin,
}

/// One run of a search: a rate scale and whether it met the SLO.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Probe {
    /// The rate scale run.
    #[serde(serialize_with = "crate::text::ser_round")]
    pub rate_scale: f64,
    /// Whether it met the SLO.
    pub meets: bool,
}

/// Two grid rates of one budget that contradict rising latency: the lower misses the SLO while
/// the higher meets it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct NonMonotone {
    /// The lowest rate the grid measured to miss the SLO.
    #[serde(serialize_with = "crate::text::ser_round")]
    pub misses_at: f64,
    /// The highest rate above it that meets the SLO.
    #[serde(serialize_with = "crate::text::ser_round")]
    pub meets_at: f64,
}

/// The answer of one search.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Search {
    /// The highest rate scale found to meet the SLO (`None` when none does).
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub rate_scale: Option<f64>,
    /// The lowest rate scale found to miss it (`None` when none does).
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub misses_at: Option<f64>,
    /// How the search ended.
    pub bound: Bound,
    /// The runs the search made itself, in order (the grid's own are not repeated).
    pub probes: Vec<Probe>,
    /// Set when the grid contradicts rising latency; the capacity is then below its first miss.
    pub non_monotone: Option<NonMonotone>,
}

/// Searches the highest rate scale for which `meets` holds, to [`TOLERANCE`].
///
/// `known` holds rates already measured (rate, met), e.g. the grid's cells for one budget;
/// `meets` runs a new rate. Rates stay within `[MIN_RATE_SCALE, MAX_RATE_SCALE]`.
///
/// # Errors
/// The first error `meets` returns.
pub fn search<E>(
    known: &[(f64, bool)],
    mut meets: impl FnMut(f64) -> Result<bool, E>,
) -> Result<Search, E> {
    let usable = |r: &f64| r.is_finite() && (MIN_RATE_SCALE..=MAX_RATE_SCALE).contains(r);
    // The first miss, and the highest meet below it: never a rate above a miss.
    let mut hi: Option<f64> = known
        .iter()
        .filter(|(r, m)| !*m && usable(r))
        .map(|(r, _)| *r)
        .min_by(f64::total_cmp);
    let mut lo: Option<f64> = known
        .iter()
        .filter(|(r, m)| *m && usable(r) && hi.is_none_or_above(*r))
        .map(|(r, _)| *r)
        .max_by(f64::total_cmp);
    let non_monotone = hi.and_then(|h| {
        known
            .iter()
            .filter(|(r, m)| *m && usable(r) && *r > h)
            .map(|(r, _)| *r)
            .max_by(f64::total_cmp)
            .map(|meets_at| NonMonotone {
                misses_at: h,
                meets_at,
            })
    });
    let mut probes = Vec::new();
    let mut probe = |r: f64, probes: &mut Vec<Probe>| -> Result<bool, E> {
        let m = meets(r)?;
        probes.push(Probe {
            rate_scale: r,
            meets: m,
        });
        Ok(m)
    };
    // Bracket: double up from a meet, or halve down from a miss.
    loop {
        if probes.len() >= MAX_PROBES {
            break;
        }
        let r = match (lo, hi) {
            (Some(_), Some(_)) => break,
            (Some(l), None) if l >= MAX_RATE_SCALE => {
                return Ok(Search {
                    rate_scale: Some(l),
                    misses_at: None,
                    bound: Bound::AtLeastMax,
                    probes,
                    non_monotone,
                })
            }
            (None, Some(h)) if h <= MIN_PROBE.max(MIN_RATE_SCALE) => {
                return Ok(Search {
                    rate_scale: None,
                    misses_at: Some(h),
                    bound: Bound::BelowMin,
                    probes,
                    non_monotone,
                })
            }
            (Some(l), None) => snap(l * 2.0).min(MAX_RATE_SCALE),
            (None, Some(h)) => snap(h / 2.0).max(MIN_PROBE),
            (None, None) => 1.0,
        };
        if probe(r, &mut probes)? {
            lo = Some(r);
        } else {
            hi = Some(r);
        }
    }
    // Bisect geometrically: rates are ratios, so the midpoint of 1 and 4 is 2.
    while let (Some(l), Some(h)) = (lo, hi) {
        if h <= l * (1.0 + TOLERANCE) || probes.len() >= MAX_PROBES {
            break;
        }
        let mid = snap((l * h).sqrt());
        // Below 0.05 two multiples of 0.001 can be more than 2% apart: the bracket is as
        // narrow as the probes' precision allows.
        if mid <= l || mid >= h {
            break;
        }
        if probe(mid, &mut probes)? {
            lo = Some(mid);
        } else {
            hi = Some(mid);
        }
    }
    Ok(Search {
        rate_scale: lo,
        misses_at: hi,
        bound: if lo.is_some() {
            Bound::Found
        } else {
            Bound::BelowMin
        },
        probes,
        non_monotone,
    })
}

/// `None` or a value above `r`.
trait NoneOrAbove {
    fn is_none_or_above(&self, r: f64) -> bool;
}

impl NoneOrAbove for Option<f64> {
    fn is_none_or_above(&self, r: f64) -> bool {
        match self {
            None => true,
            Some(h) => *h > r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic SLO: met exactly up to `capacity`.
    fn up_to(capacity: f64) -> impl FnMut(f64) -> Result<bool, ()> {
        move |r| Ok(r <= capacity)
    }

    fn check(capacity: f64, known: &[(f64, bool)]) -> Search {
        let s = search(known, up_to(capacity)).unwrap();
        assert_eq!(s.bound, Bound::Found, "{capacity}: {s:?}");
        let (lo, hi) = (s.rate_scale.unwrap(), s.misses_at.unwrap());
        assert!(lo <= capacity && capacity < hi, "{capacity}: {lo}..{hi}");
        // 2%, or one step of 0.001 where 2% is less than that.
        assert!(
            hi <= lo * (1.0 + TOLERANCE) || (hi - lo - MIN_PROBE).abs() < 1e-12,
            "{capacity}: {lo}..{hi}"
        );
        for p in &s.probes {
            let thousandths = p.rate_scale * 1000.0;
            assert!(
                (thousandths - thousandths.round()).abs() < 1e-9,
                "{capacity}: probe {} is not a multiple of 0.001",
                p.rate_scale
            );
        }
        assert!(
            s.probes.len() <= 20,
            "{capacity}: {} probes",
            s.probes.len()
        );
        s
    }

    #[test]
    fn bisection_finds_a_monotone_capacity_to_two_percent() {
        for capacity in [0.003, 0.3, 1.0, 1.7, 3.3, 100.0, 1000.0] {
            check(capacity, &[]);
            check(capacity, &[(0.5, 0.5 <= capacity), (2.0, 2.0 <= capacity)]);
        }
    }

    #[test]
    fn the_grid_brackets_the_search_so_it_only_bisects() {
        // 1 meets, 2 misses: no bracketing probe, and every probe lies between them.
        let s = check(1.5, &[(0.5, true), (1.0, true), (2.0, false), (4.0, false)]);
        assert!(s
            .probes
            .iter()
            .all(|p| p.rate_scale > 1.0 && p.rate_scale < 2.0));
        // ceil(log2(ln 2 / ln 1.02)) = 6 halvings of the log-interval.
        assert_eq!(s.probes.len(), 6);
    }

    #[test]
    fn a_grid_that_contradicts_rising_latency_is_told_and_never_answers_above_a_miss() {
        // The grid: 1 misses, 2 meets (a fluke of the trace), 4 misses. The true boundary the
        // search can trust is below 1.
        let grid = [(0.5, true), (1.0, false), (2.0, true), (4.0, false)];
        let s = search(&grid, |r| Ok::<_, ()>(r <= 0.7 || (1.9..=2.1).contains(&r))).unwrap();
        assert_eq!(
            s.non_monotone,
            Some(NonMonotone {
                misses_at: 1.0,
                meets_at: 2.0
            })
        );
        assert_eq!(s.bound, Bound::Found);
        let (lo, hi) = (s.rate_scale.unwrap(), s.misses_at.unwrap());
        assert!(lo < 1.0 && hi <= 1.0, "{lo}..{hi}");
        assert!((0.7 / 1.02..=0.7).contains(&lo), "{lo}");
        assert!(
            s.probes.iter().all(|p| p.rate_scale < 1.0),
            "{:?}",
            s.probes
        );
        // Every miss below every meet: no first meet below it either, so it halves down.
        let s = search(&[(1.0, false), (2.0, true)], |r| Ok::<_, ()>(r <= 0.25)).unwrap();
        assert!(s.non_monotone.is_some());
        assert!(s.rate_scale.unwrap() <= 0.25, "{s:?}");
        // A monotone grid says nothing.
        let s = search(&[(0.5, true), (1.0, false)], up_to(0.7)).unwrap();
        assert_eq!(s.non_monotone, None);
    }

    #[test]
    fn no_capacity_and_capacity_beyond_the_range_are_told_apart() {
        let none = search(&[], up_to(0.0)).unwrap();
        assert_eq!((none.bound, none.rate_scale), (Bound::BelowMin, None));
        assert_eq!(none.misses_at, Some(MIN_PROBE));
        assert_eq!(none.probes.last().map(|p| p.rate_scale), Some(MIN_PROBE));
        assert!(none.probes.len() <= 11, "{none:?}");
        let all = search(&[], up_to(f64::INFINITY)).unwrap();
        assert_eq!(
            (all.bound, all.rate_scale),
            (Bound::AtLeastMax, Some(MAX_RATE_SCALE))
        );
        // Out-of-range or non-finite known rates are ignored.
        let s = search(&[(f64::NAN, true), (1e9, false)], up_to(2.0)).unwrap();
        assert_eq!(s.probes[0].rate_scale, 1.0);
    }

    #[test]
    fn an_error_stops_the_search() {
        let mut calls = 0;
        let r = search(&[], |rate| {
            calls += 1;
            if rate > 2.0 {
                Err(format!("replay at {rate} failed"))
            } else {
                Ok(true)
            }
        });
        assert_eq!(r.unwrap_err(), "replay at 4 failed");
        assert_eq!(calls, 3);
    }

    fn summary(tbt: Option<f64>, ttft: Option<f64>) -> RunSummary {
        RunSummary {
            tbt_p99_ms: tbt,
            ttft_p90_ms: ttft,
            ..RunSummary::default()
        }
    }

    #[test]
    fn the_slo_checks_each_bound_given() {
        let slo = Slo::new(Some(60.0), Some(5000.0)).unwrap();
        assert!(slo.meets(&summary(Some(60.0), Some(5000.0))));
        assert!(!slo.meets(&summary(Some(60.001), Some(10.0))));
        assert!(!slo.meets(&summary(Some(1.0), Some(5000.5))));
        assert!(slo.meets(&summary(None, Some(1.0))));
        assert!(!slo.meets(&summary(Some(1.0), None)));
        let tbt_only = Slo::new(Some(60.0), None).unwrap();
        assert!(tbt_only.meets(&summary(Some(1.0), Some(1e9))));
        for (a, b) in [
            (None, None),
            (Some(0.0), None),
            (Some(f64::NAN), None),
            (None, Some(-1.0)),
            (Some(1.0), Some(f64::INFINITY)),
        ] {
            assert!(
                matches!(Slo::new(a, b), Err(SweepError::Slo(_))),
                "{a:?} {b:?}"
            );
        }
    }
}
