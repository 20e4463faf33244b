//! The names of the BPF object's maps and programs: the one contract
//! between `tracer-ebpf` and the tracer. The BPF side declares each map and
//! program under exactly these names (the aya macros take literals, so a
//! host test checks the built object against this list); the tracer looks
//! them up only through these constants.

/// Per (stack, caller, function, thread): calls and bytes.
pub const COUNTS: &str = "COUNTS";
/// Walked stacks by hash.
pub const STACKS: &str = "STACKS";
/// Exact totals and loss counters (see [`crate::counter`]).
pub const COUNTERS: &str = "COUNTERS";
/// Thread names seen at first allocation (per-thread mode).
pub const THREAD_NAMES: &str = "THREAD_NAMES";
/// Sampled by bytes: the per-CPU countdown to the next sample.
pub const COUNTDOWN: &str = "COUNTDOWN";
/// Live mode: per-CPU event rings, `EVENTS0` .. `EVENTS7`.
pub const EVENTS: [&str; crate::EVENT_RINGS as usize] = [
    "EVENTS0", "EVENTS1", "EVENTS2", "EVENTS3", "EVENTS4", "EVENTS5", "EVENTS6", "EVENTS7",
];
/// Unwind rules by return address ([`crate::UnwindRule`]), filled by the
/// tracer.
pub const UNWIND_RULES: &str = "UNWIND_RULES";
/// The direct-mapped cache in front of it ([`crate::CachedRule`]).
pub const RULE_CACHE: &str = "RULE_CACHE";
/// Walks the tracer finishes ([`crate::MissEvent`]).
pub const UNWIND_MISSES: &str = "UNWIND_MISSES";
/// One flag, set by the tracer: the map of rules is full.
pub const UNWIND_FULL: &str = "UNWIND_FULL";
/// The threads sent the throttle signal and not yet let go, by thread id
/// (see [`crate::Config::throttle`]): taken out by the tracer as it holds
/// each, so that a signal it finds there is known to be the programs'.
pub const THROTTLED: &str = "THROTTLED";
/// Live mode: frees whose event found the ring full ([`crate::LostFree`]),
/// a queue the tracer pops and applies.
pub const LOST_FREES: &str = "LOST_FREES";
/// Live mode: blocks whose allocation event found the ring full
/// ([`crate::LostAlloc`]), a queue the tracer pops and applies.
pub const LOST_ALLOCS: &str = "LOST_ALLOCS";
/// One flag, set by the tracer once every probe is attached and cleared
/// when tracing ends: counting starts and stops for all functions at once.
pub const ENABLED: &str = "ENABLED";
/// The stack walk's scratch, per CPU and level ([`crate::WalkScratch`]).
pub const WALK: &str = "WALK";
/// Remembered walks, per CPU ([`crate::WalkMemo`]).
pub const MEMO: &str = "MEMO";
/// What the programs know of the process they serve
/// ([`crate::ProcessConfig`]), written by the tracer.
pub const PROCESS: &str = "PROCESS";
/// The global the tracer writes before load ([`crate::Config`]).
pub const CONFIG: &str = "CONFIG";

/// Host scope (`--all`): per (process, function, caller's file and
/// offset), calls and bytes ([`crate::HostKey`], [`crate::HostValue`]).
pub const HOST_COUNTS: &str = "HOST_COUNTS";
/// Host scope: exact calls and bytes per function-table row.
pub const HOST_TOTALS: &str = "HOST_TOTALS";
/// Host scope: the function table ([`crate::HostFunc`]).
pub const HOST_FUNCS: &str = "HOST_FUNCS";
/// Host scope: allocator bodies per file ([`crate::HostBodies`]).
pub const HOST_BODIES: &str = "HOST_BODIES";
/// Host scope: each process's name ([`crate::HostProcess`], one per exec)
/// at its first counted call.
pub const HOST_NAMES: &str = "HOST_NAMES";
/// Host scope: each process's program runs, by process id.
pub const HOST_RUNS: &str = "HOST_RUNS";
/// Host scope: processes that exec'd ([`crate::HostExec`]).
pub const HOST_EXECS: &str = "HOST_EXECS";
/// Host scope: the tracer's own process id, which the programs skip.
pub const HOST_SELF: &str = "HOST_SELF";
/// Host scope: the frames of each stack, by its key
/// ([`crate::HostKey::stack`]).
pub const HOST_STACKS: &str = "HOST_STACKS";
/// Host scope: unwind rules by [`crate::host_frame`] (file and offset),
/// shared by every process that maps the file.
pub const HOST_RULES: &str = "HOST_RULES";
/// Host scope: the file mappings the walks met ([`crate::HostVma`]).
pub const HOST_VMAS: &str = "HOST_VMAS";
/// Host scope: each file's tag ([`crate::HostFileId`] -> tag).
pub const HOST_FILE_TAGS: &str = "HOST_FILE_TAGS";
/// Host scope: each tag's file.
pub const HOST_TAG_FILES: &str = "HOST_TAG_FILES";
/// Host scope: each process's incarnation, by process id.
pub const HOST_GENS: &str = "HOST_GENS";
/// Host scope: the next incarnation and the next tag ([`crate::HOST_NEXT_GEN`]).
pub const HOST_NEXT: &str = "HOST_NEXT";
/// Host scope narrowed to a process tree ([`crate::SCOPE_TREE`]): the
/// process ids in it (value 1), the root put in by the tracer, each
/// child by the fork tracepoint.
pub const HOST_SCOPE_PIDS: &str = "HOST_SCOPE_PIDS";
/// Host scope narrowed to cgroups ([`crate::SCOPE_CGROUP`]): the cgroup
/// v2 ids in scope (value 1), each with its descendants.
pub const HOST_SCOPE_CGROUPS: &str = "HOST_SCOPE_CGROUPS";

/// Host scope: the interpreter layout of each process running CPython
/// (by process id), put in by the tracer once it has learned it.
pub const HOST_PYTHON: &str = "HOST_PYTHON";
/// Host scope: the interpreter layout each file tagged (`HOST_FILE_TAGS`)
/// holds, its `runtime` from the file's code mapping's base: the first
/// walk of a process whose direct caller is in such a file puts the
/// process's layout into `HOST_PYTHON` itself.
pub const HOST_PY_FILES: &str = "HOST_PY_FILES";

/// The code objects a [`crate::PyCodeSnap`] was sent of (an LRU, by
/// process, address and check): each is copied once while it lives.
pub const PY_CODES_SENT: &str = "PY_CODES_SENT";

/// Every map the tracer reads or sizes.
pub const ALL_MAPS: [&str; 39] = [
    PY_CODES_SENT,
    COUNTS,
    STACKS,
    COUNTERS,
    THREAD_NAMES,
    COUNTDOWN,
    "PENDING",
    "INLINE_PENDING",
    UNWIND_RULES,
    RULE_CACHE,
    UNWIND_MISSES,
    UNWIND_FULL,
    THROTTLED,
    ENABLED,
    LOST_FREES,
    LOST_ALLOCS,
    WALK,
    MEMO,
    PROCESS,
    HOST_COUNTS,
    HOST_TOTALS,
    HOST_FUNCS,
    HOST_BODIES,
    HOST_NAMES,
    HOST_RUNS,
    HOST_EXECS,
    HOST_SELF,
    "HOST_MARKS",
    HOST_STACKS,
    HOST_RULES,
    HOST_VMAS,
    HOST_FILE_TAGS,
    HOST_TAG_FILES,
    HOST_GENS,
    HOST_NEXT,
    HOST_SCOPE_PIDS,
    HOST_SCOPE_CGROUPS,
    HOST_PYTHON,
    HOST_PY_FILES,
];

/// The host scope's programs: every allocating entry point, file-wide,
/// and the exec tracepoint.
pub const HOST_ALLOC: &str = "host_alloc";
pub const HOST_EXEC: &str = "host_exec";
pub const HOST_EXIT: &str = "host_exit";
pub const HOST_FORK: &str = "host_fork";

/// The inlined copies of CPython's object allocator (`--python-objects`
/// on a build that copied it into its callers).
pub const ALLOC_INLINE: &str = "alloc_inline";
/// Live mode: where an inlined copy's block is known.
pub const ALLOC_INLINE_RET: &str = "alloc_inline_ret";
/// The inlined copies of CPython's `_PyObject_Free`.
pub const RELEASE_INLINE: &str = "release_inline";

/// The benchmark's floor: a program that does nothing, attached where the
/// real entry probes go, and its return-probe twin.
pub const FLOOR: &str = "floor";
pub const FLOOR_RET: &str = "floor_ret";
