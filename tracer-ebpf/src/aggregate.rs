//! In-kernel aggregation: the per-function counters (per CPU, with plain
//! adds by the program that owns its CPU and atomic adds by any other) and
//! the counts per aggregation key (`COUNTS`, shared, atomic adds).

use core::intrinsics::{atomic_xadd, AtomicOrdering};

use aya_ebpf::bindings::BPF_NOEXIST;
use tracer_common::{counter, CountKey, CountValue};

use crate::maps::{COUNTERS, COUNTS, THREAD_NAMES};

/// The error `bpf_map_update_elem` returns, negated, for a key that
/// `BPF_NOEXIST` found present.
pub(crate) const EEXIST: i32 = 17;

/// Adds `by` to counter `index` (a `counter::*` index), atomically, in
/// the half of the counters everything but the CPU's owner adds to.
#[inline(always)]
pub(crate) fn bump_counter(index: u32, by: u64) {
    if let Some(p) = COUNTERS.get_ptr_mut(index + counter::N) {
        // Per-CPU, but a uprobe program can be preempted: stay atomic.
        atomic_add(p, by);
    }
}

/// Adds to counter `index`: plainly, in the owner's half, when this
/// program owns the CPU ([`OWNER`](crate::maps::OWNER)), else as
/// [`bump_counter`] does.
#[inline(always)]
fn bump_counter_owned(index: u32, by: u64, owned: bool) {
    if !owned {
        return bump_counter(index, by);
    }
    if let Some(p) = COUNTERS.get_ptr_mut(index) {
        unsafe { core::ptr::write_volatile(p, core::ptr::read_volatile(p) + by) };
    }
}

/// `*p += by` as one atomic instruction.
#[inline(always)]
pub(crate) fn atomic_add(p: *mut u64, by: u64) {
    unsafe {
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, by);
    }
}

/// Counts a call of `func` in the per-function totals and, given its key,
/// in the aggregation map (false when the key has no entry yet), with
/// plain adds when the program owns the CPU ([`OWNER`](crate::maps::OWNER)).
#[inline(always)]
pub(crate) fn count_call(
    func: u32,
    calls: u64,
    bytes: u64,
    key: Option<&CountKey>,
    owned: bool,
) -> bool {
    bump_counter_owned(counter::CALLS + func, calls, owned);
    bump_counter_owned(counter::BYTES + func, bytes, owned);
    key.is_none_or(|k| add_to_count(k, calls, bytes))
}

/// Adds a call to the count of `key`, if it has one (atomically: every
/// CPU adds to the same entry).
#[inline(always)]
pub(crate) fn add_to_count(key: &CountKey, calls: u64, bytes: u64) -> bool {
    match COUNTS.get_ptr_mut(key) {
        Some(v) => {
            atomic_add(unsafe { &raw mut (*v).calls }, calls);
            atomic_add(unsafe { &raw mut (*v).bytes }, bytes);
            true
        }
        None => false,
    }
}

/// Inserts a new aggregation key with its first counts; true when this
/// call created it. `hits` is the number of calls the counts stand for,
/// lost (and counted so) when the map is full.
#[inline(always)]
pub(crate) fn insert_count(key: &CountKey, calls: u64, bytes: u64, hits: u64) -> bool {
    let first = CountValue { calls, bytes };
    let first = &first;
    match COUNTS.insert(key, first, BPF_NOEXIST as u64) {
        Ok(()) => true,
        // Another CPU inserted the key between our lookup and insert.
        Err(e) if e == -EEXIST => {
            if !add_to_count(key, calls, bytes) {
                bump_counter(counter::MAP_FULL, hits);
            }
            false
        }
        Err(_) => {
            bump_counter(counter::MAP_FULL, hits);
            false
        }
    }
}

/// Per-thread mode: the name of a thread with a new key.
#[inline(always)]
pub(crate) fn name_thread(tid: u32) {
    if let Some(comm) = current_comm() {
        if THREAD_NAMES.insert(&tid, &comm, 0).is_err() {
            bump_counter(counter::THREAD_NAMES_FULL, 1);
        }
    }
}

/// The calling thread's name, read into uninitialized memory (the helper
/// writes all of it): a zeroed array would be a call of a byte-by-byte
/// `memset`, which the verifier walks a byte at a time.
#[inline(always)]
pub(crate) fn current_comm() -> Option<[u8; 16]> {
    let mut comm = core::mem::MaybeUninit::<[u8; 16]>::uninit();
    let r = unsafe {
        aya_ebpf::helpers::generated::bpf_get_current_comm(
            comm.as_mut_ptr() as *mut core::ffi::c_void,
            16,
        )
    };
    (r == 0).then(|| unsafe { comm.assume_init() })
}
