//! The host scope (`--all`): one program for every allocating entry point
//! of every allocator file on the host, attached file-wide (the kernel puts
//! the probe in every process that maps the file, now or later). A call is
//! counted under its process, its function and its direct caller's place
//! in the caller's file (device, inode, offset, looked up with
//! `bpf_find_vma`), so that a process gone before the tracer reads the
//! counts is still symbolized, and under its stack, walked by rules kept
//! by file and offset (shared by every process that maps the file; a walk
//! that meets an offset without one is handed to the tracer). A process
//! the tracer knows runs CPython (`HOST_PYTHON`) has its Python frames read
//! after the native walk, as a traced process's are.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_pid_tgid, bpf_probe_read_kernel, bpf_probe_read_kernel_str_bytes,
        bpf_probe_read_user, generated::bpf_get_current_task,
    },
    programs::{ProbeContext, RawTracePointContext},
};
use tracer_common::{
    counter, host_frame_parts, stop, HostExec, HostKey, HostMark, HostName, HostProcess, HostValue,
    PythonLayout, WalkScratch, HOST_NEXT_PY_EPOCH, HOST_NEXT_PY_EPOCH_TRACER, MAX_HOST_FUNCS,
    PLACE_UNRESOLVED,
};

use crate::{
    aggregate::{atomic_add, bump_counter, current_comm, name_thread, EEXIST},
    args::{attach_cookie, call_args, NO_COOKIE},
    chunk::load_chunk,
    handover::send_miss,
    hidden::hidden_return,
    incarnation::{end_counted, incarnation_of},
    maps::{
        config_u32, enabled, CONFIG, HOST_BODIES, HOST_COUNTS, HOST_EXECS, HOST_FUNCS, HOST_GENS,
        HOST_MARKS, HOST_NAMES, HOST_NEXT, HOST_PYTHON, HOST_PY_FILES, HOST_RUNS, HOST_SELF,
        HOST_STACKS, HOST_TOTALS,
    },
    memo::{memo_claim, memo_find, memo_release},
    nesting::in_ranges,
    place::{caller_place, host_place, NO_GEN},
    python::{append_python, python_key, read_python, send_python_notice},
    scope::{in_scope, leave, scope_mark},
    scratch::{give_back_scratch, level_of, take_scratch},
    walk::{finish_hash, start_walk, walk_frames},
};

/// An allocating call anywhere on the host.
#[inline(always)]
pub(crate) fn record(ctx: &ProbeContext) -> u32 {
    if !enabled() {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if HOST_SELF.get(0).is_some_and(|me| *me == tgid) {
        return 0;
    }
    // The thread's mark (null where task storage had no room), as a
    // pointer: the walk takes the process's incarnation from it too.
    let Some(mark) = scope_mark(tgid) else {
        return 0;
    };
    if config_u32(&CONFIG.host_runs) != 0 {
        count_run(tgid);
    }
    let cookie = attach_cookie(ctx);
    let func = (cookie as u32) & (MAX_HOST_FUNCS - 1);
    let Some(f) = HOST_FUNCS.get(func) else {
        return 0;
    };
    let (sp, ip) = unsafe { ((*ctx.regs).rsp, (*ctx.regs).rip) };
    // The direct caller's return address is at [rsp]: a walk's first read
    // of the stack (a chunk from there) holds it.
    let walks = config_u32(&CONFIG.max_frames) != 0;
    let mut scratch = if walks { take_scratch(ctx) } else { None };
    let ret = caller_at(scratch.unwrap_or(core::ptr::null_mut()), sp);
    if ret == 0 {
        bump_counter(counter::CALLER_READ_FAILED, 1);
    }
    let base = ip.wrapping_sub(f.probe_offset);
    let mm = match unsafe { mark.as_ref() } {
        Some(m) if m.mm != 0 => m.mm,
        _ => current_mm(),
    };
    if nested(unsafe { mark.as_mut() }, mm, ip, sp, ret, base, f.file) {
        give_back_scratch(scratch);
        bump_counter(counter::NESTED, 1);
        return 0;
    }
    let size = call_args(ctx, cookie).0;
    let tid = if config_u32(&CONFIG.per_thread) != 0 {
        pid_tgid as u32
    } else {
        0
    };
    add(HOST_TOTALS.get_ptr_mut(func), 1);
    add(HOST_TOTALS.get_ptr_mut(MAX_HOST_FUNCS + func), size);
    // No walk without a direct caller.
    if ret == 0 && scratch.is_some() {
        give_back_scratch(scratch);
        scratch = None;
    }
    if walks && ret != 0 && scratch.is_none() {
        bump_counter(counter::STACK_WALK_FAILED, 1);
    }
    // Without a walk no frame is read, Python's or other.
    let mut python_unread = 1;
    let (mut stack, mut got) = (0, Found::Walked);
    if let Some(w) = scratch {
        (stack, got) = walk(
            ctx,
            unsafe { &mut *w },
            (tgid, mark),
            mm,
            func,
            ret,
            size,
            tid,
        );
        match got {
            Found::HandedOver => {
                give_back_scratch(scratch);
                name_process(tgid, mm);
                return 0;
            }
            Found::Counted => {
                give_back_scratch(scratch);
                return 0;
            }
            _ => {}
        }
        python_unread = unsafe { (*w).host_py.runtime == 0 } as u32;
    }
    let key = HostKey {
        tgid,
        func,
        mm,
        ret,
        stack,
        tid,
        python_unread,
    };
    // A remembered walk's frames are not in the scratch (its stack is in
    // the map already).
    let frames = if got == Found::Remembered {
        None
    } else {
        scratch
    };
    let counted = count_key(&key, size, tgid, mm, ret, frames);
    give_back_scratch(scratch);
    counted
}

/// The word at `sp` (the direct caller's return address), 0 when
/// unreadable: with a walk's scratch `w` (else null), read with the
/// stack's first chunk into it. Not inlined: the program's stack has no
/// room for it beside the rest.
#[inline(never)]
fn caller_at(w: *mut WalkScratch, sp: u64) -> u64 {
    if !w.is_null() {
        let w = unsafe { &mut *w };
        if load_chunk(w, sp) {
            return w.chunk[0];
        }
        w.valid = 0;
    }
    unsafe { bpf_probe_read_user(sp as *const u64) }.unwrap_or(0)
}

/// Keeps the process's name (`comm`) as it is now, at its first counted
/// call (of its address space `mm`).
#[inline(always)]
fn name_process(tgid: u32, mm: u64) {
    let process = HostProcess { tgid, _pad: 0, mm };
    if HOST_NAMES.get_ptr(&process).is_some() {
        return;
    }
    if let Some(comm) = current_comm() {
        let name = HostName {
            comm,
            ppid: parent_tgid(),
            _pad: 0,
        };
        if let Err(e) = HOST_NAMES.insert(&process, &name, BPF_NOEXIST as u64) {
            if e != -EEXIST {
                bump_counter(counter::HOST_NAMES_FULL, 1);
            }
        }
    }
}

/// The current process's parent's id (`real_parent->tgid`), 0 when the
/// kernel's layout is not known.
#[inline(always)]
fn parent_tgid() -> u32 {
    let (parent_at, tgid_at) = (
        config_u32(&CONFIG.vma.task_real_parent) as u64,
        config_u32(&CONFIG.vma.task_tgid) as u64,
    );
    if parent_at == 0 || tgid_at == 0 {
        return 0;
    }
    let task = unsafe { bpf_get_current_task() };
    let parent = unsafe { bpf_probe_read_kernel((task + parent_at) as *const u64) }.unwrap_or(0);
    if parent == 0 {
        return 0;
    }
    unsafe { bpf_probe_read_kernel((parent + tgid_at) as *const i32) }.map_or(0, |t| t as u32)
}

/// How [`walk`] found a call's stack.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Found {
    /// Walked: its frames are in the scratch.
    Walked,
    /// A remembered walk's: its stack is in the map, its frames are not
    /// in the scratch.
    Remembered,
    /// A remembered walk's, and counted already under its key.
    Counted,
    /// Handed to the tracer with its stack (the tracer counts it).
    HandedOver,
}

/// Walks the calling thread's stack from the direct caller `ret` (the
/// probe is at a function's entry) by the rules of each return address's
/// file and offset: the stack's key, with its frames in the scratch; a
/// walk that meets a return address without a rule yet is handed to the
/// tracer. A walk of this process from the same place over the same
/// stack words is taken instead where the memo has it: the call is
/// counted at once where its key is in the map, else the stack is taken
/// where the map still holds it (its frames are not in the scratch).
#[inline(always)]
fn walk(
    ctx: &ProbeContext,
    w: &mut WalkScratch,
    (tgid, mark): (u32, *mut HostMark),
    mm: u64,
    func: u32,
    ret: u64,
    size: u64,
    tid: u32,
) -> (u64, Found) {
    let (sp, bp, ip) = unsafe { ((*ctx.regs).rsp, (*ctx.regs).rbp, (*ctx.regs).rip) };
    // (The chunk at `sp` is read: `record` took the caller from it.)
    start_walk(w, ret, sp, sp + 8, bp, ip);
    let gen = incarnation_of(tgid, mark);
    w.host_gen = gen;
    w.host_mm = mm;
    // Read before the process's interpreter is looked up: one put in the
    // tables after this read raises the epoch past it.
    w.host_epoch = interpreter_epoch();
    core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
    w.host_py.runtime = 0;
    // Not for a process without an incarnation (the memo's owner). An
    // entry is only made by a walk of a process not running Python (its
    // key has the Python frames read at the call), in the same epoch: the
    // process was not found to run it since, so the call's place and
    // interpreter need no looking up.
    let memo = gen != NO_GEN && w.limit != 0;
    if memo && memo_find(w, ret, sp, bp, ip) {
        // The key such a walk gives (its Python frames unread: none), in
        // the scratch (the program's stack has no room for it).
        let key = &mut w.host_key;
        key.tgid = tgid;
        key.func = func;
        key.mm = mm;
        key.ret = ret;
        key.stack = w.hit_key;
        key.tid = tid;
        key.python_unread = 1;
        if add_to_key(&w.host_key, size, ret) {
            return (w.hit_key, Found::Counted);
        }
        if HOST_STACKS.get_ptr(&w.hit_key).is_some() {
            return (w.hit_key, Found::Remembered);
        }
    }
    w.host_ra = host_place(w, ret);
    w.host_caller = w.host_ra;
    python_of(w, tgid, ret);
    let memo = memo && w.host_py.runtime == 0;
    bump_counter(counter::WALKS, 1);
    if memo && w.owned != 0 {
        memo_claim(w, ret, sp, NO_COOKIE, tid as u64);
    }
    walk_frames(level_of(w));
    // A process running CPython: its Python frames, read now (a walk
    // handed to the tracer takes them along), follow the native ones.
    if w.host_py.runtime != 0 {
        read_python(w);
    } else {
        w.py_n = 0;
    }
    let why = w.stack.stop;
    if why != stop::MISS {
        let native = finish_hash(w, why);
        // As a traced process's walk: one that could not read the stack
        // may do better next time; one that met a hidden return address
        // is not remembered.
        let keep = why != stop::READ_FAILED && w.hidden == 0;
        memo_release(w, keep.then_some((ret, sp, bp, native)));
        return (python_key(w, native), Found::Walked);
    }
    memo_release(w, None);
    // The mappings of the probed function and of the executable's code,
    // remembered under the incarnation like those of every frame walked:
    // with them the tracer finishes the walk in the files alone should the
    // process be gone by then.
    w.host_exe = code_start(mm);
    let _ = host_place(w, ip);
    if w.host_exe != 0 {
        let _ = host_place(w, w.host_exe);
    }
    if send_miss(w, func, tid, ret, 1, size).is_some() {
        return (0, Found::HandedOver);
    }
    let why = match w.stack.stop {
        stop::RULES_FULL => stop::RULES_FULL,
        _ => stop::COPY_LOST,
    };
    let native = finish_hash(w, why);
    (python_key(w, native), Found::Walked)
}

/// Copies process `tgid`'s interpreter layout into the walk's scratch
/// (`runtime` 0 where none is known). A process not known yet whose direct
/// caller (`ret`, at file frame `w.host_caller`) is in a file the tracer
/// knows holds an interpreter (`HOST_PY_FILES`) runs it: its layout, with
/// `_PyRuntime` where that file's code mapping puts it, becomes the
/// process's (an interpreter's first allocations come from its own code,
/// before any Python frame).
#[inline(always)]
fn python_of(w: &mut WalkScratch, tgid: u32, ret: u64) {
    w.host_py.runtime = 0;
    if let Some(l) = HOST_PYTHON.get_ptr(&tgid) {
        copy_layout(w, l);
        return;
    }
    let Some((tag, offset)) = host_frame_parts(w.host_caller) else {
        return;
    };
    let Some(l) = HOST_PY_FILES.get_ptr(&tag) else {
        return;
    };
    copy_layout(w, l);
    if w.host_py.runtime == 0 {
        return;
    }
    w.host_py.runtime = w.host_py.runtime.wrapping_add(ret.wrapping_sub(offset));
    match HOST_PYTHON.insert(&tgid, &w.host_py, BPF_NOEXIST as u64) {
        // After the layout is in: a walk that reads the epoch raised has
        // the layout to find.
        Ok(()) => add(HOST_NEXT.get_ptr_mut(HOST_NEXT_PY_EPOCH), 1),
        Err(e) if e != -EEXIST => bump_counter(counter::HOST_PYTHON_FULL, 1),
        Err(_) => {}
    }
}

/// The interpreter epoch ([`tracer_common::WalkMemo::epoch`]): the
/// programs' part and the tracer's added (each only ever raised).
#[inline(always)]
fn interpreter_epoch() -> u64 {
    let part = |slot| {
        HOST_NEXT
            .get_ptr(slot)
            .map_or(0, |p| unsafe { core::ptr::read_volatile(p) })
    };
    part(HOST_NEXT_PY_EPOCH).wrapping_add(part(HOST_NEXT_PY_EPOCH_TRACER))
}

#[inline(always)]
fn copy_layout(w: &mut WalkScratch, l: *const PythonLayout) {
    let copied = unsafe {
        aya_ebpf::helpers::generated::bpf_probe_read_kernel(
            (&raw mut w.host_py) as *mut core::ffi::c_void,
            core::mem::size_of::<PythonLayout>() as u32,
            l as *const core::ffi::c_void,
        )
    };
    if copied != 0 {
        w.host_py.runtime = 0;
    }
}

/// Counts a call under `key`; a new key also stores its stack (from the
/// walk in `scratch`), its caller's place and its process's name.
#[inline(always)]
fn count_key(
    key: &HostKey,
    size: u64,
    tgid: u32,
    mm: u64,
    ret: u64,
    scratch: Option<*mut WalkScratch>,
) -> u32 {
    if add_to_key(key, size, ret) {
        return 0;
    }
    if key.stack != 0 {
        if let Some(w) = scratch {
            append_python(unsafe { &mut *w });
            match HOST_STACKS.insert(&key.stack, unsafe { &(*w).stack }, BPF_NOEXIST as u64) {
                // A new stack: its Python frames' code objects to name.
                Ok(()) => send_python_notice(unsafe { &mut *w }),
                Err(e) if e != -EEXIST => bump_counter(counter::STACK_MAP_FULL, 1),
                Err(_) => {}
            }
        }
    }
    // A new key: where its return address lies is looked up once, here.
    let mut first = HostValue {
        calls: 1,
        bytes: size,
        ..HostValue::default()
    };
    caller_place(ret, &mut first);
    match HOST_COUNTS.insert(key, &first, BPF_NOEXIST as u64) {
        Ok(()) => {
            name_process(tgid, mm);
            if key.tid != 0 {
                name_thread(key.tid);
            }
        }
        Err(e) if e == -EEXIST => match HOST_COUNTS.get_ptr_mut(key) {
            Some(v) => add_value(v, size),
            None => bump_counter(counter::MAP_FULL, 1),
        },
        Err(_) => bump_counter(counter::MAP_FULL, 1),
    }
    0
}

/// Counts a call under `key` if the map holds it (its place looked up
/// again if it was not resolved); false when it does not.
#[inline(always)]
fn add_to_key(key: &HostKey, size: u64, ret: u64) -> bool {
    let Some(v) = HOST_COUNTS.get_ptr_mut(key) else {
        return false;
    };
    add_value(v, size);
    if unsafe { core::ptr::read_volatile(&(*v).place) } == PLACE_UNRESOLVED {
        place_again(ret, v);
    }
    true
}

/// Looks up again where a key's return address `ret` lies, its mapping
/// not looked up when the key was made (the process was changing its
/// mappings then): the place is written last, so that a reader that
/// sees it resolved sees the file and offset it names.
#[inline(never)]
fn place_again(ret: u64, v: *mut HostValue) {
    let mut again = HostValue::default();
    caller_place(ret, &mut again);
    if again.place == PLACE_UNRESOLVED {
        return;
    }
    unsafe {
        (*v).dev = again.dev;
        (*v).ino = again.ino;
        (*v).offset = again.offset;
        core::ptr::write_volatile(&mut (*v).place, again.place);
    }
}

/// A thread ended (the `sched_process_exit` raw tracepoint, once per
/// thread): with its process's last thread, the process's incarnation
/// goes (a process that reuses its id gets a new one), and so does its
/// place in a tree scope (a process that reuses its id is not the
/// tree's). Threads that outlive their main thread are counted until
/// then, as a trace by pid counts them.
#[inline(always)]
pub(crate) fn exit() -> i32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, pid) = ((id >> 32) as u32, id as u32);
    if process_ended(tgid == pid) {
        let _ = HOST_GENS.remove(&tgid);
        let _ = HOST_PYTHON.remove(&tgid);
        leave(tgid);
        // After both: a thread's mark keeps neither past this.
        end_counted();
    }
    0
}

/// Whether the exiting thread's process ended with it: no thread of it
/// is left that has not begun to exit (`signal->live`, taken down before
/// the exit tracepoint). Where the kernel's layout is not known, whether
/// the thread is the main one (`main`).
#[inline(always)]
fn process_ended(main: bool) -> bool {
    let (signal_at, live_at) = (
        config_u32(&CONFIG.vma.task_signal) as u64,
        config_u32(&CONFIG.vma.signal_live) as u64,
    );
    if signal_at == 0 || live_at == 0 {
        return main;
    }
    let task = unsafe { bpf_get_current_task() };
    let signal = unsafe { bpf_probe_read_kernel((task + signal_at) as *const u64) }.unwrap_or(0);
    if signal == 0 {
        return main;
    }
    unsafe { bpf_probe_read_kernel((signal + live_at) as *const i32) }
        .map_or(main, |live| live == 0)
}

/// One more run of the program in process `tgid` (two threads making a
/// process's first run at once may count one).
#[inline(always)]
fn count_run(tgid: u32) {
    match HOST_RUNS.get_ptr_mut(&tgid) {
        Some(p) => add(Some(p), 1),
        None => {
            if let Err(e) = HOST_RUNS.insert(&tgid, &1, BPF_NOEXIST as u64) {
                if e != -EEXIST {
                    bump_counter(counter::HOST_RUNS_FULL, 1);
                }
            }
        }
    }
}

/// Is this call the allocator's own: a tail call from the thread's last
/// counted entry (`mark`: same stack pointer and return address, another
/// function), or a call from inside an allocator body of this function's
/// file or of that entry's file? Not nested: the call becomes the
/// thread's mark (with the process's address space `mm`, read once).
#[inline(always)]
fn nested(
    mark: Option<&mut HostMark>,
    mm: u64,
    ip: u64,
    sp: u64,
    ret: u64,
    base: u64,
    file: u32,
) -> bool {
    let Some(m) = mark else {
        return false;
    };
    if m.set != 0 {
        let tail = m.sp == sp
            && m.ip != ip
            && (m.ret == ret || (m.ret != 0 && hidden_return(sp, ret) == m.ret));
        if tail || in_bodies(m.file, ret.wrapping_sub(m.base)) {
            return true;
        }
    }
    if in_bodies(file, ret.wrapping_sub(base)) {
        return true;
    }
    m.ip = ip;
    m.sp = sp;
    m.ret = ret;
    m.base = base;
    m.mm = mm;
    m.file = file;
    m.set = 1;
    false
}

/// Is file offset `offset` inside one of file `file`'s allocator bodies?
#[inline(always)]
fn in_bodies(file: u32, offset: u64) -> bool {
    let Some(b) = HOST_BODIES.get_ptr(file) else {
        return false;
    };
    in_ranges(unsafe { &(*b).ranges }, unsafe { (*b).n } as usize, offset)
}

/// Where the executable's code begins in the process of address space
/// `mm` (`mm_struct.start_code`), 0 when unknown.
#[inline(always)]
fn code_start(mm: u64) -> u64 {
    let at = config_u32(&CONFIG.vma.mm_start_code) as u64;
    if mm == 0 || at == 0 {
        return 0;
    }
    unsafe { bpf_probe_read_kernel((mm + at) as *const u64) }.unwrap_or(0)
}

/// The current process's address space (`task_struct.mm`), 0 when the
/// kernel's layout is not known.
#[inline(always)]
fn current_mm() -> u64 {
    let k = &CONFIG.kernel;
    if config_u32(&k.known) == 0 {
        return 0;
    }
    let task = unsafe { bpf_get_current_task() };
    unsafe { bpf_probe_read_kernel((task + config_u32(&k.task_mm) as u64) as *const u64) }
        .unwrap_or(0)
}

/// `*p += by`, atomically (per CPU, but a uprobe program can be preempted
/// by another thread's on its CPU).
#[inline(always)]
fn add(p: Option<*mut u64>, by: u64) {
    if let Some(p) = p {
        atomic_add(p, by);
    }
}

#[inline(always)]
fn add_value(v: *mut HostValue, bytes: u64) {
    unsafe {
        add(Some(&raw mut (*v).calls), 1);
        add(Some(&raw mut (*v).bytes), bytes);
    }
}

/// A process exec'd (the `sched_process_exec` raw tracepoint: no
/// tracefs needed, which a host may not have mounted): handed to the
/// tracer (its name and its files), and its threads' marks, which held
/// the old program's places, are gone with it.
#[inline(always)]
pub(crate) fn exec(ctx: &RawTracePointContext) -> i32 {
    if let Some(m) = HOST_MARKS.current(false) {
        m.set = 0;
        m.mm = 0;
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // A new program: new mappings, and no interpreter until the tracer
    // learns it runs one.
    let _ = HOST_GENS.remove(&tgid);
    end_counted();
    let _ = HOST_PYTHON.remove(&tgid);
    if !enabled() || !in_scope(tgid) {
        return 0;
    }
    let Some(mut entry) = HOST_EXECS.reserve::<HostExec>(0) else {
        bump_counter(counter::HOST_EXECS_LOST, 1);
        return 0;
    };
    let e = entry.as_mut_ptr();
    unsafe {
        (*e).tgid = tgid;
        (*e)._pad = 0;
        (*e).mm = current_mm();
        (*e).path[0] = 0;
        // `sched_process_exec(task, old_pid, bprm)`: the path is
        // `bprm->filename`.
        let at = config_u32(&CONFIG.vma.binprm_filename) as u64;
        let bprm: u64 = ctx.arg(2);
        if at != 0 && bprm != 0 {
            let name = bpf_probe_read_kernel((bprm + at) as *const u64).unwrap_or(0);
            if name != 0 {
                let _ = bpf_probe_read_kernel_str_bytes(name as *const u8, &mut (*e).path);
            }
        }
    }
    entry.submit(0);
    0
}
