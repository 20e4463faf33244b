//! mtrace's BPF programs: one uprobe program for every allocating entry
//! point and one for the releasing ones, attached with an attach cookie
//! that holds the function's index in the run's function table, its role
//! (what its arguments mean, see `tracer_common::Role`) and where the
//! probe finds the arguments.
//!
//! Count mode aggregates in the kernel: per (user stack, direct caller,
//! function, thread) the number of calls and requested bytes, exact on a
//! multi-threaded target (plain adds by the program that owns its CPU,
//! atomic adds by any that preempted it: see [`scratch`]). Nothing is sent
//! to user space per event. Exact per-function totals and every way a sample
//! can lose its stack live in the per-CPU `COUNTERS` array.
//!
//! The programs are at the top of this file; the rest is one module per
//! concern: [`record`] (what the entry programs do, in order), [`nesting`],
//! [`sample`], [`scratch`] (the per-CPU scratch levels and who owns the
//! CPU's counts), [`walk`] (the frame walk), [`memo`] (remembered walks),
//! [`handover`] (walks the tracer finishes), [`hidden`] (return addresses
//! a return probe hid), [`aggregate`] (the counts), [`live`] (live mode's
//! pending calls and events), [`args`] (cookies and arguments), and the
//! host scope's [`host`] (its programs' work), [`place`] (where its
//! addresses lie) and [`scope`] (which processes it counts). Every map and
//! the `CONFIG` global are in [`maps`].
#![no_std]
#![no_main]
// The intrinsics lower to the BPF atomic add and exchange instructions
// (the object is built for BPF CPU v3).
#![allow(internal_features)]
#![feature(core_intrinsics)]
// Lints that do not fit BPF code, allowed here once:
// - needless_borrows_for_generic_args: aya-ebpf's map methods take
//   `impl Borrow<T>`; a borrow hands the helper the value where it lies,
//   where a value would first be copied to the 512-byte BPF stack (a
//   `StackFrames` does not fit there).
// - mut_from_ref: a map lookup hands out the value in map memory, mutable,
//   from the shared static that names the map, as aya-ebpf's maps do.
// - too_many_arguments: helpers take the call's values one by one; bundled
//   in a struct they are built on the stack first, and the programs grow.
#![allow(
    clippy::needless_borrows_for_generic_args,
    clippy::mut_from_ref,
    clippy::too_many_arguments
)]

mod aggregate;
mod args;
mod chunk;
mod handover;
mod hidden;
mod host;
mod incarnation;
mod live;
mod maps;
mod memo;
mod nesting;
mod place;
mod python;
mod record;
mod sample;
mod scope;
mod scratch;
mod walk;

use aya_ebpf::{
    macros::{raw_tracepoint, uprobe, uretprobe},
    programs::{ProbeContext, RawTracePointContext, RetProbeContext},
};
use tracer_common::Role;

use crate::{
    args::{attach_cookie, probe_arg},
    live::{complete_alloc, complete_inline_alloc},
    record::{record_alloc, record_free, record_inline_alloc, record_inline_free},
};

/// Every allocating entry point, whatever its role (the cookie says which:
/// see `COOKIE_ROLE_SHIFT`): the role only decides where the size and the
/// block are, and one program for all of them is one program for the
/// kernel to verify per traced process instead of one per role (its
/// verification is most of what a new process waits for its probes).
#[uprobe]
pub fn alloc(ctx: ProbeContext) -> u32 {
    record_alloc(&ctx)
}

/// A copy of CPython's object allocator inlined into its caller, probed
/// at the branch of its guard (`--python-objects` on a build such as
/// Debian's python3.11; see `record::record_inline_alloc`).
#[uprobe]
pub fn alloc_inline(ctx: ProbeContext) -> u32 {
    record_inline_alloc(&ctx)
}

/// Live mode: where an inlined copy's block is known, past its guard (see
/// `live::complete_inline_alloc`).
#[uprobe]
pub fn alloc_inline_ret(ctx: ProbeContext) -> u32 {
    complete_inline_alloc(&ctx)
}

/// A copy of CPython's `_PyObject_Free` inlined into its caller, probed
/// at its guard's branch (see `record::record_inline_free`).
#[uprobe]
pub fn release_inline(ctx: ProbeContext) -> u32 {
    record_inline_free(&ctx)
}

/// `f(ptr)`: free.
#[uprobe]
pub fn release(ctx: ProbeContext) -> u32 {
    let cookie = attach_cookie(&ctx);
    record_free(&ctx, cookie, probe_arg(&ctx, cookie, 0))
}

/// Host scope (`--all`): every allocating entry point of every allocator
/// file, attached file-wide (see [`host`]).
#[uprobe]
pub fn host_alloc(ctx: ProbeContext) -> u32 {
    host::record(&ctx)
}

/// Host scope: a process exec'd (a raw tracepoint: no tracefs needed).
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn host_exec(ctx: RawTracePointContext) -> i32 {
    host::exec(&ctx)
}

/// Host scope: a thread ended (its process's incarnation goes with the
/// last one).
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn host_exit(_ctx: RawTracePointContext) -> i32 {
    host::exit()
}

/// Host scope narrowed to a process tree: a task forked.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn host_fork(ctx: RawTracePointContext) -> i32 {
    scope::fork(&ctx)
}

/// The benchmark's floor: attached where the real probes go, does nothing.
/// What mtrace costs beyond it is ours to cut.
#[uprobe]
pub fn floor(_ctx: ProbeContext) -> u32 {
    0
}

/// The floor of live mode's return probes.
#[uretprobe]
pub fn floor_ret(_ctx: RetProbeContext) -> u32 {
    0
}

/// Live mode: the return of `alloc_size`, `alloc_count_size` and
/// `alloc_align_size` functions.
#[uretprobe]
pub fn alloc_ret(ctx: RetProbeContext) -> u32 {
    complete_alloc(&ctx, Role::Size)
}

/// Live mode: the return of a resize.
#[uretprobe]
pub fn resize_ret(ctx: RetProbeContext) -> u32 {
    complete_alloc(&ctx, Role::Resize)
}

/// Live mode: the return of posix_memalign.
#[uretprobe]
pub fn posix_memalign_ret(ctx: RetProbeContext) -> u32 {
    complete_alloc(&ctx, Role::PosixMemalign)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
