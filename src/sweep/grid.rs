//! The sweep's grid: token budgets (`512,1024,2048,off`) × rate scales (`0.5,1,2,4`).

/// The largest token budget a sweep takes (2^24, the longest prompt a trace may have: a larger
/// budget never cuts anything).
pub const MAX_BUDGET_TOKENS: u32 = 1 << 24;
/// The lowest rate scale a sweep or a capacity search runs (arrivals 1024 times as sparse).
pub const MIN_RATE_SCALE: f64 = 1.0 / 1024.0;
/// The highest rate scale a sweep or a capacity search runs (arrivals 1024 times as dense).
pub const MAX_RATE_SCALE: f64 = 1024.0;
/// The most values one axis of the grid may have.
pub const MAX_AXIS_VALUES: usize = 64;

/// One budget of the grid: the core's budget value (a token budget for the replayed node/walk,
/// or chunking off), parsed by its own `FromStr`.
pub use crate::budget::BudgetValue as Budget;

/// Why a grid axis was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{flag}` {problem}")]
pub struct GridError {
    /// `--budgets` or `--rates`.
    pub flag: &'static str,
    /// What was wrong, with the value.
    pub problem: String,
}

/// A grid budget: a budget value of at most [`MAX_BUDGET_TOKENS`] (a larger budget never cuts
/// anything: no trace prompt is longer).
fn grid_budget(s: &str) -> Result<Budget, GridError> {
    s.parse::<Budget>()
        .ok()
        .filter(|b| b.get().is_none_or(|n| n <= MAX_BUDGET_TOKENS))
        .ok_or_else(|| GridError {
            flag: "--budgets",
            problem: format!(
                "takes whole numbers of tokens between 1 and {MAX_BUDGET_TOKENS}, or `off`; got {:?}",
                s.trim()
            ),
        })
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

/// Parses `--budgets`: a comma-separated list of token budgets and `off`, kept in the order
/// given, each at most once.
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
