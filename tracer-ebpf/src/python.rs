//! The calling thread's Python frames, read after its native walk in a
//! process that runs a CPython interpreter (`ProcessConfig::python`): its
//! thread state found among the interpreter's by thread id, then its frames
//! from the current one out, each stored as two words (see
//! `tracer_common::py_frame_words`) behind the native frames.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user};
use tracer_common::{
    counter, py_code_check, py_cut_words, py_entry, py_frame_words, py_snap, python_key_finish,
    stack_hash_step, stop, PyCodeKey, PyCodeSnap, PyNotice, PythonLayout, WalkScratch, MAX_FRAMES,
    PY_CODE_MASK, PY_CUT_MARK, PY_ENTRY, PY_FRAME_READ, PY_MAX_FRAMES, PY_MAX_THREADS,
    PY_OWNED_BY_CSTACK, PY_SNAP_CODE, PY_SNAP_CODE_OBJ, PY_SNAP_FILE, PY_SNAP_NAME, PY_SNAP_TABLE,
};

use crate::{
    aggregate::bump_counter,
    maps::{PROCESS, PY_CODES_SENT, PY_THREADS, UNWIND_MISSES},
    scratch::{level_of, run_loop, scratch_at},
};

/// The process's interpreter layout, when it runs one the programs read.
#[inline(always)]
pub(crate) fn python_layout() -> Option<&'static PythonLayout> {
    PROCESS
        .get(0)
        .map(|p| &p.python)
        .filter(|l| unsafe { core::ptr::read_volatile(&l.runtime) } != 0)
}

/// The layout the walk in `w` reads Python frames by: on the host scope,
/// its process's (copied into the scratch), else the traced process's.
#[inline(always)]
fn layout(w: *const WalkScratch) -> Option<&'static PythonLayout> {
    if unsafe { core::ptr::read_volatile(&(*w).host_gen) } == 0 {
        return python_layout();
    }
    // SAFETY: the scratch is a map value, alive for the whole program.
    let l = unsafe { &(*w).host_py };
    (unsafe { core::ptr::read_volatile(&l.runtime) } != 0).then_some(l)
}

#[inline(always)]
fn read_u64(addr: u64) -> u64 {
    unsafe { bpf_probe_read_user(addr as *const u64) }.unwrap_or(0)
}

/// Reads the calling thread's Python frames into `w.py` (`w.py_n` words;
/// none when the thread has no thread state or runs no Python code).
#[inline(always)]
pub(crate) fn read_python(w: &mut WalkScratch) {
    python_read_at(level_of(w));
}

/// [`read_python`] of the walk scratch at `level`. A global function
/// (numbers in, a number out): the verifier checks it once, not once for
/// each way the program reaches it. Returns 0.
#[inline(never)]
#[no_mangle]
pub extern "C" fn python_read_at(level: u64) -> u64 {
    if let Some(w) = scratch_at(level) {
        read_frames(unsafe { &mut *w });
    }
    0
}

#[inline(always)]
fn read_frames(w: &mut WalkScratch) {
    w.py_n = 0;
    let Some(l) = layout(w) else {
        return;
    };
    let interp = read_u64(l.runtime + l.interp_head as u64);
    if interp == 0 {
        bump_counter(counter::PY_NO_INTERPRETER, 1);
        return;
    }
    w.py_interp = interp;
    w.py_me = if l.tid_is_pthread != 0 {
        let task = unsafe { aya_ebpf::helpers::bpf_get_current_task() };
        unsafe {
            aya_ebpf::helpers::bpf_probe_read_kernel((task + l.task_fsbase as u64) as *const u64)
        }
        .unwrap_or(0)
    } else {
        bpf_get_current_pid_tgid() & 0xffff_ffff
    };
    w.py_frame = 0;
    w.py_search = 0;
    // (A thread state not yet bound to a thread says 0: never match it.)
    if w.py_me != 0 {
        find_thread_state(w, l);
    }
    if w.py_frame != 0 {
        // Shim frames (3.12+) sit between the runs.
        run_loop(2 * PY_MAX_FRAMES as u32, python_step, w);
    }
    let why = if w.py_n != 0 {
        counter::PY_WITH_FRAMES
    } else if w.py_me == FOUND {
        counter::PY_NO_CODE_RUNNING
    } else if w.py_search & SEARCH_BEYOND != 0 {
        counter::PY_THREADS_BEYOND
    } else {
        counter::PY_NO_THREAD_STATE
    };
    bump_counter(why, 1);
}

/// `py_me` once the calling thread's state is found.
const FOUND: u64 = u64::MAX;

/// How a search through the interpreter's thread states ended
/// (`py_search`): at the end of the list; at the first state no newer than
/// the floor; at a state that is not the interpreter's, unreadable, or no
/// older than the one before it (the list changed under the search, or is
/// no list); at the bound with states left; and whether it passed a state
/// not bound to a thread yet (which may be the caller's, bound once it
/// runs).
const SEARCH_END: u64 = 1;
const SEARCH_FLOOR: u64 = 2;
const SEARCH_BROKEN: u64 = 4;
const SEARCH_BEYOND: u64 = 8;
const SEARCH_UNBOUND: u64 = 16;
/// The states searched surely hold none of the caller's: the search went
/// to the list's end or its floor, through states all bound to a thread.
const SEARCH_SURE: u64 = 32;

/// Searches the interpreter's thread states from `head`, newest first,
/// down to the first one whose id is `floor` or lower (0: all of them):
/// the caller's state, or 0 with `py_search` saying whether the states
/// searched surely hold none of the caller's ([`SEARCH_SURE`]).
#[inline(always)]
fn search(w: &mut WalkScratch, head: u64, floor: u64) -> u64 {
    w.py_ts = head;
    w.py_floor = floor;
    w.py_last = u64::MAX;
    w.py_search = 0;
    run_loop(PY_MAX_THREADS, find_thread, w);
    if w.py_me == FOUND {
        return w.py_ts;
    }
    let s = w.py_search;
    if s & (SEARCH_END | SEARCH_FLOOR | SEARCH_BROKEN) == 0 {
        w.py_search |= SEARCH_BEYOND;
    }
    if s & (SEARCH_END | SEARCH_FLOOR) != 0 && s & (SEARCH_BROKEN | SEARCH_UNBOUND) == 0 {
        w.py_search |= SEARCH_SURE;
    }
    0
}

/// Finds the calling thread's state, searching the interpreter's list as
/// little as it can: the thread's storage remembers what its last search
/// found (a state, or none) and the id of the interpreter's newest state
/// then. The list only grows at its head, each new state with an id
/// higher than any before, and a thread binds the state made for it
/// before it allocates; so only the states made since need a search, and
/// a state remembered holds while it is still bound to the thread. Sets
/// `py_frame` to the thread's current frame and `py_me` to [`FOUND`] when
/// found.
#[inline(always)]
fn find_thread_state(w: &mut WalkScratch, l: &PythonLayout) {
    let head = read_u64(w.py_interp + l.threads_head as u64);
    if head == 0 {
        return;
    }
    let newest = read_u64(head + l.tstate_id as u64);
    let seen = PY_THREADS.current(true);
    let (mut ts, mut stamp) = match seen {
        Some(ref s) if s.interp == w.py_interp => (s.ts, s.stamp),
        _ => (0, 0),
    };
    if stamp != 0 && newest != stamp {
        // The states made since the last search.
        let found = search(w, head, stamp);
        if found != 0 {
            ts = found;
        } else if w.py_search & SEARCH_SURE == 0 {
            stamp = 0;
        }
    }
    if stamp != 0 && ts != 0 && w.py_me != FOUND {
        // The state remembered, if it is still the thread's.
        if read_u64(ts + l.tstate_tid as u64) == w.py_me {
            w.py_me = FOUND;
        } else {
            stamp = 0;
        }
    }
    if stamp == 0 {
        ts = search(w, head, 0);
        let sure = w.py_search & SEARCH_SURE != 0;
        stamp = if ts != 0 || sure { newest } else { 0 };
    } else {
        stamp = newest;
    }
    if let Some(s) = seen {
        s.ts = ts;
        s.stamp = stamp;
        s.interp = w.py_interp;
    }
    if ts == 0 {
        return;
    }
    w.py_me = FOUND;
    let mut frame = read_u64(ts + l.tstate_frame as u64);
    if l.via_cframe != 0 && frame != 0 {
        frame = read_u64(frame + l.cframe_frame as u64);
    }
    w.py_frame = frame;
}

/// One thread state of the interpreter's list (`py_ts`): the calling
/// thread's ends the loop with `py_me` set to [`FOUND`] (`py_ts` left on
/// it); so do the list's end, the floor, and a state that is not the
/// interpreter's or not older than the one before it (each state is put at
/// the head with an id higher than any before: ids fall along the list).
#[inline(never)]
extern "C" fn find_thread(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let Some(l) = layout(w) else {
        return 1;
    };
    let ts = w.py_ts;
    if ts == 0 {
        w.py_search |= SEARCH_END;
        return 1;
    }
    if read_u64(ts + l.tstate_interp as u64) != w.py_interp {
        w.py_search |= SEARCH_BROKEN;
        return 1;
    }
    let id = read_u64(ts + l.tstate_id as u64);
    if id == 0 || id >= w.py_last {
        w.py_search |= SEARCH_BROKEN;
        return 1;
    }
    if id <= w.py_floor {
        w.py_search |= SEARCH_FLOOR;
        return 1;
    }
    w.py_last = id;
    let tid = read_u64(ts + l.tstate_tid as u64);
    if tid == w.py_me {
        w.py_me = FOUND;
        return 1;
    }
    if tid == 0 {
        w.py_search |= SEARCH_UNBOUND;
    }
    match unsafe { bpf_probe_read_user((ts + l.tstate_next as u64) as *const u64) } {
        Ok(next) => w.py_ts = next,
        Err(_) => {
            w.py_search |= SEARCH_BROKEN;
            return 1;
        }
    }
    0
}

/// A field of the frame read into `w.py_buf`, at a masked offset (the
/// verifier sees it within the buffer).
#[inline(always)]
fn field_u64(w: &WalkScratch, off: u32) -> u64 {
    let off = (off as usize) & (PY_FRAME_READ - 8);
    unsafe { core::ptr::read_unaligned(w.py_buf.as_ptr().add(off) as *const u64) }
}

/// One frame from `py_frame` out: stored, or (a 3.12+ shim) marking the
/// run's first frame; ends the loop at the outermost frame, or at a frame
/// more than the stack keeps, whose place takes the mark of the cut.
#[inline(never)]
extern "C" fn python_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let Some(l) = layout(w) else {
        return 1;
    };
    let frame = w.py_frame;
    if frame == 0 {
        return 1;
    }
    let n = w.py_n as usize;
    if n > 2 * PY_MAX_FRAMES - 2 {
        return 1;
    }
    let len = (l.frame_read as usize).clamp(8, PY_FRAME_READ) as u32;
    let read = unsafe {
        aya_ebpf::helpers::generated::bpf_probe_read_user(
            w.py_buf.as_mut_ptr() as *mut core::ffi::c_void,
            len,
            frame as *const core::ffi::c_void,
        )
    };
    if read != 0 {
        bump_counter(counter::PY_READ_FAILED, 1);
        return 1;
    }
    w.py_frame = field_u64(w, l.frame_back);
    let flag = w.py_buf[(l.frame_entry as usize) & (PY_FRAME_READ - 1)];
    if l.entry == py_entry::SHIM && flag == PY_OWNED_BY_CSTACK {
        // The run below began here: its last frame read is its first.
        if n >= 2 {
            w.py[n - 2] |= PY_ENTRY;
        }
        return 0;
    }
    let code = field_u64(w, l.frame_code);
    if code == 0 {
        return 1;
    }
    if n == 2 * PY_MAX_FRAMES - 2 {
        // A frame more than a stack keeps: the last place marks the cut.
        let words = py_cut_words(0, true);
        w.py[n] = words[0];
        w.py[n + 1] = words[1];
        w.py_n = n as u64 + 2;
        bump_counter(counter::PY_CUT, 1);
        return 1;
    }
    let instr = if l.instr_is_ptr != 0 {
        field_u64(w, l.frame_instr).wrapping_sub(code) as u32
    } else {
        field_u64(w, l.frame_instr) as u32
    };
    // The code object's first line and, further on, its file and name
    // objects: one read (the frame's bytes are used up).
    // (From the word holding the first line: fields are read as whole
    // words at multiples of 8.)
    let from = l.code_firstlineno & !7;
    let names_at = l.code_filename.wrapping_sub(from);
    let len = (names_at as usize + 16).clamp(16, PY_FRAME_READ) as u32;
    let read = unsafe {
        aya_ebpf::helpers::generated::bpf_probe_read_user(
            w.py_buf.as_mut_ptr() as *mut core::ffi::c_void,
            len,
            (code + from as u64) as *const core::ffi::c_void,
        )
    };
    let check = if read == 0 {
        let first = (field_u64(w, 0) >> ((l.code_firstlineno & 7) * 8)) as u32;
        py_code_check(first, field_u64(w, names_at), field_u64(w, names_at + 8))
    } else {
        0
    };
    let entry = match l.entry {
        py_entry::EVERY => true,
        py_entry::FLAG => flag != 0,
        _ => false,
    };
    let words = py_frame_words(code, entry, instr, check);
    w.py[n] = words[0];
    w.py[n + 1] = words[1];
    w.py_n = n as u64 + 2;
    0
}

/// The key of a stack with Python frames: the native walk's key
/// (`native`) continued over the Python words
/// (`tracer_common::python_stack_key`); `native` itself without any.
#[inline(always)]
pub(crate) fn python_key(w: &mut WalkScratch, native: u64) -> u64 {
    if w.py_n == 0 {
        return native;
    }
    w.hash = native;
    run_loop(PY_MAX_FRAMES as u32, hash_step, w);
    python_key_finish(w.hash)
}

/// Python frame `i` into the key.
#[inline(never)]
extern "C" fn hash_step(i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let k = (2 * i) as usize;
    if k > 2 * PY_MAX_FRAMES - 2 || k + 2 > w.py_n as usize {
        return 1;
    }
    w.hash = stack_hash_step(stack_hash_step(w.hash, w.py[k]), w.py[k + 1]);
    0
}

/// Puts the Python frames read behind the native ones, for the stack map
/// (as `tracer::python::fit` does for a walk the tracer finishes): a
/// native walk cut short already gives way to them; then as many whole
/// frames as the stack has room for, the last place taken by the mark of
/// the cut when they do not all fit.
#[inline(always)]
pub(crate) fn append_python(w: &mut WalkScratch) {
    if w.py_n == 0 {
        return;
    }
    let py_n = (w.py_n as usize).min(2 * PY_MAX_FRAMES);
    if unsafe { core::ptr::read_volatile(&w.stack.stop) } != stop::END {
        let len = unsafe { core::ptr::read_volatile(&w.stack.len) } as usize;
        if len + py_n > MAX_FRAMES {
            unsafe { core::ptr::write_volatile(&mut w.stack.len, (MAX_FRAMES - py_n) as u32) };
        }
    }
    run_loop(PY_MAX_FRAMES as u32, append_step, w);
}

/// Frame `i` of the Python frames onto the stack, or the mark of the cut
/// when only its place is left and more frames follow.
#[inline(never)]
extern "C" fn append_step(i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let k = (2 * i) as usize;
    let py_n = w.py_n as usize;
    if k > 2 * PY_MAX_FRAMES - 2 || k + 2 > py_n {
        return 1;
    }
    let n = (unsafe { core::ptr::read_volatile(&w.stack.len) } as usize) & 127;
    if n > MAX_FRAMES - 2 {
        bump_counter(counter::PY_CUT, 1);
        return 1;
    }
    let (a, b) = if n + 2 > MAX_FRAMES - 2 && k + 2 < py_n {
        // The frames from this one on are left out (with those past a
        // mark that ends them, not read).
        let last = (py_n - 2).min(2 * PY_MAX_FRAMES - 2);
        let marked = w.py[last] & PY_CUT_MARK != 0;
        let left = (py_n - k) / 2 - marked as usize;
        bump_counter(counter::PY_CUT, 1);
        let words = py_cut_words(left as u32, marked);
        (words[0], words[1])
    } else {
        (w.py[k], w.py[k + 1])
    };
    w.stack.frames[n] = a;
    w.stack.frames[n + 1] = b;
    unsafe { core::ptr::write_volatile(&mut w.stack.len, n as u32 + 2) };
    (a & PY_CUT_MARK != 0) as i64
}

/// Tells the tracer of a new stack's Python frames, for it to read their
/// code objects' names while they live (on the ring of walks to finish,
/// where a record shorter than a walk's is a notice).
#[inline(always)]
pub(crate) fn send_python_notice(w: &mut WalkScratch) {
    if w.py_n == 0 || layout(w).is_none() {
        return;
    }
    // The copies first: the tracer has a code object's copy before the
    // notice that would have it read the object.
    send_python_snaps(w);
    let Some(mut entry) = UNWIND_MISSES.reserve::<PyNotice>(0) else {
        bump_counter(counter::PY_NOTICES_LOST, 1);
        return;
    };
    let ev = entry.as_mut_ptr();
    unsafe {
        (*ev).n = w.py_n as u32;
        if w.host_gen != 0 {
            (*ev).tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
            (*ev).mm = w.host_mm;
        } else {
            (*ev).tgid = 0;
            (*ev).mm = 0;
        }
        aya_ebpf::helpers::generated::bpf_probe_read_kernel(
            (*ev).words.as_mut_ptr() as *mut core::ffi::c_void,
            (2 * PY_MAX_FRAMES * 8) as u32,
            w.py.as_ptr() as *const core::ffi::c_void,
        );
    }
    entry.submit(0);
}

/// Copies the code objects of the Python frames read into `w` that were
/// not copied before ([`PyCodeSnap`]), for the tracer to name them also
/// once the interpreter has freed them: sent before what stores or hands
/// over the stack.
#[inline(always)]
pub(crate) fn send_python_snaps(w: &mut WalkScratch) {
    if w.py_n == 0 || layout(w).is_none() {
        return;
    }
    run_loop(PY_MAX_FRAMES as u32, snap_step, w);
}

/// Frame `i`'s code object copied to the tracer ([`PyCodeSnap`]), unless
/// it was before (in this process, with this check).
#[inline(never)]
extern "C" fn snap_step(i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &**(ctx as *mut *mut WalkScratch) };
    let k = (2 * i) as usize;
    if k > 2 * PY_MAX_FRAMES - 2 || k + 2 > w.py_n as usize {
        return 1;
    }
    let (a, b) = (w.py[k], w.py[k + 1]);
    if a & PY_CUT_MARK != 0 {
        return 0;
    }
    let Some(l) = layout(w) else {
        return 1;
    };
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let key = PyCodeKey {
        code: a & PY_CODE_MASK,
        tgid,
        check: (b >> 32) as u32,
    };
    if unsafe { PY_CODES_SENT.get(&key) }.is_some() {
        return 0;
    }
    let Some(mut entry) = UNWIND_MISSES.reserve::<PyCodeSnap>(0) else {
        bump_counter(counter::PY_NOTICES_LOST, 1);
        return 0;
    };
    let _ = PY_CODES_SENT.insert(&key, &1, 0);
    let ev = entry.as_mut_ptr();
    // SAFETY: the reserved record is ours until submitted; every copy is
    // bounded by its field's size.
    unsafe {
        (*ev).tgid = tgid;
        (*ev).minor = l.minor;
        (*ev).mm = if w.host_gen != 0 { w.host_mm } else { 0 };
        (*ev).code = key.code;
        (*ev).check = key.check;
        (*ev).code_len = copy_user((*ev).code_bytes.as_mut_ptr(), PY_SNAP_CODE, key.code);
        let field = |off: u32| -> u64 {
            let off = off as usize;
            if off <= PY_SNAP_CODE - 8 && (*ev).code_len as usize >= off + 8 {
                core::ptr::read_unaligned((*ev).code_bytes.as_ptr().add(off) as *const u64)
            } else {
                0
            }
        };
        let at = [
            field(l.code_name),
            field(l.code_filename),
            field(l.code_linetable),
            if l.code_code != 0 {
                field(l.code_code)
            } else {
                0
            },
        ];
        (*ev).at = at;
        (*ev).len[py_snap::NAME] = copy_user((*ev).name.as_mut_ptr(), PY_SNAP_NAME, at[0]);
        (*ev).len[py_snap::FILE] = copy_user((*ev).file.as_mut_ptr(), PY_SNAP_FILE, at[1]);
        (*ev).len[py_snap::TABLE] = copy_user((*ev).table.as_mut_ptr(), PY_SNAP_TABLE, at[2]);
        (*ev).len[py_snap::CODE_OBJ] =
            copy_user((*ev).code_obj.as_mut_ptr(), PY_SNAP_CODE_OBJ, at[3]);
    }
    entry.submit(0);
    0
}

/// Copies `max` bytes from the user address `from` to `to`, or, where
/// they cross into a page that cannot be read, those up to the page's
/// end: the bytes copied (0 for none).
#[inline(always)]
unsafe fn copy_user(to: *mut u8, max: usize, from: u64) -> u32 {
    if from == 0 {
        return 0;
    }
    let read = |len: u32| unsafe {
        aya_ebpf::helpers::generated::bpf_probe_read_user(
            to as *mut core::ffi::c_void,
            len,
            from as *const core::ffi::c_void,
        )
    };
    if read(max as u32) == 0 {
        return max as u32;
    }
    let rest = 4096 - (from & 4095) as u32;
    if rest >= max as u32 {
        return 0;
    }
    let len = rest;
    if len == 0 || len >= max as u32 || read(len) != 0 {
        return 0;
    }
    len
}
