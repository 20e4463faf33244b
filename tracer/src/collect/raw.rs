//! The raw profile: what the kernel maps hold, as addresses. Read by
//! [`crate::collect`], turned into a [`crate::profile::Profile`] by
//! [`crate::symbolize`].

use std::collections::BTreeMap;

use tracer_common::CountKey;

use crate::profile::{Counts, LiveStats, LiveTotals, Losses, StackQuality};

/// One aggregated row: an allocator function reached through one stack.
#[derive(Clone, Debug, PartialEq)]
pub struct RawStack {
    /// Index in the run's function table ([`crate::allocators::FuncInfo`]).
    pub func: u32,
    /// Return addresses, innermost first: `addrs[0]` is the direct caller.
    pub addrs: Vec<u64>,
    /// The walk stopped short of the thread's outermost frame.
    pub truncated: bool,
    /// Thread id when split per thread.
    pub tid: Option<u32>,
    pub counts: Counts,
    /// The kernel's aggregation key (joins live statistics).
    pub key: CountKey,
    /// Live mode: what became of this stack's blocks.
    pub live: Option<LiveStats>,
}

#[derive(Clone, Debug, Default)]
pub struct RawProfile {
    pub stacks: Vec<RawStack>,
    /// Exact calls/bytes per function (index in the function table).
    pub per_func: Vec<Counts>,
    pub nested: u64,
    pub losses: Losses,
    /// Thread names recorded by the BPF programs at first allocation.
    pub thread_names: BTreeMap<u32, String>,
    /// Live-mode counters from the kernel (totals filled in by the tracker).
    pub live: Option<LiveTotals>,
    /// Sampled mode: calls recorded.
    pub samples: u64,
    /// How whole the stacks are.
    pub stack_quality: StackQuality,
    /// `free` was probed.
    pub frees_counted: bool,
}
