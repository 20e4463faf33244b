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

use std::{borrow::Cow, collections::BTreeMap, sync::Arc};

use foldhash::HashMap;

use serde::{Deserialize, Serialize};

pub mod file;
pub mod groups;
pub mod merge;
pub mod snapshot;
pub mod synthetic;
pub mod window;

/// One source-level frame. An inlined function gets a frame of its own with
/// `inlined = true`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Frame {
    /// Demangled function name, or `[unknown]` / `module+0xoffset` when no
    /// symbol was found.
    pub function: String,
    pub file: Option<String>,
    pub line: Option<u32>,
    /// Path of the ELF object the address belongs to, as the target mapped it.
    pub module: Option<String>,
    /// GNU build id of that object, in hex.
    #[serde(default)]
    pub build_id: Option<String>,
    /// Offset of the address in that object's file.
    #[serde(default)]
    pub file_offset: Option<u64>,
    /// The address in the target (a return address for all but the
    /// innermost frame).
    #[serde(rename = "address")]
    pub addr: u64,
    pub inlined: bool,
    /// The target's mapping of the file the address is in, where the
    /// target's mappings were kept (not for a caller the host scope found
    /// by file offset, nor in files written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mapping: Option<FileMapping>,
    /// Where no line is known: the return address's offset from the
    /// start of its function's symbol, which tells apart rows whose
    /// frames would print the same (`deflateInit2_+0x7b`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symbol_offset: Option<u64>,
}

/// The name of the frame at a program's entry point (`e_entry` of its ELF
/// header) where no symbol names it, as gdb and perf name it.
pub const ENTRY_POINT: &str = "_start";

/// Where a target mapped part of a file (a line of `/proc/PID/maps`): the
/// addresses from `start` up to `limit` hold the file's bytes from
/// `offset` on, so an address `a` in it is at `a - start + offset` in the
/// file, as pprof's mappings and the backends that symbolize them count.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct FileMapping {
    pub start: u64,
    pub limit: u64,
    pub offset: u64,
}

impl Frame {
    /// `function (file:line)` or just `function`.
    pub fn describe(&self) -> String {
        format!("{}{}", self.function, self.place(Cow::Borrowed))
    }

    /// What [`Frame::describe`] writes after the function's name: ` (file:line)`,
    /// ` (file)`, ` [object]` for a frame no symbol names, or nothing.
    /// Each path is written as its last component passed through `shown`.
    pub fn place<'a>(&'a self, shown: impl Fn(&'a str) -> Cow<'a, str>) -> String {
        match (&self.file, self.line) {
            (Some(f), Some(l)) => format!(" ({}:{l})", shown(short_path(f))),
            (Some(f), None) => format!(" ({})", shown(short_path(f))),
            _ => match &self.module {
                Some(m) if self.function.starts_with('[') || self.function.contains("+0x") => {
                    format!(" [{}]", shown(short_path(m)))
                }
                _ => String::new(),
            },
        }
    }
}

/// Every distinct frame of some stacks numbered in the order of its
/// content: equal frames (one shared [`Arc`] or several) get one number,
/// and two stacks' numbers compare as their frames do. Each [`Arc`] is
/// looked at once, so grouping and ordering stacks by their numbers costs
/// a number per frame of a stack, however long the frames' names are.
pub struct FrameOrder {
    rank: HashMap<*const Frame, u32>,
}

impl FrameOrder {
    /// Numbers the frames of `stacks`.
    pub fn of<'a>(stacks: impl IntoIterator<Item = &'a StackEntry>) -> FrameOrder {
        let mut rank: HashMap<_, _> = HashMap::default();
        let mut distinct: Vec<&Arc<Frame>> = Vec::new();
        for f in stacks.into_iter().flat_map(|st| &st.frames) {
            rank.entry(Arc::as_ptr(f)).or_insert_with(|| {
                distinct.push(f);
                0
            });
        }
        distinct.sort_unstable();
        let mut n = 0;
        for (i, f) in distinct.iter().enumerate() {
            if i > 0 && distinct[i - 1] != *f {
                n += 1;
            }
            rank.insert(Arc::as_ptr(f), n);
        }
        FrameOrder { rank }
    }

    /// The numbers of `frames`, which must be frames of the stacks this
    /// was made of.
    pub fn ranks(&self, frames: &[Arc<Frame>]) -> Vec<u32> {
        frames.iter().map(|f| self.rank[&Arc::as_ptr(f)]).collect()
    }
}

/// Last path component.
pub fn short_path(p: &str) -> &str {
    p.rsplit('/').next().unwrap_or(p)
}

/// How whole the stacks are: of the calls counted under a stack, how many
/// reached the thread's outermost frame (`_start`, or the thread's start
/// routine), and why the others stopped short.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StackQuality {
    /// Calls counted under a stack.
    pub calls: u64,
    /// Of those, calls whose stack is whole.
    pub whole: u64,
    /// Calls whose stack stopped short, by cause: `no_cfi` (code without
    /// call-frame information), `max_frames`, `bad_frame` (a corrupt stack
    /// or a wrong rule), `read_failed` (the stack could not be read),
    /// `copy_lost` (a walk for the tracer to finish found its ring full),
    /// `rules_full` (the kernel's map of unwind rules was full), `unknown`
    /// (the stack map was full: see `losses`).
    pub truncated: BTreeMap<String, u64>,
    /// Walks the BPF side handed to the tracer for want of an unwind rule
    /// (finished there, not a loss).
    #[serde(default)]
    pub finished_by_tracer: u64,
    /// Stacks the BPF side walked frame by frame; the other calls' stacks
    /// came from a remembered walk from the same place whose stack words
    /// were all still there (or from the tracer). Not a loss: how much
    /// walking the kernel did. Absent in older profiles.
    #[serde(default)]
    pub walked_in_kernel: u64,
    /// `--max-stack N`: the walk kept at most N frames above the direct
    /// caller (0: the caller only); a stack cut there counts under
    /// `max_frames`. Absent without a limit (or in older profiles).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame_limit: Option<u32>,
    /// A Python process's frames: what could not be read or named.
    /// Absent where no CPython interpreter was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<PythonQuality>,
    /// JIT code's names from the runtime's perf map: what could not be
    /// kept or read. Absent where no perf map was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perf_map: Option<PerfMapQuality>,
    /// Stripped files' debug information, looked up by build id. Absent
    /// where no stripped file was met.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symbols: Option<SymbolsQuality>,
}

/// Debug information for the stripped files of a run (each counted once
/// per build id, for the whole run): found on the machine, fetched from a
/// debuginfod server, or not found, its frames left as addresses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SymbolsQuality {
    /// Files without symbols or debug information met, by build id.
    #[serde(default)]
    pub stripped_files: u64,
    /// Their debug files found on this machine: in a debug directory's
    /// `.build-id` tree or in the debuginfod client's cache.
    #[serde(default)]
    pub local: u64,
    /// Fetched from a server of `DEBUGINFOD_URLS`.
    #[serde(default)]
    pub fetched: u64,
    /// On no server asked (or none was asked: no `DEBUGINFOD_URLS`, or
    /// `--no-debuginfod`).
    #[serde(default)]
    pub not_on_servers: u64,
    /// Not fetched because a server failed (a timeout, an error).
    #[serde(default)]
    pub not_fetched: u64,
}

impl SymbolsQuality {
    /// Each count the larger of the two: both are of the same run, one
    /// later than the other.
    pub fn latest(self, o: SymbolsQuality) -> SymbolsQuality {
        SymbolsQuality {
            stripped_files: self.stripped_files.max(o.stripped_files),
            local: self.local.max(o.local),
            fetched: self.fetched.max(o.fetched),
            not_on_servers: self.not_on_servers.max(o.not_on_servers),
            not_fetched: self.not_fetched.max(o.not_fetched),
        }
    }
}

/// How whole a Python process's Python frames are. Each count is of
/// stacks' frames, not of calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PythonQuality {
    /// Stacks walked in the process: with Python frames; before the
    /// interpreter started (or after it ended); in a thread without a
    /// thread state (not a Python thread); in a Python thread running no
    /// Python code (in C only). Walks, not calls: sampled, the samples.
    #[serde(default)]
    pub with_frames: u64,
    #[serde(default)]
    pub no_interpreter: u64,
    #[serde(default)]
    pub no_thread_state: u64,
    #[serde(default)]
    pub no_code_running: u64,
    /// Stacks walked in a thread whose thread state, if it has one, lies
    /// past the first 4096 of the interpreter's list (not searched).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub threads_beyond: u64,
    /// Python frames left out for want of room (the stack's native frames
    /// took most of the 127 slots, or more than 47 Python frames): the
    /// stack shows `[N Python frames not read]` where they are missing.
    pub cut: u64,
    /// Walks whose Python frames ended at a frame that could not be read.
    pub unreadable: u64,
    /// Code objects that could not be named (gone or replaced before the
    /// tracer read them): shown as `[python code 0x...]`.
    pub unnamed: u64,
    /// New stacks whose notice to the tracer found the ring full (their
    /// code objects were named later, if they still lived).
    pub notices_lost: u64,
}

/// A JIT's perf map (`/tmp/perf-PID.map`) as mtrace read it, summed over
/// the processes that had one. The names are kept within a ceiling per
/// process, the oldest evicted first; each count is of lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PerfMapQuality {
    /// Lines read that named code.
    #[serde(default)]
    pub lines: u64,
    /// Pieces of code named when the profile was made.
    #[serde(default)]
    pub kept: u64,
    /// Names evicted to stay within the ceiling: their code's frames read
    /// `[anonymous code 0x...]`.
    #[serde(default)]
    pub evicted: u64,
    /// Names longer than the longest kept, cut.
    #[serde(default)]
    pub names_cut: u64,
    /// Lines that are not `START SIZE NAME`, skipped.
    #[serde(default)]
    pub bad_lines: u64,
    /// Bytes of the map not read yet when the profile was made.
    #[serde(default)]
    pub unread_bytes: u64,
    /// Times the map was read again from its start: another file at its
    /// path, or the file truncated or rewritten.
    #[serde(default)]
    pub rereads: u64,
}

impl StackQuality {
    /// The share of calls with a whole stack, in percent (100 without calls).
    pub fn whole_pct(&self) -> f64 {
        if self.calls == 0 {
            100.0
        } else {
            self.whole as f64 * 100.0 / self.calls as f64
        }
    }
}

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

fn yes() -> bool {
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

fn is_zero(n: &u64) -> bool {
    *n == 0
}

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
