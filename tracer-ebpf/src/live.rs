//! Live mode: the call in flight between entry and return probe, the
//! return probes' allocation events, and free events.

use aya_ebpf::{
    bindings::BPF_RB_NO_WAKEUP,
    helpers::{bpf_ktime_get_ns, bpf_probe_read_user},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext,
};
use tracer_common::{
    counter, AllocEvent, CountKey, FreeEvent, LostAlloc, LostFree, Pending, Role,
    COOKIE_INLINE_ID_SHIFT, EVENT_ALLOC, EVENT_FREE, EVENT_RINGS,
};

use crate::{
    aggregate::bump_counter,
    args::{attach_cookie, block_arg, cookie_func, ReturnArgs},
    maps::{
        EVENTS0, EVENTS1, EVENTS2, EVENTS3, EVENTS4, EVENTS5, EVENTS6, EVENTS7, INLINE_PENDING,
        LOST_ALLOCS, LOST_FREES, PENDING,
    },
};

/// Live mode: the call is in flight until its return probe.
#[inline(always)]
pub(crate) fn set_pending(
    p: &mut Pending,
    caller: u64,
    stack: u64,
    func: u32,
    tid: u32,
    size: u64,
    extra: ReturnArgs,
    sp: u64,
) {
    *p = Pending {
        key: CountKey {
            stack,
            func,
            tid,
            caller,
        },
        size,
        old_ptr: extra.old_ptr,
        memptr: extra.memptr,
        // Only a resize needs to know when it began.
        entry_ts: if extra.old_ptr != 0 { now_ns() } else { 0 },
        sp,
        active: 1,
    };
}

/// Live mode: the return of an allocating call. Only the outermost call
/// of a thread completes: a nested call (realloc -> malloc) returns with
/// the outer call's pending entry, which names another function.
#[inline(always)]
pub(crate) fn complete_alloc(ctx: &RetProbeContext, role: Role) -> u32 {
    let func = cookie_func(ctx.as_ptr());
    let pending = match PENDING.current(false) {
        Some(p) if p.active != 0 && p.key.func == func => {
            p.active = 0;
            *p
        }
        _ => return 0,
    };
    let ret: u64 = ctx.ret();
    let ptr = if role == Role::PosixMemalign {
        if ret as u32 == 0 {
            unsafe { bpf_probe_read_user(pending.memptr as *const u64) }.unwrap_or(0)
        } else {
            0
        }
    } else {
        ret
    };
    let resizes = role == Role::Resize || role == Role::ResizeArray;
    send_alloc(&pending, ptr, resizes);
    0
}

/// Live mode: an inlined copy of CPython's malloc or calloc has its block,
/// in the register (or stack slot) its cookie names, at the first place its code shares with the
/// call through the pointer that its guard passed over. The call its guard
/// began is taken up here if it is this copy's (the same number): the
/// call's path, run when the guard found a hook, reaches the same place
/// with the guard's entry cleared.
#[inline(always)]
pub(crate) fn complete_inline_alloc(ctx: &ProbeContext) -> u32 {
    let cookie = attach_cookie(ctx);
    let pending = match INLINE_PENDING.current(false) {
        Some(p) if p.active != 0 && p.memptr == cookie >> COOKIE_INLINE_ID_SHIFT => {
            p.active = 0;
            *p
        }
        _ => return 0,
    };
    send_alloc(&pending, block_arg(ctx, cookie), false);
    0
}

/// Sends the allocation `pending` made: its block `ptr` (0: it failed) and,
/// for a resize, the block it released.
#[inline(always)]
fn send_alloc(pending: &Pending, ptr: u64, resizes: bool) {
    // The old block is gone when the call moved it, or freed it
    // (realloc(p, 0)); a failed resize leaves it.
    let released = if resizes && (ptr != 0 || pending.size == 0) {
        pending.old_ptr
    } else {
        0
    };
    if ptr == 0 && !(resizes && pending.size == 0) {
        bump_counter(counter::FAILED, 1);
    }
    if ptr == 0 && released == 0 {
        return;
    }
    let sent = send_event(|ts| AllocEvent {
        kind: EVENT_ALLOC,
        _pad: 0,
        ts,
        ptr,
        size: pending.size,
        key: pending.key,
        old_ptr: released,
        entry_ts: pending.entry_ts,
    });
    if !sent {
        // Kept aside in their order: the released block before the new
        // one, which may be the same address (a resize in place).
        if released != 0 {
            keep_free(released, Some(pending.entry_ts));
        }
        if ptr != 0 {
            keep_alloc(pending, ptr);
        }
    }
}

/// Live mode: `ptr` was freed.
#[inline(always)]
pub(crate) fn send_free(ptr: u64) {
    let sent = send_event(|ts| FreeEvent {
        kind: EVENT_FREE,
        _pad: 0,
        ts,
        ptr,
    });
    if !sent {
        keep_free(ptr, None);
    }
}

/// Sends one event on this CPU's ring; the time stamp is taken once the
/// space is reserved (see `AllocEvent::ts`). False when the ring is full.
#[inline(always)]
fn send_event<T: 'static>(make: impl Fn(u64) -> T) -> bool {
    let cpu = unsafe { aya_ebpf::helpers::bpf_get_smp_processor_id() } % EVENT_RINGS;
    // One call site per ring: the verifier wants each reservation's map
    // known.
    let entry = match cpu {
        0 => EVENTS0.reserve::<T>(0),
        1 => EVENTS1.reserve::<T>(0),
        2 => EVENTS2.reserve::<T>(0),
        3 => EVENTS3.reserve::<T>(0),
        4 => EVENTS4.reserve::<T>(0),
        5 => EVENTS5.reserve::<T>(0),
        6 => EVENTS6.reserve::<T>(0),
        _ => EVENTS7.reserve::<T>(0),
    };
    match entry {
        Some(mut entry) => {
            entry.write(make(now_ns()));
            entry.submit(BPF_RB_NO_WAKEUP as u64);
            true
        }
        None => {
            bump_counter(counter::EVENTS_LOST, 1);
            false
        }
    }
}

/// A free (or the block a resize released, if born by `born_by`) that the
/// ring had no room for: kept for the tracer, which applies it in its time
/// order. It is queued before the allocator can hand the block out again,
/// so the tracer, reading the queue after the rings, never sees the block's
/// next allocation without it.
#[inline(always)]
fn keep_free(ptr: u64, born_by: Option<u64>) {
    let ts = now_ns();
    let kept = LostFree {
        ptr,
        ts,
        born_by: born_by.unwrap_or(ts),
    };
    if LOST_FREES.push(&kept, 0).is_ok() {
        bump_counter(counter::FREES_KEPT, 1);
    } else {
        bump_counter(counter::FREES_LOST, 1);
    }
}

/// A block `pending` made that the ring had no room for: kept for the
/// tracer, which applies it in its time order. It is queued before the call
/// returns, so before the block can be freed: the tracer, reading the queue
/// after the rings, never sees the block's free without it.
#[inline(always)]
fn keep_alloc(pending: &Pending, ptr: u64) {
    let kept = LostAlloc {
        ptr,
        ts: now_ns(),
        size: pending.size,
        key: pending.key,
    };
    if LOST_ALLOCS.push(&kept, 0).is_ok() {
        bump_counter(counter::ALLOCS_KEPT, 1);
    } else {
        bump_counter(counter::ALLOCS_LOST, 1);
    }
}

/// The clock of the events' time stamps (`bpf_ktime_get_ns`).
#[inline(always)]
pub(crate) fn now_ns() -> u64 {
    unsafe { bpf_ktime_get_ns() }
}
