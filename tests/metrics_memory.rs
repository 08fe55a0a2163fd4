//! The metrics recorder's memory stays bounded when nobody scrapes
//! `/metrics`. The Prometheus recorder keeps every histogram sample until
//! the samples are folded into the buckets, which only its upkeep (or a
//! scrape) does: without one, a relay that records one sample per event and
//! is never scraped (a drain, a deployment without Prometheus) grows by
//! about 8 bytes per event for as long as it runs.
//!
//! A process of its own (the recorder is global), with an allocator that
//! counts the bytes live.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use outbox_relay::metrics::names;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histogram_samples_do_not_pile_up_without_a_scrape() {
    let _handle = outbox_relay::metrics::install().expect("recorder installed");
    let before = LIVE.load(Ordering::Relaxed);
    // What a 1,000,000-event drain records: one commit-to-ack sample per event.
    for i in 0..1_000_000u32 {
        metrics::histogram!(names::COMMIT_TO_ACK_SECONDS).record(f64::from(i % 1000) / 1000.0);
    }
    // The upkeep runs every second or so; give it generous slack. The relay
    // goes on recording meanwhile (a few samples here), which is also what
    // lets the recorder free the blocks it folded (epoch-based reclamation).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut grown = LIVE.load(Ordering::Relaxed) - before;
    while grown > 1 << 20 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for _ in 0..100 {
            metrics::histogram!(names::COMMIT_TO_ACK_SECONDS).record(0.001);
        }
        grown = LIVE.load(Ordering::Relaxed) - before;
    }
    assert!(
        grown <= 1 << 20,
        "1,000,000 samples still hold {grown} bytes 30 s later: nothing folds them into the buckets"
    );
}
