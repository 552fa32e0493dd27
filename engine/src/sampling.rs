//! Choosing the next token from a row's logits, with vLLM's sampling rules and in its order:
//!
//! 1. `min_tokens`: until that many tokens are generated, the stop tokens (EOS, a chat's
//!    `<|im_end|>`) cannot be drawn;
//! 2. the penalties, on the raw logits: `repetition_penalty` divides a positive logit (and
//!    multiplies a negative one) of every token seen in the prompt or the output so far;
//!    `frequency_penalty` subtracts itself times the token's count in the output;
//!    `presence_penalty` subtracts itself once from every token in the output;
//! 3. greedy (the first largest logit) at temperature 0; else softmax at `temperature`, then
//!    `min_p` (tokens less likely than `min_p` times the most likely one are dropped), then
//!    `top_k` (the `k` most likely kept), then `top_p` (the smallest set, most likely first,
//!    whose renormalised mass reaches `top_p`), and a seeded draw from what is left.
//!
//! A neutral setting (`top_k` 0, `min_p` 0, penalties 1 / 0 / 0, `min_tokens` 0) changes
//! nothing, and then the logits are not even copied.

use std::collections::HashMap;

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

/// The most alternatives a token's log-probabilities list ([`SamplingParams::logprobs`]): 20,
/// OpenAI's `top_logprobs` bound and vLLM's default `--max-logprobs`.
pub const MAX_TOP_LOGPROBS: u8 = 20;

/// A request's sampling settings, as vLLM's `SamplingParams` for what the engine implements:
/// the one statement of them, which the API parses a request's fields into
/// ([`Settings`](crate::api::Settings): a value out of its range is refused, naming its field)
/// and the engine carries with each request
/// ([`GenRequest::sampling`](crate::engine::GenRequest::sampling)). The default is OpenAI's:
/// temperature 1 with every other setting off.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature, 0 to 2; 0 is greedy.
    pub temperature: f32,
    /// Nucleus mass, (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// The most likely tokens kept; 0 keeps every token (the API's -1 too).
    pub top_k: u32,
    /// Tokens below this fraction of the most likely token's probability are dropped, 0 to 1;
    /// 0 is off.
    pub min_p: f32,
    /// Above 1 discourages, below 1 encourages tokens of the prompt and the output (above 0);
    /// 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated, -2 to 2; 0 is off.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit per time it was generated, -2 to 2; 0 is off.
    pub frequency_penalty: f32,
    /// Tokens generated before EOS, a stop token or a stop string may end the request (at most
    /// its `max_tokens`); 0 is off.
    pub min_tokens: u32,
    /// The seed of the draws; `None`: a fresh one per request, so every request samples
    /// differently. The API takes a negative int64 as its two's-complement bits, so every
    /// int64 seeds a different draw.
    pub seed: Option<u64>,
    /// Keep generating past EOS and the stop tokens.
    pub ignore_eos: bool,
    /// Tokens that end the request as EOS does (`<|im_end|>` for a chat), unless `ignore_eos`;
    /// `min_tokens` holds them back, and EOS with them.
    pub stop_tokens: Vec<u32>,
    /// Stop strings (at most [`MAX_STOPS`](crate::api::MAX_STOPS), none empty): the text ends
    /// before the first one it holds (the server looks for them).
    pub stop: Vec<String>,
    /// Choices generated for the prompt (1 to [`MAX_N`](crate::api::MAX_N)): each is a request
    /// of its own to the engine, the `i`-th seeded `seed + i`.
    pub n: u8,
    /// Send each token's log-probability with this many most likely alternatives (0 to
    /// [`MAX_TOP_LOGPROBS`]); `None`: no log-probabilities.
    pub logprobs: Option<u8>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            min_tokens: 0,
            seed: None,
            ignore_eos: false,
            stop_tokens: Vec::new(),
            stop: Vec::new(),
            n: 1,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    fn penalised(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// Seeded sampling of one request's tokens; it remembers what it drew for the penalties.
pub struct Sampler {
    rng: SmallRng,
    params: SamplingParams,
    /// The tokens `min_tokens` holds back: the stop tokens, and EOS for a request's sampler.
    ends: Vec<u32>,
    /// Tokens of the prompt (only kept with a repetition penalty).
    prompt: Vec<bool>,
    /// How often each generated token was drawn (only kept with a penalty).
    counts: HashMap<u32, u32>,
    generated: u32,
}

impl Sampler {
    /// A sampler at `temperature` and `top_p`, nothing else; `seed` makes its draws repeatable.
    pub fn new(seed: u64, temperature: f32, top_p: f32) -> Self {
        Self::with(
            SamplingParams {
                temperature,
                top_p,
                seed: Some(seed),
                ..SamplingParams::default()
            },
            &[],
        )
    }

    /// A sampler with every setting of `params` (seeded with its `seed`, else a fresh one);
    /// `prompt` is what the repetition penalty counts besides the output. `min_tokens` holds
    /// back the stop tokens.
    pub fn with(params: SamplingParams, prompt: &[u32]) -> Self {
        let ends = params.stop_tokens.clone();
        Self::holding_back(params, ends, prompt)
    }

    /// A request's sampler: as [`with`](Self::with), and `min_tokens` holds back `eos` too.
    pub fn for_request(params: SamplingParams, eos: u32, prompt: &[u32]) -> Self {
        let mut ends = vec![eos];
        ends.extend(&params.stop_tokens);
        Self::holding_back(params, ends, prompt)
    }

    fn holding_back(params: SamplingParams, ends: Vec<u32>, prompt: &[u32]) -> Self {
        let mut seen = Vec::new();
        if params.repetition_penalty != 1.0 {
            for &t in prompt {
                let t = t as usize;
                if t >= seen.len() {
                    seen.resize(t + 1, false);
                }
                seen[t] = true;
            }
        }
        Sampler {
            rng: SmallRng::seed_from_u64(params.seed.unwrap_or_else(rand::random)),
            params,
            ends,
            prompt: seen,
            counts: HashMap::new(),
            generated: 0,
        }
    }

    /// The next token from `logits` (the model's, unchanged); it counts as generated.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        // Past EOS (`ignore_eos`), nothing ends the request early: nothing is held back.
        let masked = !p.ignore_eos && self.generated < p.min_tokens && !self.ends.is_empty();
        let tok = if masked || p.penalised() {
            let mut l = logits.to_vec();
            self.adjust(&mut l, masked);
            self.draw(&l)
        } else {
            self.draw(logits)
        };
        self.generated += 1;
        if self.params.penalised() {
            *self.counts.entry(tok).or_default() += 1;
        }
        tok
    }

    /// Steps 1 and 2: the stop tokens held back, the penalties applied.
    fn adjust(&self, l: &mut [f32], masked: bool) {
        let p = &self.params;
        if masked {
            for &t in &self.ends {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            let in_prompt = |t: usize| self.prompt.get(t).copied().unwrap_or(false);
            for (t, x) in l.iter_mut().enumerate() {
                if in_prompt(t) || self.counts.contains_key(&(t as u32)) {
                    *x = if *x > 0.0 { *x / r } else { *x * r };
                }
            }
        }
        for (&t, &n) in &self.counts {
            if let Some(x) = l.get_mut(t as usize) {
                *x -= p.frequency_penalty * n as f32 + p.presence_penalty;
            }
        }
    }

    /// Step 3: greedy, or the filtered softmax's seeded draw.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let s = &self.params;
        if s.temperature <= 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut p: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) / s.temperature).exp()))
            .collect();
        let sum: f32 = p.iter().map(|x| x.1).sum();
        p.iter_mut().for_each(|x| x.1 /= sum);
        if s.min_p > 0.0 {
            // The most likely token has probability exp(0) / sum.
            let floor = s.min_p / sum;
            p.retain(|x| x.1 >= floor);
        }
        p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if s.top_k > 0 {
            p.truncate(s.top_k as usize);
        }
        if s.min_p > 0.0 || s.top_k > 0 {
            let kept: f32 = p.iter().map(|x| x.1).sum();
            p.iter_mut().for_each(|x| x.1 /= kept);
        }
        let mut keep = 0;
        let mut acc = 0.0;
        for x in &p {
            keep += 1;
            acc += x.1;
            if acc >= s.top_p {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams::default()
    }

    /// A sampler with `p`, seeded `seed`.
    fn seeded(seed: u64, p: SamplingParams, prompt: &[u32]) -> Sampler {
        Sampler::with(
            SamplingParams {
                seed: Some(seed),
                ..p
            },
            prompt,
        )
    }

    /// Every token `s` draws in `n` tries.
    fn support(mut s: Sampler, logits: &[f32], n: usize) -> Vec<u32> {
        let mut d: Vec<u32> = (0..n).map(|_| s.sample(logits)).collect();
        d.sort_unstable();
        d.dedup();
        d
    }

    #[test]
    fn neutral_settings_draw_what_temperature_and_top_p_alone_draw() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let neutral = SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            stop_tokens: vec![3],
            ..params()
        };
        let mut a = seeded(7, neutral, &[1, 2, 3]);
        let mut b = Sampler::new(7, 0.8, 0.9);
        for _ in 0..200 {
            assert_eq!(a.sample(&logits), b.sample(&logits));
        }
    }

    #[test]
    fn top_k_keeps_the_k_most_likely() {
        let logits = [0.0, 3.0, 1.0, 2.0, 2.5, -1.0];
        let s = seeded(
            1,
            SamplingParams {
                top_k: 2,
                ..params()
            },
            &[],
        );
        assert_eq!(support(s, &logits, 500), vec![1, 4]);
        // k of the vocabulary or more keeps everything.
        let s = seeded(
            1,
            SamplingParams {
                top_k: 6,
                ..params()
            },
            &[],
        );
        assert_eq!(support(s, &logits, 3000).len(), 6);
    }

    #[test]
    fn min_p_drops_tokens_below_its_fraction_of_the_most_likely() {
        // Probabilities in proportion to e^l: e^0 / e^2 = 0.135 of the top token.
        let logits = [2.0, 0.0, 2.0_f32.ln() + 0.0, 1.9];
        let s = seeded(
            3,
            SamplingParams {
                min_p: 0.2,
                ..params()
            },
            &[],
        );
        assert_eq!(support(s, &logits, 2000), vec![0, 2, 3]);
        let s = seeded(
            3,
            SamplingParams {
                min_p: 0.1,
                ..params()
            },
            &[],
        );
        assert_eq!(support(s, &logits, 2000), vec![0, 1, 2, 3]);
        // Applied after temperature: at 0.5 token 1 is e^-4 = 0.018 of the top token.
        let s = seeded(
            3,
            SamplingParams {
                min_p: 0.1,
                temperature: 0.5,
                ..params()
            },
            &[],
        );
        assert!(!support(s, &logits, 2000).contains(&1));
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() {
        let greedy = |r: f32, prompt: &[u32], logits: &[f32]| {
            let mut s = seeded(
                0,
                SamplingParams {
                    temperature: 0.0,
                    repetition_penalty: r,
                    ..params()
                },
                prompt,
            );
            s.sample(logits)
        };
        // 3.0 / 2 = 1.5 < 2.0: the prompt's token loses to token 1.
        assert_eq!(greedy(2.0, &[0], &[3.0, 2.0]), 1);
        assert_eq!(greedy(1.4, &[0], &[3.0, 2.0]), 0);
        // -1.0 * 2 = -2.0 < -1.5.
        assert_eq!(greedy(2.0, &[0], &[-1.0, -1.5]), 1);
        // Below 1 it favours seen tokens.
        assert_eq!(greedy(0.5, &[1], &[3.0, 2.0]), 1);
        // Output tokens count too: once both were drawn, both are penalised (1.5 against 1.0).
        let mut s = seeded(
            0,
            SamplingParams {
                temperature: 0.0,
                repetition_penalty: 2.0,
                ..params()
            },
            &[],
        );
        let l = [3.0, 2.0];
        assert_eq!((s.sample(&l), s.sample(&l), s.sample(&l)), (0, 1, 0));
    }

    #[test]
    fn frequency_and_presence_penalties_count_the_output_only() {
        let run = |presence: f32, frequency: f32, prompt: &[u32]| {
            let mut s = seeded(
                0,
                SamplingParams {
                    temperature: 0.0,
                    presence_penalty: presence,
                    frequency_penalty: frequency,
                    ..params()
                },
                prompt,
            );
            let l = [1.0, 0.4, 0.0];
            (0..6).map(|_| s.sample(&l)).collect::<Vec<_>>()
        };
        // Frequency 0.25 a use: token 0 leads by 0.6 until it was drawn 3 times.
        assert_eq!(run(0.0, 0.25, &[0, 0, 0]), vec![0, 0, 0, 1, 0, 1]);
        // Presence 0.7 once: token 0 (0.3) drops below token 1 (0.4), which then drops to -0.3.
        assert_eq!(run(0.7, 0.0, &[]), vec![0, 1, 0, 0, 0, 0]);
        // A negative penalty encourages repeating.
        assert_eq!(run(-1.0, 0.0, &[]), vec![0; 6]);
    }

    #[test]
    fn min_tokens_holds_the_stop_tokens_back_that_long() {
        let mut s = seeded(
            0,
            SamplingParams {
                temperature: 0.0,
                min_tokens: 3,
                stop_tokens: vec![0, 2],
                ..params()
            },
            &[],
        );
        let l = [5.0, 1.0, 4.0];
        let d: Vec<u32> = (0..5).map(|_| s.sample(&l)).collect();
        assert_eq!(d, vec![1, 1, 1, 0, 0]);
    }

    #[test]
    fn a_requests_sampler_holds_back_eos_too_unless_it_ignores_eos() {
        let l = [5.0, 1.0, 4.0];
        let p = SamplingParams {
            temperature: 0.0,
            min_tokens: 2,
            stop_tokens: vec![2],
            ..params()
        };
        // EOS 0 and stop token 2 held back twice.
        let mut s = Sampler::for_request(p.clone(), 0, &[]);
        let d: Vec<u32> = (0..3).map(|_| s.sample(&l)).collect();
        assert_eq!(d, vec![1, 1, 0]);
        // Past EOS nothing ends the request, so nothing is held back.
        let mut s = Sampler::for_request(
            SamplingParams {
                ignore_eos: true,
                ..p
            },
            0,
            &[],
        );
        assert_eq!(s.sample(&l), 0);
    }

    #[test]
    fn without_a_seed_each_sampler_draws_its_own() {
        let logits = [0.0_f32; 64];
        let draws = |mut s: Sampler| (0..16).map(|_| s.sample(&logits)).collect::<Vec<_>>();
        let a = draws(Sampler::with(params(), &[]));
        let b = draws(Sampler::with(params(), &[]));
        // 64^-16 of the time the same.
        assert_ne!(a, b);
        assert_eq!(
            draws(seeded(3, params(), &[])),
            draws(seeded(3, params(), &[]))
        );
    }

    #[test]
    fn top_p_after_top_k_renormalises_over_the_kept_tokens() {
        // Two equal tokens and a tail: top_k 2 leaves {0, 1} at 0.5 each; top_p 0.5 keeps 0.
        let logits = [1.0, 1.0, 0.9, 0.9, 0.9];
        let s = seeded(
            2,
            SamplingParams {
                top_k: 2,
                top_p: 0.5,
                ..params()
            },
            &[],
        );
        assert_eq!(support(s, &logits, 500), vec![0]);
    }
}
