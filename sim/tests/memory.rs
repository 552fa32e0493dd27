//! Bounded memory (docs/replay-report.md#the-summary-figure-by-figure): a replay's memory does not grow
//! with the tokens it generates. Its own test binary, for its counting global allocator: the
//! peak heap growth of one replay, measured with no other test running beside it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use mstar_chunking::manifest::Manifest;
use mstar_chunking_sim::config::{Settings, DEMO_MANIFEST_TOML};
use mstar_chunking_sim::replay::{self, ReplayOptions};

/// The system allocator, counting the bytes held now and at the peak.
struct Counting;

static HELD: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn held(delta: isize) {
    let now = if delta >= 0 {
        HELD.fetch_add(delta as usize, Ordering::Relaxed) + delta as usize
    } else {
        HELD.fetch_sub(delta.unsigned_abs(), Ordering::Relaxed) - delta.unsigned_abs()
    };
    PEAK.fetch_max(now, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            held(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        held(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            // Counted as the new block held beside the old one, as a moving realloc holds both.
            held(new_size as isize);
            held(-(layout.size() as isize));
        }
        p
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// 1,000 requests of 16-token prompts that each generate 2,000 tokens: two million
/// times between tokens. Kept one by one (4 bytes each), they alone would hold 8 MB at the
/// end and 12 MB while the last doubling copies; in the bounded histogram, at most 279 KB.
#[test]
fn two_million_generated_tokens_hold_no_memory_per_token() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("long.csv");
    let mut text = String::from("arrival_ms,prompt_tokens,output_tokens\n");
    for _ in 0..1000 {
        text.push_str("0,16,2000\n");
    }
    std::fs::write(&trace, text).unwrap();
    let m = Manifest::from_toml(DEMO_MANIFEST_TOML, "demo").unwrap();
    let s = Settings::default();
    let opts = ReplayOptions {
        trace: Some(trace),
        ..ReplayOptions::default()
    };
    let system = actix::System::new();
    let before = HELD.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let report = system.block_on(replay::run(&m, &s, &opts)).unwrap();
    let growth = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    println!("peak heap growth: {growth} bytes");
    let tbt = report.tbt_ms.unwrap();
    assert_eq!(tbt.samples, 1000 * 1999);
    assert!(
        growth < 4 << 20,
        "the replay's heap grew by {growth} bytes at its peak for {} generated tokens",
        report.tokens.generated
    );
}
