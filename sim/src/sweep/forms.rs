//! The plain forms every output of a sweep shares: a terminal table, a CSV table, text escaped
//! for HTML. A module of its own below the outputs (`output.rs`, `html.rs`, `verdict.rs`, the
//! axes), so that none of them imports another for them.

use std::fmt::Write as _;

/// Renders a terminal table, `header` then `rows`, each column right-aligned to its widest
/// cell, two spaces apart.
pub(crate) fn render(out: &mut String, (header, rows): (Vec<&str>, Vec<Vec<String>>)) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (w, v) in widths.iter_mut().zip(r) {
            *w = (*w).max(v.chars().count());
        }
    }
    let line = |out: &mut String, cells: Vec<&str>| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:>w$}"))
            .collect();
        let _ = writeln!(out, "  {}", text.join("  ").trim_end());
    };
    line(out, header.clone());
    for r in &rows {
        line(out, r.iter().map(String::as_str).collect());
    }
}

/// A comparison's CSV file: `header`, then each row.
///
/// # Errors
/// None in practice (written to memory).
pub fn csv_table(
    header: &[&str],
    rows: impl IntoIterator<Item = Vec<String>>,
) -> Result<Vec<u8>, csv::Error> {
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record(header)?;
    for row in rows {
        w.write_record(&row)?;
    }
    w.into_inner().map_err(|e| csv::Error::from(e.into_error()))
}

/// Escapes text for HTML.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}
