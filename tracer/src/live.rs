//! Live mode: what the allocation and free events say about the heap.
//!
//! The BPF programs keep every outstanding block in a bounded map and send
//! one event per tracked allocation and one per free of a tracked block, in
//! the order they happened. [`LiveTracker`] folds them into per-stack
//! statistics: outstanding blocks, sizes and lifetimes (hdrhistogram),
//! temporary allocations, each stack's own maximum of live bytes, and the
//! global peak with every stack's share of it (what DHAT calls t-gmax).
//! Its memory is bounded by the number of distinct stacks, not blocks.

use std::collections::HashMap;

use hdrhistogram::Histogram;
use tracer_common::{CountKey, Event, EVENT_ALLOC, EVENT_FREE};

use crate::profile::{LiveStats, Percentiles};

/// Per-stack state.
pub struct KeyStats {
    pub allocations: u64,
    pub allocated_bytes: u64,
    pub frees: u64,
    pub freed_bytes: u64,
    pub live_blocks: u64,
    pub live_bytes: u64,
    pub max_live_bytes: u64,
    pub live_bytes_at_peak: u64,
    pub temporaries: u64,
    sizes: Histogram<u64>,
    lifetimes: Histogram<u64>,
}

impl KeyStats {
    fn new() -> Self {
        KeyStats {
            allocations: 0,
            allocated_bytes: 0,
            frees: 0,
            freed_bytes: 0,
            live_blocks: 0,
            live_bytes: 0,
            max_live_bytes: 0,
            live_bytes_at_peak: 0,
            temporaries: 0,
            // Two significant digits: percentiles within 1%, a few KiB each.
            sizes: Histogram::new(2).expect("valid sigfig"),
            lifetimes: Histogram::new(2).expect("valid sigfig"),
        }
    }
}

pub struct LiveTracker {
    pub keys: HashMap<CountKey, KeyStats>,
    pub temporary_ns: u64,
    pub live_bytes: u64,
    pub peak_bytes: u64,
    /// Monotonic time (ns) of the peak.
    pub peak_ts: u64,
    /// The peak was raised and per-stack shares not yet taken.
    peak_pending: bool,
    /// Events that did not parse (never expected).
    pub bad_events: u64,
}

impl LiveTracker {
    pub fn new(temporary_ns: u64) -> Self {
        LiveTracker {
            keys: HashMap::new(),
            temporary_ns,
            live_bytes: 0,
            peak_bytes: 0,
            peak_ts: 0,
            peak_pending: false,
            bad_events: 0,
        }
    }

    /// Takes one raw ring-buffer record.
    pub fn on_bytes(&mut self, bytes: &[u8]) {
        if bytes.len() < std::mem::size_of::<Event>() {
            self.bad_events += 1;
            return;
        }
        // SAFETY: Event is plain old data and the record is at least its size.
        let ev: Event = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        self.on_event(&ev);
    }

    pub fn on_event(&mut self, ev: &Event) {
        match ev.kind {
            EVENT_ALLOC => self.on_alloc(ev),
            EVENT_FREE => self.on_free(ev),
            _ => self.bad_events += 1,
        }
    }

    fn on_alloc(&mut self, ev: &Event) {
        let st = self.keys.entry(ev.key).or_insert_with(KeyStats::new);
        st.allocations += 1;
        st.allocated_bytes += ev.size;
        st.live_blocks += 1;
        st.live_bytes += ev.size;
        st.max_live_bytes = st.max_live_bytes.max(st.live_bytes);
        record(&mut st.sizes, ev.size);
        self.live_bytes += ev.size;
        if self.live_bytes > self.peak_bytes {
            self.peak_bytes = self.live_bytes;
            self.peak_ts = ev.ts;
            self.peak_pending = true;
        }
    }

    fn on_free(&mut self, ev: &Event) {
        // Leaving a peak: record every stack's share of it, once.
        if self.peak_pending {
            self.take_peak_shares();
        }
        let st = self.keys.entry(ev.key).or_insert_with(KeyStats::new);
        st.frees += 1;
        st.freed_bytes += ev.size;
        st.live_blocks = st.live_blocks.saturating_sub(1);
        st.live_bytes = st.live_bytes.saturating_sub(ev.size);
        let lifetime = ev.ts.saturating_sub(ev.alloc_ts);
        record(&mut st.lifetimes, lifetime);
        if lifetime < self.temporary_ns {
            st.temporaries += 1;
        }
        self.live_bytes = self.live_bytes.saturating_sub(ev.size);
    }

    fn take_peak_shares(&mut self) {
        for st in self.keys.values_mut() {
            st.live_bytes_at_peak = st.live_bytes;
        }
        self.peak_pending = false;
    }

    /// Call once no more events will come.
    pub fn finish(&mut self) {
        if self.peak_pending {
            self.take_peak_shares();
        }
    }

    /// The statistics of one stack; `outstanding` comes from the kernel's
    /// map of live blocks: (blocks, bytes, oldest allocation time, blocks
    /// and bytes at least `--min-age` old).
    pub fn stats(
        &self,
        key: &CountKey,
        outstanding: Option<&Outstanding>,
        now: u64,
    ) -> Option<LiveStats> {
        let st = self.keys.get(key);
        if st.is_none() && outstanding.is_none() {
            return None;
        }
        let o = outstanding.copied().unwrap_or_default();
        let percentiles = |h: &Histogram<u64>| {
            (!h.is_empty()).then(|| Percentiles {
                p50: h.value_at_quantile(0.50),
                p90: h.value_at_quantile(0.90),
                p99: h.value_at_quantile(0.99),
                max: h.max(),
            })
        };
        Some(LiveStats {
            allocations: st.map_or(0, |s| s.allocations),
            allocated_bytes: st.map_or(0, |s| s.allocated_bytes),
            frees: st.map_or(0, |s| s.frees),
            outstanding: o.blocks,
            outstanding_bytes: o.bytes,
            oldest_age_secs: if o.blocks > 0 {
                now.saturating_sub(o.oldest_ts) as f64 / 1e9
            } else {
                0.0
            },
            old_outstanding: o.old_blocks,
            old_outstanding_bytes: o.old_bytes,
            max_live_bytes: st.map_or(0, |s| s.max_live_bytes),
            live_bytes_at_peak: st.map_or(0, |s| s.live_bytes_at_peak),
            temporaries: st.map_or(0, |s| s.temporaries),
            size: st.and_then(|s| percentiles(&s.sizes)),
            lifetime_ns: st.and_then(|s| percentiles(&s.lifetimes)),
        })
    }
}

/// Records into an auto-resizing histogram (memory grows with the largest
/// value seen, not with a fixed range); values beyond its reach are clamped.
fn record(h: &mut Histogram<u64>, v: u64) {
    if h.record(v).is_err() {
        h.saturating_record(v);
    }
}

/// Outstanding blocks of one stack, from the kernel's live map.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outstanding {
    pub blocks: u64,
    pub bytes: u64,
    pub oldest_ts: u64,
    /// Blocks (and their bytes) allocated at least `--min-age` ago.
    pub old_blocks: u64,
    pub old_bytes: u64,
}

/// CLOCK_MONOTONIC in ns: the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(stack: u64) -> CountKey {
        CountKey {
            stack,
            ..CountKey::default()
        }
    }

    fn alloc(k: u64, size: u64, ts: u64) -> Event {
        Event {
            kind: EVENT_ALLOC,
            ptr: ts,
            size,
            alloc_ts: ts,
            ts,
            key: key(k),
            ..Event::default()
        }
    }

    fn free(k: u64, size: u64, alloc_ts: u64, ts: u64) -> Event {
        Event {
            kind: EVENT_FREE,
            ptr: alloc_ts,
            size,
            alloc_ts,
            ts,
            key: key(k),
            ..Event::default()
        }
    }

    #[test]
    fn peak_shares_are_taken_when_the_heap_shrinks() {
        let mut t = LiveTracker::new(1_000_000);
        t.on_event(&alloc(1, 100, 1));
        t.on_event(&alloc(2, 50, 2));
        // Peak 150: stack 1 has 100 of it, stack 2 has 50.
        t.on_event(&free(1, 100, 1, 3));
        t.on_event(&alloc(2, 60, 4)); // live 110, below the peak
        t.finish();
        assert_eq!(t.peak_bytes, 150);
        assert_eq!(t.keys[&key(1)].live_bytes_at_peak, 100);
        assert_eq!(t.keys[&key(2)].live_bytes_at_peak, 50);
        assert_eq!(t.keys[&key(2)].max_live_bytes, 110);
    }

    #[test]
    fn a_later_higher_peak_replaces_the_shares() {
        let mut t = LiveTracker::new(1_000_000);
        t.on_event(&alloc(1, 100, 1));
        t.on_event(&free(1, 100, 1, 2));
        t.on_event(&alloc(2, 300, 3));
        t.finish();
        assert_eq!(t.peak_bytes, 300);
        assert_eq!(t.keys[&key(1)].live_bytes_at_peak, 0);
        assert_eq!(t.keys[&key(2)].live_bytes_at_peak, 300);
    }

    #[test]
    fn temporaries_and_lifetimes() {
        let mut t = LiveTracker::new(1000);
        t.on_event(&alloc(1, 8, 10));
        t.on_event(&free(1, 8, 10, 500)); // 490 ns: temporary
        t.on_event(&alloc(1, 8, 600));
        t.on_event(&free(1, 8, 600, 10_600)); // 10 us: not
        t.finish();
        let s = t.stats(&key(1), None, 20_000).unwrap();
        assert_eq!(s.temporaries, 1);
        assert_eq!(s.allocations, 2);
        assert_eq!(s.frees, 2);
        let life = s.lifetime_ns.unwrap();
        assert!(life.max >= 10_000 && life.max <= 10_100, "{life:?}");
        assert_eq!(s.size.unwrap().p50, 8);
    }

    #[test]
    fn outstanding_comes_from_the_kernel_map() {
        let mut t = LiveTracker::new(1000);
        t.on_event(&alloc(1, 64, 1_000_000_000));
        t.finish();
        let o = Outstanding {
            blocks: 1,
            bytes: 64,
            oldest_ts: 1_000_000_000,
            old_blocks: 1,
            old_bytes: 64,
        };
        let s = t.stats(&key(1), Some(&o), 3_000_000_000).unwrap();
        assert_eq!(s.outstanding, 1);
        assert!((s.oldest_age_secs - 2.0).abs() < 1e-9);
    }
}
