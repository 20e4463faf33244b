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

/// Scratch space of the stack walk, per CPU and level (see
/// [`WALK_LEVELS`]). The walk's state is kept here rather than on the
/// program's stack, where the verifier would follow every exact frame
/// count as a state of its own.
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
    /// The level this scratch is (its flag in `OWNER`) and the thread
    /// using it (see [`EntryMark::me`]).
    pub level: u64,
    pub me: u64,
    /// The call's thread id where keys are split by thread, else 0.
    pub tid: u64,
    /// The attach cookie a remembered walk's entry held for this probe
    /// (`u64::MAX`: none).
    pub cookie: u64,
    /// What the walk's result depends on, for [`WalkMemo`]: the stack
    /// pointer at entry (`origin`); the count of stack words it read and
    /// used, which go straight into the entry it claimed (`noting`: entry
    /// `check_slot`, whose `seq` was `claim_seq`), `memo_over` when they did
    /// not fit; where the current rbp was read from (0: the entry's
    /// register) and whether the entry's rbp was used.
    pub origin: u64,
    pub memo_n: u64,
    pub memo_over: u64,
    pub memo_bp_at: u64,
    pub memo_uses_bp: u64,
    /// Words above the entry's stack pointer that hold the noted ones.
    pub memo_span: u64,
    pub noting: u64,
    pub claim_seq: u64,
    /// The walk's result came from a [`WalkMemo`] (entry `check_slot`
    /// while its `seq` was `hit_seq`): `stack` was not filled.
    pub memo_hit: u64,
    pub hit_seq: u64,
    /// The remembered walk's key.
    pub hit_key: u64,
    /// The check of a [`WalkMemo`] against the stack (kept here, where the
    /// verifier does not follow the values): the entry, how many of its
    /// words are compared so far, its count of words, and whether all
    /// matched.
    pub check_slot: u64,
    pub check_i: u64,
    pub check_n: u64,
    pub check_same: u64,
    /// Where the call's probe is (the instruction pointer at the probe).
    pub ip: u64,
    /// The thread's Python frames ([`crate::py_frame_words`]), `py_n`
    /// words, read after the native walk; the frame read last, the thread
    /// state looked at, the thread looked for, its interpreter, how the
    /// search through the interpreter's thread states ended, the id of the
    /// newest state it need not look at and the id of the last it did.
    pub py: [u64; 2 * crate::PY_MAX_FRAMES],
    pub py_n: u64,
    pub py_frame: u64,
    pub py_ts: u64,
    pub py_me: u64,
    pub py_interp: u64,
    pub py_search: u64,
    pub py_floor: u64,
    pub py_last: u64,
    pub py_buf: [u8; crate::PY_FRAME_READ],
    /// 1 when the counting program owns its CPU's plain-add counts: kept
    /// here, where the verifier does not follow values, rather than in a
    /// register across the walk, which multiplied the states the verifier
    /// follows.
    pub owned: u64,
    /// The walk met a return address a return probe had replaced with the
    /// kernel's trampoline and took the real one from the kernel (such a
    /// walk is not remembered: the trampoline's word says nothing of the
    /// address it hides); `caller` the direct caller's real return address
    /// when it was the one replaced (0: it was not); `prev_hash` the hash
    /// before the last frame.
    pub hidden: u64,
    pub caller: u64,
    pub prev_hash: u64,
    /// For a walk handed to the tracer: `MissEvent::trampoline` and
    /// `MissEvent::hidden`.
    pub trampoline: u64,
    pub hidden_at: [[u64; 2]; crate::MAX_HIDDEN],
    /// The host scope's walk: the calling process's incarnation
    /// (`HOST_GENS`; 0: a traced process's walk, whose rules and frames
    /// are return addresses), its address space, and the frame of the
    /// return address the walk is at ([`crate::host_frame`]).
    pub host_gen: u64,
    pub host_mm: u64,
    pub host_ra: u64,
    /// The host scope's walk: the interpreter epoch it began in
    /// ([`WalkMemo::epoch`]; 0 for a traced process's).
    pub host_epoch: u64,
    /// The host scope: the key of a call that took a remembered walk.
    pub host_key: crate::HostKey,
    /// The host scope's walk: the direct caller's frame, as the walk
    /// began.
    pub host_caller: u64,
    /// The host scope's walk handed to the tracer: an address in the
    /// executable's code (`mm_struct.start_code`, 0: unknown).
    pub host_exe: u64,
    /// The host scope's walk: why the return address it is at was kept
    /// as an address ([`crate::HOST_RAW_BUSY`], [`crate::HOST_RAW_ANON`];
    /// 0: in a file, or in no mapping).
    pub host_raw: u64,
    /// The host scope's walk of a process running CPython: its layout,
    /// copied from `HOST_PYTHON` (`runtime` 0: none, no Python frames).
    pub host_py: crate::PythonLayout,
}

/// Walks each CPU remembers ([`WalkMemo`]), direct-mapped by direct caller
/// and stack pointer.
pub const MEMO_ENTRIES: u32 = 64;

/// Most stack words a remembered walk depends on.
pub const MEMO_WORDS: usize = 128;

/// A finished walk remembered with everything its result depends on: the
/// walk is a function of the direct caller, the stack pointer, (sometimes)
/// rbp at entry and the stack words it read, the rules being fixed. A call
/// with the same caller, stack pointer and rbp whose stack holds the same
/// words at the same places has the same stack, found by comparing the
/// words instead of walking again.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct WalkMemo {
    /// Even when the entry is whole; odd while it is written (a uprobe
    /// program can be preempted on its CPU by another).
    pub seq: u64,
    pub caller: u64,
    pub sp: u64,
    pub bp: u64,
    /// The walk used rbp as it was at entry: `bp` must match too.
    pub uses_bp: u64,
    /// The stack's key (its hash) and why the walk ended.
    pub key: u64,
    pub stop: u64,
    pub n: u64,
    /// How many words above `sp` hold the `n` words (the highest offset
    /// plus one).
    pub span: u64,
    /// The allocator function and thread (0 unless split by thread) of the
    /// call that walked: with `caller` and `key`, the aggregation key
    /// ([`CountKey`]) of the calls that take this walk.
    pub func: u64,
    pub tid: u64,
    /// Where that call's probe is and its attach cookie (the function, its
    /// role and where its arguments are): a call from the same place
    /// through the same probe takes the cookie from here instead of a
    /// helper call.
    pub ip: u64,
    pub cookie: u64,
    /// The host scope: the incarnation of the process that walked (its
    /// frames are files and offsets by that process's mappings); a call
    /// takes the walk only in the same one. 0 for a traced process's.
    pub owner: u64,
    /// Calls of that key counted here since the walk (plain adds, by the
    /// program that owns the CPU) instead of in the aggregation map, whose
    /// lookup was the largest cost of a counted call after the stack read.
    /// Moved to the map when the entry is taken for another walk; the
    /// tracer adds what is still here. `hits` is their number (`calls`
    /// is weighted when sampling).
    pub hits: u64,
    pub calls: u64,
    pub bytes: u64,
    /// `frame << 63 | offset << 48 | value`: the stack word `offset` words
    /// above `sp` held `value` (below 2^48, as user addresses are); `frame`
    /// when the value is a return address, the stack's next frame.
    pub words: [u64; MEMO_WORDS],
    /// The host scope: the interpreter epoch as the walk began
    /// (`HOST_NEXT`'s two epoch slots added): a call takes the walk only
    /// while no process has become known to run an interpreter and no
    /// interpreter file was learned since (the walk's call had no Python
    /// frames to read; a later call of that process may). 0 for a traced
    /// process's.
    pub epoch: u64,
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

/// Value of the aggregation map, added to atomically by every CPU. In
/// sampled mode calls are estimates in 16.16 fixed point and bytes
/// estimates.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CountValue {
    pub calls: u64,
    pub bytes: u64,
}

/// Thread name as `bpf_get_current_comm` returns it.
pub type Comm = [u8; 16];

/// A thread's last counted allocator entry, used to recognise a tail call
/// from one allocator function into another (glibc's `realloc(NULL, n)`
/// jumps to `malloc` with the caller's frame intact).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryMark {
    /// The thread: where the kernel keeps its saved user registers (the
    /// probe's context), one place per live thread, known without a helper
    /// call.
    pub me: u64,
    /// Where the entry's probe is (one place per function).
    pub ip: u64,
    pub sp: u64,
    pub ret: u64,
}

/// Slots of the threads' entry marks, by a hash of the thread.
pub const MARK_SLOTS: u32 = 4096;

/// Walk scratch spaces per CPU: one per program a CPU may be running at once
/// (a uprobe program can be preempted by another thread's on its CPU).
pub const WALK_LEVELS: u32 = 4;
