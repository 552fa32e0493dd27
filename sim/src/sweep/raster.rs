//! The PNG backend: `plotters`' bitmap backend with text drawn by `ab_glyph` directly.
//!
//! `plotters` 0.3.7 places each glyph of an `ab_glyph` font at its advance position but drops
//! the glyph's left side bearing, so text comes out unevenly spaced ("TB T", "1 024"). This
//! backend delegates every shape to the bitmap backend and draws text itself, each glyph at its
//! advance position plus its bearing, with the same layout box `plotters` measures (advances
//! and kerning), so anchors and label areas stay as the chart computed them.

use ab_glyph::{point, Font, FontRef, PxScale, ScaleFont};
use plotters::prelude::{BitMapBackend, DrawingBackend};
use plotters_backend::text_anchor::{HPos, VPos};
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingErrorKind,
};

/// A bitmap backend that draws text with `font`.
pub(crate) struct PngBackend<'a> {
    inner: BitMapBackend<'a>,
    font: FontRef<'static>,
}

type Failed<'a> = DrawingErrorKind<<BitMapBackend<'a> as DrawingBackend>::ErrorType>;

impl<'a> PngBackend<'a> {
    /// Draws into `rgb` (`width * height * 3` bytes), text with `font`.
    ///
    /// # Errors
    /// `font` is not a font `ab_glyph` reads.
    pub(crate) fn new(
        rgb: &'a mut [u8],
        size: (u32, u32),
        font: &'static [u8],
    ) -> Result<Self, ab_glyph::InvalidFont> {
        Ok(Self {
            inner: BitMapBackend::with_buffer(rgb, size),
            font: FontRef::try_from_slice(font)?,
        })
    }
}

/// Trait methods that hand their arguments to the bitmap backend as they are (generics in
/// brackets): one line each, where a function cannot stand for a method of a trait.
macro_rules! delegate {
    ($failed:ty; $(fn $name:ident $([$($g:tt)*])? ($($arg:ident: $ty:ty),*);)*) => {
        $(fn $name $(<$($g)*>)? (&mut self, $($arg: $ty),*) -> Result<(), $failed> {
            self.inner.$name($($arg),*)
        })*
    };
}

impl<'a> DrawingBackend for PngBackend<'a> {
    type ErrorType = <BitMapBackend<'a> as DrawingBackend>::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.inner.get_size()
    }

    delegate! {
        Failed<'a>;
        fn ensure_prepared();
        fn present();
        fn draw_pixel(point: BackendCoord, color: BackendColor);
        fn draw_line[S: BackendStyle](from: BackendCoord, to: BackendCoord, style: &S);
        fn draw_rect[S: BackendStyle](ul: BackendCoord, br: BackendCoord, style: &S, fill: bool);
        fn draw_path[S: BackendStyle, I: IntoIterator<Item = BackendCoord>](path: I, style: &S);
        fn draw_circle[S: BackendStyle](c: BackendCoord, r: u32, style: &S, fill: bool);
        fn fill_polygon[S: BackendStyle, I: IntoIterator<Item = BackendCoord>](v: I, style: &S);
        fn blit_bitmap(pos: BackendCoord, size: (u32, u32), src: &[u8]);
    }

    fn draw_text<TStyle: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &TStyle,
        pos: BackendCoord,
    ) -> Result<(), Failed<'a>> {
        let color = style.color();
        if color.alpha == 0.0 {
            return Ok(());
        }
        let size = style.size() as f32;
        let font = self.font.as_scaled(PxScale::from(size));
        // The layout box `plotters` measured: advances and kerning wide, size / 1.24 high.
        let mut width = 0.0_f32;
        let mut prev = None;
        for c in text.chars() {
            let id = font.glyph_id(c);
            if let Some(p) = prev {
                width += font.kern(p, id);
            }
            width += font.h_advance(id);
            prev = Some(id);
        }
        let (w, h) = (width as i32, (size / 1.24) as i32);
        let anchor = style.anchor();
        let dx = match anchor.h_pos {
            HPos::Left => 0,
            HPos::Right => -w,
            HPos::Center => -w / 2,
        };
        let dy = match anchor.v_pos {
            VPos::Top => 0,
            VPos::Center => -h / 2,
            VPos::Bottom => -h,
        };
        // Capitals centred in the box: the baseline half a cap height below its middle.
        let cap = font
            .outline_glyph(font.scaled_glyph('H'))
            .map_or(size * 0.6, |g| -g.px_bounds().min.y);
        let baseline = h as f32 / 2.0 + cap / 2.0;
        let trans = style.transform();
        let (bw, bh) = self.get_size();
        let mut x = 0.0_f32;
        let mut prev = None;
        let mut result = Ok(());
        for c in text.chars() {
            let id = font.glyph_id(c);
            if let Some(p) = prev {
                x += font.kern(p, id);
            }
            prev = Some(id);
            let glyph = id.with_scale_and_position(PxScale::from(size), point(x, baseline));
            x += font.h_advance(id);
            let Some(outline) = font.outline_glyph(glyph) else {
                continue;
            };
            let b = outline.px_bounds();
            let (ox, oy) = (b.min.x as i32, b.min.y as i32);
            outline.draw(|gx, gy, coverage| {
                if result.is_err() || coverage <= 0.0 {
                    return;
                }
                let (tx, ty) = trans.transform(ox + gx as i32 + dx, oy + gy as i32 + dy);
                let (px, py) = (pos.0 + tx, pos.1 + ty);
                if px >= 0 && py >= 0 && (px as u32) < bw && (py as u32) < bh {
                    let c = BackendColor {
                        alpha: color.alpha * f64::from(coverage.min(1.0)),
                        rgb: color.rgb,
                    };
                    result = self.inner.draw_pixel((px, py), c);
                }
            });
            result
                .as_ref()
                .map_err(|_| DrawingErrorKind::FontError("a glyph could not be drawn".into()))?;
        }
        Ok(())
    }
}
