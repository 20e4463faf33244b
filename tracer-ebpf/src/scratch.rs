//! Scratch-level ownership: each program running on a CPU takes its own
//! level of the per-CPU walk scratch, and the one at level 0 owns the CPU's
//! counts (plain adds); the others add atomically.

use core::intrinsics::{atomic_xchg, AtomicOrdering};

use aya_ebpf::{helpers::bpf_get_current_pid_tgid, programs::ProbeContext};
use tracer_common::{WalkScratch, WALK_LEVELS};

use crate::maps::{config_u32, CONFIG, OWNER, WALK};

/// Takes the first free level of this CPU's walk scratch for a call from
/// the thread whose context is `ctx` ([`give_back_scratch`] must follow).
#[inline(always)]
pub(crate) fn take_scratch(ctx: &ProbeContext) -> Option<*mut WalkScratch> {
    let level = if take_level(0) {
        0
    } else {
        take_higher_level()
    };
    let w = WALK.get_ptr_mut(level)?;
    unsafe {
        core::ptr::write_volatile(&mut (*w).level, level as u64);
        core::ptr::write_volatile(&mut (*w).owned, (level == 0) as u64);
        // The context's address as a number: stored and read back (the
        // verifier allows no arithmetic on it).
        core::ptr::write_volatile(&mut (*w).me, ctx.regs as u64);
        // The thread id where the keys are split by thread, else 0 (a
        // helper call less).
        let tid = if config_u32(&CONFIG.per_thread) != 0 {
            bpf_get_current_pid_tgid() as u32
        } else {
            0
        };
        core::ptr::write_volatile(&mut (*w).tid, tid as u64);
    }
    Some(w)
}

/// Takes level `level` of this CPU's walk scratch if it is free.
#[inline(always)]
fn take_level(level: u32) -> bool {
    OWNER.get_ptr_mut(level).is_some_and(
        |flag| unsafe { atomic_xchg::<u32, { AtomicOrdering::Relaxed }>(flag, 1) } == 0,
    )
}

/// The first free level above 0 (the program that holds level 0 was
/// preempted on this CPU), `WALK_LEVELS` when none is.
#[inline(never)]
fn take_higher_level() -> u32 {
    let mut level = 1;
    while level < WALK_LEVELS {
        if take_level(level) {
            return level;
        }
        level += 1;
    }
    WALK_LEVELS
}

/// Which level of this CPU's walk scratch `w` is: what a global function
/// is given to find it again with [`scratch_at`] (a global function takes
/// numbers, not pointers into a map).
#[inline(always)]
pub(crate) fn level_of(w: *const WalkScratch) -> u64 {
    unsafe { core::ptr::read_volatile(&(*w).level) }
}

/// Level `level` of this CPU's walk scratch: in a global function, the
/// same entry as its caller's (a BPF program runs on one CPU throughout).
#[inline(always)]
pub(crate) fn scratch_at(level: u64) -> Option<*mut WalkScratch> {
    WALK.get_ptr_mut(level as u32)
}

/// A `bpf_loop` of at most `n` calls of `step` on the scratch (a step
/// returns 1 to end it).
#[inline(always)]
pub(crate) fn run_loop(
    n: u32,
    step: extern "C" fn(u64, *mut core::ffi::c_void) -> i64,
    w: &mut WalkScratch,
) {
    let mut p = w as *mut WalkScratch;
    unsafe {
        aya_ebpf::helpers::generated::bpf_loop(
            n,
            step as *mut core::ffi::c_void,
            &mut p as *mut *mut WalkScratch as *mut core::ffi::c_void,
            0,
        );
    }
}

/// Gives back the level [`take_scratch`] took.
#[inline(always)]
pub(crate) fn give_back_scratch(scratch: Option<*mut WalkScratch>) {
    if let Some(w) = scratch {
        let level = unsafe { core::ptr::read_volatile(&(*w).level) } as u32;
        if let Some(flag) = OWNER.get_ptr_mut(level) {
            unsafe { core::ptr::write_volatile(flag, 0) };
        }
    }
}

/// Whether the walk in `scratch` holds level 0 (owns the CPU's counts).
#[inline(always)]
pub(crate) fn owns_cpu(scratch: Option<*mut WalkScratch>) -> bool {
    scratch.is_some_and(|w| unsafe { core::ptr::read_volatile(&(*w).owned) } != 0)
}
