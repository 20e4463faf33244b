//! The host scope (`--all`): one program for every allocating entry point
//! of every allocator file on the host, attached file-wide (the kernel puts
//! the probe in every process that maps the file, now or later). A call is
//! counted under its process, its function and its direct caller's place
//! in the caller's file (device, inode, offset, looked up with
//! `bpf_find_vma`), so that a process gone before the tracer reads the
//! counts is still symbolized. No stack walk: unwind rules are per
//! process, and this scope has no per-process state.

use core::intrinsics::{atomic_xadd, AtomicOrdering};

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_pid_tgid, bpf_probe_read_kernel, bpf_probe_read_kernel_buf,
        bpf_probe_read_kernel_str_bytes, bpf_probe_read_user,
        generated::{bpf_find_vma, bpf_get_current_task, bpf_get_current_task_btf},
    },
    programs::{ProbeContext, RawTracePointContext},
};
use tracer_common::{
    counter, HostExec, HostKey, HostMark, HostProcess, HostValue, MAX_HOST_FUNCS, PLACE_ANONYMOUS,
    PLACE_FILE, PLACE_UNRESOLVED, VMA_COPY,
};

use crate::{
    aggregate::{bump_counter, current_comm, EEXIST},
    args::{attach_cookie, call_args},
    hidden::hidden_return,
    maps::{
        config_u32, enabled, CONFIG, HOST_BODIES, HOST_COUNTS, HOST_EXECS, HOST_FUNCS, HOST_MARKS,
        HOST_NAMES, HOST_RUNS, HOST_SELF, HOST_TOTALS,
    },
    nesting::in_ranges,
};

/// An allocating call anywhere on the host.
#[inline(always)]
pub(crate) fn record(ctx: &ProbeContext) -> u32 {
    if !enabled() {
        return 0;
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if HOST_SELF.get(0).is_some_and(|me| *me == tgid) {
        return 0;
    }
    if config_u32(&CONFIG.host_runs) != 0 {
        count_run(tgid);
    }
    let cookie = attach_cookie(ctx);
    let func = (cookie as u32) & (MAX_HOST_FUNCS - 1);
    let Some(f) = HOST_FUNCS.get(func) else {
        return 0;
    };
    let (sp, ip) = unsafe { ((*ctx.regs).rsp, (*ctx.regs).rip) };
    let ret = unsafe { bpf_probe_read_user(sp as *const u64) }.unwrap_or(0);
    if ret == 0 {
        bump_counter(counter::CALLER_READ_FAILED, 1);
    }
    let base = ip.wrapping_sub(f.probe_offset);
    let mark = HOST_MARKS.current(true);
    let mm = match &mark {
        Some(m) if m.mm != 0 => m.mm,
        _ => current_mm(),
    };
    if nested(mark, mm, ip, sp, ret, base, f.file) {
        bump_counter(counter::NESTED, 1);
        return 0;
    }
    let size = call_args(ctx, cookie).0;
    add(HOST_TOTALS.get_ptr_mut(func), 1);
    add(HOST_TOTALS.get_ptr_mut(MAX_HOST_FUNCS + func), size);
    let key = HostKey {
        tgid,
        func,
        mm,
        ret,
    };
    if let Some(v) = HOST_COUNTS.get_ptr_mut(&key) {
        add_value(v, size);
        return 0;
    }
    // A new key: where its return address lies is looked up once, here.
    let mut first = HostValue {
        calls: 1,
        bytes: size,
        ..HostValue::default()
    };
    caller_place(ret, &mut first);
    match HOST_COUNTS.insert(&key, &first, BPF_NOEXIST as u64) {
        Ok(()) => {
            if let Some(comm) = current_comm() {
                let process = HostProcess {
                    tgid,
                    _pad: 0,
                    mm: key.mm,
                };
                let _ = HOST_NAMES.insert(&process, &comm, BPF_NOEXIST as u64);
            }
        }
        Err(e) if e == -EEXIST => match HOST_COUNTS.get_ptr_mut(&key) {
            Some(v) => add_value(v, size),
            None => bump_counter(counter::MAP_FULL, 1),
        },
        Err(_) => bump_counter(counter::MAP_FULL, 1),
    }
    0
}

/// One more run of the program in process `tgid` (two threads making a
/// process's first run at once may count one).
#[inline(always)]
fn count_run(tgid: u32) {
    match HOST_RUNS.get_ptr_mut(&tgid) {
        Some(p) => add(Some(p), 1),
        None => {
            let _ = HOST_RUNS.insert(&tgid, &1, BPF_NOEXIST as u64);
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
    *m = HostMark {
        ip,
        sp,
        ret,
        base,
        mm,
        file,
        set: 1,
    };
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
        unsafe {
            atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, by);
        }
    }
}

#[inline(always)]
fn add_value(v: *mut HostValue, bytes: u64) {
    unsafe {
        add(Some(&raw mut (*v).calls), 1);
        add(Some(&raw mut (*v).bytes), bytes);
    }
}

/// What the mapping callback fills in.
#[repr(C)]
struct VmaFound {
    vma: [u8; VMA_COPY],
    found: u64,
}

/// Puts where return address `ret` lies in `v`: its file and offset in
/// it, or that it lies in no file, or that its mapping could not be
/// looked up.
#[inline(always)]
fn caller_place(ret: u64, v: &mut HostValue) {
    v.place = PLACE_UNRESOLVED;
    let o = &CONFIG.vma;
    if config_u32(&o.known) == 0 || ret == 0 {
        return;
    }
    let mut found = VmaFound {
        vma: [0; VMA_COPY],
        found: 0,
    };
    let r = unsafe {
        bpf_find_vma(
            bpf_get_current_task_btf(),
            ret,
            copy_vma as *mut core::ffi::c_void,
            &mut found as *mut VmaFound as *mut core::ffi::c_void,
            0,
        )
    };
    if r == -2 {
        // -ENOENT: no mapping there.
        v.place = PLACE_ANONYMOUS;
        return;
    }
    if r != 0 || found.found == 0 {
        return;
    }
    let field = |at: u32| -> u64 {
        let at = (at as usize) & (VMA_COPY - 8);
        u64::from_ne_bytes([
            found.vma[at],
            found.vma[at + 1],
            found.vma[at + 2],
            found.vma[at + 3],
            found.vma[at + 4],
            found.vma[at + 5],
            found.vma[at + 6],
            found.vma[at + 7],
        ])
    };
    let file = field(config_u32(&o.vm_file));
    if file == 0 {
        v.place = PLACE_ANONYMOUS;
        return;
    }
    let read = |addr: u64| unsafe { bpf_probe_read_kernel(addr as *const u64) }.unwrap_or(0);
    let inode = read(file + config_u32(&o.file_inode) as u64);
    if inode == 0 {
        return;
    }
    let sb = read(inode + config_u32(&o.inode_sb) as u64);
    if sb == 0 {
        return;
    }
    v.dev = unsafe { bpf_probe_read_kernel((sb + config_u32(&o.sb_dev) as u64) as *const u32) }
        .unwrap_or(0);
    v.ino = read(inode + config_u32(&o.inode_ino) as u64);
    let start = field(config_u32(&o.vm_start));
    let pgoff = field(config_u32(&o.vm_pgoff));
    v.offset = ret.wrapping_sub(start).wrapping_add(pgoff << 12);
    v.place = PLACE_FILE;
}

/// `bpf_find_vma`'s callback: copies the start of the mapping's
/// `vm_area_struct` (the offsets of [`VmaOffsets`](tracer_common::VmaOffsets)
/// are read from the copy: the verifier allows no variable offset into the
/// pointer it hands over).
#[inline(never)]
extern "C" fn copy_vma(
    _task: *mut core::ffi::c_void,
    vma: *mut core::ffi::c_void,
    ctx: *mut core::ffi::c_void,
) -> i64 {
    let found = unsafe { &mut *(ctx as *mut VmaFound) };
    if unsafe { bpf_probe_read_kernel_buf(vma as *const u8, &mut found.vma) }.is_ok() {
        found.found = 1;
    }
    0
}

/// A process exec'd (the `sched_process_exec` raw tracepoint: no
/// tracefs needed, which a host may not have mounted): handed to the tracer (its name and its files), and
/// its threads' marks, which held the old program's places, are gone with
/// it.
#[inline(always)]
pub(crate) fn exec(ctx: &RawTracePointContext) -> i32 {
    if let Some(m) = HOST_MARKS.current(false) {
        m.set = 0;
        m.mm = 0;
    }
    if !enabled() {
        return 0;
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let Some(mut entry) = HOST_EXECS.reserve::<HostExec>(0) else {
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
