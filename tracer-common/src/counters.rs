//! The per-CPU `COUNTERS` array: exact totals per function and every way
//! a call can lose its stack or its event.

/// Indexes into the per-CPU `COUNTERS` array: exact totals and every way a
/// sample can be lost. Totals are kept apart from the aggregation map so they
/// stay exact even when that map is full.
pub mod counter {
    use crate::MAX_FUNCS;
    /// Calls per function: `CALLS + func`.
    pub const CALLS: u32 = 0;
    /// Requested bytes per function: `BYTES + func`.
    pub const BYTES: u32 = MAX_FUNCS;
    /// Allocations that found the aggregation map full (counted in totals only).
    pub const MAP_FULL: u32 = 2 * MAX_FUNCS;
    /// Stack walks that failed (allocation counted under an unknown stack).
    pub const STACK_WALK_FAILED: u32 = MAP_FULL + 1;
    /// Stack-map bucket collisions (allocation counted under an unknown stack).
    pub const STACK_COLLISION: u32 = MAP_FULL + 2;
    /// The return address at `[rsp]` could not be read.
    pub const CALLER_READ_FAILED: u32 = MAP_FULL + 3;
    /// Calls made by the allocator itself (realloc -> malloc and the like),
    /// not counted again.
    pub const NESTED: u32 = MAP_FULL + 4;
    /// Thread-name map full (names then come from /proc only).
    pub const THREAD_NAMES_FULL: u32 = MAP_FULL + 5;
    /// The stack-trace map had no free slot (allocation counted under an
    /// unknown stack).
    pub const STACK_MAP_FULL: u32 = MAP_FULL + 6;
    /// Live mode: allocations that failed (NULL, or posix_memalign != 0).
    pub const FAILED: u32 = MAP_FULL + 7;
    /// Live mode: events the ring buffer had no room for.
    pub const EVENTS_LOST: u32 = MAP_FULL + 8;
    /// Live mode: allocating calls not followed to their return (no
    /// per-thread storage for the pending call).
    pub const PENDING_FULL: u32 = MAP_FULL + 9;
    /// Sampled mode: calls recorded.
    pub const SAMPLES: u32 = MAP_FULL + 10;
    /// Walks handed to the tracer for want of a rule (the tracer finishes
    /// them: not a loss).
    pub const UNWIND_MISSES: u32 = MAP_FULL + 11;
    /// Of those, walks whose stack copy found the ring full (the call is
    /// counted under the frames walked so far).
    pub const UNWIND_MISSES_LOST: u32 = MAP_FULL + 12;
    /// Live mode: frees (and blocks a resize released) whose event found
    /// the ring full, kept in `LOST_FREES` for the tracer to apply: not a
    /// loss.
    pub const FREES_KEPT: u32 = MAP_FULL + 13;
    /// Live mode: of those, frees `LOST_FREES` had no room for either: their
    /// blocks may be reported outstanding though freed.
    pub const FREES_LOST: u32 = MAP_FULL + 14;
    /// Stacks the kernel walked frame by frame (the others came from a
    /// remembered walk, `WalkMemo`): not a loss.
    pub const WALKS: u32 = MAP_FULL + 15;
    /// Remembered walks' counts moved into the aggregation map (see
    /// `WalkMemo::calls`): not a loss; the tracer reads it to know that
    /// its read of both was not torn by a move.
    pub const MEMO_FLUSHES: u32 = MAP_FULL + 16;
    /// Python frames left out of a stack for want of room (the stack's
    /// native frames took most of it).
    pub const PY_CUT: u32 = MAP_FULL + 17;
    /// A Python frame could not be read (the thread's frames end there).
    pub const PY_READ_FAILED: u32 = MAP_FULL + 18;
    /// New Python stacks whose notice found the ring full: their code
    /// objects are named at the end, if they still live.
    pub const PY_NOTICES_LOST: u32 = MAP_FULL + 19;
    /// Walks of a Python process: with Python frames; before (or after)
    /// the interpreter ran; in a thread with no thread state (not a
    /// Python thread); in one with a thread state but no Python code
    /// running.
    pub const PY_WITH_FRAMES: u32 = MAP_FULL + 20;
    pub const PY_NO_INTERPRETER: u32 = MAP_FULL + 21;
    pub const PY_NO_THREAD_STATE: u32 = MAP_FULL + 22;
    pub const PY_NO_CODE_RUNNING: u32 = MAP_FULL + 23;
    /// Live mode: calls of inlined copies of CPython's allocator whose
    /// block was never taken (the copy left by a way not probed: a failed
    /// allocation, or a place the tracer did not find).
    pub const INLINE_UNFINISHED: u32 = MAP_FULL + 24;
    /// Walks of a Python process in a thread whose thread state was not
    /// among the first `PY_MAX_THREADS` of the interpreter's list (counted
    /// apart from `PY_NO_THREAD_STATE`: the thread may have one further on).
    pub const PY_THREADS_BEYOND: u32 = MAP_FULL + 25;
    /// Live mode: blocks whose allocation event found the ring full, kept
    /// in `LOST_ALLOCS` for the tracer to apply: not a loss.
    pub const ALLOCS_KEPT: u32 = MAP_FULL + 26;
    /// Live mode: of those, blocks `LOST_ALLOCS` had no room for either:
    /// never followed, so each may be a leak the report cannot name.
    pub const ALLOCS_LOST: u32 = MAP_FULL + 27;
    /// Host scope: frames in a file the tag table had no room for (kept as
    /// return addresses: named while the process lives).
    pub const HOST_NO_TAG: u32 = MAP_FULL + 28;
    /// Host scope: calls of a process the incarnation table had no room
    /// for (their walks look each mapping up afresh).
    pub const HOST_NO_GEN: u32 = MAP_FULL + 29;
    /// Host scope narrowed to a process tree: children the tree's table
    /// had no room for (neither they nor their descendants are counted).
    pub const SCOPE_FULL: u32 = MAP_FULL + 30;
    /// Host scope: execs whose event found the exec ring full (the tracer
    /// did not hear of the new program: its own allocator, if it has one,
    /// is probed only when the tracer next looks at the process).
    pub const HOST_EXECS_LOST: u32 = MAP_FULL + 31;
    /// Host scope: rows made while the name table had no room for their
    /// process (named from /proc while it lives, else left without one).
    pub const HOST_NAMES_FULL: u32 = MAP_FULL + 32;
    /// Host scope: processes the runs table had no room for (their runs
    /// are not counted, so the windows policy sees fewer).
    pub const HOST_RUNS_FULL: u32 = MAP_FULL + 33;
    /// Host scope: Python processes the table of interpreter layouts had
    /// no room for (their stacks have native frames only).
    pub const HOST_PYTHON_FULL: u32 = MAP_FULL + 34;
    /// Threads stopped after a walk's copy found the ring of walks a
    /// quarter full, until the tracer had finished what it held (launch
    /// mode: see `Config::throttle`): not a loss.
    pub const THROTTLED: u32 = MAP_FULL + 35;
    /// Walks whose copy found the ring a quarter full in a thread that
    /// blocks the throttle signal, or whose blocked signals could not be
    /// read: sent none (the program would take it as its own) and not
    /// held. Not a loss itself: a copy that then finds the ring full is
    /// (`UNWIND_MISSES_LOST`).
    pub const NOT_THROTTLED: u32 = MAP_FULL + 36;
    pub const N: u32 = MAP_FULL + 37;
}
