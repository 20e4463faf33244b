//! Live mode's figures: a stack's blocks in use, their sizes and lifetimes,
//! and the whole run's totals and losses.

use serde::{Deserialize, Serialize};

/// p50/p90/p99/max of a distribution (hdrhistogram, 2 significant digits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
}

/// Live mode: what became of one stack's blocks.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveStats {
    /// Tracked allocations that succeeded.
    pub allocations: u64,
    pub allocated_bytes: u64,
    /// Of those, freed while tracing.
    pub frees: u64,
    /// Still allocated when tracing ended.
    pub outstanding: u64,
    pub outstanding_bytes: u64,
    /// Age of the oldest outstanding block.
    pub oldest_age_secs: f64,
    /// Outstanding blocks at least `--min-age` old (leak suspects).
    pub old_outstanding: u64,
    pub old_outstanding_bytes: u64,
    /// This stack's own maximum of live bytes.
    pub max_live_bytes: u64,
    /// This stack's live bytes when the whole heap (as traced) peaked.
    pub live_bytes_at_peak: u64,
    /// Blocks freed sooner than `--temporary-under` after allocation.
    pub temporaries: u64,
    /// Requested sizes in bytes.
    pub size: Option<Percentiles>,
    /// Lifetimes of freed blocks in nanoseconds.
    pub lifetime_ns: Option<Percentiles>,
}

/// Live mode: the whole heap, as traced.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveTotals {
    /// Highest live bytes seen, and when (seconds after tracing began).
    pub peak_bytes: u64,
    pub peak_secs: f64,
    pub outstanding: u64,
    pub outstanding_bytes: u64,
    /// Outstanding blocks at least `min_age_secs` old.
    pub old_outstanding: u64,
    pub old_outstanding_bytes: u64,
    pub min_age_secs: f64,
    pub temporary_under_ns: u64,
    pub tracked_allocations: u64,
    pub temporaries: u64,
    /// Allocations that returned NULL (or posix_memalign != 0): not blocks.
    pub failed: u64,
    /// Allocations not tracked because the live map was full.
    pub untracked: u64,
    pub live_map_size: u64,
    /// Frees of blocks not seen allocated: allocated before attach, or
    /// untracked. Counted apart, never subtracted from anything.
    pub frees_unknown: u64,
    /// Events the kernel-to-tracer buffer had no room for.
    pub events_lost: u64,
    /// Of those, frees (and blocks a resize released) kept aside in the
    /// kernel and applied in their order: not a loss.
    #[serde(default)]
    pub frees_kept: u64,
    /// Frees lost outright (the ring and the map of lost frees both full):
    /// their blocks may be listed outstanding though freed.
    #[serde(default)]
    pub frees_lost: u64,
    /// Of the events lost, allocations kept aside in the kernel and
    /// applied in their order: not a loss.
    #[serde(default)]
    pub allocs_kept: u64,
    /// Allocations lost outright (the ring and the map of lost allocations
    /// both full): their blocks were never followed, so at most this many
    /// leaks are missing from the suspects.
    #[serde(default)]
    pub allocs_lost: u64,
    /// Blocks handed out again while still tracked (a free was missed).
    pub stale: u64,
    /// Allocating calls not followed to their return (no per-thread storage).
    pub pending_full: u64,
    /// Calls of copies of CPython's allocator inlined into their callers
    /// whose block was not seen (the copy left by a way not probed).
    #[serde(default)]
    pub inline_unfinished: u64,
}
