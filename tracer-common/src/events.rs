//! Live mode: what the entry probe leaves for the return probe, and the
//! events sent to the tracer.

use crate::CountKey;

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

/// Live mode: a free (or the block a resize released) whose event found
/// the ring full, kept in the `LOST_FREES` queue until the tracer applies
/// it: a lost free must never leave a freed block reported outstanding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LostFree {
    /// The block.
    pub ptr: u64,
    /// As [`FreeEvent::ts`].
    pub ts: u64,
    /// The block is released only if it was allocated no later than this:
    /// the free's own stamp, or a resize's [`AllocEvent::entry_ts`].
    pub born_by: u64,
}

/// Live mode: a block whose allocation event found the ring full, kept in
/// the `LOST_ALLOCS` queue until the tracer applies it: a lost allocation
/// must never leave a leak unreported. (The block a resize released is
/// kept as a [`LostFree`].)
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LostAlloc {
    /// The block.
    pub ptr: u64,
    /// As [`AllocEvent::ts`].
    pub ts: u64,
    pub size: u64,
    pub key: CountKey,
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
