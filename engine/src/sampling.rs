//! Choosing the next token from a row's logits: greedy, or seeded temperature and top-p sampling.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Seeded sampling: greedy at temperature 0, else softmax at `temperature` restricted to the
/// smallest set of tokens whose probability reaches `top_p`.
pub struct Sampler {
    rng: SmallRng,
    temperature: f32,
    top_p: f32,
}

impl Sampler {
    /// A sampler; `seed` makes its draws repeatable.
    pub fn new(seed: u64, temperature: f32, top_p: f32) -> Self {
        Sampler {
            rng: SmallRng::seed_from_u64(seed),
            temperature,
            top_p,
        }
    }

    /// The next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.temperature <= 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut p: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) / self.temperature).exp()))
            .collect();
        let sum: f32 = p.iter().map(|x| x.1).sum();
        p.iter_mut().for_each(|x| x.1 /= sum);
        p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut keep = 0;
        let mut acc = 0.0;
        for x in &p {
            keep += 1;
            acc += x.1;
            if acc >= self.top_p {
                break;
            }
        }
        let p = &p[..keep];
        let mut u = self.rng.gen::<f32>() * acc;
        for x in p {
            if u < x.1 {
                return x.0;
            }
            u -= x.1;
        }
        p[p.len() - 1].0
    }
}
