//! The tracer's half of every walk the BPF side could not finish: a thread
//! that wakes for each [`MissEvent`], finishes the walk with the
//! [`Unwinder`], counts the call under its whole stack and adds the rules
//! the walk needed to the kernel's map at once, so that the next walk
//! through the same code stays in the kernel.
//!
//! It is started after the BPF object is loaded and before any probe is
//! attached, with every object's call-frame information already loaded:
//! the first walks are finished within microseconds, before the ring of
//! stack copies can fill.

use std::{
    os::fd::{AsRawFd, FromRawFd},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard,
    },
    thread::JoinHandle,
};

use anyhow::Result;
use aya::{
    maps::{HashMap as BpfHashMap, MapData, RingBuf},
    Ebpf,
};
use tracer_common::{
    maps, rule_slot, CachedRule, CountKey, MissEvent, PyNotice, MISS_HEADER_BYTES,
};

use super::{Rule, Unwinder};
use crate::{collect::UserWalks, tracee::AddressSpace};

/// What the service has done, shared with the session.
pub struct Walks {
    /// Given back when the service stops (see [`crate::probes::pool::ring`]).
    ring: Option<RingBuf<MapData>>,
    rules: BpfHashMap<MapData, u64, Rule>,
    full: aya::maps::Array<MapData, u64>,
    cache: aya::maps::Array<MapData, CachedRule>,
    /// `cache`'s descriptor, for updates in batches.
    cache_fd: std::os::fd::RawFd,
    /// `rules`'s descriptor, for deletes in batches.
    rules_fd: std::os::fd::RawFd,
    /// Which cache slots are taken.
    cached: std::collections::HashSet<u32>,
    /// A batch of rules went into the kernel's map only in part: the
    /// map holds rules the unwinder does not (see [`Walks::take_rules_out`]).
    untracked: bool,
    pub unwinder: Unwinder,
    space: Arc<Mutex<AddressSpace>>,
    /// The calls counted under finished walks.
    pub counted: UserWalks,
    /// Live mode: (stack id, stack key) of finished walks, for the tracker.
    remaps: Vec<(u64, u64)>,
    live: bool,
    /// Rules the kernel map had no room for.
    pub rules_full: u64,
    /// A Python process's code objects, named while they live.
    pub python: Option<crate::python::Names>,
    /// One record's room, kept from the first walk on: a fresh one is
    /// a large zeroed allocation that the allocator hands back to the
    /// kernel and takes again (a madvise and page faults a batch).
    ev: Option<Box<MissEvent>>,
}

impl Walks {
    /// Finishes every walk waiting in the ring.
    pub fn finish_all(&mut self) {
        let mut new_rules: Vec<(u64, Rule)> = Vec::new();
        let space = self.space.clone();
        let mut space = space.lock().unwrap();
        let Some(ring) = self.ring.as_mut() else {
            return;
        };
        // One record's room for every walk: zeroed once, not once a walk
        // (a walk reads no byte past what its record copied).
        let mut kept = self.ev.take();
        while let Some(item) = ring.next() {
            let ev = &mut **kept.get_or_insert_with(zeroed_miss);
            if !read_miss_into(ev, &item) {
                if let (Some(names), Some(snap)) =
                    (self.python.as_mut(), crate::python::snap::parse(&item))
                {
                    names.copied(&snap, &mut std::collections::HashMap::new());
                } else if let (Some(names), Some(words)) =
                    (self.python.as_mut(), read_notice(&item))
                {
                    names.learn(&words);
                }
                continue;
            }
            self.unwinder.stats.record_bytes += item.len() as u64;
            drop(item);
            let done = self.unwinder.finish(ev, &mut space, &mut new_rules);
            if let Some(names) = self.python.as_mut() {
                names.learn(crate::python::split(&done.frames).1);
            }
            let key = CountKey {
                stack: done.key,
                func: ev.func,
                tid: ev.tid,
                caller: ev.caller,
            };
            if self.live {
                self.remaps.push((ev.stack_id, done.key));
            }
            self.counted
                .add(key, done.frames, done.stop, ev.calls, ev.bytes);
            for (ra, rule) in new_rules.drain(..) {
                let slot = rule_slot(ra);
                if self.cached.insert(slot) {
                    // A map update is a plain copy that a walk running on
                    // the other CPU can see half done: the rule goes in
                    // under no address first, then the address (the walk
                    // reads the address first).
                    let _ = self.cache.set(slot, CachedRule { ra: 0, rule }, 0);
                    let _ = self.cache.set(slot, CachedRule { ra, rule }, 0);
                }
                if self.rules.insert(ra, rule, 0).is_err() {
                    if self.rules_full == 0 {
                        log::warn!("the kernel's map of unwind rules is full: stacks through new code end there from now on (raise --unwind-rules-size)");
                        let _ = self.full.set(0, 1, 0);
                    }
                    self.rules_full += 1;
                }
            }
        }
        self.ev = kept;
    }

    /// Takes every rule it put in the kernel's map out, by key (a walk
    /// over the map's buckets costs the same, full or not): the rules
    /// the unwinder handed out, unless the map refused some (full) or
    /// holds some it forgot (`untracked`). True when the map is left
    /// empty.
    fn take_rules_out(&mut self) -> bool {
        if self.untracked || self.rules_full != 0 {
            return false;
        }
        let given: Vec<u64> = self.unwinder.rule_addresses().collect();
        crate::probes::pool::delete_batch(self.rules_fd, &given)
    }

    /// Live mode: the walks finished since the last call, as (stack id,
    /// stack key).
    pub fn take_remaps(&mut self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.remaps)
    }
}

/// A [`MissEvent`] of zeroes, on the heap (it holds the largest copy).
pub(crate) fn zeroed_miss() -> Box<MissEvent> {
    // SAFETY: MissEvent is plain data (integers and arrays of them): every
    // bit pattern is valid, zeroes included.
    unsafe { Box::<MissEvent>::new_zeroed().assume_init() }
}

/// A [`MissEvent`] out of its ring record (read unaligned), whatever its
/// size of copy ([`MISS_COPY_SIZES`]), into `ev`, which may hold an
/// earlier walk: its header is
/// overwritten, and of its copy only the bytes this record copied are
/// read afterwards (`copied`). False for a record too short to hold the
/// header (`ev` then unchanged).
pub(crate) fn read_miss_into(ev: &mut MissEvent, bytes: &[u8]) -> bool {
    if bytes.len() < MISS_HEADER_BYTES {
        return false;
    }
    let len = bytes.len().min(std::mem::size_of::<MissEvent>());
    // SAFETY: MissEvent is plain data: every bit pattern is valid, and
    // `len` bytes fit in both.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), ev as *mut MissEvent as *mut u8, len);
    }
    // What the record holds of the copy, whatever the header says.
    ev.copied = ev.copied.min((len - MISS_HEADER_BYTES) as u32);
    reveal_hidden(ev);
    true
}

/// Puts in `ev.copy` the return addresses that return probes hid where it
/// holds the kernel's trampoline in their place (`MissEvent::hidden`).
fn reveal_hidden(ev: &mut MissEvent) {
    if ev.trampoline == 0 {
        return;
    }
    for &[slot, real] in &ev.hidden {
        let Some(at) = ev.copy_offset(slot) else {
            continue;
        };
        if slot == 0 {
            continue;
        }
        let word = &mut ev.copy[at..at + 8];
        if u64::from_ne_bytes(word.try_into().unwrap()) == ev.trampoline {
            word.copy_from_slice(&real.to_ne_bytes());
        }
    }
}

/// The Python words of a [`PyNotice`] record (shorter than any miss).
fn read_notice(bytes: &[u8]) -> Option<Vec<u64>> {
    if bytes.len() < std::mem::size_of::<PyNotice>() {
        return None;
    }
    // SAFETY: PyNotice is plain data; the record holds one whole.
    let ev: PyNotice = unsafe { std::ptr::read_unaligned(bytes.as_ptr() as *const PyNotice) };
    let n = (ev.n as usize).min(ev.words.len());
    Some(ev.words[..n].to_vec())
}

/// Runs the calling thread at the lowest real-time priority: a walk waiting
/// in the ring holds a stack copy the ring needs back, and the target runs
/// on meanwhile, so the thread must not wait behind the target (or behind
/// anything else on a busy machine) to be scheduled. It sleeps in `poll`
/// whenever no walk waits, and walks stop coming once the rules are in.
pub(crate) fn realtime_priority() {
    let param = libc::sched_param { sched_priority: 1 };
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
        log::debug!(
            "unwind: no real-time priority for the unwind thread: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The thread and what it shares with the session. Dropping it stops the
/// thread.
pub struct UnwindService {
    walks: Arc<Mutex<Walks>>,
    stop: Arc<AtomicBool>,
    /// Wakes the thread to stop.
    wake: Arc<std::os::fd::OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl UnwindService {
    /// Takes handles on the rule map and the ring of walks of `ebpf` (loaded, not
    /// yet attached), loads the call-frame information of every object the
    /// target maps, and starts the thread.
    pub fn start(
        ebpf: &mut Ebpf,
        pid: u32,
        space: Arc<Mutex<AddressSpace>>,
        live: bool,
        max_frames: u32,
        python: Option<crate::python::Names>,
    ) -> Result<UnwindService> {
        let ring = crate::probes::pool::ring(ebpf, maps::UNWIND_MISSES)?;
        let rules = crate::probes::pool::map_copy(ebpf, maps::UNWIND_RULES)?;
        let rules_fd = crate::probes::pool::map_fd(&rules)?;
        let capacity = crate::probes::pool::hash_capacity(&rules)? as usize;
        let rules = BpfHashMap::try_from(rules)?;
        let full =
            aya::maps::Array::try_from(crate::probes::pool::map_copy(ebpf, maps::UNWIND_FULL)?)?;
        let cache = crate::probes::pool::map_copy(ebpf, maps::RULE_CACHE)?;
        let cache_fd = crate::probes::pool::map_fd(&cache)?;
        let cache = aya::maps::Array::try_from(cache)?;
        let mut unwinder = Unwinder::new(pid);
        unwinder.max_frames = max_frames as usize;
        unwinder.preload(&space.lock().unwrap());
        // Before the first call: the rules other processes of the run
        // learned for the same code, in the map and its cache at once (no
        // walk runs yet: the cache needs no two-step update), in at most
        // half the map: the rest is for what this process meets first.
        let seeding = std::time::Instant::now();
        let seeded = unwinder.seed(&space.lock().unwrap(), capacity / 2);
        let mut cached = std::collections::HashSet::new();
        let mut untracked = false;
        if !seeded.is_empty() {
            let (ras, kept): (Vec<u64>, Vec<Rule>) = seeded.iter().copied().unzip();
            if let Err(e) = crate::probes::pool::update_batch(rules_fd, &ras, &kept) {
                // Those the kernel lacks are learned again, as without
                // (the first of them may be in).
                log::debug!("unwind: {} rules learned before not given: {e}", ras.len());
                unwinder.forget(&ras);
                untracked = true;
            }
            let (slots, slotted): (Vec<u32>, Vec<CachedRule>) = seeded
                .iter()
                .filter(|(ra, _)| cached.insert(rule_slot(*ra)))
                .map(|&(ra, rule)| (rule_slot(ra), CachedRule { ra, rule }))
                .unzip();
            if let Err(e) = crate::probes::pool::update_batch(cache_fd, &slots, &slotted) {
                log::debug!("unwind: the rule cache not filled: {e}");
                cached.clear();
            }
        }
        log::debug!(
            "unwind: pid {pid} given {} rules learned before ({:.2} ms)",
            seeded.len(),
            seeding.elapsed().as_secs_f64() * 1e3
        );
        let fd = ring.as_raw_fd();
        // Written when the service is dropped: the thread wakes at once.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if wake < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: a new descriptor, owned from here on.
        let wake = Arc::new(unsafe { std::os::fd::OwnedFd::from_raw_fd(wake) });
        let walks = Arc::new(Mutex::new(Walks {
            ring: Some(ring),
            rules,
            full,
            cache,
            cache_fd,
            rules_fd,
            cached,
            untracked,
            unwinder,
            space,
            counted: UserWalks::default(),
            remaps: Vec::new(),
            live,
            rules_full: 0,
            python,
            ev: None,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (walks, stop, woken) = (walks.clone(), stop.clone(), wake.clone());
            std::thread::Builder::new()
                .name("mtrace-unwind".into())
                .spawn(move || {
                    realtime_priority();
                    // `fd` stays open: `walks` owns the ring.
                    while !stop.load(Ordering::Relaxed) {
                        let mut pfd = [
                            libc::pollfd {
                                fd,
                                events: libc::POLLIN,
                                revents: 0,
                            },
                            libc::pollfd {
                                fd: woken.as_raw_fd(),
                                events: libc::POLLIN,
                                revents: 0,
                            },
                        ];
                        let ready = unsafe { libc::poll(pfd.as_mut_ptr(), 2, 50) };
                        if ready > 0 && pfd[0].revents != 0 {
                            walks.lock().unwrap().finish_all();
                        }
                    }
                })?
        };
        Ok(UnwindService {
            walks,
            stop,
            wake,
            thread: Some(thread),
        })
    }

    /// The walks finished so far, after finishing those still waiting.
    pub fn walks(&self) -> MutexGuard<'_, Walks> {
        let mut w = self.walks.lock().unwrap();
        w.finish_all();
        w
    }
}

impl UnwindService {
    /// Stops the service; true when the kernel's map of rules is left
    /// empty (every rule it put in taken out by key).
    pub fn stop(mut self) -> bool {
        self.shut_down()
    }

    fn shut_down(&mut self) -> bool {
        self.stop.store(true, Ordering::Relaxed);
        let one = 1u64;
        // SAFETY: eight bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&raw const one).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // The cache slots it filled go free: the object may serve another
        // process, whose code may lie at the same addresses (the object's
        // other maps are emptied whole; this one is large and mostly
        // free).
        let mut walks = self.walks.lock().unwrap();
        let walks = &mut *walks;
        let slots: Vec<u32> = walks.cached.drain().collect();
        let free = vec![CachedRule::default(); slots.len()];
        let _ = crate::probes::pool::update_batch(walks.cache_fd, &slots, &free);
        if let Some(ring) = walks.ring.take() {
            crate::probes::pool::ring_back(ring);
        }
        walks.take_rules_out()
    }
}

impl Drop for UnwindService {
    fn drop(&mut self) {
        self.shut_down();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A return address a return probe hid is put back wherever the copy
    /// holds the slot: in its first part, or in the tail of a stack deeper
    /// than the copy; a slot between the two is not in the copy.
    #[test]
    fn hidden_returns_are_revealed_in_both_parts_of_a_copy() {
        let mut ev = zeroed_miss();
        let (tramp, sp) = (0x7fff_f000u64, 0x7000_0008u64);
        ev.sp = sp;
        ev.trampoline = tramp;
        ev.copied = tracer_common::STACK_COPY as u32;
        ev.head = (tracer_common::STACK_COPY - tracer_common::STACK_COPY_TAIL) as u32;
        ev.tail_at = 0x7100_0000;
        let head_slot = 0x7000_0100u64;
        let tail_slot = ev.tail_at + 0x40;
        let between = 0x7080_0000u64;
        let tail_off = ev.head as usize + 0x40;
        for at in [0x100, tail_off] {
            ev.copy[at..at + 8].copy_from_slice(&tramp.to_ne_bytes());
        }
        ev.hidden[0] = [head_slot, 0x1111];
        ev.hidden[1] = [tail_slot, 0x2222];
        ev.hidden[2] = [between, 0x3333];
        assert_eq!(ev.copy_offset(between), None);
        reveal_hidden(&mut ev);
        let at = |o: usize| u64::from_ne_bytes(ev.copy[o..o + 8].try_into().unwrap());
        assert_eq!((at(0x100), at(tail_off)), (0x1111, 0x2222));
    }
}
