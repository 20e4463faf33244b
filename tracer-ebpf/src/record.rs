//! What the entry programs do: a freeing call is counted (or sent, in live
//! mode); an allocating call is checked for nesting, walked (or its walk
//! remembered), handed over when the walk misses a rule, and counted under
//! its aggregation key.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    programs::ProbeContext,
};
use tracer_common::{
    counter, stop, CountKey, Role, WalkScratch, COOKIE_INLINE_ID_SHIFT, COOKIE_ROLE_SHIFT,
    MAX_FUNCS, PYMALLOC_MAX, SAMPLE_NONE, WEIGHT_ONE,
};

use crate::{
    aggregate::{bump_counter, count_call, insert_count, name_thread, EEXIST},
    args::{attach_cookie, block_arg, call_args, NO_COOKIE},
    chunk::load_chunk,
    handover::send_miss,
    live::{send_free, set_pending},
    maps::{config_u32, enabled, CONFIG, INLINE_PENDING, PENDING, STACKS},
    memo::{memo_count, memo_find, memo_frames},
    nesting::{in_allocator_body, in_free_body, tail_called},
    python::{append_python, python_key, python_layout, read_python, send_python_notice},
    sample::{sample_weight, weighted_bytes},
    scratch::{give_back_scratch, owns_cpu, take_scratch},
    walk::{finish_hash, memo_sp, start_walk, walk_stack},
};

/// A call of a releasing function (`ptr` is the block). It needs no stack
/// and no nesting check: a free the allocator makes itself, as
/// realloc(p, 0) does, is a free all the same. Count mode wants the number
/// of frees; live mode, which block went when. Sampled, frees are not
/// counted at all. Only a tail call from another release function
/// (operator delete jumping to free), or a free made inside a probed
/// release function that frees through it (CPython's `PyObject_Free`), is
/// the same free again.
#[inline(always)]
pub(crate) fn record_free(ctx: &ProbeContext, cookie: u64, ptr: u64) -> u32 {
    if !enabled() {
        return 0;
    }
    let func = (cookie as u32) & (MAX_FUNCS - 1);
    let (sp, ip) = unsafe { ((*ctx.regs).rsp, (*ctx.regs).rip) };
    let ret = unsafe { bpf_probe_read_user(sp as *const u64) }.unwrap_or(0);
    // (Without a scratch level, all four taken on this CPU, the tail-call
    // check cannot run.)
    let scratch = take_scratch(ctx);
    let tail = tail_called(scratch, sp, ret, ip);
    give_back_scratch(scratch);
    if tail || in_free_body(ret) {
        bump_counter(counter::NESTED, 1);
        return 0;
    }
    if config_u32(&CONFIG.sample_mode) == SAMPLE_NONE {
        bump_counter(counter::CALLS + func, 1);
    }
    if config_u32(&CONFIG.live) != 0 && ptr != 0 {
        send_free(ptr);
    }
    0
}

/// A call of an allocating function. Its attach cookie (which function,
/// where its size is) is taken late: a call that takes a remembered walk
/// finds it in the walk's entry, a helper call less. Sampled, the size
/// decides first whether the call is taken at all.
#[inline(always)]
pub(crate) fn record_alloc(ctx: &ProbeContext) -> u32 {
    if !enabled() {
        return 0;
    }
    let sampled = config_u32(&CONFIG.sample_mode) != SAMPLE_NONE;
    let (mut early, mut weight) = (NO_COOKIE, WEIGHT_ONE);
    if sampled {
        let cookie = attach_cookie(ctx);
        let Some(w) = sample_weight(call_args(ctx, cookie).0) else {
            return 0;
        };
        (early, weight) = (cookie, w);
    }
    let scratch = take_scratch(ctx);
    record_alloc_with_scratch(ctx, scratch, early, weight, false);
    give_back_scratch(scratch);
    0
}

/// The zero flag in `pt_regs.eflags`.
const ZF: u64 = 1 << 6;

/// A copy of CPython's object allocator that the compiler inlined into a
/// caller behind a guard (`cmp $_PyObject_Malloc, %reg; jne <call *%reg>`:
/// the allocator's function pointer is still pymalloc's own). The probe
/// sits on the guard's branch: with the zero flag set the copy runs and
/// is this call; else the call goes through the pointer to a hook, whose
/// own allocations are counted where they reach a probe. A request the
/// copy does not serve itself (0, or over [`PYMALLOC_MAX`] bytes) falls
/// through to `malloc`, which counts it; a copy of realloc counts every
/// call, as a probe at `PyObject_Realloc`'s entry would. The call is its
/// caller's frame, at the guard: the walk starts there.
///
/// In live mode the call is completed where the copy's block is known
/// (`live::complete_inline_alloc`); a guard passed the other way, or a
/// request the copy hands to `malloc`, leaves nothing for it to complete.
#[inline(always)]
pub(crate) fn record_inline_alloc(ctx: &ProbeContext) -> u32 {
    if !enabled() {
        return 0;
    }
    let live = config_u32(&CONFIG.live) != 0;
    let runs = unsafe { (*ctx.regs).eflags } & ZF != 0;
    if !runs {
        if live {
            clear_inline_pending();
        }
        return 0;
    }
    let cookie = attach_cookie(ctx);
    let size = call_args(ctx, cookie).0;
    // A copy of realloc is counted whatever the size: the calls it makes
    // to the C library's allocator are its own (the tracer makes their
    // return addresses allocator bodies).
    let resize = (cookie >> COOKIE_ROLE_SHIFT) & 0xff == Role::Resize as u64;
    if !resize && (size == 0 || size > PYMALLOC_MAX) {
        if live {
            clear_inline_pending();
        }
        return 0;
    }
    let mut weight = WEIGHT_ONE;
    if config_u32(&CONFIG.sample_mode) != SAMPLE_NONE {
        let Some(w) = sample_weight(size) else {
            if live {
                clear_inline_pending();
            }
            return 0;
        };
        weight = w;
    }
    let scratch = take_scratch(ctx);
    record_alloc_with_scratch(ctx, scratch, cookie, weight, true);
    give_back_scratch(scratch);
    0
}

/// Live mode: no call of an inlined copy in flight on this thread (one
/// still in flight was never completed: counted).
#[inline(always)]
fn clear_inline_pending() {
    if let Some(p) = INLINE_PENDING.current(false) {
        if p.active != 0 {
            p.active = 0;
            bump_counter(counter::INLINE_UNFINISHED, 1);
        }
    }
}

/// A copy of CPython's `_PyObject_Free` inlined into its caller, probed at
/// its guard's branch: with the zero flag set the copy runs and frees the
/// block where the cookie says (see `args::block_arg`). The calls of the
/// C library's `free` it makes (a block pymalloc does not own) are this
/// free (the tracer makes their return addresses free bodies).
#[inline(always)]
pub(crate) fn record_inline_free(ctx: &ProbeContext) -> u32 {
    if !enabled() || unsafe { (*ctx.regs).eflags } & ZF == 0 {
        return 0;
    }
    let cookie = attach_cookie(ctx);
    if config_u32(&CONFIG.sample_mode) == SAMPLE_NONE {
        bump_counter(counter::CALLS + ((cookie as u32) & (MAX_FUNCS - 1)), 1);
    }
    if config_u32(&CONFIG.live) == 0 {
        return 0;
    }
    let ptr = block_arg(ctx, cookie);
    if ptr != 0 {
        send_free(ptr);
    }
    0
}

/// [`record_alloc`] with a scratch level taken: reads the direct caller,
/// checks for nesting, walks the stack (or takes a remembered walk), hands
/// a walk that missed a rule over to the tracer, and counts the call under
/// its key (live mode: makes it pending for the return probe).
#[inline(always)]
pub(crate) fn record_alloc_with_scratch(
    ctx: &ProbeContext,
    scratch: Option<*mut WalkScratch>,
    early: u64,
    weight: u64,
    inline: bool,
) {
    let sampled = config_u32(&CONFIG.sample_mode) != SAMPLE_NONE;
    let live = config_u32(&CONFIG.live) != 0;
    let (sp, ip) = unsafe { ((*ctx.regs).rsp, (*ctx.regs).rip) };
    // The direct caller's return address is at [rsp]. Read the stack from
    // there a chunk at a time: the same read usually holds the first
    // frames of the walk too (without a walk, the caller alone). An
    // inlined copy's caller is the code it sits in: the address after the
    // probe's stands for it (its rule is the CFI row of the probe's).
    let walks = config_u32(&CONFIG.max_frames) != 0;
    let caller = match scratch {
        Some(w) if walks && load_chunk(unsafe { &mut *w }, sp) => {
            if inline {
                ip + 1
            } else {
                unsafe { (*w).chunk[0] }
            }
        }
        Some(_) if !walks && inline => ip + 1,
        Some(_) if !walks => unsafe { bpf_probe_read_user(sp as *const u64) }.unwrap_or(0),
        _ => 0,
    };
    let frame_sp = if inline { sp } else { sp + 8 };
    if caller == 0 {
        bump_counter(counter::CALLER_READ_FAILED, 1);
    }
    // A remembered walk from here, looked for first: a call from the same
    // place passed the nesting check before. Under `--max-stack 0` the
    // direct caller is the whole key: remembered by the caller alone.
    let remembered = match scratch {
        Some(w) => unsafe {
            let bp = (*ctx.regs).rbp;
            start_walk(&mut *w, caller, sp, frame_sp, bp, ip);
            caller != 0 && memo_find(w, caller, memo_sp(&*w, sp), bp, ip)
        },
        None => false,
    };
    // In live mode the pending entry below is the nesting check.
    if !live && caller != 0 && !remembered && in_allocator_body(caller) {
        bump_counter(counter::NESTED, 1);
        return;
    }
    let mut pending = None;
    if live {
        // In live mode the outer call's pending entry says exactly when the
        // thread is inside the allocator (the return probes have replaced
        // return addresses, so the marks below would not match).
        pending = PENDING.current(true);
        match &pending {
            Some(p) if p.active != 0 && sp <= p.sp => {
                bump_counter(counter::NESTED, 1);
                return;
            }
            Some(_) => {}
            None => bump_counter(counter::PENDING_FULL, 1),
        }
        if inline {
            // An inlined copy's call waits in its own entry.
            pending = INLINE_PENDING.current(true);
            match &pending {
                Some(p) if p.active != 0 => bump_counter(counter::INLINE_UNFINISHED, 1),
                Some(_) => {}
                None => bump_counter(counter::PENDING_FULL, 1),
            }
        }
    } else if tail_called(scratch, sp, caller, ip) {
        bump_counter(counter::NESTED, 1);
        return;
    }
    let per_thread = config_u32(&CONFIG.per_thread) != 0;
    let tid = match scratch {
        Some(w) => unsafe { core::ptr::read_volatile(&(*w).tid) as u32 },
        None if per_thread => bpf_get_current_pid_tgid() as u32,
        None => 0,
    };
    let key_tid = tid;
    let (stack, walk, cookie) = walk_stack(ctx, scratch, caller, key_tid, early);
    // The direct caller a return probe hid, found by the walk.
    let caller = match walk {
        Some(w) if unsafe { core::ptr::read_volatile(&(*w).caller) } != 0 => unsafe { (*w).caller },
        _ => caller,
    };
    // A Python process's stack is its native walk (remembered or not) and
    // its Python frames, read now (a walk handed to the tracer takes them
    // along).
    let python = python_layout().is_some();
    if let Some(w) = walk {
        if python {
            read_python(unsafe { &mut *w });
        } else {
            unsafe { (*w).py_n = 0 };
        }
    }
    let func = (cookie as u32) & (MAX_FUNCS - 1);
    let (size, mut extra) = call_args(ctx, cookie);
    if inline {
        // The copy's number: only its own place takes the call up.
        extra.memptr = cookie >> COOKIE_INLINE_ID_SHIFT;
    }
    let (calls_inc, bytes_inc) = if sampled {
        bump_counter(counter::SAMPLES, 1);
        (weight, weighted_bytes(size, weight))
    } else {
        (1, size)
    };
    let owned = owns_cpu(walk);
    // A walk that met a return address without a rule goes to the tracer
    // with a copy of the stack; the tracer counts the call (under the same
    // key the walk would have made) and adds the missing rules.
    let stack = match walk {
        Some(w) if unsafe { (*w).stack.stop } == stop::MISS => {
            match send_miss(unsafe { &*w }, func, key_tid, caller, calls_inc, bytes_inc) {
                Some(id) => {
                    count_call(func, calls_inc, bytes_inc, None, owned);
                    if let Some(p) = pending {
                        set_pending(p, caller, id, func, key_tid, size, extra, sp);
                    }
                    return;
                }
                None => {
                    let why = match unsafe { (*w).stack.stop } {
                        stop::RULES_FULL => stop::RULES_FULL,
                        _ => stop::COPY_LOST,
                    };
                    finish_hash(unsafe { &mut *w }, why)
                }
            }
        }
        _ => stack,
    };
    // Its key: the native walk's, continued over the Python frames (also
    // where the walk ended for want of room to hand it over).
    let stack = match walk {
        Some(w) if python => python_key(unsafe { &mut *w }, stack),
        _ => stack,
    };
    let key = CountKey {
        stack,
        func,
        tid: key_tid,
        caller,
    };
    if let Some(p) = pending {
        set_pending(p, caller, stack, func, key_tid, size, extra, sp);
    }
    // A remembered walk of this key counts the call itself; else the map.
    // (A Python process's calls are not counted in the remembered walk:
    // its key is of the native frames only.)
    let in_memo = owned
        && !python
        && matches!(walk, Some(w) if unsafe { (*w).memo_hit } != 0
            && memo_count(w, func, key_tid, calls_inc, bytes_inc));
    let counted = count_call(
        func,
        calls_inc,
        bytes_inc,
        (!in_memo).then_some(&key),
        owned,
    );
    if !counted && insert_count(&key, calls_inc, bytes_inc, 1) {
        if per_thread {
            name_thread(tid);
        }
        // A new key: make sure its stack is stored (once per stack). A
        // remembered walk has no frames: walk again for them.
        let walk = match walk {
            Some(w) if unsafe { (*w).memo_hit } != 0 => {
                if memo_frames(w) {
                    Some(w)
                } else {
                    bump_counter(counter::STACK_WALK_FAILED, 1);
                    None
                }
            }
            other => other,
        };
        if let Some(w) = walk {
            append_python(unsafe { &mut *w });
            match STACKS.insert(&stack, unsafe { &(*w).stack }, BPF_NOEXIST as u64) {
                // A new stack: its Python frames' code objects to name.
                Ok(()) => send_python_notice(unsafe { &mut *w }),
                Err(e) if e != -EEXIST => bump_counter(counter::STACK_MAP_FULL, 1),
                Err(_) => {}
            }
        }
    }
}
