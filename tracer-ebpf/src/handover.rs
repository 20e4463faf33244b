//! The miss hand-over: a walk that met a return address without an unwind
//! rule goes to the tracer, with a copy of the stack from there.

use aya_ebpf::bindings::{BPF_NOEXIST, BPF_RB_AVAIL_DATA, BPF_RB_RING_SIZE};
use tracer_common::{
    counter, miss_stack_id, stop, MissEvent, WalkScratch, MAX_FRAMES, MISS_COPY_SIZES,
    PY_MAX_FRAMES, STACK_COPY, STACK_COPY_TAIL, THROTTLE_SIGNAL,
};

use crate::{
    aggregate::{bump_counter, current_comm},
    hidden::note_hidden,
    live::now_ns,
    maps::{config_u32, CONFIG, PROCESS, THREAD_NAMES, THROTTLED, UNWIND_FULL, UNWIND_MISSES},
    scratch::{level_of, scratch_at},
    walk::finish_hash,
};

/// Hands a walk that met an address without a rule to the tracer: where it
/// stopped and a copy of the stack from there. Returns the call's stack id
/// (live mode's events carry it), `None` when the ring had no room.
#[inline(always)]
pub(crate) fn send_miss(
    w: &WalkScratch,
    func: u32,
    tid: u32,
    caller: u64,
    calls: u64,
    bytes: u64,
) -> Option<u64> {
    let level = level_of(w);
    let id = send_miss_at(
        level,
        (func as u64) << 32 | tid as u64,
        caller,
        calls,
        bytes,
    );
    (id != 0).then_some(id)
}

/// [`send_miss`] for the walk scratch at `level`, `func` and `tid` in
/// the high and low halves of `func_tid`; 0 when the ring had no room (a
/// stack id is never 0). A global function (numbers in, a number out):
/// the verifier checks it once, not once for each way the program
/// reaches it.
#[inline(never)]
#[no_mangle]
pub extern "C" fn send_miss_at(
    level: u64,
    func_tid: u64,
    caller: u64,
    calls: u64,
    bytes: u64,
) -> u64 {
    let Some(w) = scratch_at(level) else {
        return 0;
    };
    let w = unsafe { &mut *w };
    let (func, tid) = ((func_tid >> 32) as u32, func_tid as u32);
    if UNWIND_FULL.get(0).is_some_and(|f| *f != 0) {
        finish_hash(w, stop::RULES_FULL);
        return 0;
    }
    bump_counter(counter::UNWIND_MISSES, 1);
    if tid != 0 {
        // Per thread: the kernel may never count this thread's calls
        // itself (where its name is recorded otherwise).
        if let Some(comm) = current_comm() {
            let _ = THREAD_NAMES.insert(&tid, &comm, BPF_NOEXIST as u64);
        }
    }
    // Its Python frames' code objects copied ahead of it (the tracer
    // finishes the walk, maybe after the interpreter freed them).
    crate::python::send_python_snaps(w);
    // Unique: a CPU copies one stack at a time, and a copy outlasts the
    // clock's nanosecond.
    // (The BPF target here has no fetch-and-add for a counter.)
    let cpu = unsafe { aya_ebpf::helpers::bpf_get_smp_processor_id() } as u64;
    let id = miss_stack_id(((now_ns() & ((1 << 52) - 1)) << 8) | (cpu & 0xff));
    // The copy goes from the page of the return address's slot to the end
    // of the stack's mapping (the thread's outermost frame lies below it),
    // or on the main thread to where its frames end, in the smallest
    // record that holds it.
    let from = w.sp - 8;
    let base = from & !4095;
    let end = mapping_end(from);
    let mut top = if end > from {
        end
    } else {
        base + STACK_COPY as u64
    };
    let start = if w.host_gen != 0 {
        main_stack_start(w.host_mm)
    } else {
        PROCESS.get(0).map_or(0, |p| p.stack_start)
    };
    if start > from && start < top {
        top = start + 64;
    }
    let total = top - base;
    note_hidden(level);
    let head = (id, func, tid, caller, calls, bytes);
    let sent = if total <= MISS_COPY_SIZES[0] as u64 {
        send_copy::<{ MISS_COPY_SIZES[0] }>(w, head, base, total)
    } else if total <= MISS_COPY_SIZES[1] as u64 {
        send_copy::<{ MISS_COPY_SIZES[1] }>(w, head, base, total)
    } else if total <= MISS_COPY_SIZES[2] as u64 {
        send_copy::<{ MISS_COPY_SIZES[2] }>(w, head, base, total)
    } else if total <= MISS_COPY_SIZES[3] as u64 {
        send_copy::<{ MISS_COPY_SIZES[3] }>(w, head, base, total)
    } else if total <= MISS_COPY_SIZES[4] as u64 {
        send_copy::<{ MISS_COPY_SIZES[4] }>(w, head, base, total)
    } else if total <= MISS_COPY_SIZES[5] as u64 {
        send_copy::<{ MISS_COPY_SIZES[5] }>(w, head, base, total)
    } else {
        send_copy::<STACK_COPY>(w, head, base, total)
    };
    throttle();
    if !sent {
        bump_counter(counter::UNWIND_MISSES_LOST, 1);
        return 0;
    }
    id
}

/// Launch mode (`Config::throttle`): once a quarter of the ring of walks
/// is taken, the calling thread is sent the throttle signal, which stops
/// it for its tracer (ptrace) before its next instruction; the tracer
/// finishes the walks the ring holds and lets it go, the signal taken.
/// So a thread that makes copies faster than the tracer finishes them
/// waits for it. Past the mark each thread makes at most one more copy
/// (the one after which it is stopped): the rest of the ring is room
/// for that copy of as many threads as it holds copies. A thread is sent
/// one signal at a time (`THROTTLED`, which tells the tracer the signal
/// is not the program's).
#[inline(always)]
fn throttle() {
    if config_u32(&CONFIG.throttle) == 0 {
        return;
    }
    let size = UNWIND_MISSES.query(BPF_RB_RING_SIZE as u64);
    let held = UNWIND_MISSES.query(BPF_RB_AVAIL_DATA as u64);
    if held < size / 4 {
        return;
    }
    if blocks_throttle_signal() {
        bump_counter(counter::NOT_THROTTLED, 1);
        return;
    }
    let tid = aya_ebpf::helpers::bpf_get_current_pid_tgid() as u32;
    if THROTTLED.insert(&tid, &1, BPF_NOEXIST as u64).is_err() {
        return;
    }
    if unsafe { aya_ebpf::helpers::generated::bpf_send_signal_thread(THROTTLE_SIGNAL) } == 0 {
        bump_counter(counter::THROTTLED, 1);
    } else {
        let _ = THROTTLED.remove(&tid);
    }
}

/// Whether the calling thread blocks the throttle signal (true when that
/// cannot be read): it would not stop for the signal, which would wait in
/// it for the program to take with sigwait or a signalfd as its own.
#[inline(always)]
fn blocks_throttle_signal() -> bool {
    let at = config_u32(&CONFIG.kernel.task_blocked) as u64;
    if at == 0 {
        return true;
    }
    let task = unsafe { aya_ebpf::helpers::bpf_get_current_task() };
    match unsafe { aya_ebpf::helpers::bpf_probe_read_kernel((task + at) as *const u64) } {
        Ok(blocked) => blocked & (1u64 << (THROTTLE_SIGNAL - 1)) != 0,
        Err(_) => true,
    }
}

/// The host scope: where the main thread's frames end in the process of
/// address space `mm` (its stack pointer at exec), 0 when unknown.
#[inline(always)]
fn main_stack_start(mm: u64) -> u64 {
    let at = config_u32(&CONFIG.vma.mm_start_stack) as u64;
    if mm == 0 || at == 0 {
        return 0;
    }
    unsafe { aya_ebpf::helpers::bpf_probe_read_kernel((mm + at) as *const u64) }.unwrap_or(0)
}

/// The end of the target's mapping that holds `addr`, 0 when it cannot be
/// found (another thread holds the address space's lock, say).
#[inline(always)]
fn mapping_end(addr: u64) -> u64 {
    let mut end: u64 = 0;
    unsafe {
        aya_ebpf::helpers::generated::bpf_find_vma(
            aya_ebpf::helpers::generated::bpf_get_current_task_btf(),
            addr,
            vma_end as *mut core::ffi::c_void,
            &mut end as *mut u64 as *mut core::ffi::c_void,
            0,
        );
    }
    end
}

/// `bpf_find_vma`'s callback: the mapping's `vm_end` (the second word of
/// `struct vm_area_struct`, after `vm_start`).
#[inline(never)]
extern "C" fn vma_end(
    _task: *mut core::ffi::c_void,
    vma: *mut core::ffi::c_void,
    end: *mut core::ffi::c_void,
) -> i64 {
    unsafe { *(end as *mut u64) = core::ptr::read_volatile((vma as *const u64).add(1)) };
    0
}

/// One [`MissEvent`] with `N` bytes of copy: the walk so far and the
/// target's stack from `base` (a page boundary), `total` bytes of it in
/// one read; more than `N` (the largest copy), its first `N -
/// STACK_COPY_TAIL` bytes and its last `STACK_COPY_TAIL` in two. Where
/// that fails (a page never touched under a large local buffer), a page
/// at a time, the pages that cannot be read marked as holes. False when
/// the ring is full.
#[inline(always)]
fn send_copy<const N: usize>(
    w: &mut WalkScratch,
    (id, func, tid, caller, calls, bytes): (u64, u32, u32, u64, u64, u64),
    base: u64,
    total: u64,
) -> bool {
    let Some(mut entry) = UNWIND_MISSES.reserve::<MissEvent<N>>(0) else {
        return false;
    };
    let ev = entry.as_mut_ptr();
    unsafe {
        (*ev).stack_id = id;
        (*ev).func = func;
        (*ev).tid = tid;
        (*ev).caller = caller;
        (*ev).calls = calls;
        (*ev).bytes = bytes;
        (*ev).n = w.stack.len;
        (*ev).ra = w.ra;
        (*ev).sp = w.sp;
        (*ev).bp = w.bp;
        (*ev).bp_ok = w.bp_ok;
        (*ev).tgid = if w.host_gen != 0 {
            aya_ebpf::helpers::bpf_get_current_pid_tgid() >> 32
        } else {
            0
        };
        (*ev).mm = w.host_mm;
        (*ev).ra_frame = w.host_ra;
        (*ev).caller_frame = w.host_caller;
        (*ev).gen = w.host_gen;
        (*ev).ip = w.ip;
        (*ev).exe = w.host_exe;
        (*ev).trampoline = w.trampoline;
        aya_ebpf::helpers::generated::bpf_probe_read_kernel(
            (*ev).hidden.as_mut_ptr() as *mut core::ffi::c_void,
            core::mem::size_of_val(&w.hidden_at) as u32,
            w.hidden_at.as_ptr() as *const core::ffi::c_void,
        );
        (*ev).skip = ((w.sp - 8) & 4095) as u32;
        aya_ebpf::helpers::generated::bpf_probe_read_kernel(
            (*ev).frames.as_mut_ptr() as *mut core::ffi::c_void,
            (MAX_FRAMES * 8) as u32,
            w.stack.frames.as_ptr() as *const core::ffi::c_void,
        );
        (*ev).py_n = w.py_n as u32;
        (*ev).python_unread = (w.host_gen != 0 && w.host_py.runtime == 0) as u32;
        aya_ebpf::helpers::generated::bpf_probe_read_kernel(
            (*ev).py.as_mut_ptr() as *mut core::ffi::c_void,
            (2 * PY_MAX_FRAMES * 8) as u32,
            w.py.as_ptr() as *const core::ffi::c_void,
        );
        let len = if total < N as u64 {
            total as u32
        } else {
            N as u32
        };
        // Deeper than the copy: a head and the stack's last bytes.
        let split = total > N as u64 && N > STACK_COPY_TAIL;
        let head = if split {
            (N - STACK_COPY_TAIL) as u32
        } else {
            len
        };
        let tail_at = if split {
            base + total - STACK_COPY_TAIL as u64
        } else {
            0
        };
        (*ev).copied = len;
        (*ev).head = head;
        (*ev).tail_at = tail_at;
        (*ev).holes = 0;
        let whole = if split {
            aya_ebpf::helpers::generated::bpf_probe_read_user(
                (*ev).copy.as_mut_ptr() as *mut core::ffi::c_void,
                (N - STACK_COPY_TAIL) as u32,
                base as *const core::ffi::c_void,
            ) == 0
                && aya_ebpf::helpers::generated::bpf_probe_read_user(
                    (*ev).copy.as_mut_ptr().add(N - STACK_COPY_TAIL) as *mut core::ffi::c_void,
                    STACK_COPY_TAIL as u32,
                    tail_at as *const core::ffi::c_void,
                ) == 0
        } else {
            aya_ebpf::helpers::generated::bpf_probe_read_user(
                (*ev).copy.as_mut_ptr() as *mut core::ffi::c_void,
                len,
                base as *const core::ffi::c_void,
            ) == 0
        };
        if !whole {
            // A page that cannot be read is zeroed by the helper.
            let mut holes = 0u64;
            let mut page = 0usize;
            while page < N / 4096 {
                let at = page * 4096;
                if at as u32 >= len {
                    break;
                }
                let from = if (at as u32) < head {
                    base + at as u64
                } else {
                    tail_at + (at as u64 - head as u64)
                };
                if aya_ebpf::helpers::generated::bpf_probe_read_user(
                    (*ev).copy.as_mut_ptr().add(at) as *mut core::ffi::c_void,
                    4096,
                    from as *const core::ffi::c_void,
                ) != 0
                {
                    holes |= 1 << page;
                }
                page += 1;
            }
            (*ev).holes = holes;
        }
    }
    // Wake the tracer: the sooner it adds the rules, the fewer copies.
    entry.submit(0);
    true
}
