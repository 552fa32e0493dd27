//! KV-cache block accounting for the replay (`docs/kv-memory.md`): a fixed pool of blocks of
//! `block_tokens` tokens, shared by the requests in the component and by the prefix cache.
//!
//! Plain data, no I/O: the simulation (`sim.rs`) decides when to allocate, evict and preempt;
//! this module only counts, and refuses an allocation that does not fit (changing nothing).
//!
//! - A request holds `ceil(tokens / block_tokens)` blocks for the tokens its KV cache holds;
//!   it only grows while the request runs, and is released whole when it ends or is
//!   preempted.
//! - An admitted prompt that has not run its first chunk holds no block but a *reservation*
//!   of the blocks its first chunk needs; reservations only gate admission.
//! - The prefix cache's blocks count against the pool too; they are evictable.
//! - The watermark is a number of blocks that admission leaves free for running requests to
//!   grow into; allocation for running requests may use it.

/// Why an allocation was refused: the blocks it needed beyond what is free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Short {
    /// Blocks missing.
    pub missing: u64,
}

/// The pool of KV blocks.
#[derive(Debug, Clone)]
pub struct KvPool {
    limit: u64,
    block_tokens: u32,
    watermark: u64,
    /// Blocks held, by request index.
    held: Vec<u64>,
    /// Blocks reserved for a first chunk, by request index.
    reserved: Vec<u64>,
    requests_used: u64,
    reserved_total: u64,
    cache_used: u64,
    peak: u64,
    used_sum: u128,
    samples: u64,
}

impl KvPool {
    /// A pool of `limit` blocks of `block_tokens` tokens (both at least 1) for `requests`
    /// requests (indices `0..requests`), keeping `watermark` blocks free at admission.
    pub fn new(limit: u64, block_tokens: u32, watermark: u64, requests: usize) -> Self {
        Self {
            limit: limit.max(1),
            block_tokens: block_tokens.max(1),
            watermark,
            held: vec![0; requests],
            reserved: vec![0; requests],
            requests_used: 0,
            reserved_total: 0,
            cache_used: 0,
            peak: 0,
            used_sum: 0,
            samples: 0,
        }
    }

    /// Blocks in the pool.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// Blocks admission keeps free.
    pub fn watermark(&self) -> u64 {
        self.watermark
    }

    /// Blocks that hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.block_tokens))
    }

    /// Blocks request `i` holds.
    pub fn held(&self, i: usize) -> u64 {
        self.held.get(i).copied().unwrap_or(0)
    }

    /// Blocks in use: the requests' and the prefix cache's.
    pub fn used(&self) -> u64 {
        self.requests_used + self.cache_used
    }

    /// Blocks the prefix cache holds.
    pub fn cache_used(&self) -> u64 {
        self.cache_used
    }

    /// Blocks reserved for admitted prompts' first chunks.
    #[cfg(test)]
    pub fn reserved(&self) -> u64 {
        self.reserved_total
    }

    /// Blocks neither a request nor the prefix cache holds.
    pub fn free(&self) -> u64 {
        self.limit.saturating_sub(self.used())
    }

    /// The blocks request `i` must add to hold `tokens` tokens (0 if it holds enough).
    pub fn extra_for(&self, i: usize, tokens: u64) -> u64 {
        self.blocks_for(tokens).saturating_sub(self.held(i))
    }

    /// Grows request `i` to hold `tokens` tokens, converting its reservation. Refused, with
    /// nothing changed, when the blocks it adds are not free.
    ///
    /// # Errors
    /// [`Short`]: the blocks missing.
    pub fn grow(&mut self, i: usize, tokens: u64) -> Result<u64, Short> {
        let extra = self.extra_for(i, tokens);
        if extra > self.free() {
            return Err(Short {
                missing: extra - self.free(),
            });
        }
        self.clear_reservation(i);
        if extra > 0 {
            self.held[i] += extra;
            self.requests_used += extra;
            self.peak = self.peak.max(self.used());
        }
        Ok(extra)
    }

    /// Releases every block request `i` holds, and its reservation; answers the blocks freed.
    pub fn release(&mut self, i: usize) -> u64 {
        self.clear_reservation(i);
        let Some(h) = self.held.get_mut(i) else {
            return 0;
        };
        let freed = std::mem::take(h);
        self.requests_used -= freed;
        freed
    }

    /// Whether a prompt whose first chunk needs `blocks` may be admitted: it fits with the
    /// watermark left free, counting the blocks already reserved and the prefix cache as free
    /// (it is evicted on demand). `alone`: nothing else is admitted; then the watermark and
    /// reservations do not apply, so the replay always makes progress.
    pub fn can_admit(&self, blocks: u64, alone: bool) -> bool {
        let available = self.limit.saturating_sub(self.requests_used);
        if alone {
            return blocks <= available;
        }
        available >= blocks + self.reserved_total + self.watermark
    }

    /// Reserves `blocks` for request `i`'s first chunk (replacing a reservation it had).
    pub fn reserve(&mut self, i: usize, blocks: u64) {
        self.clear_reservation(i);
        if let Some(r) = self.reserved.get_mut(i) {
            *r = blocks;
            self.reserved_total += blocks;
        }
    }

    /// Drops request `i`'s reservation, if any.
    pub fn clear_reservation(&mut self, i: usize) {
        if let Some(r) = self.reserved.get_mut(i) {
            self.reserved_total -= std::mem::take(r);
        }
    }

    /// Sets the blocks the prefix cache holds. Refused, with nothing changed, when the growth is
    /// not free.
    ///
    /// # Errors
    /// [`Short`]: the blocks missing.
    pub fn set_cache(&mut self, blocks: u64) -> Result<(), Short> {
        let grow = blocks.saturating_sub(self.cache_used);
        if grow > self.free() {
            return Err(Short {
                missing: grow - self.free(),
            });
        }
        self.cache_used = blocks;
        self.peak = self.peak.max(self.used());
        Ok(())
    }

    /// Records the blocks in use for one step (for the mean utilisation).
    pub fn sample(&mut self) {
        self.used_sum += u128::from(self.used());
        self.samples += 1;
    }

    /// Pools another worker's pool figures (of the same size) into these: the larger peak, and
    /// every step's sample for the mean.
    pub fn absorb_figures(&mut self, other: &KvPool) {
        self.peak = self.peak.max(other.peak);
        self.used_sum += other.used_sum;
        self.samples += other.samples;
    }

    /// The most blocks ever in use.
    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// The mean blocks in use over the steps sampled, as a fraction of the pool; `None`
    /// without a sample.
    pub fn mean_utilisation(&self) -> Option<f64> {
        (self.samples > 0).then(|| self.used_sum as f64 / self.samples as f64 / self.limit as f64)
    }
}

/// Bytes in a GiB: memory sizes (`gpu_memory_gb`, `weights_gb`) are in GiB, as GPU memory is
/// sold (an "80GB" A100 has 80 GiB, 81,920 MiB).
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// A memory budget: where the KV pool's blocks come from (`docs/kv-memory.md#presets`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryBudget {
    /// GPU memory, GiB.
    pub gpu_memory_gb: f64,
    /// The fraction of it the engine may use (vLLM's `gpu_memory_utilization`).
    pub memory_utilization: f64,
    /// The weights, GiB.
    pub weights_gb: f64,
    /// Bytes of KV cache per token.
    pub kv_bytes_per_token: f64,
}

impl MemoryBudget {
    /// Bytes left for the KV cache: `gpu × utilization − weights` (may be ≤ 0).
    pub fn kv_bytes(&self) -> f64 {
        self.gpu_memory_gb * self.memory_utilization * GIB - self.weights_gb * GIB
    }

    /// Whole blocks of `block_tokens` tokens that fit in [`kv_bytes`](Self::kv_bytes).
    pub fn blocks(&self, block_tokens: u32) -> u64 {
        let per_block = self.kv_bytes_per_token * f64::from(block_tokens);
        let b = (self.kv_bytes() / per_block).floor();
        if b.is_finite() && b > 0.0 {
            b as u64
        } else {
            0
        }
    }
}

/// Llama-2-7B's parameters (`meta-llama/Llama-2-7b-hf`: 6,738,415,616), 2 bytes each in fp16.
pub const LLAMA2_7B_WEIGHT_BYTES: f64 = 6_738_415_616.0 * 2.0;

/// A memory preset: a model on a GPU, at vLLM's default utilisation of 0.9.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryPreset {
    /// The name configs use (`[replay.kv] preset = "..."`), as the cost presets'.
    pub name: &'static str,
    /// Its budget.
    pub budget: MemoryBudget,
}

/// The memory presets: the model/GPU pairs of the cost presets.
pub const MEMORY_PRESETS: [MemoryPreset; 2] = [
    MemoryPreset {
        name: "llama2-7b-a100",
        budget: MemoryBudget {
            gpu_memory_gb: 80.0,
            memory_utilization: 0.9,
            weights_gb: LLAMA2_7B_WEIGHT_BYTES / GIB,
            kv_bytes_per_token: 524_288.0,
        },
    },
    MemoryPreset {
        name: "llama2-7b-h100",
        budget: MemoryBudget {
            gpu_memory_gb: 80.0,
            memory_utilization: 0.9,
            weights_gb: LLAMA2_7B_WEIGHT_BYTES / GIB,
            kv_bytes_per_token: 524_288.0,
        },
    },
];

/// The memory preset called `name`.
pub fn memory_preset(name: &str) -> Option<&'static MemoryPreset> {
    MEMORY_PRESETS.iter().find(|p| p.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_up_and_growth_only_adds_what_is_missing() {
        let mut p = KvPool::new(10, 16, 1, 3);
        assert_eq!(
            (
                p.blocks_for(0),
                p.blocks_for(1),
                p.blocks_for(16),
                p.blocks_for(17)
            ),
            (0, 1, 1, 2)
        );
        assert_eq!(p.grow(0, 17), Ok(2));
        assert_eq!(p.grow(0, 32), Ok(0), "32 tokens still fit in 2 blocks");
        assert_eq!(p.grow(0, 33), Ok(1));
        assert_eq!((p.held(0), p.used(), p.free()), (3, 3, 7));
        // A shorter context never shrinks what is held.
        assert_eq!(p.grow(0, 1), Ok(0));
        assert_eq!(p.held(0), 3);
    }

    #[test]
    fn a_refused_growth_changes_nothing_and_says_what_is_missing() {
        let mut p = KvPool::new(4, 16, 0, 2);
        p.grow(0, 48).unwrap();
        assert_eq!(p.grow(1, 40), Err(Short { missing: 2 }));
        assert_eq!((p.held(1), p.used(), p.peak()), (0, 3, 3));
        assert_eq!(p.release(0), 3);
        assert_eq!(p.grow(1, 40), Ok(3));
        assert_eq!((p.used(), p.peak()), (3, 3));
        // Releasing twice frees nothing the second time; an unknown index is a no-op.
        assert_eq!(p.release(1), 3);
        assert_eq!(p.release(1), 0);
        assert_eq!(p.release(99), 0);
        assert_eq!(p.used(), 0);
    }

    #[test]
    fn admission_keeps_the_watermark_and_the_reservations_free() {
        let mut p = KvPool::new(10, 16, 2, 4);
        p.grow(0, 16 * 4).unwrap();
        // 6 blocks left: 4 fit with 2 kept free, 5 do not.
        assert!(p.can_admit(4, false));
        assert!(!p.can_admit(5, false));
        p.reserve(1, 3);
        assert_eq!(p.reserved(), 3);
        assert!(!p.can_admit(2, false), "3 reserved + 2 + watermark 2 > 6");
        assert!(p.can_admit(1, false));
        // Alone, only the pool bounds it.
        assert!(p.can_admit(6, true));
        assert!(!p.can_admit(7, true));
        // Growing request 1 converts its reservation.
        p.grow(1, 10).unwrap();
        assert_eq!((p.reserved(), p.held(1)), (0, 1));
        p.reserve(2, 2);
        p.reserve(2, 1);
        assert_eq!(p.reserved(), 1, "a new reservation replaces the old");
        p.release(2);
        assert_eq!(p.reserved(), 0);
    }

    #[test]
    fn the_prefix_cache_counts_against_the_pool_but_not_against_admission() {
        let mut p = KvPool::new(10, 16, 0, 2);
        p.set_cache(6).unwrap();
        assert_eq!((p.used(), p.free(), p.cache_used()), (6, 4, 6));
        assert_eq!(p.grow(0, 16 * 5), Err(Short { missing: 1 }));
        // The cache is evictable, so admission counts its blocks as available.
        assert!(p.can_admit(10, false));
        assert_eq!(p.set_cache(11), Err(Short { missing: 1 }), "5 more, 4 free");
        p.set_cache(1).unwrap();
        assert_eq!(p.grow(0, 16 * 5), Ok(5));
        assert_eq!((p.used(), p.peak()), (6, 6));
        assert_eq!(p.set_cache(6), Err(Short { missing: 1 }));
    }

    #[test]
    fn presets_match_the_derivation_in_the_docs() {
        // docs/kv-memory.md#presets: 80 GiB × 0.9 − 12.551 GiB of weights = 59.449 GiB;
        // / (512 KiB × 16) = 7,609 blocks = 121,744 tokens.
        for name in ["llama2-7b-a100", "llama2-7b-h100"] {
            let p = memory_preset(name).unwrap();
            assert!((p.budget.weights_gb - 12.5512).abs() < 1e-4);
            assert_eq!(
                p.budget.kv_bytes_per_token,
                mstar_chunking::latency::presets::LLAMA2_7B.kv_bytes_per_token()
            );
            assert_eq!(p.budget.blocks(16), 7609, "{name}");
            assert_eq!(p.budget.blocks(32), 3804, "{name}");
        }
        assert!(memory_preset("gpt-9").is_none());
        let none = MemoryBudget {
            gpu_memory_gb: 10.0,
            memory_utilization: 0.9,
            weights_gb: 12.0,
            kv_bytes_per_token: 1.0,
        };
        assert_eq!(none.blocks(16), 0);
    }

    #[test]
    fn mean_utilisation_is_over_the_samples() {
        let mut p = KvPool::new(8, 1, 0, 1);
        assert_eq!(p.mean_utilisation(), None);
        p.grow(0, 2).unwrap();
        p.sample();
        p.grow(0, 6).unwrap();
        p.sample();
        assert_eq!(p.mean_utilisation(), Some(0.5));
        assert_eq!(p.peak(), 6);
    }
}
