//! A simulated prefix (KV) cache: an LRU of fixed-size token blocks keyed by a trace's block
//! hashes (Mooncake `hash_ids`, which form a prefix tree: equal leading ids, equal prefix).
//!
//! A request's cached prefix is the longest run of its leading block hashes present in the
//! cache; its blocks go in once its prefill completed (only then is its KV cache computed).

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

/// The LRU of blocks.
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    block_tokens: u32,
    /// `hash -> last use`; the tick orders blocks for eviction.
    blocks: FxHashMap<u64, u64>,
    /// `last use -> hash`, oldest first: the eviction order.
    by_use: BTreeMap<u64, u64>,
    tick: u64,
    /// Whether a prompt's blocks are made recent last block first, so that eviction takes a
    /// prefix's tail before its head (as vLLM frees a request's blocks); see
    /// [`PrefixCache::tail_first`].
    tail_first: bool,
    /// In a fleet's worker, `hash -> when its KV cache was complete` (simulated ms): a router
    /// looking at the cache while the step that computes a block still runs does not see the
    /// block yet ([`PrefixCache::held_blocks_at`]). `None`: not tracked (one worker).
    visible_from: Option<FxHashMap<u64, f64>>,
}

impl PrefixCache {
    /// A cache of `capacity` blocks of `block_tokens` tokens each.
    pub fn new(capacity: usize, block_tokens: u32) -> Self {
        Self {
            capacity,
            block_tokens,
            blocks: FxHashMap::default(),
            by_use: BTreeMap::new(),
            tick: 0,
            tail_first: false,
            visible_from: None,
        }
    }

    /// Tracks when each block's KV cache was complete, for a fleet's router
    /// ([`PrefixCache::held_blocks_at`]).
    #[must_use]
    pub fn track_visibility(mut self) -> Self {
        self.visible_from = Some(FxHashMap::default());
        self
    }

    /// Makes a prompt's blocks recent from its last to its first, so that the least recently
    /// used block of a prefix is its tail: evicting one block then shortens a cached prefix
    /// instead of making it unreachable (a lookup needs the leading run). The KV memory model
    /// evicts block by block, so it turns this on; without it the cache keeps its first order.
    #[must_use]
    pub fn tail_first(mut self) -> Self {
        self.tail_first = true;
        self
    }

    fn touch_all(&mut self, hashes: &[u64]) {
        if self.tail_first {
            for &h in hashes.iter().rev() {
                self.touch(h);
            }
        } else {
            for &h in hashes {
                self.touch(h);
            }
        }
    }

    fn touch(&mut self, hash: u64) {
        self.tick += 1;
        if let Some(old) = self.blocks.insert(hash, self.tick) {
            self.by_use.remove(&old);
        }
        self.by_use.insert(self.tick, hash);
    }

    /// The tokens of the longest cached prefix of a prompt of `input_tokens` with block hashes
    /// `hashes`, at most `input_tokens - 1` (the last token always runs). The blocks hit become
    /// the most recently used. A block counts once: the run stops at a hash repeated within the
    /// prompt, so the cache never reports more tokens than the blocks it holds.
    pub fn lookup(&mut self, hashes: &[u64], input_tokens: u32) -> u32 {
        let mut seen = rustc_hash::FxHashSet::default();
        let hits = hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h) && seen.insert(**h))
            .count();
        self.touch_all(&hashes[..hits]);
        let tokens = u64::from(self.block_tokens) * hits as u64;
        tokens.min(u64::from(input_tokens.saturating_sub(1))) as u32
    }

    /// Puts a prefilled prompt's blocks in, evicting the least recently used beyond capacity.
    #[cfg(test)]
    pub fn insert(&mut self, hashes: &[u64]) {
        self.insert_at(hashes, 0.0);
    }

    /// [`PrefixCache::insert`] by a step that ends at `t_ms`: the blocks new to the cache are
    /// visible to a router from then on (when tracked).
    pub fn insert_at(&mut self, hashes: &[u64], t_ms: f64) {
        if self.capacity == 0 {
            return;
        }
        if let Some(v) = &mut self.visible_from {
            for h in hashes {
                if !self.blocks.contains_key(h) {
                    v.insert(*h, t_ms);
                }
            }
        }
        self.touch_all(hashes);
        while self.blocks.len() > self.capacity {
            let Some((_, oldest)) = self.by_use.pop_first() else {
                break;
            };
            self.forget(oldest);
        }
    }

    fn forget(&mut self, hash: u64) {
        self.blocks.remove(&hash);
        if let Some(v) = &mut self.visible_from {
            v.remove(&hash);
        }
    }

    /// How many of a prompt's leading blocks (`hashes`) the cache holds, as a router sees it
    /// at `t_ms`: blocks still being computed by a step that ends after `t_ms` are not counted
    /// (when tracked). Nothing becomes more recent.
    pub fn held_blocks_at(&self, hashes: &[u64], t_ms: f64) -> u32 {
        let mut seen = rustc_hash::FxHashSet::default();
        let visible = |h: &u64| {
            self.visible_from
                .as_ref()
                .is_none_or(|v| v.get(h).is_none_or(|&from| from <= t_ms))
        };
        let hits = hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h) && visible(h) && seen.insert(**h))
            .count();
        u32::try_from(hits).unwrap_or(u32::MAX)
    }

    /// What [`lookup`](Self::lookup) would answer, without making any block more recent (to
    /// test whether a prompt could be admitted).
    pub fn peek(&self, hashes: &[u64], input_tokens: u32) -> u32 {
        let mut seen = rustc_hash::FxHashSet::default();
        let hits = hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h) && seen.insert(**h))
            .count();
        let tokens = u64::from(self.block_tokens) * hits as u64;
        tokens.min(u64::from(input_tokens.saturating_sub(1))) as u32
    }

    /// Evicts the least recently used block; answers whether there was one.
    pub fn evict_lru(&mut self) -> bool {
        match self.by_use.pop_first() {
            Some((_, oldest)) => {
                self.forget(oldest);
                true
            }
            None => false,
        }
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_leading_run_hits_and_lru_evicts() {
        let mut c = PrefixCache::new(3, 512);
        assert_eq!(c.lookup(&[1, 2, 3], 1500), 0);
        c.insert(&[1, 2]);
        // Leading run [1, 2]; 3 is missing.
        assert_eq!(c.lookup(&[1, 2, 3], 1500), 1024);
        // A gap stops the run even when later blocks are present.
        assert_eq!(c.lookup(&[9, 2], 1000), 0);
        // A full hit still leaves the last token to run.
        assert_eq!(c.lookup(&[1, 2], 1024), 1023);
        c.insert(&[7]);
        c.lookup(&[1], 600); // 1 is now more recent than 2
        c.insert(&[8]); // evicts 2, the least recently used
        assert_eq!(c.len(), 3);
        assert_eq!(c.lookup(&[1, 2], 2000), 512);
        assert_eq!(c.lookup(&[8], 600), 512);
    }

    #[test]
    fn a_repeated_hash_counts_once() {
        let mut c = PrefixCache::new(1, 512);
        c.insert(&[7]);
        assert_eq!(c.len(), 1);
        assert_eq!(c.lookup(&[7, 7, 7, 7], 4096), 512);
        let mut c = PrefixCache::new(4, 512);
        c.insert(&[1, 2]);
        assert_eq!(c.lookup(&[1, 2, 1, 2], 4096), 1024);
    }

    #[test]
    fn peek_does_not_reorder_and_eviction_takes_the_oldest() {
        let mut c = PrefixCache::new(3, 512);
        c.insert(&[1, 2, 3]);
        assert_eq!(c.peek(&[1, 2], 2000), 1024);
        // Peeking at 1 did not make it recent: it is still the oldest.
        assert!(c.evict_lru());
        assert_eq!(c.peek(&[1], 600), 0);
        assert_eq!(c.lookup(&[2], 600), 512); // 2 is now the most recent
        assert!(c.evict_lru()); // evicts 3
        assert_eq!((c.len(), c.peek(&[2], 600), c.peek(&[3], 600)), (1, 512, 0));
        assert!(c.evict_lru());
        assert!(!c.evict_lru());
        assert!(c.is_empty());
    }

    #[test]
    fn a_router_sees_a_block_once_the_step_computing_it_has_ended() {
        let mut c = PrefixCache::new(8, 512).track_visibility();
        c.insert_at(&[1, 2], 100.0);
        // Blocks 1 and 2 ended at 100 ms; block 3 joins at 250 ms with 1 and 2 again.
        c.insert_at(&[1, 2, 3], 250.0);
        assert_eq!(c.held_blocks_at(&[1, 2, 3], 99.0), 0);
        assert_eq!(c.held_blocks_at(&[1, 2, 3], 100.0), 2);
        assert_eq!(c.held_blocks_at(&[1, 2, 3], 249.9), 2);
        assert_eq!(c.held_blocks_at(&[1, 2, 3], 250.0), 3);
        // A gap or a repeat stops the run, as a lookup's does.
        assert_eq!(c.held_blocks_at(&[9, 1], 300.0), 0);
        assert_eq!(c.held_blocks_at(&[1, 1, 2], 300.0), 1);
        // An evicted block comes back with the time of its new insert.
        let mut small = PrefixCache::new(1, 512).track_visibility();
        small.insert_at(&[5], 10.0);
        small.insert_at(&[6], 20.0);
        small.insert_at(&[5], 30.0);
        assert_eq!(small.held_blocks_at(&[5], 25.0), 0);
        assert_eq!(small.held_blocks_at(&[5], 30.0), 1);
        // Untracked: every block held counts, whenever it was put in.
        let mut plain = PrefixCache::new(8, 512);
        plain.insert_at(&[1, 2], 1e9);
        assert_eq!(plain.held_blocks_at(&[1, 2], 0.0), 2);
    }

    #[test]
    fn tail_first_eviction_shortens_a_prefix_instead_of_losing_it() {
        let mut plain = PrefixCache::new(8, 512);
        let mut tail = PrefixCache::new(8, 512).tail_first();
        for c in [&mut plain, &mut tail] {
            c.insert(&[1, 2, 3]);
            assert!(c.evict_lru());
        }
        // Head first: block 1 went, so nothing of the prefix can hit.
        assert_eq!(plain.peek(&[1, 2, 3], 2000), 0);
        // Tail first: block 3 went, two blocks still hit.
        assert_eq!(tail.peek(&[1, 2, 3], 2000), 1024);
        tail.lookup(&[1, 2], 2000);
        assert!(tail.evict_lru());
        assert_eq!(
            tail.peek(&[1, 2], 2000),
            512,
            "the lookup kept the head recent"
        );
    }

    #[test]
    fn zero_capacity_holds_nothing() {
        let mut c = PrefixCache::new(0, 512);
        c.insert(&[1]);
        assert!(c.is_empty());
        assert_eq!(c.lookup(&[1], 600), 0);
    }
}
