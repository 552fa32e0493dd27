//! How numbers and counts read in the crate's messages, tables, plots and JSON files, in one
//! place so that every report says `2.5` and `1 token` the same way.

/// `n thing` or `n things`: "1 token", "2 tokens".
pub fn plural(n: u64, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

/// Rounds to 0.001, the precision a simulated ms (or a rate scale) means.
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Serialises a float rounded to 0.001 ([`round3`]; a non-finite one as null).
pub(crate) fn ser_round<S: serde::Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    if x.is_finite() {
        s.serialize_f64(round3(*x))
    } else {
        s.serialize_none()
    }
}

/// [`ser_round`] for an optional float.
pub(crate) fn ser_opt_round<S: serde::Serializer>(
    x: &Option<f64>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match x {
        Some(x) => ser_round(x, s),
        None => s.serialize_none(),
    }
}

/// [`ser_round`] for every float of a list (the sweep's step-time percentiles).
pub(crate) fn ser_vec_round<S: serde::Serializer>(v: &[f64], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|x| x.is_finite().then(|| round3(*x))))
}

/// A rate scale for people: at most 3 decimals, no trailing zeros (`0.5`, `2.153`, `1024`).
pub fn fmt_rate(r: f64) -> String {
    let s = format!("{:.3}", round3(r));
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_owned()
}

/// `x` in positional notation (never an exponent), to 6 significant digits, trailing zeros
/// dropped: `3.4e-6` prints `0.0000034`, `56.4512` prints `56.4512`.
pub fn plain_decimal(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let magnitude = x.abs().log10().floor();
    // Digits after the point for 6 significant ones; within 0..=340 for any finite f64.
    let decimals = (5.0 - magnitude).clamp(0.0, 340.0) as usize;
    let text = format!("{x:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    }
}

/// A coefficient to 4 significant digits, with no trailing zeros: `8`, `0.02`, `0.01235`,
/// `6.104e-5`. The summary's cost and latency-model lines both print coefficients this way.
pub fn coefficient(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let magnitude = x.abs().log10().floor();
    if (-3.0..6.0).contains(&magnitude) {
        // Digits after the point for 4 significant ones; the cast is within 0..=6.
        let decimals = (3.0 - magnitude).max(0.0) as usize;
        let text = format!("{x:.decimals$}");
        match text.contains('.') {
            true => text.trim_end_matches('0').trim_end_matches('.').to_owned(),
            false => text,
        }
    } else {
        let text = format!("{x:.3e}");
        let (mantissa, exponent) = text.split_once('e').unwrap_or((&text, "0"));
        let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
        format!("{mantissa}e{exponent}")
    }
}

/// A value in ms on a plot's axis: whole numbers without decimals, small ones with what they
/// need (`120`, `2.5`, `0.05`).
pub fn fmt_ms(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// A number as a user would write it: exponent notation when very large or small.
pub(crate) fn float(v: f64) -> String {
    let a = v.abs();
    if a.is_finite() && a != 0.0 && !(1e-6..1e16).contains(&a) {
        format!("{v:e}")
    } else {
        v.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plurals_are_english() {
        assert_eq!(plural(1, "node"), "1 node");
        assert_eq!(plural(0, "token"), "0 tokens");
        assert_eq!(plural(2, "row-step"), "2 row-steps");
    }
}
