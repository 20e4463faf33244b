//! Types shared by the BPF programs (`tracer-ebpf`) and the tracer.
//!
//! Everything here is `#[repr(C)]` plain data: the BPF side writes it into
//! maps, the tracer reads the same bytes back.
#![no_std]

/// The allocator entry points mtrace probes. The discriminant is what the
/// BPF programs store in [`CountKey::func`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AllocFn {
    Malloc = 0,
    Calloc = 1,
    Realloc = 2,
    Reallocarray = 3,
    PosixMemalign = 4,
    AlignedAlloc = 5,
    Memalign = 6,
    Valloc = 7,
    Pvalloc = 8,
    Free = 9,
}

/// Number of [`AllocFn`] variants.
pub const N_FUNCS: usize = 10;

impl AllocFn {
    pub const ALL: [AllocFn; N_FUNCS] = [
        AllocFn::Malloc,
        AllocFn::Calloc,
        AllocFn::Realloc,
        AllocFn::Reallocarray,
        AllocFn::PosixMemalign,
        AllocFn::AlignedAlloc,
        AllocFn::Memalign,
        AllocFn::Valloc,
        AllocFn::Pvalloc,
        AllocFn::Free,
    ];

    /// The C symbol name.
    pub const fn name(self) -> &'static str {
        match self {
            AllocFn::Malloc => "malloc",
            AllocFn::Calloc => "calloc",
            AllocFn::Realloc => "realloc",
            AllocFn::Reallocarray => "reallocarray",
            AllocFn::PosixMemalign => "posix_memalign",
            AllocFn::AlignedAlloc => "aligned_alloc",
            AllocFn::Memalign => "memalign",
            AllocFn::Valloc => "valloc",
            AllocFn::Pvalloc => "pvalloc",
            AllocFn::Free => "free",
        }
    }

    pub const fn from_u32(v: u32) -> Option<AllocFn> {
        if (v as usize) < N_FUNCS {
            Some(Self::ALL[v as usize])
        } else {
            None
        }
    }
}

/// `CountKey::stack` when the stack walk failed; the allocation is still
/// counted, under its direct caller only.
pub const STACK_NONE: u64 = 0;

/// `CountKey::stack` when there was no frame pointer to follow: the stack
/// is the direct caller alone (not a loss).
pub const STACK_EMPTY: u64 = 1;

/// Most frames a stack keeps (as the kernel's perf_event_max_stack).
pub const MAX_FRAMES: usize = 127;

/// Bytes of the target's stack read at once by the frame-pointer walk.
pub const STACK_CHUNK: usize = 1024;

/// A walked user stack: return addresses above the direct caller, stored
/// once per distinct stack under its hash.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackFrames {
    pub len: u32,
    pub _pad: u32,
    pub frames: [u64; MAX_FRAMES],
}

/// Scratch space of the stack walk, per thread slot.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct WalkScratch {
    pub chunk: [u64; STACK_CHUNK / 8],
    pub stack: StackFrames,
    /// The walk's state between chunks: the next frame pointer and the
    /// hash so far (`stack.len` counts the frames). Kept in the map rather
    /// than on the program's stack, where the verifier would follow every
    /// exact frame count as a state of its own.
    pub fp: u64,
    pub hash: u64,
    /// Where in the target's stack `chunk` was read from, and how many of
    /// its bytes are valid (0: none).
    pub base: u64,
    pub valid: u64,
}

/// Key of the in-kernel aggregation map: one entry per distinct
/// (user stack, direct caller, allocator function, thread).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CountKey {
    /// Hash of the walked stack (its key in the stack map), or
    /// [`STACK_NONE`].
    pub stack: u64,
    /// An [`AllocFn`] discriminant.
    pub func: u32,
    /// Thread id when per-thread splitting is on, else 0.
    pub tid: u32,
    /// The return address at `[rsp]` on entry: the direct caller, which a
    /// frame-pointer walk started inside the allocator's prologue misses.
    pub caller: u64,
}

/// Value of the aggregation map. Updated with atomic adds. In sampled
/// mode `calls` is an estimate in 16.16 fixed point and `bytes` an estimate.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CountValue {
    pub calls: u64,
    pub bytes: u64,
    /// Calls recorded (all of them unless sampled).
    pub samples: u64,
}

/// Fixed-point one for sample weights (16.16).
pub const WEIGHT_ONE: u64 = 1 << 16;

/// `Config::sample_mode`.
pub const SAMPLE_NONE: u32 = 0;
/// On average one sample per `sample_param` allocated bytes (exponential
/// intervals, as jemalloc and tcmalloc draw them).
pub const SAMPLE_BYTES: u32 = 1;
/// Each call sampled with probability 1 / `sample_param`.
pub const SAMPLE_EVERY: u32 = 2;

/// Entries of the exponential-interval table: `-ln((i + 0.5) / N)` in 16.16.
pub const EXP_TABLE_LEN: usize = 1024;
/// Entries of the bytes-sampling weight table, for `x = size / rate` from
/// 0.5 in steps of 1/256: `1 / (1 - exp(-x))` in 16.16.
pub const WEIGHT_TABLE_LEN: usize = 4096;
/// `x` (in 1/256) where the weight table starts; below it a series is used.
pub const WEIGHT_TABLE_START: u64 = 128;

/// Indexes into the per-CPU `COUNTERS` array: exact totals and every way a
/// sample can be lost. Totals are kept apart from the aggregation map so they
/// stay exact even when that map is full.
pub mod counter {
    /// Calls per function: `CALLS + func`.
    pub const CALLS: u32 = 0;
    /// Requested bytes per function: `BYTES + func`.
    pub const BYTES: u32 = 10;
    /// Allocations that found the aggregation map full (counted in totals only).
    pub const MAP_FULL: u32 = 20;
    /// Stack walks that failed (allocation counted under an unknown stack).
    pub const STACK_WALK_FAILED: u32 = 21;
    /// Stack-map bucket collisions (allocation counted under an unknown stack).
    pub const STACK_COLLISION: u32 = 22;
    /// The return address at `[rsp]` could not be read.
    pub const CALLER_READ_FAILED: u32 = 23;
    /// Calls made by the allocator itself (realloc -> malloc and the like),
    /// not counted again.
    pub const NESTED: u32 = 24;
    /// Thread-name map full (names then come from /proc only).
    pub const THREAD_NAMES_FULL: u32 = 25;
    /// The stack-trace map had no free slot (allocation counted under an
    /// unknown stack).
    pub const STACK_MAP_FULL: u32 = 26;
    /// Live mode: allocations that failed (NULL, or posix_memalign != 0).
    pub const FAILED: u32 = 27;
    /// Live mode: events the ring buffer had no room for.
    pub const EVENTS_LOST: u32 = 28;
    /// Live mode: allocating calls not followed to their return (no
    /// per-thread storage for the pending call).
    pub const PENDING_FULL: u32 = 29;
    /// Sampled mode: calls recorded.
    pub const SAMPLES: u32 = 30;
    pub const N: u32 = 31;
}

/// Maximum number of allocator body ranges the nesting check compares.
pub const MAX_BODY_RANGES: usize = 12;

/// Address range `[start, end)` of an allocator function in the target.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BodyRange {
    pub start: u64,
    pub end: u64,
}

/// Per-thread record of the last counted allocator entry, used to recognise
/// a tail call from one allocator function into another (glibc's
/// `realloc(NULL, n)` jumps to `malloc` with the caller's frame intact).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryMark {
    pub tid: u32,
    pub func: u32,
    pub sp: u64,
    pub ret: u64,
}

/// Run-time settings the tracer writes into the BPF object before loading.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Non-zero: key the aggregation by thread id.
    pub per_thread: u32,
    /// Non-zero: live mode (track every block until it is freed).
    pub live: u32,
    /// `SAMPLE_NONE`, `SAMPLE_BYTES` or `SAMPLE_EVERY`.
    pub sample_mode: u32,
    /// Mean bytes between samples, or N of one-in-N.
    pub sample_param: u64,
    /// How many entries of `bodies` are valid.
    pub n_bodies: u32,
    /// Bodies of the probed allocator functions in the target's address
    /// space: a call whose return address lies in one is the allocator
    /// calling itself (realloc -> malloc) and is not counted again.
    pub bodies: [BodyRange; MAX_BODY_RANGES],
    /// `-ln((i + 0.5) / EXP_TABLE_LEN)` in 16.16 (bytes sampling).
    pub exp_table: [u32; EXP_TABLE_LEN],
    /// `1 / (1 - exp(-x))` in 16.16 for `x = (WEIGHT_TABLE_START + i) / 256`.
    pub weight_table: [u32; WEIGHT_TABLE_LEN],
}

/// Live mode: an allocating call between its entry and its return.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pending {
    pub key: CountKey,
    pub size: u64,
    /// realloc/reallocarray: the block being resized.
    pub old_ptr: u64,
    /// posix_memalign: where the block's address will be written.
    pub memptr: u64,
    /// When the call began (ns, CLOCK_MONOTONIC).
    pub entry_ts: u64,
    /// Stack pointer at entry: a call made while this one is in flight, at
    /// this depth or deeper, is the allocator calling itself.
    pub sp: u64,
    /// Non-zero while the call is in flight (the entry is the thread's own
    /// and stays between calls).
    pub active: u64,
}

pub const EVENT_ALLOC: u32 = 1;
pub const EVENT_FREE: u32 = 2;

/// Event ring buffers: events go to ring `cpu % EVENT_RINGS`, so that
/// threads on different CPUs do not contend for one buffer. The tracer
/// merges them by time stamp.
pub const EVENT_RINGS: u32 = 8;

/// Live mode: the return of an allocating call, sent to the tracer, which
/// keeps the table of outstanding blocks.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocEvent {
    /// [`EVENT_ALLOC`].
    pub kind: u32,
    pub _pad: u32,
    /// When the call returned (ns, CLOCK_MONOTONIC), taken after the
    /// event's buffer space was reserved: an event that follows another
    /// causally (a free after the allocation's return) has a later stamp
    /// than the other's commit.
    pub ts: u64,
    /// The new block, or 0 when the call only released `old_ptr`
    /// (`realloc(p, 0)` returning NULL).
    pub ptr: u64,
    pub size: u64,
    pub key: CountKey,
    /// realloc/reallocarray: the block the call released, or 0. Released
    /// only if it is still the block that existed when the call began
    /// (allocated no later than `entry_ts`): another thread may have been
    /// handed the same address since.
    pub old_ptr: u64,
    pub entry_ts: u64,
}

/// Live mode: a call to `free` with a non-NULL pointer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FreeEvent {
    /// [`EVENT_FREE`].
    pub kind: u32,
    pub _pad: u32,
    /// As [`AllocEvent::ts`].
    pub ts: u64,
    pub ptr: u64,
}

/// Slots in the entry-mark array (indexed by `tid % TAIL_SLOTS`).
pub const TAIL_SLOTS: u32 = 65536;

/// Thread name as `bpf_get_current_comm` returns it.
pub type Comm = [u8; 16];

#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for CountKey {}
    unsafe impl aya::Pod for CountValue {}
    unsafe impl aya::Pod for BodyRange {}
    unsafe impl aya::Pod for EntryMark {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for Pending {}
    unsafe impl aya::Pod for StackFrames {}
}
