//! `report.html`: the sweep in one self-contained page (plots inline as SVG, tables, settings,
//! and how to read each plot), readable in a browser without the terminal. It loads nothing:
//! no script, stylesheet, font or image from anywhere.

use std::fmt::Write as _;

use super::capacity::slo_text;
use super::capacity::TOLERANCE;
pub use super::forms::escape;
use super::plots::{Plot, HEIGHT, WIDTH};
use super::tables::{budget_list, capacity_table, cell_table, notes, replays};
use super::Sweep;
use crate::text::fmt_rate;

const STYLE: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1040px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}\
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}\
table{border-collapse:collapse;margin:1em 0;font-size:.9em}th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}\
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}\
.plot svg{max-width:100%;height:auto;border:1px solid #eee}.read{background:#f8f8f0;border-left:4px solid #cc9;padding:.5em 1em}\
td.meets{color:#060}td.misses{color:#a00}.warn{background:#fdecea;border-left:4px solid #a00;padding:.5em 1em}code{background:#f4f4f4;padding:0 .2em}";

fn table(out: &mut String, (header, rows): (Vec<&str>, Vec<Vec<String>>)) {
    out.push_str("<table>\n<tr>");
    for h in header {
        let _ = write!(out, "<th>{}</th>", escape(h));
    }
    out.push_str("</tr>\n");
    for r in rows {
        out.push_str("<tr>");
        for v in r {
            let class = match v.as_str() {
                "meets" => " class=\"meets\"",
                "misses" => " class=\"misses\"",
                _ => "",
            };
            let _ = write!(out, "<td{class}>{}</td>", escape(&v));
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</table>\n");
}

/// The plot's SVG, made to scale with the page (a `viewBox`, so CSS can resize it).
fn inline_svg(p: &Plot) -> String {
    let svg = p.svg.trim_start();
    let svg = svg
        .find("<svg")
        .map_or(svg, |i| svg.get(i..).unwrap_or(svg));
    match svg.strip_prefix("<svg") {
        Some(rest) => format!(
            "<svg viewBox=\"0 0 {WIDTH} {HEIGHT}\" role=\"img\" aria-label=\"{}\"{rest}",
            escape(&p.title)
        ),
        None => String::new(),
    }
}

fn plot(out: &mut String, plots: &[Plot], name: &str, read: &str) {
    let Some(p) = plots.iter().find(|p| p.name == name) else {
        return;
    };
    let _ = write!(
        out,
        "<figure class=\"plot\">{}<figcaption>{} (also <code>{name}.svg</code>, <code>{name}.png</code>)</figcaption></figure>\n<div class=\"read\"><p><strong>How to read this:</strong> {read}</p></div>\n",
        inline_svg(p),
        escape(&p.title)
    );
}

/// The whole page for `sweep` with its drawn `plots`.
pub fn report(sweep: &Sweep, plots: &[Plot]) -> String {
    let mut out = String::new();
    let rates: Vec<String> = sweep
        .rates
        .iter()
        .map(|r| format!("{}x", fmt_rate(*r)))
        .collect();
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>mstar-chunking sweep</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<h1>Chunking sweep: {}</h1>\n<p>Every token budget ({}) was replayed at every rate scale ({}) on a simulated clock. A rate scale of 2x makes requests arrive twice as densely as the trace's own arrivals; all times are simulated milliseconds. Made by mstar-chunking {}.</p>\n",
        replays(sweep),
        escape(&budget_list(sweep)),
        escape(&rates.join(", ")),
        escape(sweep.version),
    );

    for n in notes(sweep) {
        let _ = writeln!(
            out,
            "<p class=\"warn\"><strong>Warning:</strong> {}</p>",
            escape(&n)
        );
    }

    out.push_str("<h2>Settings</h2>\n<table>\n");
    let mut settings: Vec<(String, String)> = sweep.settings.clone();
    settings.push(("budgets".into(), budget_list(sweep)));
    settings.push(("rate scales".into(), rates.join(", ")));
    settings.push((
        "SLO".into(),
        sweep.slo.as_ref().map_or_else(|| "none".into(), slo_text),
    ));
    for (k, v) in &settings {
        let _ = writeln!(out, "<tr><th>{}</th><td>{}</td></tr>", escape(k), escape(v));
    }
    out.push_str("</table>\n");

    if let Some(slo) = &sweep.slo {
        let _ = write!(
            out,
            "<h2>Capacity under the SLO</h2>\n<p>For each budget, the highest rate scale at which the replay still meets the SLO ({}), found by doubling or halving the rate until one run meets it and one misses, then bisecting to {}%.</p>\n",
            escape(&slo_text(slo)),
            TOLERANCE * 100.0
        );
        plot(
            &mut out,
            plots,
            "capacity",
            "each bar is one token budget; its height is how much denser than the trace the traffic can get before the latency objective is missed. Taller is better: pick the budget with the tallest bar, and read its height as the load one worker can take (1x is the trace's own rate, drawn as a line). \"none\" means even the sparsest traffic tried misses the objective.",
        );
        table(&mut out, capacity_table(sweep));
        if let Some(v) = super::verdict::Verdict::of_sweep(sweep) {
            out.push_str(&v.html());
        }
    }

    out.push_str("<h2>Trade-off: time between tokens against time to first token</h2>\n");
    plot(
        &mut out,
        plots,
        "tradeoff",
        "each line is one token budget, each point one rate scale (labelled, e.g. 2x), both axes logarithmic. Up means decode tokens wait longer between steps (a long prompt shares a step with decoding rows); right means prompts wait longer for their first token. Small budgets sit up-left of large ones along the lower edge: they keep TBT low at the cost of TTFT. As the rate grows, a line climbs to the upper right. The x axis is TTFT p90 and the y axis TBT p99, the percentiles the SLO bounds. The red line is its TBT p99 bound and the blue line its TTFT p90 bound: a filled point meets the objective, a hollow one misses it (above the red line or right of the blue one).",
    );

    let _ = writeln!(
        out,
        "<h2>Step times at rate scale {}x</h2>",
        escape(&fmt_rate(sweep.step_time_rate))
    );
    plot(
        &mut out,
        plots,
        "step_times",
        "each line is one token budget: for a step time on the horizontal axis (logarithmic), the height is the fraction of steps that took at most that long. A line that rises steeply and early means short, even steps; a long flat tail to the right means some steps ran long (a big prompt chunk), which is what decode rows feel as time between tokens.",
    );

    out.push_str("<h2>Every run</h2>\n");
    table(&mut out, cell_table(sweep));
    out.push_str("<p><strong>Columns:</strong> TBT is the time between two tokens of one request; TTFT the time from a request's arrival to its first token; step p50/p99 are percentiles of step durations; overruns count steps that ran more tokens than their budget; utilisation is the share of the budget the budgeted steps scheduled; SLO says whether the run meets the objective. The same figures, unrounded to 0.001 ms, are in <code>sweep.csv</code> and <code>sweep.json</code>.</p>\n</body>\n</html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::super::charts::draw_all;
    use super::super::tests::sample_sweep;
    use super::*;

    #[test]
    fn the_report_embeds_every_plot_and_table_and_loads_nothing() {
        let s = sample_sweep();
        let plots = draw_all(&s).unwrap();
        let page = report(&s, &plots);
        assert!(page.starts_with("<!DOCTYPE html>"));
        assert!(page.trim_end().ends_with("</html>"));
        assert_eq!(page.matches("<svg viewBox=\"0 0 960 600\"").count(), 3);
        for p in &plots {
            // The plot's drawing, not only its title, is in the page.
            let body = &p.svg[p.svg.find('>').unwrap() + 1..];
            assert!(page.contains(body), "{}", p.name);
        }
        assert_eq!(page.matches("How to read this:").count(), 3);
        assert!(page.contains("<td>bundled &lt;test&gt; &amp; co</td>"));
        assert!(
            page.contains("<th>SLO</th><td>TBT p99 &lt;= 60 ms and TTFT p90 &lt;= 5000 ms</td>")
        );
        // One table row per cell and per capacity, plus their headers and the settings.
        assert_eq!(
            page.matches("<td class=\"meets\">meets</td>").count()
                + page.matches("<td class=\"misses\">misses</td>").count(),
            9
        );
        for c in &s.capacity {
            assert!(page.contains(&format!(
                "<td>{}</td><td>{}</td>",
                c.budget,
                escape(&c.label())
            )));
        }
        for forbidden in ["<script", "<link", "src=", "@import", "url("] {
            assert!(!page.contains(forbidden), "{forbidden}");
        }
    }

    #[test]
    fn escape_covers_markup() {
        assert_eq!(
            escape("<a href='x'>&\"</a>"),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;&lt;/a&gt;"
        );
    }
}
