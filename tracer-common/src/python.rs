//! CPython frames in the stacks: where the programs find a thread's
//! Python frames ([`PythonLayout`], per process) and how they store them
//! beside the native frames.
//!
//! A stack of a Python process is its native frames (return addresses,
//! innermost first) followed by its Python frames, innermost first, two
//! words each ([`py_frame_words`]). The tracer puts the Python frames in
//! place of the interpreter's eval-loop frames: each run of the eval loop
//! (a native `_PyEval_EvalFrameDefault` frame) ran the Python frames up to
//! and including the next one marked [`PY_ENTRY`].

/// Most Python frames a stack keeps, two words each: 47 frames read and,
/// when the thread has more, a cut marker ([`py_cut_words`]) in the last
/// place.
pub const PY_MAX_FRAMES: usize = 48;

/// The first word of a Python frame has this bit set (no user address
/// has): it holds the code object's address.
pub const PY_FRAME: u64 = 1 << 63;

/// The frame is the first its run of the eval loop executed (the last of
/// the run, innermost first).
pub const PY_ENTRY: u64 = 1 << 62;

/// The code object's address in a Python frame's first word.
pub const PY_CODE_MASK: u64 = (1 << 48) - 1;

/// A Python frame's first word with this bit (and [`PY_FRAME`]) set is no
/// frame but the mark of a cut ([`py_cut_words`]): the thread's Python
/// frames go on past it, not kept.
pub const PY_CUT_MARK: u64 = 1 << 61;

/// In a cut mark's second word: frames past the ones it counts were not
/// read either (how many is not known).
pub const PY_CUT_MORE: u64 = 1 << 32;

/// The two words of a cut mark: `left` frames read but left out for want
/// of room in the stack, and with `more` frames past them not read. Its
/// words are a function of the frames read and the room, so that a stack's
/// key (which counts them) stays the same for the same frames.
#[inline(always)]
pub const fn py_cut_words(left: u32, more: bool) -> [u64; 2] {
    let m = if more { PY_CUT_MORE } else { 0 };
    [PY_FRAME | PY_CUT_MARK, m | left as u64]
}

/// A Python frame's two words: `PY_FRAME | entry | code` and
/// `check << 32 | instr`, where `instr` says where in the code the frame
/// is (see `PythonLayout::instr_is_ptr`) and `check` is
/// [`py_code_check`] of the code object as the probe read it, so that a
/// code object freed and replaced at the same address is not given the
/// new one's name.
#[inline(always)]
pub const fn py_frame_words(code: u64, entry: bool, instr: u32, check: u32) -> [u64; 2] {
    let e = if entry { PY_ENTRY } else { 0 };
    [
        PY_FRAME | e | (code & PY_CODE_MASK),
        ((check as u64) << 32) | instr as u64,
    ]
}

/// What identifies a code object beside its address: its first line and
/// the addresses of its file and function name objects (every module's
/// code begins at line 1; its file name object is its own).
#[inline(always)]
pub const fn py_code_check(first_line: u32, filename: u64, name: u64) -> u32 {
    first_line ^ (filename >> 3) as u32 ^ ((name >> 3) as u32).rotate_left(16)
}

/// The end of [`python_stack_key`]: low bits `10`, as every stack key.
#[inline(always)]
pub const fn python_key_finish(hash: u64) -> u64 {
    (hash & !3) | 2
}

/// The key of a stack with Python frames: the key of its native frames
/// (`crate::stack_hash_finish`) continued over its Python words, so that
/// a remembered native walk and the Python frames read at each call make
/// the same key as a whole walk. Without Python words, the native key.
pub fn python_stack_key(native: u64, words: &[u64]) -> u64 {
    if words.is_empty() {
        return native;
    }
    let mut h = native;
    for &w in words {
        h = crate::stack_hash_step(h, w);
    }
    python_key_finish(h)
}

/// How an eval-loop run's first frame is marked.
pub mod py_entry {
    /// Every frame is a run of its own (3.10 and before: the eval loop
    /// recurses per Python call).
    pub const EVERY: u32 = 0;
    /// The frame's `is_entry` byte (3.11).
    pub const FLAG: u32 = 1;
    /// A shim frame owned by the C stack (`owner == 3`) stands between
    /// runs (3.12 and later): not a Python frame itself.
    pub const SHIM: u32 = 2;
}

/// `PythonLayout::entry` of 3.12+: the owner value of a run's shim frame
/// (`FRAME_OWNED_BY_CSTACK`).
pub const PY_OWNED_BY_CSTACK: u8 = 3;

/// Bytes of a frame the programs read at once: every field they use lies
/// in them.
pub const PY_FRAME_READ: usize = 128;

/// Most thread states the programs look through for the calling thread's
/// (once per thread: the one found is remembered in the thread's storage).
pub const PY_MAX_THREADS: u32 = 4096;

/// What a thread's task storage remembers of its last search for its
/// Python thread state in interpreter `interp`: the state found (`ts`), or
/// none (`ts == 0`), when the interpreter's newest thread state had the id
/// `stamp` (`stamp == 0`: nothing remembered).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PyThreadSeen {
    pub ts: u64,
    pub stamp: u64,
    pub interp: u64,
}

/// Where a CPython interpreter keeps its threads' frames, for the
/// programs: offsets of the fields they follow, by version. `runtime == 0`:
/// the process runs no Python the programs can read.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonLayout {
    /// Address of `_PyRuntime` in the process.
    pub runtime: u64,
    /// `_PyRuntimeState.interpreters.head`.
    pub interp_head: u32,
    /// `PyInterpreterState.threads.head`.
    pub threads_head: u32,
    /// `PyThreadState.next`.
    pub tstate_next: u32,
    /// `PyThreadState.interp`: the interpreter it belongs to.
    pub tstate_interp: u32,
    /// `PyThreadState.id`: unique in its interpreter, increasing (a new
    /// thread state's is higher than any before it).
    pub tstate_id: u32,
    /// `PyThreadState.native_thread_id` (the kernel's thread id), or with
    /// `tid_is_pthread` `thread_id` (the thread's `pthread_self()`, its
    /// fs base on x86_64).
    pub tstate_tid: u32,
    pub tid_is_pthread: u32,
    /// Where the kernel keeps a thread's fs base: the offset of
    /// `thread.fsbase` in `struct task_struct` (with `tid_is_pthread`).
    pub task_fsbase: u32,
    /// `PyThreadState` to its current frame: the field holding the
    /// `_PyCFrame` pointer (3.11, 3.12), or the frame itself.
    pub tstate_frame: u32,
    /// Non-zero: `tstate_frame` leads to a `_PyCFrame`, whose field at
    /// `cframe_frame` is the current frame.
    pub via_cframe: u32,
    pub cframe_frame: u32,
    /// Frame fields: the code object, the caller's frame, where it is in
    /// its code, and the byte marking a run's entry ([`py_entry`]).
    pub frame_code: u32,
    pub frame_back: u32,
    pub frame_instr: u32,
    pub frame_entry: u32,
    /// One of [`py_entry`].
    pub entry: u32,
    /// Bytes of a frame to read: past the last field used, at most
    /// [`PY_FRAME_READ`].
    pub frame_read: u32,
    /// Non-zero: `frame_instr` holds a pointer into the code object (3.11
    /// and later; the frame word stores it less the code object's
    /// address); else the `int` f_lasti.
    pub instr_is_ptr: u32,
    /// `PyCodeObject.co_firstlineno` (an `int`), and `co_filename`, which
    /// `co_name` follows.
    pub code_firstlineno: u32,
    pub code_filename: u32,
    /// The interpreter's minor version (3.X), for the tracer to read a
    /// [`PyCodeSnap`] of a process it never looked at.
    pub minor: u32,
    /// `PyCodeObject` fields a [`PyCodeSnap`] follows: the name shown
    /// (`co_qualname`, else `co_name`), the line table, and the bytecode
    /// object (`co_code`, up to 3.10; 0 where the bytecode is inline).
    pub code_name: u32,
    pub code_linetable: u32,
    pub code_code: u32,
}

/// A Python stack's frames for the tracer to name while their code objects
/// live: sent when a stack with Python frames is stored for the first time.
/// Shorter than any [`crate::MissEvent`], which shares its ring.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PyNotice {
    /// Words in `words` (two per frame).
    pub n: u32,
    /// The host scope's: the process and its address space, whose code
    /// objects these are (0 on a traced process's own ring).
    pub tgid: u32,
    pub mm: u64,
    pub words: [u64; 2 * PY_MAX_FRAMES],
}

/// Bytes of a code object a [`PyCodeSnap`] holds (past every field the
/// tracer reads, in every version).
pub const PY_SNAP_CODE: usize = 208;
/// Bytes of its name's `str` object (header and data).
pub const PY_SNAP_NAME: usize = 160;
/// Bytes of its file name's `str` object.
pub const PY_SNAP_FILE: usize = 384;
/// Bytes of its line table's `bytes` object: a longer table is cut.
pub const PY_SNAP_TABLE: usize = 1136;
/// Bytes of its bytecode's `bytes` object (its header: the length).
pub const PY_SNAP_CODE_OBJ: usize = 32;

/// What [`PyCodeSnap::at`] holds the addresses of, in order.
pub mod py_snap {
    pub const NAME: usize = 0;
    pub const FILE: usize = 1;
    pub const TABLE: usize = 2;
    pub const CODE_OBJ: usize = 3;
}

/// A code object copied at the call that first stored a stack holding it
/// (with its name, file name, line table and bytecode header), for the
/// tracer to name it even when the interpreter frees it at once (a
/// module's body run at its import, code `exec`'d): sent before the
/// stack's [`PyNotice`], on the same ring. Its size tells it from a
/// notice and from any [`crate::MissEvent`].
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PyCodeSnap {
    /// The process (always set, on either scope) and, on the host scope,
    /// its address space (0 on a traced process's own ring).
    pub tgid: u32,
    /// [`PythonLayout::minor`].
    pub minor: u32,
    pub mm: u64,
    /// The code object and the frame's check (`py_code_check`).
    pub code: u64,
    pub check: u32,
    /// Bytes of `code_bytes` copied (0: none could be read).
    pub code_len: u32,
    /// Where the objects of [`py_snap`] were, and bytes of each copied.
    pub at: [u64; 4],
    pub len: [u32; 4],
    pub code_bytes: [u8; PY_SNAP_CODE],
    pub name: [u8; PY_SNAP_NAME],
    pub file: [u8; PY_SNAP_FILE],
    pub table: [u8; PY_SNAP_TABLE],
    pub code_obj: [u8; PY_SNAP_CODE_OBJ],
}

/// `PY_CODES_SENT`' key: a code object of a process, with its check.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct PyCodeKey {
    pub code: u64,
    pub tgid: u32,
    pub check: u32,
}

const _: () = assert!(
    core::mem::size_of::<PyCodeSnap>() != core::mem::size_of::<PyNotice>()
        && core::mem::size_of::<PyCodeSnap>() < crate::MISS_HEADER_BYTES
);
