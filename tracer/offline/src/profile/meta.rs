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
    /// The host engine's own tables and rings (`--all`, `--file-wide`,
    /// `--cgroup`, `agent --all`), beside the others in the JSON; absent
    /// for a trace by process.
    #[serde(flatten)]
    pub host: Option<HostLosses>,
}

/// What the host engine's tables and rings had no room for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostLosses {
    /// Execs the tracer never heard of (the exec ring was full): a new
    /// program's own allocator is probed only when the process is next
    /// looked at.
    pub exec_events_lost: u64,
    /// Rows (process, function, stack) made while the name table had no
    /// room for their process (named from /proc while it lived, else
    /// unnamed).
    pub process_names_full: u64,
    /// Processes the runs table had no room for (runs the windows policy
    /// did not see).
    pub process_runs_full: u64,
    /// Children of a traced tree the tree's table had no room for: neither
    /// they nor their descendants were counted.
    pub tree_full: u64,
    /// Frames kept as addresses for want of a file tag (named only while
    /// their process ran).
    pub frames_untagged: u64,
    /// Calls of processes the incarnation table had no room for: counted,
    /// their mappings looked up afresh at each walk (a cost, not a loss).
    pub processes_unnumbered: u64,
    /// Python processes beyond the table of interpreter layouts: their
    /// stacks have native frames only.
    #[serde(default)]
    pub python_full: u64,
}

impl HostLosses {
    /// Each counter by its stable name, in the order reports print them.
    pub fn named(&self) -> [(&'static str, u64); 7] {
        [
            ("exec_events_lost", self.exec_events_lost),
            ("process_names_full", self.process_names_full),
            ("process_runs_full", self.process_runs_full),
            ("tree_full", self.tree_full),
            ("frames_untagged", self.frames_untagged),
            ("processes_unnumbered", self.processes_unnumbered),
            ("python_full", self.python_full),
        ]
    }

    /// Each counter of `later` less `earlier`'s.
    pub fn since(&self, earlier: &HostLosses) -> HostLosses {
        self.zip(earlier, u64::saturating_sub)
    }

    /// Both counters added.
    pub fn plus(&self, other: &HostLosses) -> HostLosses {
        self.zip(other, |a, b| a + b)
    }

    /// Each counter `f` of this one's and `other`'s.
    fn zip(&self, other: &HostLosses, f: impl Fn(u64, u64) -> u64) -> HostLosses {
        HostLosses {
            exec_events_lost: f(self.exec_events_lost, other.exec_events_lost),
            process_names_full: f(self.process_names_full, other.process_names_full),
            process_runs_full: f(self.process_runs_full, other.process_runs_full),
            tree_full: f(self.tree_full, other.tree_full),
            frames_untagged: f(self.frames_untagged, other.frames_untagged),
            processes_unnumbered: f(self.processes_unnumbered, other.processes_unnumbered),
            python_full: f(self.python_full, other.python_full),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::{HostLosses, Losses};

    /// A trace by process writes no host counters and reads back without
    /// them; the host engine's sit beside the others in `losses` and read
    /// back whole.
    #[test]
    fn host_losses_sit_beside_the_others_and_are_absent_for_a_process() {
        let by_process = Losses::default();
        let text = serde_json::to_string(&by_process).unwrap();
        assert!(!text.contains("tree_full"), "{text}");
        assert_eq!(serde_json::from_str::<Losses>(&text).unwrap(), by_process);
        let host = Losses {
            host: Some(HostLosses {
                tree_full: 7,
                process_names_full: 3,
                ..HostLosses::default()
            }),
            ..Losses::default()
        };
        let value = serde_json::to_value(host).unwrap();
        assert_eq!(value["tree_full"], 7);
        assert_eq!(value["exec_events_lost"], 0);
        assert_eq!(serde_json::from_value::<Losses>(value).unwrap(), host);
    }
}
