//! What was traced, when and how: the run's metadata, its totals and every
//! counter of data lost.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::stack::yes;
use super::{Counts, ProcessMeta};

/// Every way data can be lost; each is printed in every report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Losses {
    /// Allocations that found the aggregation map full: in the totals, in no
    /// stack.
    pub map_full: u64,
    /// Allocations whose stack walk failed: counted under their direct
    /// caller only.
    pub stack_walk_failed: u64,
    /// Stack-map bucket collisions: counted under their direct caller only.
    pub stack_collisions: u64,
    /// Stack map full: counted under their direct caller only.
    pub stack_map_full: u64,
    /// The return address at the stack pointer could not be read.
    pub caller_unreadable: u64,
    /// Thread-name map full (names taken from /proc instead).
    pub thread_names_full: u64,
    /// Calls of processes gone whose stack was not among the stacks kept
    /// of processes gone (`mtrace agent --all` keeps a fixed number of
    /// them): counted under one row per command and function that says
    /// so, in no stack of their own.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gone_stacks_beyond: u64,
}

/// Exact totals, kept apart from the per-stack map.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    /// Per allocator function (frees have bytes = 0).
    pub per_func: BTreeMap<String, Counts>,
    /// Allocations (every function but `free`).
    pub allocs: Counts,
    pub frees: u64,
    /// Whether `free` was probed (live mode, or `--count-frees`): count
    /// and sampled modes probe only the allocating functions.
    #[serde(default = "yes")]
    pub frees_counted: bool,
    /// Calls the allocator made to itself (realloc -> malloc), not counted
    /// twice.
    pub nested: u64,
}

impl Default for Totals {
    fn default() -> Self {
        Totals {
            per_func: BTreeMap::new(),
            allocs: Counts::default(),
            frees: 0,
            frees_counted: true,
            nested: 0,
        }
    }
}

/// One attached probe.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe {
    /// `malloc`, or aliases joined with `/`.
    pub function: String,
    /// Bytes into the function where the probe sits.
    pub offset: u64,
    /// The probed instruction's mnemonic.
    pub instruction: String,
    /// Whether the kernel emulates it (cheap) or single-steps it.
    pub emulated: bool,
}

/// How a sampled trace was sampled.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplingInfo {
    /// `bytes`: on average one sample per `rate` allocated bytes;
    /// `every`: each call with probability 1/`rate`.
    pub kind: String,
    pub rate: u64,
    /// Calls recorded.
    pub samples: u64,
}

/// The windows policy's record: how much of the trace the probes were in.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowsInfo {
    /// Seconds counted, over the trace: what the counts are scaled by.
    pub probed_secs: f64,
    /// Seconds the probes were in the processes (each window from its
    /// first attach to its last link closed: `probed_secs` and the
    /// switches around it), what the processes paid for; 0 in profiles
    /// of mtrace before it was kept.
    #[serde(default)]
    pub trapped_secs: f64,
    /// Windows begun.
    pub windows: u64,
    pub window_secs: f64,
    /// The slowdown allowed on average (0.02: 2%).
    pub budget: f64,
    /// The last window's slowdown while the probes were in.
    pub last_slowdown: f64,
    /// Counts have been multiplied by this (the trace's duration over
    /// `probed_secs`); 0 while they are the windows' own.
    #[serde(default)]
    pub scale: f64,
}

/// What was traced, when and how.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub mtrace_version: String,
    pub pid: u32,
    /// Target command line.
    pub command: String,
    /// The target's executable, as it sees it (`/proc/PID/exe`).
    #[serde(default)]
    pub executable: String,
    /// When tracing started, RFC 3339 (UTC).
    pub start_time: String,
    pub duration_secs: f64,
    /// `uname -r` of the machine traced on.
    pub kernel_release: String,
    /// `count` or `live`.
    pub mode: String,
    /// Count mode, sampled: counts are unbiased estimates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<SamplingInfo>,
    /// `mtrace agent`'s windows policy: the counts are those of the
    /// windows in which the probes were in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub windows: Option<WindowsInfo>,
    /// Object the probes sit in (for example `/usr/lib/x86_64-linux-gnu/libc.so.6`).
    pub allocator_object: String,
    /// Its family: glibc, musl, jemalloc, tcmalloc, mimalloc (empty in
    /// older profiles).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub allocator_family: String,
    /// Its version, when the object says it (empty otherwise).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub allocator_version: String,
    /// An allocator whose prefixed API is probed beside it, as `FAMILY
    /// (PREFIX) in OBJECT` (tikv-jemallocator in a Rust program: `jemalloc
    /// (_rjem_) in /usr/bin/server`); empty when there is none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub allocator_beside: String,
    /// The CPython interpreter whose Python frames the stacks hold, as
    /// `CPython 3.X in OBJECT`, or why they hold none (`Python 3.X in
    /// OBJECT, whose frames mtrace cannot read yet`); empty when the
    /// process runs no Python.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub python: String,
    pub probes: Vec<Probe>,
    /// How the probes were placed, when not in each traced process by its
    /// pid: file-wide probes in every process that maps an allocator, each
    /// call counted under its process and whole stack, of `host` (`--all`),
    /// `tree` (`--file-wide` with a command) or `cgroup` (`--file-wide
    /// --cgroup`). Empty for per-pid probes.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub scope: String,
    /// Every process of the traced tree when there were more than one
    /// (the root first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<ProcessMeta>,
    /// Processes of the tree not traced and not listed in `processes`
    /// either (beyond [`Meta::MAX_PROCESS_RECORDS`]: a fork bomb must not
    /// grow mtrace without bound).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub processes_unlisted: u64,
}

impl Meta {
    pub const MAX_PROCESS_RECORDS: usize = 4096;
}

pub(super) fn is_zero(n: &u64) -> bool {
    *n == 0
}
