//! mtrace's BPF programs: one uprobe per allocator entry point.
//!
//! Count mode aggregates in the kernel: per (user stack, direct caller,
//! function, thread) the number of calls and requested bytes, with atomic
//! adds so the counts stay exact on a multi-threaded target. Nothing is sent
//! to user space per event. Exact per-function totals and every way a sample
//! can lose its stack live in the per-CPU `COUNTERS` array.
#![no_std]
#![no_main]
// The BPF target has no compare-and-swap, so `AtomicU64::fetch_add` does not
// exist; the intrinsic lowers to the BPF atomic add instruction.
#![allow(internal_features)]
#![feature(core_intrinsics)]

use core::intrinsics::{atomic_xadd, AtomicOrdering};

use aya_ebpf::{
    bindings::{BPF_F_USER_STACK, BPF_NOEXIST},
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::{map, uprobe},
    maps::{Array, HashMap, PerCpuArray, StackTrace},
    programs::{tracing::StackIdContext, ProbeContext},
};
use tracer_common::{
    counter, AllocFn, Comm, Config, CountKey, CountValue, EntryMark, MAX_BODY_RANGES,
    STACK_ID_NONE, TAIL_SLOTS,
};

const EEXIST: i32 = 17;
const ENOMEM: i32 = 12;

/// Written by the tracer before load (`EbpfLoader::set_global`).
#[no_mangle]
static CONFIG: Config = Config {
    per_thread: 0,
    n_bodies: 0,
    bodies: [tracer_common::BodyRange { start: 0, end: 0 }; MAX_BODY_RANGES],
};

/// Sizes are placeholders: the tracer sets them before load.
#[map]
static COUNTS: HashMap<CountKey, CountValue> = HashMap::with_max_entries(65536, 0);

#[map]
static STACKS: StackTrace = StackTrace::with_max_entries(16384, 0);

#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::N, 0);

#[map]
static MARKS: Array<EntryMark> = Array::with_max_entries(TAIL_SLOTS, 0);

#[map]
static THREAD_NAMES: HashMap<u32, Comm> = HashMap::with_max_entries(16384, 0);

#[inline(always)]
fn bump(index: u32, by: u64) {
    if let Some(p) = COUNTERS.get_ptr_mut(index) {
        // Per-CPU, but a uprobe program can be preempted: stay atomic.
        atomic_add(p, by);
    }
}

#[inline(always)]
fn atomic_add(p: *mut u64, by: u64) {
    unsafe {
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, by);
    }
}

#[inline(always)]
fn config_u32(field: &u32) -> u32 {
    unsafe { core::ptr::read_volatile(field) }
}

/// Is `addr` inside one of the probed allocator functions? Then this call
/// is the allocator calling itself and was counted by the outer call.
#[inline(always)]
fn in_allocator_body(addr: u64) -> bool {
    let n = config_u32(&CONFIG.n_bodies) as usize;
    let mut i = 0;
    while i < MAX_BODY_RANGES {
        if i >= n {
            break;
        }
        let r = unsafe { core::ptr::read_volatile(&CONFIG.bodies[i]) };
        if addr >= r.start && addr < r.end {
            return true;
        }
        i += 1;
    }
    false
}

#[inline(always)]
fn record(ctx: &ProbeContext, func: AllocFn, size: u64) -> u32 {
    let sp = unsafe { (*ctx.regs).rsp };
    let caller = match unsafe { bpf_probe_read_user(sp as *const u64) } {
        Ok(v) => v,
        Err(_) => {
            bump(counter::CALLER_READ_FAILED, 1);
            0
        }
    };
    if caller != 0 && in_allocator_body(caller) {
        bump(counter::NESTED, 1);
        return 0;
    }
    let tid = bpf_get_current_pid_tgid() as u32;
    // A tail call from another allocator function arrives with the same
    // stack pointer and return address as the call that was just counted
    // (reallocarray -> realloc -> malloc in glibc). The mark stays, so a
    // chain of tail calls is counted once; the next counted call replaces it.
    if let Some(mark) = MARKS.get_ptr_mut(tid % TAIL_SLOTS) {
        let mark = unsafe { &mut *mark };
        if mark.tid == tid && mark.sp == sp && mark.ret == caller && mark.func != func as u32 {
            bump(counter::NESTED, 1);
            return 0;
        }
        *mark = EntryMark {
            tid,
            func: func as u32,
            sp,
            ret: caller,
        };
    }
    bump(counter::CALLS + func as u32, 1);
    if func == AllocFn::Free {
        return 0;
    }
    bump(counter::BYTES + func as u32, size);

    let stack_id = match ctx.get_stackid(&STACKS, BPF_F_USER_STACK as u64) {
        Ok(id) => id as i32,
        Err(e) => {
            bump(
                match -e {
                    EEXIST => counter::STACK_COLLISION,
                    ENOMEM => counter::STACK_MAP_FULL,
                    _ => counter::STACK_WALK_FAILED,
                },
                1,
            );
            STACK_ID_NONE
        }
    };
    let per_thread = config_u32(&CONFIG.per_thread) != 0;
    let key = CountKey {
        stack_id,
        func: func as u32,
        tid: if per_thread { tid } else { 0 },
        _pad: 0,
        caller,
    };
    if add_to(&key, size) {
        return 0;
    }
    let first = CountValue {
        calls: 1,
        bytes: size,
    };
    match COUNTS.insert(&key, &first, BPF_NOEXIST as u64) {
        Ok(()) => {
            if per_thread {
                if let Ok(comm) = bpf_get_current_comm() {
                    if THREAD_NAMES.insert(&tid, &comm, 0).is_err() {
                        bump(counter::THREAD_NAMES_FULL, 1);
                    }
                }
            }
        }
        // Another CPU inserted the key between our lookup and insert.
        Err(e) if e == -EEXIST => {
            if !add_to(&key, size) {
                bump(counter::MAP_FULL, 1);
            }
        }
        Err(_) => bump(counter::MAP_FULL, 1),
    }
    0
}

#[inline(always)]
fn add_to(key: &CountKey, size: u64) -> bool {
    match COUNTS.get_ptr_mut(key) {
        Some(v) => {
            unsafe {
                atomic_add(&raw mut (*v).calls, 1);
                atomic_add(&raw mut (*v).bytes, size);
            }
            true
        }
        None => false,
    }
}

#[inline(always)]
fn arg(ctx: &ProbeContext, n: usize) -> u64 {
    ctx.arg::<u64>(n).unwrap_or(0)
}

/// `n * m`, saturating. Done on 32-bit halves: LLVM turns the usual
/// overflow checks into a 128-bit multiply, which the BPF target lacks.
#[inline(always)]
fn product(n: u64, m: u64) -> u64 {
    let (n_hi, n_lo) = (n >> 32, n & 0xffff_ffff);
    let (m_hi, m_lo) = (m >> 32, m & 0xffff_ffff);
    if n_hi != 0 && m_hi != 0 {
        return u64::MAX;
    }
    let cross = n_hi * m_lo + n_lo * m_hi;
    if cross >> 32 != 0 {
        return u64::MAX;
    }
    let low = n_lo * m_lo;
    let sum = low.wrapping_add(cross << 32);
    if sum < low {
        u64::MAX
    } else {
        sum
    }
}

#[uprobe]
pub fn malloc(ctx: ProbeContext) -> u32 {
    record(&ctx, AllocFn::Malloc, arg(&ctx, 0))
}

#[uprobe]
pub fn calloc(ctx: ProbeContext) -> u32 {
    let size = product(arg(&ctx, 0), arg(&ctx, 1));
    record(&ctx, AllocFn::Calloc, size)
}

#[uprobe]
pub fn realloc(ctx: ProbeContext) -> u32 {
    record(&ctx, AllocFn::Realloc, arg(&ctx, 1))
}

#[uprobe]
pub fn reallocarray(ctx: ProbeContext) -> u32 {
    let size = product(arg(&ctx, 1), arg(&ctx, 2));
    record(&ctx, AllocFn::Reallocarray, size)
}

#[uprobe]
pub fn posix_memalign(ctx: ProbeContext) -> u32 {
    record(&ctx, AllocFn::PosixMemalign, arg(&ctx, 2))
}

#[uprobe]
pub fn aligned_alloc(ctx: ProbeContext) -> u32 {
    record(&ctx, AllocFn::AlignedAlloc, arg(&ctx, 1))
}

#[uprobe]
pub fn memalign(ctx: ProbeContext) -> u32 {
    record(&ctx, AllocFn::Memalign, arg(&ctx, 1))
}

#[uprobe]
pub fn valloc(ctx: ProbeContext) -> u32 {
    record(&ctx, AllocFn::Valloc, arg(&ctx, 0))
}

#[uprobe]
pub fn pvalloc(ctx: ProbeContext) -> u32 {
    record(&ctx, AllocFn::Pvalloc, arg(&ctx, 0))
}

#[uprobe]
pub fn free(ctx: ProbeContext) -> u32 {
    record(&ctx, AllocFn::Free, 0)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
