//! Return addresses a return probe hid: while a function with a uretprobe
//! runs (another tool's, or another mtrace's in live mode, on the same
//! file: the kernel runs every consumer of a probed address in every
//! process the address is probed in), its return address on the stack is
//! the kernel's trampoline, and the real one is in the thread's list of
//! pending returns. The walk, the tail-call check and the stack copy
//! handed to the tracer take the real one from there.

use aya_ebpf::helpers::{bpf_probe_read_kernel, generated::bpf_get_current_task};
use tracer_common::MAX_HIDDEN;

use crate::{
    maps::{config_u32, CONFIG},
    scratch::scratch_at,
};

/// Most pending returns looked through (one per function with a return
/// probe that has not returned yet, innermost first).
const MAX_PENDING: usize = 16;

/// The real return address the word `value` at stack slot `slot` hides,
/// when it is the kernel's trampoline put there for a pending return;
/// else 0. Two reads of the kernel when the thread has no pending return.
#[inline(never)]
#[no_mangle]
pub extern "C" fn hidden_return(slot: u64, value: u64) -> u64 {
    let mut list = [0u64; 2];
    if !pending_returns(&mut list) || list[1] != value {
        return 0;
    }
    let mut real = 0;
    each_pending(list[0], |at, ri| {
        if at == slot {
            real = hidden_by(ri);
        }
        at == slot
    });
    real
}

/// Calls `f` with each pending return's stack slot and the pending
/// return, newest first, until `f` says it is done.
#[inline(always)]
fn each_pending(first: u64, mut f: impl FnMut(u64, u64) -> bool) {
    let k = &CONFIG.kernel;
    let (at_stack, at_next) = (
        config_u32(&k.return_stack) as u64,
        config_u32(&k.return_next) as u64,
    );
    let mut ri = first;
    let mut i = 0;
    while i < MAX_PENDING && ri != 0 {
        if f(read(ri + at_stack), ri) {
            return;
        }
        ri = read(ri + at_next);
        i += 1;
    }
}

/// The current thread's newest pending return and the trampoline's
/// address, in `out`; false when it has none (or the kernel's layout is
/// not known).
#[inline(always)]
fn pending_returns(out: &mut [u64; 2]) -> bool {
    let k = &CONFIG.kernel;
    if config_u32(&k.known) == 0 {
        return false;
    }
    let task = unsafe { bpf_get_current_task() };
    let utask = read(task + config_u32(&k.task_utask) as u64);
    if utask == 0 {
        return false;
    }
    let first = read(utask + config_u32(&k.utask_returns) as u64);
    if first == 0 {
        return false;
    }
    let mm = read(task + config_u32(&k.task_mm) as u64);
    let area = if mm == 0 {
        0
    } else {
        read(mm + config_u32(&k.mm_xol_area) as u64)
    };
    if area == 0 {
        return false;
    }
    out[0] = first;
    out[1] = read(area + config_u32(&k.xol_vaddr) as u64);
    out[1] != 0
}

/// The return address pending return `ri` hides.
#[inline(always)]
fn hidden_by(ri: u64) -> u64 {
    read(ri + config_u32(&CONFIG.kernel.return_orig) as u64)
}

/// A kernel word, 0 when it cannot be read.
#[inline(always)]
fn read(addr: u64) -> u64 {
    unsafe { bpf_probe_read_kernel(addr as *const u64) }.unwrap_or(0)
}

/// Notes in the walk scratch at `level` the trampoline's address and each
/// pending return's stack slot with the address it hides (at most
/// `MAX_HIDDEN`), for the tracer to walk a copy of the stack as the walk
/// here would have. A global function (numbers in, a number out): the
/// verifier checks it once, not once for each way the program reaches it.
/// Returns 0.
#[inline(never)]
#[no_mangle]
pub extern "C" fn note_hidden(level: u64) -> u64 {
    let Some(w) = scratch_at(level) else {
        return 0;
    };
    let w = unsafe { &mut *w };
    w.trampoline = 0;
    // One store a word: an assignment of the array becomes a call of a
    // byte-by-byte `memset`, which the verifier walks a byte at a time.
    let mut i = 0;
    while i < MAX_HIDDEN {
        unsafe {
            core::ptr::write_volatile(&mut w.hidden_at[i][0], 0);
            core::ptr::write_volatile(&mut w.hidden_at[i][1], 0);
        }
        i += 1;
    }
    let mut list = [0u64; 2];
    if !pending_returns(&mut list) {
        return 0;
    }
    w.trampoline = list[1];
    let mut n = 0;
    each_pending(list[0], |slot, ri| {
        w.hidden_at[n & (MAX_HIDDEN - 1)] = [slot, hidden_by(ri)];
        n += 1;
        n == MAX_HIDDEN
    });
    0
}
