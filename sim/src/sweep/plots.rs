//! The sweep's plots, drawn with `plotters` as SVG (for the HTML report) and PNG (for anything
//! else): the TBT/TTFT trade-off curve, the capacity under the SLO, and the step-time
//! distributions.
//!
//! PNG text is drawn with DejaVu Sans, bundled (`data/fonts/`, Bitstream Vera licence), so the
//! plots look the same on every machine and need no system font.

use std::error::Error;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle, RGBAColor};

use super::raster::PngBackend;
use super::SweepError;

/// Width of every plot, in pixels.
pub const WIDTH: u32 = 960;
/// Height of every plot, in pixels.
pub const HEIGHT: u32 = 600;

/// DejaVu Sans 2.37 (see `data/fonts/DejaVuSans.ttf.LICENSE.txt`).
static FONT: &[u8] = include_bytes!("../../../data/fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

/// The file stems of every plot a sweep may draw.
pub const NAMES: [&str; 3] = ["tradeoff", "capacity", "step_times"];

/// One drawn plot.
#[derive(Debug, Clone, PartialEq)]
pub struct Plot {
    /// The file stem: `tradeoff`, `capacity` or `step_times`.
    pub name: &'static str,
    /// Its title.
    pub title: String,
    /// The SVG document.
    pub svg: String,
    /// The PNG file.
    pub png: Vec<u8>,
}

/// What drawing a plot answers.
pub(crate) type Drawn = Result<(), Box<dyn Error>>;

/// `items` without repeats, in the order of their first appearance (a plot's series, its
/// points along an axis).
pub(crate) fn distinct<T: PartialEq>(items: impl IntoIterator<Item = T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

/// Registers the bundled font once per process (`plotters` keeps fonts in a global table).
pub(crate) fn font() -> Result<(), SweepError> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        register_font(FAMILY, FontStyle::Normal, FONT)
            .map_err(|_| "the bundled DejaVu Sans font cannot be read".to_owned())
    })
    .clone()
    .map_err(|message| SweepError::Plot {
        plot: "any",
        message,
    })
}

fn encode_png(rgb: &[u8]) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, WIDTH, HEIGHT);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header()?;
    w.write_image_data(rgb)?;
    w.finish()?;
    Ok(out)
}

fn color(i: usize) -> RGBAColor {
    Palette99::pick(i).to_rgba()
}

fn font_of(size: u32) -> TextStyle<'static> {
    (FAMILY, size).into_font().color(&BLACK)
}

/// A plot, on any backend: the sweep's own (`charts.rs`) and each axis's comparison.
pub(crate) trait Figure {
    /// Draws the plot on `root`, already filled white.
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn
    where
        DB::ErrorType: 'static;
}

/// Renders `figure` as SVG and PNG, as the sweep's own plots are.
///
/// # Errors
/// The plot cannot be drawn or encoded.
pub(crate) fn render_figure(
    name: &'static str,
    title: String,
    figure: &impl Figure,
) -> Result<Plot, SweepError> {
    font()?;
    let err = |e: Box<dyn Error>| SweepError::Plot {
        plot: name,
        message: e.to_string(),
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.into()))?;
        figure.draw(&root).map_err(err)?;
        root.present().map_err(|e| err(e.into()))?;
    }
    let mut rgb = vec![0u8; WIDTH as usize * HEIGHT as usize * 3];
    {
        let backend =
            PngBackend::new(&mut rgb, (WIDTH, HEIGHT), FONT).map_err(|e| err(e.into()))?;
        let root = backend.into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.into()))?;
        figure.draw(&root).map_err(err)?;
        root.present().map_err(|e| err(e.into()))?;
    }
    let png = encode_png(&rgb).map_err(|e| err(e.into()))?;
    Ok(Plot {
        name,
        title,
        svg,
        png,
    })
}

/// Draws the legend of `chart`'s labelled series at `at`, in text of `size`, as every plot of
/// a sweep does.
pub(crate) fn legend<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    size: u32,
    at: SeriesLabelPosition,
) -> Drawn
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .label_font(font_of(size))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(at)
        .draw()?;
    Ok(())
}

/// Draws `pts` as a line of colour `c` with a dot at each point; with a label, the line is in
/// the legend under it.
pub(crate) fn marked_line<'a, DB, X, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    pts: Vec<(X::ValueType, Y::ValueType)>,
    c: RGBAColor,
    label: Option<String>,
) -> Drawn
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    X: Ranged,
    Y: Ranged,
    X::ValueType: Clone + 'static,
    Y::ValueType: Clone + 'static,
{
    let line = chart.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?;
    if let Some(name) = label {
        line.label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))?;
    Ok(())
}

/// The palette and fonts of the sweep's plots, for [`Figure`]s.
pub(crate) fn series_color(i: usize) -> RGBAColor {
    color(i)
}

/// A text style of the sweep's plots.
pub(crate) fn text_style(size: u32) -> TextStyle<'static> {
    font_of(size)
}
