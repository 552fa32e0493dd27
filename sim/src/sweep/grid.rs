//! The sweep's grid: its settings, token budgets (`512,1024,2048,off`) and time budgets
//! (`95,120` ms), × rate scales (`0.5,1,2,4`).

use std::num::NonZeroU32;

use mstar_chunking::budget::BudgetValue;

/// The largest token budget a sweep takes (2^24, the longest prompt a trace may have: a larger
/// budget never cuts anything).
pub const MAX_BUDGET_TOKENS: u32 = 1 << 24;
/// The lowest rate scale a sweep or a capacity search runs (arrivals 1024 times as sparse).
pub const MIN_RATE_SCALE: f64 = 1.0 / 1024.0;
/// The highest rate scale a sweep or a capacity search runs (arrivals 1024 times as dense).
pub const MAX_RATE_SCALE: f64 = 1024.0;
/// The most values one axis of the grid may have.
pub const MAX_AXIS_VALUES: usize = 64;

/// The largest time budget a sweep takes, ms (an hour: no step is planned that long).
pub const MAX_STEP_MS: f64 = 3_600_000.0;

/// One setting of the grid (`--budgets`), capacity-searched like any other: a token budget of
/// the replayed node's step walk (a count, or `off`: chunking off), or a time budget (`95ms`:
/// the node's `chunking.max_step_ms`, under the config's own token budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Budget {
    /// A token budget.
    Tokens(NonZeroU32),
    /// Chunking off.
    Off,
    /// A time budget.
    Time(StepMs),
}

/// A time budget of the grid in steps of 0.001 ms (the precision every output prints), so that
/// it compares, hashes and prints exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StepMs(NonZeroU32);

impl StepMs {
    /// `ms`, if it is finite, in `(0, MAX_STEP_MS]` and a multiple of 0.001.
    pub fn new(ms: f64) -> Option<Self> {
        if !(ms.is_finite() && ms > 0.0 && ms <= MAX_STEP_MS) {
            return None;
        }
        let thousandths = (ms * 1000.0).round();
        // Finer than 0.001 ms would print as another value than the one run.
        if (thousandths / 1000.0 - ms).abs() > ms * 1e-12 {
            return None;
        }
        NonZeroU32::new(thousandths as u32).map(Self)
    }

    /// The budget in ms.
    pub fn ms(self) -> f64 {
        f64::from(self.0.get()) / 1000.0
    }
}

impl std::fmt::Display for StepMs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ms", crate::text::fmt_rate(self.ms()))
    }
}

impl Budget {
    /// The token budget; `None` when chunking is off or the setting is a time budget.
    pub fn get(self) -> Option<u32> {
        match self {
            Self::Tokens(t) => Some(t.get()),
            Self::Off | Self::Time(_) => None,
        }
    }

    /// The token budget the setting puts over the config's (`replay --budget`); `None` for a
    /// time budget, which runs under the config's own.
    pub fn token_value(self) -> Option<BudgetValue> {
        match self {
            Self::Tokens(t) => Some(BudgetValue::Tokens(t)),
            Self::Off => Some(BudgetValue::Off),
            Self::Time(_) => None,
        }
    }

    /// The time budget, if the setting is one.
    pub fn time(self) -> Option<StepMs> {
        match self {
            Self::Time(t) => Some(t),
            _ => None,
        }
    }

    /// Whether the setting is a time budget.
    pub fn is_time(self) -> bool {
        matches!(self, Self::Time(_))
    }
}

impl From<BudgetValue> for Budget {
    fn from(v: BudgetValue) -> Self {
        match v {
            BudgetValue::Tokens(t) => Self::Tokens(t),
            BudgetValue::Off => Self::Off,
        }
    }
}

/// A token budget prints as the config writes it (`512`, `off`); a time budget as `95 ms`.
impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tokens(t) => write!(f, "{t}"),
            Self::Off => f.write_str("off"),
            Self::Time(ms) => ms.fmt(f),
        }
    }
}

/// What [`Budget`]'s `FromStr` refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetParseError {
    /// Not a token budget.
    #[error(transparent)]
    Tokens(#[from] mstar_chunking::budget::BudgetValueError),
    /// Not a time budget.
    #[error("expected a time budget in ms between 0.001 and {MAX_STEP_MS}, in steps of 0.001, got {0:?}")]
    Time(String),
}

/// The forms [`Budget`]'s `Display` prints: a token budget as the config writes it, or a time
/// budget ending in `ms` (`95 ms`, `95ms`).
impl std::str::FromStr for Budget {
    type Err = BudgetParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().strip_suffix("ms") {
            Some(ms) => parse_step_ms(ms).ok_or_else(|| BudgetParseError::Time(s.trim().into())),
            None => Ok(s.parse::<BudgetValue>()?.into()),
        }
    }
}

/// A time budget written in ms (`95`, `95.5`), if it is one the grid takes.
fn parse_step_ms(s: &str) -> Option<Budget> {
    let t = s.trim();
    // Decimal digits and one point only: `1e2`, `inf` and `0x10` are refused, not guessed at.
    if t.is_empty() || t.len() > 24 || !t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return None;
    }
    t.parse::<f64>()
        .ok()
        .and_then(StepMs::new)
        .map(Budget::Time)
}

/// Serialised as its number of tokens, the string `"off"`, or the string `"95 ms"`.
impl serde::Serialize for Budget {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Tokens(n) => s.serialize_u32(n.get()),
            Self::Off => s.serialize_str("off"),
            Self::Time(_) => s.collect_str(self),
        }
    }
}

/// Why a grid axis was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{flag}` {problem}")]
pub struct GridError {
    /// `--budgets` or `--rates`.
    pub flag: &'static str,
    /// What was wrong, with the value.
    pub problem: String,
}

/// A grid budget: a token budget of at most [`MAX_BUDGET_TOKENS`] (a larger budget never cuts
/// anything: no trace prompt is longer), `off`, or a time budget ending in `ms`.
fn grid_budget(s: &str) -> Result<Budget, GridError> {
    if let Some(ms) = s.trim().strip_suffix("ms") {
        return parse_step_ms(ms).ok_or_else(|| GridError {
            flag: "--budgets",
            problem: format!(
                "takes time budgets in ms between 0.001 and {MAX_STEP_MS}, in steps of 0.001 (`95ms`), got {}",
                quoted(s.trim())
            ),
        });
    }
    s.parse::<BudgetValue>()
        .ok()
        .map(Budget::from)
        .filter(|b| b.get().is_none_or(|n| n <= MAX_BUDGET_TOKENS))
        .ok_or_else(|| GridError {
            flag: "--budgets",
            problem: format!(
                "takes whole numbers of tokens between 1 and {MAX_BUDGET_TOKENS}, `off`, or time budgets such as `95ms`; got {:?}",
                s.trim()
            ),
        })
}

/// `s` quoted, cut to 200 characters (a value may be anything, of any length).
fn quoted(s: &str) -> String {
    let cut: String = s.chars().take(200).collect();
    let more = if cut.len() < s.len() { "…" } else { "" };
    format!("{cut:?}{more}")
}

/// Splits an axis's comma-separated list, refusing empty entries and more than
/// [`MAX_AXIS_VALUES`].
pub(crate) fn split<'a>(flag: &'static str, list: &'a str) -> Result<Vec<&'a str>, GridError> {
    let items: Vec<&str> = list.split(',').map(str::trim).collect();
    if items.iter().any(|i| i.is_empty()) {
        return Err(GridError {
            flag,
            problem: format!("takes a comma-separated list without empty entries, got {list:?}"),
        });
    }
    if items.len() > MAX_AXIS_VALUES {
        return Err(GridError {
            flag,
            problem: format!(
                "takes at most {MAX_AXIS_VALUES} values, got {}",
                items.len()
            ),
        });
    }
    Ok(items)
}

/// Parses `--budgets`: a comma-separated list of token budgets, `off` and time budgets (`95ms`),
/// kept in the order given, each at most once.
///
/// # Errors
/// An empty entry, a bad value, a repeated value, or more than [`MAX_AXIS_VALUES`].
pub fn parse_budgets(list: &str) -> Result<Vec<Budget>, GridError> {
    let mut out: Vec<Budget> = Vec::new();
    for item in split("--budgets", list)? {
        let b = grid_budget(item)?;
        if out.contains(&b) {
            return Err(GridError {
                flag: "--budgets",
                problem: format!("names {b} twice"),
            });
        }
        out.push(b);
    }
    Ok(out)
}

/// Parses `--rates`: a comma-separated list of rate scales in
/// `[MIN_RATE_SCALE, MAX_RATE_SCALE]` and in steps of 0.001 (the precision every output prints,
/// so that no two cells print the same rate and a printed rate replays as run), each at most
/// once, returned in ascending order.
///
/// # Errors
/// An empty entry, a value that is not a finite number in range or not a multiple of 0.001, a
/// repeated value, or more than [`MAX_AXIS_VALUES`].
pub fn parse_rates(list: &str) -> Result<Vec<f64>, GridError> {
    let mut out: Vec<f64> = Vec::new();
    for item in split("--rates", list)? {
        let r = item
            .parse::<f64>()
            .ok()
            .filter(|r| r.is_finite() && (MIN_RATE_SCALE..=MAX_RATE_SCALE).contains(r))
            .ok_or_else(|| GridError {
                flag: "--rates",
                problem: format!(
                    "takes rate scales between 1/1024 and 1024 (1 = the trace's own rate), got {item:?}"
                ),
            })?;
        // Every output prints a rate to 0.001: a finer one would print as another, and the
        // printed figure would not replay the cell that was run.
        if crate::text::round3(r) != r {
            return Err(GridError {
                flag: "--rates",
                problem: format!(
                    "takes rate scales in steps of 0.001, as every output prints them, got {item:?} (give {})",
                    crate::text::fmt_rate(r)
                ),
            });
        }
        if out.contains(&r) {
            return Err(GridError {
                flag: "--rates",
                problem: format!("names {r} twice"),
            });
        }
        out.push(r);
    }
    out.sort_by(f64::total_cmp);
    Ok(out)
}

/// Asserts that `parse` refuses each list of `cases` with an error that names `flag` first and
/// says the case's words.
#[cfg(test)]
pub(crate) fn assert_refused<T: std::fmt::Debug>(
    flag: &str,
    parse: impl Fn(&str) -> Result<T, GridError>,
    cases: &[(&str, &str)],
) {
    for (list, words) in cases {
        let e = parse(list).unwrap_err().to_string();
        assert!(e.starts_with(&format!("`{flag}` ")), "{list}: {e}");
        assert!(e.contains(words), "{list}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_in_order_with_off() {
        let b = parse_budgets(" 512,1024 , OFF,2048").unwrap();
        assert_eq!(
            b.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["512", "1024", "off", "2048"]
        );
        assert_eq!(b[0].get(), Some(512));
        assert_eq!(b[2].get(), None);
        assert_eq!(
            serde_json::to_string(&b).unwrap(),
            r#"[512,1024,"off",2048]"#
        );
    }

    #[test]
    fn bad_budgets_are_refused_with_the_value() {
        let cases = [
            ("0", "got \"0\""),
            ("-5", "got \"-5\""),
            ("16777217", "between 1 and 16777216"),
            ("512,,1024", "without empty entries"),
            ("", "without empty entries"),
            ("512,512", "names 512 twice"),
            ("off,Off", "names off twice"),
            ("1.5", "got \"1.5\""),
        ];
        assert_refused("--budgets", parse_budgets, &cases);
        let many = (1..=65)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",");
        assert!(parse_budgets(&many)
            .unwrap_err()
            .to_string()
            .contains("at most 64 values"));
    }

    #[test]
    fn time_budgets_parse_in_order_print_and_read_back() {
        let b = parse_budgets("95ms, 120.5 ms,0.001ms").unwrap();
        let shown: Vec<String> = b.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["95 ms", "120.5 ms", "0.001 ms"]);
        assert_eq!(
            serde_json::to_string(&b).unwrap(),
            r#"["95 ms","120.5 ms","0.001 ms"]"#
        );
        for (b, s) in b.iter().zip(&shown) {
            assert_eq!(s.parse::<Budget>().unwrap(), *b);
            assert_eq!(s.replace(' ', "").parse::<Budget>().unwrap(), *b);
            assert!(b.is_time() && b.get().is_none() && b.token_value().is_none());
        }
        assert_eq!(b[0].time().unwrap().ms(), 95.0);
        // A token budget reads back as one; a time budget is never a token budget.
        assert_eq!("512".parse::<Budget>().unwrap().get(), Some(512));
        assert_eq!("off".parse::<Budget>().unwrap(), Budget::Off);
        assert_ne!("95".parse::<Budget>().unwrap(), b[0]);
        assert_eq!(Budget::Off.token_value(), Some(BudgetValue::Off));
        assert!(!Budget::Off.is_time() && Budget::Off.time().is_none());
    }

    #[test]
    fn bad_time_budgets_are_refused_with_the_value() {
        let cases = [
            ("0ms", "got \"0ms\""),
            ("-5ms", "got \"-5ms\""),
            ("nanms", "got \"nanms\""),
            ("inf ms", "got \"inf ms\""),
            ("1e2ms", "got \"1e2ms\""),
            ("95.0001ms", "in steps of 0.001"),
            ("3600000.001ms", "got \"3600000.001ms\""),
            ("95ms,95.0ms", "names 95 ms twice"),
            ("95s", "or time budgets such as `95ms`; got \"95s\""),
        ];
        assert_refused("--budgets", parse_budgets, &cases);
        let long = format!("{}ms", "9".repeat(5000));
        let e = parse_budgets(&long).unwrap_err().to_string();
        assert!(e.len() < 400 && e.ends_with("…"), "{e}");
        assert!(parse_budgets("3600000ms,512,95ms,off").is_ok());
        for bad in ["0 ms", "-1ms", "nanms", "ms", "1.2.3 ms"] {
            assert!(bad.parse::<Budget>().is_err(), "{bad}");
        }
    }

    #[test]
    fn rates_parse_sorted_and_bad_ones_are_refused() {
        assert_eq!(parse_rates("4, 0.5,1,2").unwrap(), [0.5, 1.0, 2.0, 4.0]);
        for list in [
            "0", "-1", "NaN", "inf", "1e400", "2000", "0.0001", "x", "1,1.0",
        ] {
            let e = parse_rates(list).unwrap_err();
            assert_eq!(e.flag, "--rates", "{list}");
        }
    }

    #[test]
    fn rates_finer_than_the_printed_precision_are_refused() {
        // 1 and 1.0004 would both print as 1; 1/1024 prints as 0.001 but runs 0.0009765625.
        for (list, shown) in [
            ("1,1.0004", "\"1.0004\" (give 1)"),
            ("0.0009765625", "(give 0.001)"),
            ("2.1534", "(give 2.153)"),
        ] {
            let e = parse_rates(list).unwrap_err().to_string();
            assert!(
                e.contains("in steps of 0.001") && e.contains(shown),
                "{list}: {e}"
            );
        }
        assert_eq!(
            parse_rates("0.001,0.1,0.3,1.234,1024").unwrap(),
            [0.001, 0.1, 0.3, 1.234, 1024.0]
        );
    }
}
