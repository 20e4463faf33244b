//! The walk memo: per CPU, the stack words a walk from a place read and
//! the key it made; a later call from the same place whose stack still holds
//! those words takes the key without walking, and is counted in the entry.

use core::intrinsics::AtomicOrdering;

use tracer_common::{
    counter, CountKey, WalkMemo, WalkScratch, MAX_FRAMES, MAX_FUNCS, MEMO_ENTRIES, MEMO_WORDS,
    STACK_CHUNK,
};

use crate::{
    aggregate::{add_to_count, bump_counter, insert_count},
    args::NO_COOKIE,
    chunk::load_chunk,
    maps::{MEMO, MEMO_NOWHERE},
    scratch::{level_of, run_loop, scratch_at},
};

/// The [`MEMO`] entry of a call from `caller` with stack pointer `sp`.
#[inline(always)]
fn memo_slot(caller: u64, sp: u64) -> u32 {
    ((caller ^ sp.rotate_left(20)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as u32
        & (MEMO_ENTRIES - 1)
}

/// Whether a walk from `caller` at `sp` is remembered and the stack still
/// holds every word that walk read (so that walking would give the same):
/// then the scratch has its key (`hit_key`), entry (`check_slot`, with
/// `hit_seq`) and, for a call through the same probe, cookie.
#[inline(always)]
pub(crate) fn memo_find(w: *mut WalkScratch, caller: u64, sp: u64, bp: u64, ip: u64) -> bool {
    let found = memo_lookup(w, caller, sp, bp, ip);
    unsafe {
        match found {
            Some(key) => {
                (*w).hit_key = key;
                (*w).memo_hit = 1;
            }
            // The walk that follows notes nowhere unless it claims an
            // entry (a walk whose program does not own the CPU must not
            // write into the entry the check looked at).
            None => (*w).check_slot = MEMO_NOWHERE as u64,
        }
    }
    found.is_some()
}

/// [`memo_find`]'s check: the remembered key, if any.
#[inline(always)]
fn memo_lookup(w: *mut WalkScratch, caller: u64, sp: u64, bp: u64, ip: u64) -> Option<u64> {
    let slot = memo_slot(caller, sp);
    let e = MEMO.get_ptr(slot)?;
    unsafe {
        let seq = core::ptr::read_volatile(&(*e).seq);
        if seq & 1 != 0
            || core::ptr::read_volatile(&(*e).caller) != caller
            || core::ptr::read_volatile(&(*e).sp) != sp
            || core::ptr::read_volatile(&(*e).owner) != (*w).host_gen
            || core::ptr::read_volatile(&(*e).epoch) != (*w).host_epoch
            || (core::ptr::read_volatile(&(*e).uses_bp) != 0
                && core::ptr::read_volatile(&(*e).bp) != bp)
        {
            return None;
        }
        let key = core::ptr::read_volatile(&(*e).key);
        let n = core::ptr::read_volatile(&(*e).n);
        // The cookie of the walk's call, when this call is through the
        // same probe.
        let cookie = if core::ptr::read_volatile(&(*e).ip) == ip {
            core::ptr::read_volatile(&(*e).cookie)
        } else {
            NO_COOKIE
        };
        (*w).check_slot = slot as u64;
        // Every word in the chunk read at `sp` (the usual case): compared
        // without a bounds check per word.
        let span = core::ptr::read_volatile(&(*e).span);
        let i = if n <= MEMO_INLINE && (*w).base == sp && span * 8 <= (*w).valid {
            if memo_compare_chunk(w, e, n) {
                n
            } else {
                u64::MAX
            }
        } else {
            memo_compare(level_of(w), sp, n)
        };
        if i > n {
            return None;
        }
        if i < n {
            // The rest a step at a time, reading the stack as needed.
            (*w).origin = sp;
            (*w).check_i = i;
            (*w).check_n = n;
            (*w).check_same = 0;
            memo_check_rest(level_of(w));
            if core::ptr::read_volatile(&(*w).check_same) == 0 {
                return None;
            }
        }
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
        if core::ptr::read_volatile(&(*e).seq) != seq {
            return None;
        }
        (*w).hit_seq = seq;
        (*w).cookie = cookie;
        Some(key)
    }
}

/// Remembered words [`memo_find`] compares without `bpf_loop`.
const MEMO_INLINE: u64 = 64;

/// Compares the `n` (at most `MEMO_INLINE`) remembered words of `e` with
/// the chunk, which holds all of them (read at the entry's stack pointer,
/// and as long as the entry's span): no bounds check per word, and inline
/// (a BPF subprogram's return goes through the kernel's return thunk where
/// the CPU needs one).
#[inline(always)]
fn memo_compare_chunk(w: *mut WalkScratch, e: *const WalkMemo, n: u64) -> bool {
    unsafe {
        let mut i = 0u64;
        while i < MEMO_INLINE {
            if i >= n {
                return true;
            }
            let word = core::ptr::read_volatile(&(*e).words[(i as usize) & (MEMO_WORDS - 1)]);
            if (*w).chunk[((word >> 48) as usize) & (STACK_CHUNK / 8 - 1)] != word & ((1 << 48) - 1)
            {
                return false;
            }
            i += 1;
        }
        true
    }
}

/// Compares the first remembered words of the entry the check looks at
/// (`check_slot`) that lie in the chunk already read with the stack at
/// `sp`, for the walk scratch at `level`, without `bpf_loop` (a helper
/// call whose every step is an indirect call, which retpolines and return
/// thunks make dear). Returns how many matched before a word beyond the
/// chunk or beyond the first `MEMO_INLINE`, or more than `n` at a
/// mismatch. For a walk whose words are not all in the first chunk (a walk
/// that fits takes [`memo_compare_chunk`]). A global function (numbers in,
/// a number out): the verifier checks it once, and its caller sees any
/// count, not one constant per way out of the loop.
#[inline(never)]
#[no_mangle]
pub extern "C" fn memo_compare(level: u64, sp: u64, n: u64) -> u64 {
    let Some(w) = scratch_at(level) else {
        return u64::MAX;
    };
    unsafe {
        let Some(e) = MEMO.get_ptr((*w).check_slot as u32) else {
            return u64::MAX;
        };
        let (base, valid) = ((*w).base, (*w).valid);
        let mut i = 0u64;
        while i < MEMO_INLINE {
            if i >= n {
                break;
            }
            let word = core::ptr::read_volatile(&(*e).words[(i as usize) & (MEMO_WORDS - 1)]);
            let addr = sp + ((word >> 45) & (0x7fff << 3));
            if addr < base || addr + 8 > base + valid {
                break;
            }
            if (*w).chunk[(((addr - base) / 8) as usize) & (STACK_CHUNK / 8 - 1)]
                != word & ((1 << 48) - 1)
            {
                return u64::MAX;
            }
            i += 1;
        }
        i
    }
}

/// Remembered words a `bpf_loop` step of [`memo_step`] or
/// [`memo_frames_step`] handles.
const MEMO_PER_STEP: usize = 8;

/// Compares the remembered words from `check_i` to `check_n` with the
/// stack for the walk scratch at `level`, a `bpf_loop` step at a time;
/// `check_same` says whether all matched. A global function (a number in,
/// a number out, always 0): the verifier checks it once, not once for
/// each way the program reaches it.
#[inline(never)]
#[no_mangle]
pub extern "C" fn memo_check_rest(level: u64) -> u64 {
    if let Some(w) = scratch_at(level) {
        run_loop((MEMO_WORDS / MEMO_PER_STEP + 1) as u32, memo_step, unsafe {
            &mut *w
        });
    }
    0
}

/// One `bpf_loop` step of [`memo_find`]: compares up to `MEMO_PER_STEP`
/// remembered words with the stack, reading chunks of it as needed.
#[inline(never)]
extern "C" fn memo_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let Some(e) = MEMO.get_ptr(w.check_slot as u32) else {
        return 1;
    };
    // In registers for the step (the scratch is written only on a read).
    let (n, origin) = (w.check_n, w.origin);
    let mut i = w.check_i;
    let mut base = w.base;
    let mut end = base + w.valid;
    let mut k = 0;
    while k < MEMO_PER_STEP {
        if i >= n {
            w.check_same = 1;
            return 1;
        }
        let word =
            unsafe { core::ptr::read_volatile(&(*e).words[(i as usize) & (MEMO_WORDS - 1)]) };
        let addr = origin + ((word >> 45) & (0x7fff << 3));
        if addr < base || addr + 8 > end {
            if !load_chunk(w, addr) {
                return 1;
            }
            base = w.base;
            end = base + w.valid;
        }
        if w.chunk[(((addr - base) / 8) as usize) & (STACK_CHUNK / 8 - 1)] != word & ((1 << 48) - 1)
        {
            return 1;
        }
        i += 1;
        k += 1;
    }
    w.check_i = i;
    0
}

/// Counts a call that took a remembered walk in the walk's entry, if the
/// entry (still the one the walk came from) is of the same function and
/// thread. Only the CPU's owner calls this.
#[inline(always)]
pub(crate) fn memo_count(w: *mut WalkScratch, func: u32, tid: u32, calls: u64, bytes: u64) -> bool {
    unsafe {
        let Some(e) = MEMO.get_ptr_mut((*w).check_slot as u32) else {
            return false;
        };
        if core::ptr::read_volatile(&(*e).seq) != (*w).hit_seq
            || (*e).func != func as u64
            || (*e).tid != tid as u64
        {
            return false;
        }
        (*e).hits += 1;
        (*e).calls += calls;
        (*e).bytes += bytes;
        true
    }
}

/// After a remembered walk, its frames (a new aggregation key stores its
/// stack): the return addresses among the words the entry holds. False
/// when the entry changed meanwhile (the call then goes under no stack).
#[inline(always)]
pub(crate) fn memo_frames(mut w: *mut WalkScratch) -> bool {
    unsafe {
        let Some(e) = MEMO.get_ptr((*w).check_slot as u32) else {
            return false;
        };
        // The entry the call's key came from, unchanged since.
        let seq = (*w).hit_seq;
        if core::ptr::read_volatile(&(*e).seq) != seq {
            return false;
        }
        (*w).stack.len = 0;
        (*w).stack.stop = core::ptr::read_volatile(&(*e).stop) as u32;
        (*w).check_i = 0;
        aya_ebpf::helpers::generated::bpf_loop(
            (MEMO_WORDS / MEMO_PER_STEP + 1) as u32,
            memo_frames_step as *mut core::ffi::c_void,
            &mut w as *mut *mut WalkScratch as *mut core::ffi::c_void,
            0,
        );
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
        core::ptr::read_volatile(&(*e).seq) == seq
    }
}

/// One `bpf_loop` step of [`memo_frames`].
#[inline(never)]
extern "C" fn memo_frames_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let Some(e) = MEMO.get_ptr(w.check_slot as u32) else {
        return 1;
    };
    let mut k = 0;
    while k < MEMO_PER_STEP {
        let i = w.check_i;
        if i >= w.check_n {
            return 1;
        }
        let word =
            unsafe { core::ptr::read_volatile(&(*e).words[(i as usize) & (MEMO_WORDS - 1)]) };
        if word >> 63 != 0 {
            let n = (unsafe { core::ptr::read_volatile(&w.stack.len) } as usize) & 127;
            if n >= MAX_FRAMES {
                return 1;
            }
            w.stack.frames[n] = word & ((1 << 48) - 1);
            unsafe { core::ptr::write_volatile(&mut w.stack.len, n as u32 + 1) };
        }
        w.check_i = i + 1;
        k += 1;
    }
    0
}

/// Takes the [`MEMO`] entry of a walk from `caller` at `sp` for the walk
/// about to run, which writes the stack words it reads into it (unless
/// another program on this CPU is writing the entry: then the walk is not
/// remembered). Not inlined: the verifier would follow the walk once per
/// way through.
#[inline(never)]
pub(crate) fn memo_claim(w: &mut WalkScratch, caller: u64, sp: u64, cookie: u64, tid: u64) {
    if sp & 7 != 0 {
        return;
    }
    let slot = memo_slot(caller, sp);
    let Some(e) = MEMO.get_ptr_mut(slot) else {
        return;
    };
    let seq = unsafe { core::ptr::read_volatile(&(*e).seq) };
    if seq & 1 != 0 {
        return;
    }
    // Odd while written; only the program that made it odd writes.
    let (_, won) = unsafe {
        core::intrinsics::atomic_cxchg::<
            u64,
            { AtomicOrdering::Relaxed },
            { AtomicOrdering::Relaxed },
        >(&mut (*e).seq, seq, seq + 1)
    };
    if won {
        memo_flush(e);
        unsafe {
            (*e).func = cookie & (MAX_FUNCS as u64 - 1);
            (*e).tid = tid;
            (*e).ip = w.ip;
            (*e).cookie = cookie;
        }
        w.check_slot = slot as u64;
        w.claim_seq = seq;
        w.noting = 1;
    }
}

/// Notes in the claimed entry that the walk read `value` from the stack
/// word at `addr` (a return address, the next frame, when `frame` is 1).
#[inline(always)]
pub(crate) fn memo_note(w: &mut WalkScratch, e: *mut WalkMemo, addr: u64, value: u64, frame: u64) {
    let off = addr.wrapping_sub(w.origin) / 8;
    let n = unsafe { core::ptr::read_volatile(&w.memo_n) };
    if n >= MEMO_WORDS as u64 || off >= 1 << 15 || value >= 1 << 48 {
        w.memo_over = 1;
        return;
    }
    unsafe { (*e).words[(n as usize) & (MEMO_WORDS - 1)] = (frame << 63) | (off << 48) | value };
    w.memo_n = n + 1;
    if off >= w.memo_span {
        w.memo_span = off + 1;
    }
}

/// Gives the claimed entry back: remembering the walk, given `done`
/// (caller, stack pointer, rbp, key) and that its words fit, else empty.
/// Not inlined: the verifier would follow the rest of the program once per
/// way through.
#[inline(never)]
pub(crate) fn memo_release(w: &mut WalkScratch, done: Option<(u64, u64, u64, u64)>) {
    if w.noting == 0 {
        return;
    }
    w.noting = 0;
    let Some(e) = MEMO.get_ptr_mut(w.check_slot as u32) else {
        return;
    };
    unsafe {
        match done {
            Some((caller, sp, bp, key)) if w.memo_over == 0 => {
                (*e).caller = caller;
                (*e).sp = sp;
                (*e).owner = w.host_gen;
                (*e).epoch = w.host_epoch;
                (*e).bp = bp;
                (*e).uses_bp = w.memo_uses_bp;
                (*e).key = key;
                (*e).stop = w.stack.stop as u64;
                (*e).n = w.memo_n;
                (*e).span = w.memo_span;
            }
            _ => {
                (*e).caller = 0;
                (*e).n = 0;
            }
        }
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
        core::ptr::write_volatile(&mut (*e).seq, w.claim_seq + 2);
    }
}

/// Moves the calls a remembered walk counted into the aggregation map.
/// The entry is claimed (its sequence is odd): the tracer, which adds what
/// entries hold to the map's counts, reads again when it finds a claimed
/// entry that holds calls.
#[inline(always)]
fn memo_flush(e: *mut WalkMemo) {
    let (hits, calls, bytes) = unsafe { ((*e).hits, (*e).calls, (*e).bytes) };
    if hits == 0 {
        return;
    }
    let key = unsafe {
        CountKey {
            stack: (*e).key,
            func: (*e).func as u32,
            tid: (*e).tid as u32,
            caller: (*e).caller,
        }
    };
    if !add_to_count(&key, calls, bytes) {
        insert_count(&key, calls, bytes, hits);
    }
    // Counted between the move and the zeroing: a read of the map and
    // then of the entries that a move tore either sees the number change
    // or finds the entry still holding its calls while claimed.
    bump_counter(counter::MEMO_FLUSHES, 1);
    unsafe {
        core::ptr::write_volatile(&mut (*e).hits, 0);
        core::ptr::write_volatile(&mut (*e).calls, 0);
        core::ptr::write_volatile(&mut (*e).bytes, 0);
    }
}
