//! The names of the BPF object's maps and programs: the one contract
//! between `tracer-ebpf` and the tracer. The BPF side declares each map and
//! program under exactly these names (the aya macros take literals, so a
//! host test checks the built object against this list); the tracer looks
//! them up only through these constants.

/// Per (stack, caller, function, thread): calls, bytes, samples.
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
/// The global the tracer writes before load ([`crate::Config`]).
pub const CONFIG: &str = "CONFIG";

/// Every map the tracer reads or sizes.
pub const ALL_MAPS: [&str; 6] = [COUNTS, STACKS, COUNTERS, THREAD_NAMES, COUNTDOWN, "PENDING"];

/// The benchmark's floor: a program that does nothing, attached where the
/// real entry probes go, and its return-probe twin.
pub const FLOOR: &str = "floor";
pub const FLOOR_RET: &str = "floor_ret";
