//! A stack and what was counted under it: calls and bytes, the allocator
//! function, the weights a stack can be drawn by, its process and thread.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{Frame, LiveStats};

/// Calls and requested bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub calls: u64,
    pub bytes: u64,
}

impl Counts {
    pub fn add(&mut self, other: Counts) {
        self.calls += other.calls;
        self.bytes += other.bytes;
    }
}

pub(super) fn yes() -> bool {
    true
}

/// Name of the deallocation function. Its stack entries (if any) are not
/// allocations and are left out of every rendered stack, matching
/// [`Totals::allocs`].
pub const FREE_FUNC: &str = "free";

/// The allocator function of rows read from a Go program's own heap
/// profile (its runtime's sampled record of `new`, `make` and the rest,
/// which is not malloc): estimates scaled as Go's pprof scales them, never
/// in [`Totals`].
pub const GO_HEAP_FUNC: &str = "go heap";

/// Whether `entry` is a row of a Go program's own heap profile.
pub fn is_go_heap(entry: &StackEntry) -> bool {
    entry.func == GO_HEAP_FUNC
}

/// Whether `entry` counts an allocation (anything but `free`).
pub fn is_allocation(entry: &StackEntry) -> bool {
    entry.func != FREE_FUNC
}

/// Which count sizes a stack: in folded stacks, flame graphs, the diff gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weight {
    Calls,
    Bytes,
}

impl Weight {
    /// `"calls"` or `"bytes"`.
    pub fn unit(self) -> &'static str {
        match self {
            Weight::Calls => "calls",
            Weight::Bytes => "bytes",
        }
    }

    /// The count this weight selects.
    pub fn of(self, counts: Counts) -> u64 {
        match self {
            Weight::Calls => counts.calls,
            Weight::Bytes => counts.bytes,
        }
    }
}

/// One row of the profile: an allocator function reached through one stack
/// (from one thread, when split per thread).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StackEntry {
    /// Allocator function name as probed (`malloc`, `calloc`, ...). Aliases
    /// sharing one address are joined with `/` (`aligned_alloc/memalign`).
    #[serde(rename = "function")]
    pub func: String,
    /// Innermost first; `frames[0]` is the direct caller. Stacks through
    /// one frame share it.
    pub frames: Vec<Arc<Frame>>,
    /// The stack walk failed or collided: only the direct caller is known.
    pub truncated: bool,
    /// Thread id and name when split per thread.
    pub thread: Option<Thread>,
    /// The process, when split per process (`--per-process`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessRef>,
    #[serde(flatten)]
    pub counts: Counts,
    /// Live mode: what became of this stack's blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<LiveStats>,
    /// A Go heap row ([`GO_HEAP_FUNC`]): the objects and bytes its stack
    /// held in use at the reading, Go's estimate. Absent on other rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_use: Option<Counts>,
    /// A Go heap row: the size of each of its objects (Go's profile keeps
    /// one record per stack and object size, and so do its rows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_size: Option<u64>,
}

/// The process a row belongs to (`--per-process`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ProcessRef {
    pub pid: u32,
    /// Its command name (`comm`).
    pub name: String,
}

/// A process of the traced tree.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessMeta {
    pub pid: u32,
    /// The process that created it (0 for the root).
    pub ppid: u32,
    /// Its command name (`comm`), after its last `exec`.
    pub name: String,
    /// Its command line, after its last `exec`.
    pub command: String,
    #[serde(default)]
    pub executable: String,
    /// Its cgroup v2 path (from `/proc/PID/cgroup`), empty when unknown.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cgroup: String,
    /// Where its probes were (empty when not traced).
    #[serde(default)]
    pub allocator_object: String,
    /// Its allocating calls were counted.
    pub traced: bool,
    /// Why it was not (or not from its start) traced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_traced: Option<String>,
    /// Its exit code (128 + signal when killed); none when it still ran
    /// at the end of the trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Thread {
    pub tid: u32,
    pub name: String,
}
