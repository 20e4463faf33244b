//! The calling thread's Python frames, read after its native walk in a
//! process that runs a CPython interpreter (`ProcessConfig::python`): its
//! thread state found among the interpreter's by thread id, then its frames
//! from the current one out, each stored as two words (see
//! `tracer_common::py_frame_words`) behind the native frames.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user};
use tracer_common::{
    counter, py_code_check, py_entry, py_frame_words, python_key_finish, stack_hash_step, PyNotice,
    PythonLayout, WalkScratch, MAX_FRAMES, PY_ENTRY, PY_FRAME_READ, PY_MAX_FRAMES, PY_MAX_THREADS,
    PY_OWNED_BY_CSTACK,
};

use crate::{
    aggregate::bump_counter,
    maps::{PROCESS, UNWIND_MISSES},
    scratch::run_loop,
};

/// The process's interpreter layout, when it runs one the programs read.
#[inline(always)]
pub(crate) fn python_layout() -> Option<&'static PythonLayout> {
    PROCESS
        .get(0)
        .map(|p| &p.python)
        .filter(|l| unsafe { core::ptr::read_volatile(&l.runtime) } != 0)
}

#[inline(always)]
fn read_u64(addr: u64) -> u64 {
    unsafe { bpf_probe_read_user(addr as *const u64) }.unwrap_or(0)
}

/// Reads the calling thread's Python frames into `w.py` (`w.py_n` words;
/// none when the thread has no thread state or runs no Python code).
#[inline(always)]
pub(crate) fn read_python(w: &mut WalkScratch) {
    w.py_n = 0;
    let Some(l) = python_layout() else {
        return;
    };
    let interp = read_u64(l.runtime + l.interp_head as u64);
    if interp == 0 {
        bump_counter(counter::PY_NO_INTERPRETER, 1);
        return;
    }
    w.py_ts = read_u64(interp + l.threads_head as u64);
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
    // (A thread state not yet bound to a thread says 0: never match it.)
    if w.py_me != 0 {
        run_loop(PY_MAX_THREADS, find_thread, w);
    }
    if w.py_frame != 0 {
        // Shim frames (3.12+) sit between the runs.
        run_loop(2 * PY_MAX_FRAMES as u32, python_step, w);
    }
    let why = if w.py_n != 0 {
        counter::PY_WITH_FRAMES
    } else if w.py_me == FOUND {
        counter::PY_NO_CODE_RUNNING
    } else {
        counter::PY_NO_THREAD_STATE
    };
    bump_counter(why, 1);
}

/// `py_me` once the calling thread's state is found.
const FOUND: u64 = u64::MAX;

/// One thread state of the interpreter's list: the calling thread's sets
/// `py_frame` to its current frame and ends the loop.
#[inline(never)]
extern "C" fn find_thread(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let Some(l) = python_layout() else {
        return 1;
    };
    let ts = w.py_ts;
    if ts == 0 {
        return 1;
    }
    if read_u64(ts + l.tstate_tid as u64) == w.py_me {
        let mut frame = read_u64(ts + l.tstate_frame as u64);
        if l.via_cframe != 0 && frame != 0 {
            frame = read_u64(frame + l.cframe_frame as u64);
        }
        w.py_frame = frame;
        w.py_me = FOUND;
        return 1;
    }
    w.py_ts = read_u64(ts + l.tstate_next as u64);
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
/// run's first frame; ends the loop at the outermost frame or when the
/// stack has no room left.
#[inline(never)]
extern "C" fn python_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let Some(l) = python_layout() else {
        return 1;
    };
    let frame = w.py_frame;
    if frame == 0 {
        return 1;
    }
    let n = w.py_n as usize;
    if n > 2 * PY_MAX_FRAMES - 2 {
        bump_counter(counter::PY_CUT, 1);
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

/// Puts the Python frames read behind the native ones (as many whole
/// frames as the stack has room for), for the stack map.
#[inline(always)]
pub(crate) fn append_python(w: &mut WalkScratch) {
    if w.py_n != 0 {
        run_loop(PY_MAX_FRAMES as u32, append_step, w);
    }
}

/// Frame `i` of the Python frames onto the stack.
#[inline(never)]
extern "C" fn append_step(i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let k = (2 * i) as usize;
    if k > 2 * PY_MAX_FRAMES - 2 || k + 2 > w.py_n as usize {
        return 1;
    }
    let n = (unsafe { core::ptr::read_volatile(&w.stack.len) } as usize) & 127;
    if n > MAX_FRAMES - 2 {
        bump_counter(counter::PY_CUT, 1);
        return 1;
    }
    let (a, b) = (w.py[k], w.py[k + 1]);
    w.stack.frames[n] = a;
    w.stack.frames[n + 1] = b;
    unsafe { core::ptr::write_volatile(&mut w.stack.len, n as u32 + 2) };
    0
}

/// Tells the tracer of a new stack's Python frames, for it to read their
/// code objects' names while they live (on the ring of walks to finish,
/// where a record shorter than a walk's is a notice).
#[inline(always)]
pub(crate) fn send_python_notice(w: &WalkScratch) {
    if w.py_n == 0 || python_layout().is_none() {
        return;
    }
    let Some(mut entry) = UNWIND_MISSES.reserve::<PyNotice>(0) else {
        bump_counter(counter::PY_NOTICES_LOST, 1);
        return;
    };
    let ev = entry.as_mut_ptr();
    unsafe {
        (*ev).n = w.py_n as u32;
        (*ev)._pad = 0;
        aya_ebpf::helpers::generated::bpf_probe_read_kernel(
            (*ev).words.as_mut_ptr() as *mut core::ffi::c_void,
            (2 * PY_MAX_FRAMES * 8) as u32,
            w.py.as_ptr() as *const core::ffi::c_void,
        );
    }
    entry.submit(0);
}
