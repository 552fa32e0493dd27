//! The sweep's own plots (`docs/sweep.md`): the trade-off curve of TBT against TTFT,
//! the capacity bars under the SLO and the step-time distributions, each a `Figure` that
//! `plots.rs` renders as every plot is, and [`draw_all`], which draws them all.

use plotters::coord::ranged1d::SegmentValue;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::capacity::slo_text;
use super::plots::{font, legend, render_figure, series_color, text_style, Drawn, Figure, Plot};
use super::{Bound, Sweep, SweepError};
use crate::text::fmt_rate;

/// Draws every plot of `sweep`, SVG and PNG: the trade-off curve, the capacity bars (only with
/// an SLO) and the step-time distributions.
///
/// # Errors
/// A plot cannot be drawn or encoded.
pub fn draw_all(sweep: &Sweep) -> Result<Vec<Plot>, SweepError> {
    font()?;
    Chart::all(sweep)
        .iter()
        .map(|c| render_figure(c.name(), c.title(), c))
        .collect()
}

/// One of the sweep's plots of one sweep.
pub(crate) struct Chart<'a> {
    kind: Kind,
    sweep: &'a Sweep,
}

impl<'a> Chart<'a> {
    /// The plots `sweep` draws, in order: the trade-off curve, the capacity bars (only with an
    /// SLO) and the step-time distributions.
    pub(crate) fn all(sweep: &'a Sweep) -> Vec<Self> {
        let mut kinds = vec![Kind::Tradeoff];
        if sweep.slo.is_some() {
            kinds.push(Kind::Capacity);
        }
        kinds.push(Kind::StepTimes);
        kinds.into_iter().map(|kind| Self { kind, sweep }).collect()
    }

    /// Its file stem.
    pub(crate) fn name(&self) -> &'static str {
        self.kind.name()
    }

    /// Its title.
    pub(crate) fn title(&self) -> String {
        self.kind.title(self.sweep)
    }
}

impl Figure for Chart<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn
    where
        DB::ErrorType: 'static,
    {
        let title = self.title();
        match self.kind {
            Kind::Tradeoff => tradeoff(root, self.sweep, &title),
            Kind::Capacity => capacity(root, self.sweep, &title),
            Kind::StepTimes => step_times(root, self.sweep, &title),
        }
    }
}

/// A budget's points on the trade-off plot: (TTFT p90, TBT p99, rate scale, meets the SLO).
type Curve = Vec<(f64, f64, f64, bool)>;

#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    Tradeoff,
    Capacity,
    StepTimes,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Tradeoff => "tradeoff",
            Self::Capacity => "capacity",
            Self::StepTimes => "step_times",
        }
    }

    fn title(self, sweep: &Sweep) -> String {
        match self {
            Self::Tradeoff => "Time between tokens vs time to first token, by budget".into(),
            Self::Capacity => match &sweep.slo {
                Some(slo) => format!("Capacity under the SLO ({})", slo_text(slo)),
                None => "Capacity under the SLO".into(),
            },
            Self::StepTimes => format!(
                "Step-time distribution by budget at rate scale {}",
                fmt_rate(sweep.step_time_rate)
            ),
        }
    }
}

/// `[lo, hi]` of positive values on a log scale: from the power of ten at or below `lo / 1.3`
/// (so the axis is labelled from its start) to `hi * pad`; `None` without values.
pub(crate) fn log_range(values: impl Iterator<Item = f64>, pad: f64) -> Option<(f64, f64)> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    (hi > 0.0).then(|| (10f64.powf((lo / 1.3).log10().floor()), hi * pad))
}

/// A log-axis label: only at 1, 2 and 5 times a power of ten, where `plotters` puts a tick at
/// every multiple and the labels of 6 to 9 would run into each other.
pub(crate) fn fmt_log_ms(v: &f64) -> String {
    if !(v.is_finite() && *v > 0.0) {
        return String::new();
    }
    let lead = (v / 10f64.powf(v.log10().floor())).round();
    if lead == 1.0 || lead == 2.0 || lead == 5.0 {
        crate::text::fmt_ms(*v)
    } else {
        String::new()
    }
}

fn no_data<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, title: &str, why: &str) -> Drawn
where
    DB::ErrorType: 'static,
{
    root.draw(&Text::new(title.to_owned(), (20, 20), text_style(22)))?;
    root.draw(&Text::new(why.to_owned(), (20, 60), text_style(16)))?;
    Ok(())
}

/// TBT p99 against TTFT p90 (the percentiles the objective bounds), one line per budget through
/// its rates (log-log); the objective's bounds as lines, and each point filled when its run
/// meets the objective, hollow when it misses (with no objective, every point is filled).
fn tradeoff<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, sweep: &Sweep, title: &str) -> Drawn
where
    DB::ErrorType: 'static,
{
    let series: Vec<(String, Curve)> = sweep
        .budgets
        .iter()
        .map(|b| {
            let pts = sweep
                .cells_of(*b)
                .filter_map(|c| {
                    let (x, y) = (c.summary.ttft_p90_ms?, c.summary.tbt_p99_ms?);
                    let meets = sweep.slo.is_none_or(|slo| slo.meets(&c.summary));
                    (x.is_finite() && y.is_finite() && x > 0.0 && y > 0.0).then_some((
                        x,
                        y,
                        c.rate_scale,
                        meets,
                    ))
                })
                .collect();
            (format!("budget {b}"), pts)
        })
        .collect();
    let slo_tbt = sweep.slo.and_then(|s| s.tbt_p99_ms);
    let slo_ttft = sweep.slo.and_then(|s| s.ttft_p90_ms);
    let xs = || series.iter().flat_map(|(_, p)| p.iter().map(|p| p.0));
    let ys = || series.iter().flat_map(|(_, p)| p.iter().map(|p| p.1));
    // The y range is padded more: room above the highest point for the legend.
    let (Some((x0, x1)), Some((y0, y1))) = (
        log_range(xs().chain(slo_ttft), 1.3),
        log_range(ys().chain(slo_tbt), 2.5),
    ) else {
        return no_data(root, title, "No run has both TTFT and TBT samples.");
    };
    let mut chart = ChartBuilder::on(root)
        .caption(title, text_style(22))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("TTFT p90 (simulated ms, log scale)")
        .y_desc("TBT p99 (simulated ms, log scale)")
        .x_label_formatter(&fmt_log_ms)
        .y_label_formatter(&fmt_log_ms)
        // Light lines crowd near each power of ten on a log axis.
        .max_light_lines(0)
        .label_style(text_style(14))
        .axis_desc_style(text_style(16))
        .draw()?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let c = series_color(i);
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|p| (p.0, p.1)),
                c.stroke_width(2),
            ))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        // Filled: the run meets the objective; hollow: it misses.
        chart.draw_series(pts.iter().map(|p| {
            let style = if p.3 { c.filled() } else { c.stroke_width(2) };
            Circle::new((p.0, p.1), 4, style)
        }))?;
        chart.draw_series(pts.iter().map(|p| {
            EmptyElement::at((p.0, p.1))
                + Text::new(format!("{}x", fmt_rate(p.2)), (6, -16), text_style(12))
        }))?;
    }
    if let Some(t) = slo_tbt {
        chart
            .draw_series(LineSeries::new([(x0, t), (x1, t)], RED.stroke_width(1)))?
            .label(format!("SLO: TBT p99 <= {t} ms"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    }
    if let Some(t) = slo_ttft {
        chart
            .draw_series(LineSeries::new([(t, y0), (t, y1)], BLUE.stroke_width(1)))?
            .label(format!("SLO: TTFT p90 <= {t} ms"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    }
    legend(&mut chart, 14, SeriesLabelPosition::UpperLeft)?;
    Ok(())
}

/// The capacity of each budget as a bar, the trace's own rate (1x) as a line.
fn capacity<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, sweep: &Sweep, title: &str) -> Drawn
where
    DB::ErrorType: 'static,
{
    let caps = &sweep.capacity;
    if caps.is_empty() {
        return no_data(root, title, "No capacity was searched.");
    }
    let n = caps.len() as i32;
    // The axis fits the bars (a 0.08x bar is visible), reaching up to the trace's own rate
    // only when a bar comes near it.
    let tallest = caps
        .iter()
        .filter_map(|c| c.search.rate_scale)
        .fold(0.0_f64, f64::max);
    let top = if tallest > 0.0 { tallest * 1.25 } else { 1.25 };
    let names: Vec<String> = caps.iter().map(|c| c.budget.to_string()).collect();
    let mut chart = ChartBuilder::on(root)
        .caption(title, text_style(22))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..top)?;
    // The left edge of bar `i`; the last bar ends at the axis' end.
    let edge = |i: i32| {
        if i >= n {
            SegmentValue::Last
        } else {
            SegmentValue::Exact(i)
        }
    };
    let label = |v: &SegmentValue<i32>| match v {
        SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => usize::try_from(*i)
            .ok()
            .and_then(|i| names.get(i).cloned())
            .unwrap_or_default(),
        SegmentValue::Last => String::new(),
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(caps.len())
        .x_label_formatter(&label)
        .x_desc(if caps.iter().any(|c| c.budget.is_time()) {
            "token or time budget"
        } else {
            "token budget"
        })
        .y_desc("highest rate scale meeting the SLO")
        .label_style(text_style(14))
        .axis_desc_style(text_style(16))
        .draw()?;
    for (i, c) in caps.iter().enumerate() {
        let x = i as i32;
        let height = c.search.rate_scale.unwrap_or(0.0);
        let fill = series_color(i);
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(x), 0.0),
                (SegmentValue::Exact(x + 1), height),
            ],
            fill.filled(),
        );
        bar.set_margin(0, 0, 20, 20);
        chart.draw_series([bar])?;
        let text = match c.search.bound {
            Bound::BelowMin => "none".to_owned(),
            _ => c.label(),
        };
        chart.draw_series([EmptyElement::at((SegmentValue::CenterOf(x), height))
            + Text::new(text, (-24, -20), text_style(14))])?;
    }
    if top >= 1.0 {
        chart
            .draw_series(LineSeries::new(
                [(edge(0), 1.0), (edge(n), 1.0)],
                BLACK.stroke_width(1),
            ))?
            .label("1x: the trace's own rate")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
        legend(&mut chart, 14, SeriesLabelPosition::UpperRight)?;
    }
    Ok(())
}

/// The step-time CDF of each budget at the sweep's step-time rate.
fn step_times<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    sweep: &Sweep,
    title: &str,
) -> Drawn
where
    DB::ErrorType: 'static,
{
    let series: Vec<(String, &[f64])> = sweep
        .budgets
        .iter()
        .filter_map(|b| {
            let c = sweep.cell(*b, sweep.step_time_rate)?;
            let p = c.summary.step_ms.percentiles_ms.as_slice();
            (!p.is_empty()).then(|| (format!("budget {b}"), p))
        })
        .collect();
    let top = series
        .iter()
        .flat_map(|(_, p)| p.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0_f64, f64::max);
    if series.is_empty() || top <= 0.0 {
        return no_data(root, title, "No run at this rate scale has step times.");
    }
    // A log axis: a budget's steps cluster at a few tens of ms while an unbudgeted run's
    // longest prompt takes seconds; a linear axis would squash every curve against the left.
    let bottom = series
        .iter()
        .flat_map(|(_, p)| p.iter().copied())
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold(top, f64::min);
    let (x0, x1) = (bottom / 1.2, top * 1.2);
    let mut chart = ChartBuilder::on(root)
        .caption(title, text_style(22))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d((x0..x1).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("step time (simulated ms, log scale)")
        .y_desc("fraction of steps at or below")
        .label_style(text_style(14))
        .axis_desc_style(text_style(16))
        .draw()?;
    for (i, (label, p)) in series.iter().enumerate() {
        let c = series_color(i);
        let last = (p.len().max(2) - 1) as f64;
        chart
            .draw_series(LineSeries::new(
                p.iter()
                    .enumerate()
                    .map(|(k, v)| (v.max(x0), k as f64 / last)),
                c.stroke_width(2),
            ))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    legend(&mut chart, 14, SeriesLabelPosition::LowerRight)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::plots::{HEIGHT, WIDTH};
    use super::super::tests::{options, sample_sweep};
    use super::super::{run_sweep, RunSummary};
    use super::*;

    const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];

    #[test]
    fn every_plot_is_a_valid_svg_and_png_naming_its_series() {
        let s = sample_sweep();
        let plots = draw_all(&s).unwrap();
        assert_eq!(
            plots.iter().map(|p| p.name).collect::<Vec<_>>(),
            ["tradeoff", "capacity", "step_times"]
        );
        for p in &plots {
            assert!(p.svg.starts_with("<svg"), "{}: {}", p.name, &p.svg[..40]);
            assert!(p.svg.trim_end().ends_with("</svg>"), "{}", p.name);
            assert!(
                p.svg
                    .contains(&p.title.replace('<', "&lt;").replace('>', "&gt;")),
                "{}",
                p.name
            );
            assert!(p.png.starts_with(&PNG_SIGNATURE), "{}", p.name);
            // Decodes, with the plot's size and not one colour: something was drawn.
            let dec = png::Decoder::new(&p.png[..]);
            let mut reader = dec.read_info().unwrap();
            let mut buf = vec![0; reader.output_buffer_size()];
            let info = reader.next_frame(&mut buf).unwrap();
            assert_eq!((info.width, info.height), (WIDTH, HEIGHT));
            let pixels = &buf[..info.buffer_size()];
            assert!(
                pixels.chunks(3).any(|px| px != [255, 255, 255]),
                "{}",
                p.name
            );
            // Text was drawn with the font: some pixels are neither white nor a series colour.
            assert!(pixels.chunks(3).any(|px| px == [0, 0, 0]), "{}", p.name);
        }
        let [tradeoff, capacity, steps] = &plots[..] else {
            panic!()
        };
        for b in ["budget 512", "budget 2048", "budget off"] {
            assert!(tradeoff.svg.contains(b), "{b}");
            assert!(steps.svg.contains(b), "{b}");
        }
        assert!(tradeoff.svg.contains("SLO: TBT p99 &lt;= 60 ms"));
        // The x axis is the percentile the objective bounds, and its bound is drawn.
        assert!(tradeoff.svg.contains("TTFT p90 (simulated ms"));
        assert!(!tradeoff.svg.contains("TTFT p99"));
        assert!(tradeoff.svg.contains("SLO: TTFT p90 &lt;= 5000 ms"));
        // A point is hollow exactly when its run misses the objective.
        let slo = s.slo.unwrap();
        let misses = s.cells.iter().filter(|c| !slo.meets(&c.summary)).count();
        let circles: Vec<&str> = tradeoff
            .svg
            .split("<circle")
            .skip(1)
            .map(|c| c.split("/>").next().unwrap_or(c))
            .collect();
        let hollow = circles
            .iter()
            .filter(|c| c.contains("fill=\"none\""))
            .count();
        assert!(misses > 0 && misses < s.cells.len(), "the sample has both");
        assert_eq!(hollow, misses);
        assert_eq!(circles.len() - hollow, s.cells.len() - misses);
        assert!(tradeoff.svg.contains("0.5x") && tradeoff.svg.contains("2x"));
        assert!(tradeoff.svg.contains("<polyline") || tradeoff.svg.contains("<path"));
        for c in &s.capacity {
            assert!(capacity.svg.contains(&c.label()), "{}", c.label());
        }
        assert!(capacity.svg.contains("<rect"));
        assert!(steps.title.ends_with("at rate scale 1"));
    }

    #[test]
    fn log_axes_start_at_a_power_of_ten_and_label_1_2_5() {
        assert_eq!(
            log_range([13.0, 90.0].into_iter(), 2.0),
            Some((10.0, 180.0))
        );
        assert_eq!(log_range([f64::NAN, -1.0, 0.0].into_iter(), 2.0), None);
        let labels: Vec<String> = [10.0, 20.0, 30.0, 50.0, 90.0, 100.0, 0.5, 0.3, 2000.0]
            .iter()
            .map(fmt_log_ms)
            .collect();
        assert_eq!(labels, ["10", "20", "", "50", "", "100", "0.5", "", "2000"]);
    }

    #[test]
    fn plots_without_data_say_so() {
        let s = run_sweep(
            &options(None),
            |_, _| Ok::<_, String>(RunSummary::default()),
        )
        .unwrap();
        let plots = draw_all(&s).unwrap();
        assert_eq!(plots.len(), 2);
        assert!(plots[0]
            .svg
            .contains("No run has both TTFT and TBT samples."));
        assert!(plots[1]
            .svg
            .contains("No run at this rate scale has step times."));
        assert!(plots[1].png.starts_with(&PNG_SIGNATURE));
    }
}
