//! `ChunkRange`: the tokens one chunked row runs in one step (docs/ranges.md).

use serde::Serialize;

/// The tokens `[start, end)` a chunked row runs this step, of the `total` its whole prepared
/// input was measured at.
///
/// `stride` is how far the chunk moves the row's chunk Loop, which counts tokens run up to
/// `total`: `end` for a prompt's first chunk (the Loop starts at 0 even when a cached prefix moved
/// `start` past 0), `end - start` for every later chunk. So the strides of a completed row always
/// sum to `total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct ChunkRange {
    /// The first token the chunk runs.
    pub start: u32,
    /// One past the last token it runs.
    pub end: u32,
    /// Tokens of the whole prepared input.
    pub total: u32,
    /// How far the chunk moves the row's chunk Loop.
    pub stride: u32,
}

impl ChunkRange {
    /// Builds the first chunk of a prompt; `start` is the cached prefix length.
    ///
    /// Callers guarantee `start < end <= total` (checked in debug builds).
    pub fn first(start: u32, end: u32, total: u32) -> Self {
        debug_assert!(
            start < end && end <= total,
            "bad first chunk [{start},{end}) of {total}"
        );
        Self {
            start,
            end,
            total,
            stride: end,
        }
    }

    /// Builds a later chunk, which continues from the previous chunk's `end`.
    pub fn later(start: u32, end: u32, total: u32) -> Self {
        debug_assert!(
            start < end && end <= total,
            "bad chunk [{start},{end}) of {total}"
        );
        Self {
            start,
            end,
            total,
            stride: end - start,
        }
    }

    /// Builds the first or a later chunk depending on whether the row has run a chunk before.
    ///
    /// ```
    /// use mstar_chunking::ChunkRange;
    ///
    /// // A 1,000-token prompt with a 300-token cached prefix, cut at 512 then finished.
    /// let first = ChunkRange::new(true, 300, 512, 1000);
    /// let last = ChunkRange::new(false, 512, 1000, 1000);
    /// assert_eq!((first.stride, first.tokens()), (512, 212)); // the Loop counts from 0
    /// assert_eq!(first.stride + last.stride, 1000);
    /// assert!(last.is_final() && !first.is_final());
    /// ```
    pub fn new(first: bool, start: u32, end: u32, total: u32) -> Self {
        if first {
            Self::first(start, end, total)
        } else {
            Self::later(start, end, total)
        }
    }

    /// Whether this chunk ends the row's prefill.
    pub fn is_final(&self) -> bool {
        self.end == self.total
    }

    /// The tokens this chunk runs (the cached prefix is not run).
    pub fn tokens(&self) -> u32 {
        self.end - self.start
    }
}

/// The most tokens of a prepared input that a cached prefix may cover: a full cache hit still
/// runs the last token, so the row produces its next token.
pub fn clamp_cached(cached: u32, total: u32) -> u32 {
    cached.min(total.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_chunk_strides_from_zero_even_with_a_cached_prefix() {
        let c = ChunkRange::first(512, 1024, 4096);
        assert_eq!(c.stride, 1024);
        assert_eq!(c.tokens(), 512);
        assert!(!c.is_final());
    }

    #[test]
    fn later_chunks_stride_by_their_length_and_strides_sum_to_total() {
        let chunks = [
            ChunkRange::first(100, 1000, 2500),
            ChunkRange::later(1000, 2000, 2500),
            ChunkRange::later(2000, 2500, 2500),
        ];
        assert_eq!(chunks.iter().map(|c| c.stride).sum::<u32>(), 2500);
        assert_eq!(chunks.iter().filter(|c| c.is_final()).count(), 1);
        assert!(chunks[2].is_final());
    }

    #[test]
    fn a_whole_row_is_one_final_chunk() {
        let c = ChunkRange::new(true, 0, 10, 10);
        assert!(c.is_final());
        assert_eq!(c.stride, 10);
    }

    #[test]
    fn cached_prefix_leaves_the_last_token() {
        assert_eq!(clamp_cached(4096, 4096), 4095);
        assert_eq!(clamp_cached(10, 4096), 10);
        assert_eq!(clamp_cached(5, 0), 0);
    }
}
