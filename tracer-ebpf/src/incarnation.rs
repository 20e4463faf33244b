//! A host process's incarnation: a number no other process had, by
//! process id (`HOST_GENS`), that keeps one process's mappings and
//! remembered walks from another's that reused its id; kept in each
//! thread's mark while no incarnation ends on the host.

use core::intrinsics::AtomicOrdering;

use aya_ebpf::bindings::BPF_NOEXIST;
use tracer_common::{counter, HostMark, HOST_NEXT_ENDS, HOST_NEXT_GEN};

use crate::{
    aggregate::{atomic_add, bump_counter, EEXIST},
    maps::{HOST_GENS, HOST_NEXT},
    place::NO_GEN,
};

/// How many process incarnations ended on the host (`u64::MAX` where it
/// cannot be read: nothing kept by it stands).
#[inline(always)]
pub(crate) fn ends_count() -> u64 {
    HOST_NEXT
        .get_ptr(HOST_NEXT_ENDS)
        .map_or(u64::MAX, |p| unsafe { core::ptr::read_volatile(p) })
}

/// The incarnation of process `tgid`, as its thread's mark (`mark`, may be
/// null) has it where no process's incarnation ended since that thread
/// looked it up, else [`incarnation`] (then kept in the mark). The ends
/// are counted before the lookup, an end after the incarnation is taken
/// out: a thread that reads the count before an end looks up at its next
/// call.
#[inline(always)]
pub(crate) fn incarnation_of(tgid: u32, mark: *mut HostMark) -> u64 {
    let ends = ends_count();
    let m = unsafe { mark.as_mut() };
    if let Some(m) = &m {
        if m.gen != 0 && m.ends == ends && ends != u64::MAX {
            return m.gen;
        }
    }
    core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
    let gen = incarnation(tgid);
    if let Some(m) = m {
        // (NO_GEN is looked up again: the table may have room later.)
        m.gen = if gen == NO_GEN { 0 } else { gen };
        m.ends = ends;
    }
    gen
}

/// The incarnation of process `tgid` (a number no other process had): its
/// entry, made at its first walk (an exec or its end removes it). Where the
/// table is full, [`NO_GEN`]: its walks look every mapping up afresh.
#[inline(always)]
fn incarnation(tgid: u32) -> u64 {
    if let Some(g) = HOST_GENS.get_ptr(&tgid) {
        return unsafe { *g };
    }
    let Some(gen) = next_number(HOST_NEXT_GEN) else {
        bump_counter(counter::HOST_NO_GEN, 1);
        return NO_GEN;
    };
    match HOST_GENS.insert(&tgid, &gen, BPF_NOEXIST as u64) {
        Ok(()) => gen,
        Err(e) if e == -EEXIST => HOST_GENS.get_ptr(&tgid).map_or(NO_GEN, |g| unsafe { *g }),
        Err(_) => {
            bump_counter(counter::HOST_NO_GEN, 1);
            NO_GEN
        }
    }
}

/// The next number of counter `slot` of `HOST_NEXT` (from 1), never given
/// twice: taken by compare-and-exchange (the BPF target here has no
/// fetch-and-add that returns the old value). `None` when other programs
/// took every number tried meanwhile.
#[inline(always)]
pub(crate) fn next_number(slot: u32) -> Option<u64> {
    let next = HOST_NEXT.get_ptr_mut(slot)?;
    let mut tries = 0;
    while tries < 8 {
        let seen = unsafe { core::ptr::read_volatile(next) };
        let (_, won) = unsafe {
            core::intrinsics::atomic_cxchg::<
                u64,
                { AtomicOrdering::Relaxed },
                { AtomicOrdering::Relaxed },
            >(next, seen, seen + 1)
        };
        if won {
            return Some(seen + 1);
        }
        tries += 1;
    }
    None
}

/// One more process incarnation ended (taken out of `HOST_GENS`, and out
/// of a tree scope at a process's end, just before): every thread's mark
/// looks both up again.
#[inline(always)]
pub(crate) fn end_counted() {
    if let Some(p) = HOST_NEXT.get_ptr_mut(HOST_NEXT_ENDS) {
        atomic_add(p, 1);
    }
}
