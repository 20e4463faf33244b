//! The nesting check: a call the allocator makes itself (from inside a
//! probed function's body) or a tail call from a function just counted is
//! not counted again.

use tracer_common::{BodyRange, EntryMark, WalkScratch, MARK_SLOTS, MAX_BODY_RANGES};

use crate::{
    hidden::hidden_return,
    maps::{CPU_MARK, MARKS, PROCESS},
};

/// Is `addr` inside one of the probed allocator functions? Then this call
/// is the allocator calling itself and was counted by the outer call.
#[inline(always)]
pub(crate) fn in_allocator_body(addr: u64) -> bool {
    let Some(p) = PROCESS.get_ptr(0) else {
        return false;
    };
    in_ranges(
        unsafe { &(*p).bodies },
        unsafe { (*p).n_bodies } as usize,
        addr,
    )
}

/// Is `addr` in one of the first `n` of `ranges` (sorted, not
/// overlapping)? The last range starting at or below `addr` is the only
/// candidate, found in six halvings of the 64 slots without a branch:
/// each halving's choice is arithmetic (`below`), so the verifier walks
/// one path through the search, not one per outcome of each comparison.
#[inline(always)]
pub(crate) fn in_ranges(ranges: &[BodyRange; MAX_BODY_RANGES], n: usize, addr: u64) -> bool {
    const _: () = assert!(MAX_BODY_RANGES == 64);
    let n = n as u64;
    // Slots `base` and below start at or below `addr`, or `base` is 0.
    let mut base = 0u64;
    let mut half = (MAX_BODY_RANGES / 2) as u64;
    while half > 0 {
        let i = (base + half) & (MAX_BODY_RANGES as u64 - 1);
        let start = unsafe { core::ptr::read_volatile(&ranges[i as usize].start) };
        base += half * (below(start, addr.wrapping_add(1)) & below(i, n));
        half /= 2;
    }
    let r = ranges[(base & (MAX_BODY_RANGES as u64 - 1)) as usize];
    base < n && addr >= r.start && addr < r.end
}

/// 1 when `a < b`, else 0, for values below 2^63 (addresses in user
/// space, file offsets, slot numbers), computed without a branch: the
/// difference goes through the stack, or the compiler would turn the
/// shift back into a comparison and a branch.
#[inline(always)]
fn below(a: u64, b: u64) -> u64 {
    let d = a.wrapping_sub(b);
    unsafe { core::ptr::read_volatile(&d) >> 63 }
}

/// Is `addr` inside a probed releasing function whose own free is the
/// free it was called for (CPython's `PyObject_Free`)? Then this free was
/// counted by that call.
#[inline(always)]
pub(crate) fn in_free_body(addr: u64) -> bool {
    let Some(p) = PROCESS.get_ptr(0) else {
        return false;
    };
    in_ranges(
        unsafe { &(*p).free_bodies },
        unsafe { (*p).n_free_bodies } as usize,
        addr,
    )
}

/// Is this call a tail call from another allocator function that was
/// just counted? It arrives with the same stack pointer and return address
/// (glibc's reallocarray -> realloc -> malloc; operator delete -> free).
/// The mark stays, so a chain of tail calls is counted once; the next
/// counted call replaces it. A return probe on the function just counted
/// (another tool's, or another trace's) puts the kernel's trampoline in
/// the return address's place after the count: the address it hides is
/// the one compared then. The thread's mark is in its slot of
/// [`MARKS`] unless another thread took the slot since: then in its CPU's
/// last mark, unless another thread counted a call there since too.
#[inline(always)]
pub(crate) fn tail_called(scratch: Option<*mut WalkScratch>, sp: u64, ret: u64, ip: u64) -> bool {
    let Some(w) = scratch else {
        return false;
    };
    let me = unsafe { core::ptr::read_volatile(&(*w).me) };
    let slot = ((me >> 14).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52) as u32 & (MARK_SLOTS - 1);
    let (Some(mine), Some(cpu)) = (MARKS.get_ptr_mut(slot), CPU_MARK.get_ptr_mut(0)) else {
        return false;
    };
    let last = unsafe {
        if (*mine).me == me {
            *mine
        } else {
            *cpu
        }
    };
    if last.me == me
        && last.sp == sp
        && last.ip != ip
        && (last.ret == ret || (last.ret != 0 && hidden_return(sp, ret) == last.ret))
    {
        return true;
    }
    let mark = EntryMark { me, ip, sp, ret };
    unsafe {
        *mine = mark;
        *cpu = mark;
    }
    false
}
