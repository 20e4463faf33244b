//! The frame walk: the target's user stack, frame by frame, by the unwind
//! rule of each return address, a chunk of stack read at a time.

use aya_ebpf::programs::ProbeContext;
use tracer_common::{
    counter, host_anon_rule_key, rule_slot, stack_hash_finish, stack_hash_step, stop, UnwindRule,
    WalkMemo, WalkScratch, HOST_FRAME_IN_FILE, HOST_GEN_NONE, HOST_RAW_ANON, HOST_RAW_BUSY,
    MAX_FRAMES, STACK_CHUNK, STACK_HASH_SEED, STACK_NONE,
};

use crate::{
    aggregate::bump_counter,
    args::{cookie_or, NO_COOKIE},
    chunk::load_chunk,
    hidden::hidden_return,
    maps::{config_u32, CONFIG, HOST_RULES, MEMO, MEMO_NOWHERE, RULE_CACHE, UNWIND_RULES},
    memo::{memo_claim, memo_note, memo_release},
    place::host_place,
    scratch::{level_of, run_loop, scratch_at},
};

/// Sets the walk off from the probe: `caller` is the direct caller (at
/// `[rsp]` at a function's entry), `frame_sp` the stack pointer in its
/// frame (`rsp + 8` there), rbp the caller's.
#[inline(always)]
pub(crate) fn start_walk(
    w: &mut WalkScratch,
    caller: u64,
    sp: u64,
    frame_sp: u64,
    bp: u64,
    ip: u64,
) {
    w.ip = ip;
    w.ra = caller;
    w.sp = frame_sp;
    w.bp = bp;
    w.bp_ok = 1;
    w.hash = STACK_HASH_SEED;
    w.stack.len = 0;
    w.stack.stop = if caller == 0 {
        stop::READ_FAILED
    } else {
        stop::MAX_FRAMES
    };
    // 0 (--max-stack 0): the direct caller only.
    w.limit = config_u32(&CONFIG.max_frames) as u64;
    w.origin = sp;
    w.check_slot = MEMO_NOWHERE as u64;
    // Volatile: LLVM would merge the zeroes into a call of a memset that
    // goes a byte at a time.
    unsafe {
        core::ptr::write_volatile(&mut w.memo_hit, 0);
        core::ptr::write_volatile(&mut w.memo_n, 0);
        core::ptr::write_volatile(&mut w.memo_span, 0);
        core::ptr::write_volatile(&mut w.memo_over, 0);
        core::ptr::write_volatile(&mut w.memo_bp_at, 0);
        core::ptr::write_volatile(&mut w.memo_uses_bp, 0);
        core::ptr::write_volatile(&mut w.noting, 0);
        core::ptr::write_volatile(&mut w.hidden, 0);
        core::ptr::write_volatile(&mut w.caller, 0);
        core::ptr::write_volatile(&mut w.host_gen, 0);
        core::ptr::write_volatile(&mut w.host_epoch, 0);
    }
}

/// The stack pointer a walk memo entry of `--max-stack 0` is kept under:
/// the direct caller alone makes the key, wherever the stack is.
const CALLER_ONLY_SP: u64 = 0;

/// The stack pointer the walk memo keeps a call at `sp` under, for the
/// walk scratch `w` (set off by [`start_walk`]).
#[inline(always)]
pub(crate) fn memo_sp(w: &WalkScratch, sp: u64) -> u64 {
    if w.limit == 0 {
        CALLER_ONLY_SP
    } else {
        sp
    }
}

/// Walks the target's stack from the probe (where `[rsp]` is the direct
/// caller and rbp the caller's) by the unwind rule of each return address,
/// one `bpf_loop` step per frame. Returns the stack's key and the scratch
/// holding the frames; with `stack.stop == MISS` the walk stopped at an
/// address without a rule and the key is not final.
#[inline(always)]
pub(crate) fn walk_stack(
    ctx: &ProbeContext,
    scratch: Option<*mut WalkScratch>,
    caller: u64,
    tid: u32,
    cookie: u64,
) -> (u64, Option<*mut WalkScratch>, u64) {
    let Some(w) = scratch else {
        bump_counter(counter::STACK_WALK_FAILED, 1);
        return (STACK_NONE, None, cookie_or(cookie, ctx));
    };
    unsafe {
        // Set off (and checked against the memo) by `record_alloc_with_scratch`.
        let (sp, bp) = ((*ctx.regs).rsp, (*ctx.regs).rbp);
        if caller != 0 {
            if (*w).memo_hit != 0 {
                // Taken before (sampled), else the entry's, else the probe's.
                let cookie = cookie_or(
                    if cookie != NO_COOKIE {
                        cookie
                    } else {
                        (*w).cookie
                    },
                    ctx,
                );
                return ((*w).hit_key, Some(w), cookie);
            }
            let cookie = cookie_or(cookie, ctx);
            if (*w).limit == 0 {
                // `--max-stack 0`: no frame to walk, and a key of the
                // caller alone, remembered under it (no stack word to
                // check) so that the next call from there is counted in
                // the memo's entry.
                let at = memo_sp(&*w, sp);
                if core::ptr::read_volatile(&(*w).owned) != 0 {
                    memo_claim(&mut *w, caller, at, cookie, tid as u64);
                }
                let key = finish_hash(&mut *w, (*w).stack.stop);
                memo_release(&mut *w, Some((caller, at, bp, key)));
                return (key, Some(w), cookie);
            }
            bump_counter(counter::WALKS, 1);
            if core::ptr::read_volatile(&(*w).owned) != 0 {
                memo_claim(&mut *w, caller, sp, cookie, tid as u64);
            }
            run_walk(w);
            let why = (*w).stack.stop;
            if why == stop::MISS {
                memo_release(&mut *w, None);
                return (0, Some(w), cookie);
            }
            let key = finish_hash(&mut *w, why);
            // A walk that could not read the stack may do better next time;
            // one that met a hidden return address is not remembered.
            let keep = why != stop::READ_FAILED && core::ptr::read_volatile(&(*w).hidden) == 0;
            let done = keep.then_some((caller, sp, bp, key));
            memo_release(&mut *w, done);
            return (key, Some(w), cookie);
        }
        let why = (*w).stack.stop;
        (finish_hash(&mut *w, why), Some(w), cookie_or(cookie, ctx))
    }
}

/// Walks frame by frame until the walk ends (`stack.stop` says why).
#[inline(always)]
fn run_walk(w: *mut WalkScratch) {
    walk_frames(level_of(w));
}

/// Walks the walk scratch at `level` frame by frame until the walk ends.
/// A global function (a number in, a number out, always 0): the verifier
/// checks the walk once, not once for each way the program reaches it.
#[inline(never)]
#[no_mangle]
pub extern "C" fn walk_frames(level: u64) -> u64 {
    if let Some(w) = scratch_at(level) {
        run_loop(
            (MAX_FRAMES / FRAMES_PER_STEP + 1 + MAX_REVEALED) as u32,
            unwind_step,
            unsafe { &mut *w },
        );
    }
    0
}

/// Steps added for the walk to go on from hidden return addresses (each
/// one ends a step early).
const MAX_REVEALED: usize = 4;

/// Frames a `bpf_loop` step of the walk takes on (a callback call per
/// frame would cost more than the frame).
const FRAMES_PER_STEP: usize = 8;

/// One `bpf_loop` step of the walk: up to [`FRAMES_PER_STEP`] frames.
#[inline(never)]
extern "C" fn unwind_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    // The entry the walk notes its stack words in (looked up once a step).
    let Some(e) = MEMO.get_ptr_mut(w.check_slot as u32) else {
        return 1;
    };
    let mut k = 0;
    while k < FRAMES_PER_STEP {
        if unwind_frame(w, e) != 0 {
            break;
        }
        k += 1;
    }
    if k == FRAMES_PER_STEP {
        return 0;
    }
    // Where the walk ended at an address without a rule of its own, that
    // address may be the kernel's trampoline in place of a return address
    // (read from the slot below the frame's CFA): the walk goes on from
    // the real one.
    let why = w.stack.stop;
    if why == stop::MISS || why == stop::NO_CFI || why == stop::BAD_FRAME {
        let real = hidden_return(w.sp - 8, w.ra);
        if real != 0 {
            reveal(w, real);
            w.stack.stop = stop::MAX_FRAMES;
            return 0;
        }
    }
    1
}

/// One frame of the walk: finds the rule of the current return address,
/// computes the caller's frame from it, and reads the next return address
/// (and a saved rbp) from the chunk of stack in the scratch, reading a new
/// chunk when the frame lies outside it. Returns 1 when the walk is over
/// (`stack.stop` says why), 0 to go on.
#[inline(always)]
fn unwind_frame(w: &mut WalkScratch, e: *mut WalkMemo) -> i64 {
    let found = if w.host_gen != 0 {
        host_rule(w.host_ra, w.host_raw, w.host_gen)
    } else {
        rule_of(w.ra)
    };
    let Some(rule) = found else {
        w.stack.stop = stop::MISS;
        return 1;
    };
    let base = match rule.kind {
        UnwindRule::CFA_RSP => w.sp,
        UnwindRule::CFA_RBP if w.bp_ok != 0 => {
            // The walk depends on rbp: on the entry's register, or on the
            // stack word it was read from.
            if w.memo_bp_at == 0 {
                w.memo_uses_bp = 1;
            } else {
                memo_note(w, e, w.memo_bp_at, w.bp, 0);
            }
            w.bp
        }
        UnwindRule::END => return end_walk(w, stop::END),
        UnwindRule::NOT_CODE => return end_walk(w, stop::BAD_FRAME),
        _ => return end_walk(w, stop::NO_CFI),
    };
    let cfa = base.wrapping_add(rule.cfa_off as i64 as u64);
    // Each caller's frame lies above its callee's: what makes the walk end
    // on garbage.
    if cfa <= w.sp || cfa & 7 != 0 {
        return end_walk(w, stop::BAD_FRAME);
    }
    // The slots to read: the return address at CFA - 8 and, below it, a
    // saved rbp.
    let saves_bp = rule.rbp == UnwindRule::RBP_AT;
    let rbp_off = rule.rbp_off as i64;
    let low_off: i64 = if saves_bp && rbp_off < -8 {
        rbp_off
    } else {
        -8
    };
    let low = cfa.wrapping_add(low_off as u64);
    let covered = low >= w.base && w.valid >= 8 && cfa - w.base <= w.valid;
    if !covered && !load_chunk(w, low) {
        return end_walk(w, stop::READ_FAILED);
    }
    let base = w.base;
    let valid = w.valid;
    if cfa < base + 8 || cfa - base > valid {
        return end_walk(w, stop::READ_FAILED);
    }
    let next = w.chunk[(((cfa - 8 - base) / 8) as usize) & (STACK_CHUNK / 8 - 1)];
    memo_note(w, e, cfa - 8, next, 1);
    if saves_bp {
        let at = cfa.wrapping_add(rbp_off as u64);
        if at < base || at & 7 != 0 || at + 8 > base + valid {
            return end_walk(w, stop::READ_FAILED);
        }
        w.bp = w.chunk[(((at - base) / 8) as usize) & (STACK_CHUNK / 8 - 1)];
        w.bp_ok = 1;
        w.memo_bp_at = at;
    } else if rule.rbp != UnwindRule::RBP_SAME {
        w.bp_ok = 0;
    }
    if next == 0 {
        return end_walk(w, stop::END);
    }
    // The count is read afresh and masked, so that the verifier sees the
    // slot's bounds.
    let n = (unsafe { core::ptr::read_volatile(&w.stack.len) } as usize) & 127;
    if n >= MAX_FRAMES || n as u64 >= w.limit {
        return end_walk(w, stop::MAX_FRAMES);
    }
    let frame = frame_of(w, next);
    w.stack.frames[n] = frame;
    unsafe { core::ptr::write_volatile(&mut w.stack.len, n as u32 + 1) };
    w.prev_hash = w.hash;
    w.hash = stack_hash_step(w.hash, frame);
    w.ra = next;
    w.sp = cfa;
    0
}

/// Puts `real` in place of the return address the walk is at (`ra`, the
/// last frame, or the direct caller when there is none yet).
#[inline(always)]
fn reveal(w: &mut WalkScratch, real: u64) {
    unsafe { core::ptr::write_volatile(&mut w.hidden, 1) };
    let n = (unsafe { core::ptr::read_volatile(&w.stack.len) } as usize) & 127;
    if n == 0 {
        w.caller = real;
        if w.host_gen != 0 {
            w.host_ra = host_place(w, real);
        }
    } else if n <= MAX_FRAMES {
        let frame = frame_of(w, real);
        w.stack.frames[n - 1] = frame;
        w.hash = stack_hash_step(w.prev_hash, frame);
    }
    w.ra = real;
}

/// What the walk keeps of return address `ra`: the address itself, or in
/// the host scope its place in its file (then also the place the next
/// rule is looked up by).
#[inline(always)]
fn frame_of(w: &mut WalkScratch, ra: u64) -> u64 {
    if w.host_gen == 0 {
        return ra;
    }
    let frame = host_place(w, ra);
    w.host_ra = frame;
    frame
}

/// The host scope's rule of the return address at `frame` (its file and
/// offset): `None` when the tracer has not given it yet. A frame kept as
/// an address (`raw` says why): one whose mapping could not be looked up
/// has none (the tracer places it); code in no file has the rule the
/// tracer gave the process's (incarnation `gen`) JIT code, none before
/// it has judged it; other addresses are no code (the walk ends there).
#[inline(always)]
fn host_rule(frame: u64, raw: u64, gen: u64) -> Option<UnwindRule> {
    if frame & HOST_FRAME_IN_FILE != 0 {
        return unsafe { HOST_RULES.get(&frame) }.copied();
    }
    match raw {
        HOST_RAW_BUSY => None,
        HOST_RAW_ANON if gen != HOST_GEN_NONE => {
            unsafe { HOST_RULES.get(&host_anon_rule_key(gen)) }.copied()
        }
        _ => Some(UnwindRule::unsupported()),
    }
}

/// The rule of return address `ra`: from the direct-mapped cache (an array
/// lookup the verifier inlines), else from the hash map.
#[inline(always)]
fn rule_of(ra: u64) -> Option<UnwindRule> {
    if let Some(slot) = RULE_CACHE.get(rule_slot(ra)) {
        // The tracer fills a slot while the target runs, the rule first
        // and its address after (two updates): the address is read first,
        // so a slot that names `ra` holds its whole rule.
        let cached = unsafe { core::ptr::read_volatile(&slot.ra) };
        if cached == ra {
            // One 8-byte load (a volatile struct read is one per field).
            let bits =
                unsafe { core::ptr::read_volatile(&slot.rule as *const UnwindRule as *const u64) };
            return Some(unsafe { core::mem::transmute::<u64, UnwindRule>(bits) });
        }
    }
    unsafe { UNWIND_RULES.get(&ra) }.copied()
}

/// Ends the walk for reason `why` (a `stop` value): 1, what a frame
/// returns when the walk is over.
#[inline(always)]
fn end_walk(w: &mut WalkScratch, why: u32) -> i64 {
    w.stack.stop = why;
    1
}

/// The walk's key: its frames and why it ended.
#[inline(always)]
pub(crate) fn finish_hash(w: &mut WalkScratch, why: u32) -> u64 {
    w.stack.stop = why;
    stack_hash_finish(w.hash, why)
}
