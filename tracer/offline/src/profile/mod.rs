//! The symbolized profile: what every renderer reads.
//!
//! Produced by the tracer's symbolizer from the raw profile (addresses);
//! written and read as a file by [`file`]. Stacks are stored innermost first: `frames[0]` is the
//! direct caller of the allocator function (the allocator's own frame is
//! implied by [`StackEntry::func`]).
//!
//! A frame is shared, not copied: every stack that passes through it holds
//! an [`Arc`] of the one [`Frame`], so a profile takes memory in
//! proportion to its distinct frames plus a pointer per frame of a stack
//! (a file names each distinct frame once and its stacks by index; read
//! back, each index becomes a pointer to that frame).
//!
//! The types are in files by concern: frames (`frame.rs`), stacks and
//! their counts (`stack.rs`), the stack-quality counters (`quality.rs`),
//! live mode's figures (`live.rs`) and the run's metadata and losses
//! (`meta.rs`); this file holds the profile itself.

use serde::{Deserialize, Serialize};

mod frame;
mod live;
mod meta;
mod quality;
mod stack;

pub use frame::{short_path, FileMapping, Frame, FrameOrder, ENTRY_POINT};
pub use live::{LiveStats, LiveTotals, Percentiles};
pub use meta::{HostLosses, Losses, Meta, Probe, SamplingInfo, Totals, WindowsInfo};
pub use quality::{PerfMapQuality, PythonQuality, StackQuality, SymbolsQuality};
pub use stack::{
    is_allocation, is_go_heap, Counts, ProcessMeta, ProcessRef, StackEntry, Thread, Weight,
    FREE_FUNC, GO_HEAP_FUNC,
};

pub mod file;
pub mod groups;
pub mod merge;
pub mod snapshot;
pub mod synthetic;
pub mod window;

/// Present in snapshot files: which snapshot, and what changed since the
/// previous one.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// 1 for the first snapshot of a trace.
    pub index: u32,
    /// Seconds since tracing started.
    pub elapsed_secs: f64,
    /// Change of the totals since the previous snapshot (since attach for
    /// the first).
    pub delta_allocs: Counts,
    pub delta_frees: u64,
    /// Stacks whose counts changed since the previous snapshot, with the
    /// change as their counts.
    pub delta_stacks: Vec<StackEntry>,
}

/// The trace over time: what happened in each interval since tracing began
/// (every trace records one; profiles of mtrace before 0.2 have none).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// Seconds each point covers. A long trace keeps at most
    /// [`Timeline::MAX_POINTS`] points by joining neighbours (the interval
    /// doubles).
    pub interval_secs: f64,
    pub points: Vec<TimePoint>,
}

impl Timeline {
    pub const MAX_POINTS: usize = 2048;
}

/// One interval of a [`Timeline`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TimePoint {
    /// End of the interval, in seconds after tracing began.
    pub t: f64,
    /// Allocating calls and their requested bytes in the interval (sampled
    /// mode: estimates).
    pub calls: u64,
    pub bytes: u64,
    /// Frees in the interval, when they are counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frees: Option<u64>,
    /// Live mode: bytes live (allocated, not yet freed, as traced) at `t`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_bytes: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub meta: Meta,
    pub stacks: Vec<StackEntry>,
    pub totals: Totals,
    pub losses: Losses,
    /// How whole the stacks are (profiles of mtrace 0.1 before unwinding
    /// without frame pointers have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack_quality: Option<StackQuality>,
    /// Live mode: the whole heap as traced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<LiveTotals>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<Snapshot>,
    /// The trace over time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
    /// The Go programs whose own heap profile was read (their rows are
    /// [`GO_HEAP_FUNC`]'s). Absent where none was.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub go_heaps: Vec<GoHeap>,
    /// Processes whose heap mtrace cannot see, one line each: a JVM's
    /// Java heap, V8's, a Go program that samples nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unseen: Vec<Unseen>,
    /// `--per-test`: allocations by test (see [`groups`]). Absent where
    /// not asked for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tests: Vec<groups::GroupTotals>,
    /// `--group`: allocations by the user's groups. Absent where none was
    /// asked for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<groups::GroupTotals>,
}

/// A Go program's heap profile as read from its memory: sampled by its
/// runtime, one allocation per `rate` bytes on average, published at each
/// garbage collection.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoHeap {
    pub pid: u32,
    /// Its command name (`comm`).
    pub name: String,
    /// `go1.19.8`.
    pub version: String,
    /// `runtime.MemProfileRate` as read (bytes between samples on
    /// average; 1: every allocation).
    pub rate: u64,
    /// What the rows' allocations count from: `attach` (allocations the
    /// program made while traced, as its last garbage collection
    /// published them) or `start` (since it started: launched by mtrace).
    pub since: String,
    /// When the reading was made: `exit` (held at its exit), or `running`.
    pub read_at: String,
    /// Allocations (objects and bytes) and what is in use, over its rows:
    /// estimates.
    pub allocated: Counts,
    pub in_use: Counts,
    /// Buckets read (one per stack and object size).
    pub buckets: u64,
    /// Buckets that could not be read (the walk stopped there), or whose
    /// counts never agreed with their size (left out).
    pub unreadable: u64,
    pub inconsistent: u64,
    /// The walk stopped at its bound.
    #[serde(default)]
    pub cut: bool,
}

/// A process whose heap mtrace cannot see, and why, in one line.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unseen {
    pub pid: u32,
    pub name: String,
    /// `java heap`, `v8 heap`, `go heap`.
    pub heap: String,
    pub why: String,
}
