//! The time margin (`docs/cost-model.md#the-time-margin`): how much slower than predicted a
//! node's recent steps ran, so time budgets are planned for the steps the engine really runs.
//!
//! A planner that fills every step up to its time budget `X` by the model's prediction sees
//! half its full steps overrun whenever the model is right on average, and more when the model
//! is biased where the steps are (a CPU's matrix products are not linear in a step's tokens at
//! small counts). With a margin quantile `q`, each node keeps the ratios measured ÷ predicted
//! of its last [`WINDOW`] timed steps, and steps are planned against `X / m`, where `m` is the
//! `q`-quantile of those ratios, clamped to `[1, MAX_MARGIN]`. Overruns are still checked
//! against `X` itself. Plain logic, no runtime: part of the engine core.

/// The steps whose ratios a node remembers.
pub const WINDOW: usize = 256;
/// Steps observed before a margin is applied; until then it is 1.
pub const MIN_STEPS: usize = 32;
/// The largest margin: a step is never planned against less than half its time budget.
pub const MAX_MARGIN: f64 = 2.0;

/// One node's recent ratios of measured to predicted step time, and the margin they give.
#[derive(Debug, Clone, PartialEq)]
pub struct TimeMargin {
    /// The last [`WINDOW`] ratios, oldest overwritten first.
    ratios: Vec<f64>,
    /// Where the next ratio goes once the window is full.
    next: usize,
    /// The margin at the quantile asked for by the last [`TimeMargin::observe`].
    margin: f64,
    /// Scratch for the quantile, kept to avoid an allocation per step.
    scratch: Vec<f64>,
}

impl Default for TimeMargin {
    fn default() -> Self {
        Self {
            ratios: Vec::with_capacity(WINDOW),
            next: 0,
            margin: 1.0,
            scratch: Vec::with_capacity(WINDOW),
        }
    }
}

impl TimeMargin {
    /// Records a step measured at `measured_ms` that was predicted at `predicted_ms`, and
    /// updates the margin at `quantile` (in `(0, 1]`). A step without a usable prediction
    /// (not finite and > 0) or measurement (not finite and >= 0) changes nothing.
    pub fn observe(&mut self, measured_ms: f64, predicted_ms: f64, quantile: f64) {
        let usable = predicted_ms.is_finite()
            && predicted_ms > 0.0
            && super::measured_ms(measured_ms).is_some();
        if !usable {
            return;
        }
        let ratio = measured_ms / predicted_ms;
        if self.ratios.len() < WINDOW {
            self.ratios.push(ratio);
        } else {
            self.ratios[self.next] = ratio;
            self.next = (self.next + 1) % WINDOW;
        }
        self.margin = self.quantile(quantile);
    }

    /// The `quantile` of the ratios remembered, clamped to `[1, MAX_MARGIN]`; 1 before
    /// [`MIN_STEPS`] steps. Nearest rank: the smallest ratio at least `quantile` of the
    /// window is at or below.
    fn quantile(&mut self, quantile: f64) -> f64 {
        let n = self.ratios.len();
        if n < MIN_STEPS {
            return 1.0;
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(&self.ratios);
        // Nearest rank k = ceil(q n), 1-based; a quantile outside (0, 1] is held to it.
        let rank = (quantile.clamp(0.0, 1.0) * n as f64).ceil() as usize;
        let index = rank.clamp(1, n) - 1;
        let (_, &mut value, _) = self.scratch.select_nth_unstable_by(index, f64::total_cmp);
        value.clamp(1.0, MAX_MARGIN)
    }

    /// The margin steps are planned with: their time budget is divided by it.
    pub fn margin(&self) -> f64 {
        self.margin
    }

    /// Steps remembered (at most [`WINDOW`]).
    pub fn steps(&self) -> usize {
        self.ratios.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observed(ratios: &[f64], quantile: f64) -> TimeMargin {
        let mut m = TimeMargin::default();
        for &r in ratios {
            m.observe(10.0 * r, 10.0, quantile);
        }
        m
    }

    #[test]
    fn no_margin_before_min_steps() {
        let m = observed(&[1.5; MIN_STEPS - 1], 0.9);
        assert_eq!((m.steps(), m.margin()), (MIN_STEPS - 1, 1.0));
        let m = observed(&[1.5; MIN_STEPS], 0.9);
        assert_eq!((m.steps(), m.margin()), (MIN_STEPS, 1.5));
    }

    #[test]
    fn the_margin_is_the_nearest_rank_quantile() {
        // 40 ratios 1.01, 1.02, ..., 1.40: the 0.9-quantile is the 36th (ceil(0.9 * 40)).
        let ratios: Vec<f64> = (1..=40).map(|i| 1.0 + f64::from(i) / 100.0).collect();
        let m = observed(&ratios, 0.9);
        assert!((m.margin() - 1.36).abs() < 1e-12, "{}", m.margin());
        // The quantile is of the values, not of their order of arrival.
        let mut reversed = ratios.clone();
        reversed.reverse();
        assert_eq!(observed(&reversed, 0.9).margin(), m.margin());
        // q = 1 is the largest; a tiny q the smallest.
        assert!((observed(&ratios, 1.0).margin() - 1.40).abs() < 1e-12);
        assert!((observed(&ratios, 1e-9).margin() - 1.01).abs() < 1e-12);
        // 0.5 of 40 is the 20th exactly (rank 20, not 21).
        assert!((observed(&ratios, 0.5).margin() - 1.20).abs() < 1e-12);
    }

    #[test]
    fn the_margin_is_clamped_to_one_and_max() {
        assert_eq!(observed(&[0.5; 40], 0.9).margin(), 1.0);
        assert_eq!(observed(&[3.0; 40], 0.9).margin(), MAX_MARGIN);
        assert_eq!(observed(&[2.0; 40], 0.9).margin(), 2.0);
    }

    #[test]
    fn the_window_forgets_the_oldest_steps() {
        let mut m = observed(&[1.8; WINDOW], 0.5);
        assert_eq!((m.steps(), m.margin()), (WINDOW, 1.8));
        // Half the window replaced by 1.2: the nearest-rank median (rank 128 of 256) is the
        // larger of the 1.2s.
        for _ in 0..WINDOW / 2 {
            m.observe(12.0, 10.0, 0.5);
        }
        assert_eq!(m.steps(), WINDOW);
        assert!((m.margin() - 1.2).abs() < 1e-12, "{}", m.margin());
        // The other half replaced too: every 1.8 is gone, so even the 0.99-quantile is 1.2.
        for _ in 0..WINDOW / 2 {
            m.observe(12.0, 10.0, 0.99);
        }
        assert!(
            (m.margin() - 1.2).abs() < 1e-12,
            "every 1.8 is gone: {}",
            m.margin()
        );
    }

    #[test]
    fn unusable_steps_change_nothing() {
        let mut m = observed(&[1.5; MIN_STEPS], 0.9);
        let before = m.clone();
        for (measured, predicted) in [
            (10.0, 0.0),
            (10.0, -1.0),
            (10.0, f64::NAN),
            (10.0, f64::INFINITY),
            (f64::NAN, 10.0),
            (-1.0, 10.0),
            (f64::INFINITY, 10.0),
        ] {
            m.observe(measured, predicted, 0.9);
            assert_eq!(m, before, "({measured}, {predicted})");
        }
        // A measured 0 is a real step (ratio 0).
        m.observe(0.0, 10.0, 0.9);
        assert_eq!(m.steps(), MIN_STEPS + 1);
    }
}
