//! Stacks: the aggregation key and value, the walked frames and the
//! walk's scratch space.

/// `CountKey::stack` when the stack walk could not run (no scratch space);
/// the allocation is still counted, under its direct caller only.
pub const STACK_NONE: u64 = 0;

/// Most frames a stack keeps (as the kernel's perf_event_max_stack).
pub const MAX_FRAMES: usize = 127;

/// Bytes of the target's stack read at once by the walk.
pub const STACK_CHUNK: usize = 1024;

/// A walked user stack: return addresses above the direct caller, stored
/// once per distinct stack under its hash.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackFrames {
    pub len: u32,
    /// Why the walk ended ([`crate::stop`]).
    pub stop: u32,
    pub frames: [u64; MAX_FRAMES],
}

/// Scratch space of the stack walk, per thread slot. The walk's state is
/// kept here rather than on the program's stack, where the verifier would
/// follow every exact frame count as a state of its own. Aligned to a
/// cache line: threads of one process use neighbouring slots, written on
/// every call (a shared line cost a second thread ~10% more per call).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct WalkScratch {
    pub chunk: [u64; STACK_CHUNK / 8],
    pub stack: StackFrames,
    /// The next return address to find a rule for, the CFA of the frame
    /// below it (its frame's stack pointer), rbp there, and whether rbp is
    /// known.
    pub ra: u64,
    pub sp: u64,
    pub bp: u64,
    pub bp_ok: u64,
    /// The hash of the frames so far (`stack.len` counts them).
    pub hash: u64,
    /// Where in the target's stack `chunk` was read from, and how many of
    /// its bytes are valid (0: none).
    pub base: u64,
    pub valid: u64,
    /// Most frames this walk keeps (`Config::max_frames`).
    pub limit: u64,
    /// The thread's last counted allocator entry (tail-call check).
    pub mark: EntryMark,
}

/// Key of the in-kernel aggregation map: one entry per distinct
/// (user stack, direct caller, allocator function, thread).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CountKey {
    /// Hash of the walked stack (its key in the stack map), or
    /// [`STACK_NONE`].
    pub stack: u64,
    /// The probed function: its index in the run's function table (the
    /// probe's attach cookie).
    pub func: u32,
    /// Thread id when per-thread splitting is on, else 0.
    pub tid: u32,
    /// The return address at `[rsp]` on entry: the direct caller.
    pub caller: u64,
}

/// Value of the aggregation map (per CPU). `calls` and `bytes` are added
/// to plainly by the program that owns the CPU, the `_shared` ones
/// atomically by a program that preempted it; the sums are the counts. In
/// sampled mode calls are estimates in 16.16 fixed point and bytes
/// estimates.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CountValue {
    pub calls: u64,
    pub bytes: u64,
    pub calls_shared: u64,
    pub bytes_shared: u64,
}

/// Thread name as `bpf_get_current_comm` returns it.
pub type Comm = [u8; 16];

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
