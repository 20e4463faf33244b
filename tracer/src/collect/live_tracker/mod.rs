//! Live mode: what the allocation and free events say about the heap.
//!
//! The BPF programs send one event per allocating call that returned a
//! block and one per `free`, in the order they happened; they keep no
//! table of blocks (a shared map updated twice per block cost the target
//! more than everything else mtrace does). [`LiveTracker`] keeps the table
//! of outstanding blocks, bounded by `--live-map-size`, and folds the
//! events into per-stack statistics: outstanding blocks, sizes and
//! lifetimes (hdrhistogram), temporary allocations, each stack's own
//! maximum of live bytes, and the global peak with every stack's share of
//! it (what DHAT calls t-gmax).

use std::collections::HashMap;

use foldhash::fast::RandomState;
use hdrhistogram::Histogram;
use tracer_common::{
    is_miss_stack_id, AllocEvent, CountKey, FreeEvent, LostAlloc, LostFree, EVENT_ALLOC, EVENT_FREE,
};

use crate::profile::{LiveStats, Percentiles};

/// Per-stack state.
pub struct KeyStats {
    pub allocations: u64,
    pub allocated_bytes: u64,
    pub frees: u64,
    pub freed_bytes: u64,
    pub live_blocks: u64,
    pub live_bytes: u64,
    pub max_live_bytes: u64,
    pub live_bytes_at_peak: u64,
    pub temporaries: u64,
    sizes: Histogram<u64>,
    lifetimes: Histogram<u64>,
    /// Exact maxima beside the histograms (which only keep two digits: a
    /// 16384-byte block reads 16511 there).
    max_size: u64,
    max_lifetime: u64,
}

impl KeyStats {
    fn new() -> Self {
        KeyStats {
            allocations: 0,
            allocated_bytes: 0,
            frees: 0,
            freed_bytes: 0,
            live_blocks: 0,
            live_bytes: 0,
            max_live_bytes: 0,
            live_bytes_at_peak: 0,
            temporaries: 0,
            // Two significant digits: percentiles within 1%, a few KiB each.
            sizes: Histogram::new(2).expect("valid sigfig"),
            lifetimes: Histogram::new(2).expect("valid sigfig"),
            max_size: 0,
            max_lifetime: 0,
        }
    }
}

/// An event as the BPF programs sent it.
enum Event {
    Alloc(AllocEvent),
    Free(FreeEvent),
    /// A free kept in the kernel's queue of lost frees.
    Kept(LostFree),
}

impl Event {
    fn ts(&self) -> u64 {
        match self {
            Event::Alloc(a) => a.ts,
            Event::Free(f) => f.ts,
            Event::Kept(k) => k.ts,
        }
    }
}

/// One outstanding block.
#[derive(Clone, Copy)]
struct Block {
    /// Index into `LiveTracker::stacks`.
    stack: u32,
    size: u64,
    /// When it was allocated (ns, CLOCK_MONOTONIC).
    ts: u64,
}

pub struct LiveTracker {
    /// Per-stack statistics, in order of first allocation.
    stacks: Vec<(CountKey, KeyStats)>,
    index: HashMap<CountKey, u32, RandomState>,
    /// Outstanding blocks by address. Two lookups per block at up to a few
    /// million blocks a second: a fast hash (the addresses are the
    /// target's, not an adversary's).
    blocks: HashMap<u64, Block, RandomState>,
    /// Most blocks tracked at once (`--live-map-size`).
    capacity: usize,
    pub temporary_ns: u64,
    pub live_bytes: u64,
    pub peak_bytes: u64,
    /// Monotonic time (ns) of the peak.
    pub peak_ts: u64,
    /// The peak was raised and per-stack shares not yet taken.
    peak_pending: bool,
    /// Allocations not tracked because the table was full.
    pub untracked: u64,
    /// Frees of blocks not seen allocated (allocated before attach, or
    /// untracked).
    pub frees_unknown: u64,
    /// Blocks handed out again while still tracked: their free was missed
    /// (its event lost); the old block is closed first.
    pub stale: u64,
    /// Events that did not parse (never expected).
    pub bad_events: u64,
    /// Events drained but not yet applied (see [`Self::flush`]).
    waiting: Vec<Event>,
    /// Stack ids of calls whose walk the tracer finished -> their stack key.
    remap: HashMap<u64, u64, RandomState>,
    /// Stack ids of calls applied before their walk was finished -> the
    /// entry of `stacks` they went to (its own: an id is one call's) and
    /// their block. Moved to their stack when its key comes.
    pending: HashMap<u64, (u32, u64), RandomState>,
    /// Entries of `stacks` emptied by such a move, for new stacks to take.
    free_slots: Vec<u32>,
}

impl LiveTracker {
    pub fn new(temporary_ns: u64, capacity: usize) -> Self {
        LiveTracker {
            stacks: Vec::new(),
            index: HashMap::default(),
            blocks: HashMap::default(),
            capacity,
            temporary_ns,
            live_bytes: 0,
            peak_bytes: 0,
            peak_ts: 0,
            peak_pending: false,
            untracked: 0,
            frees_unknown: 0,
            stale: 0,
            bad_events: 0,
            waiting: Vec::new(),
            remap: HashMap::default(),
            pending: HashMap::default(),
            free_slots: Vec::new(),
        }
    }

    /// The call with stack id `id` (a walk the tracer finished) has its
    /// stack under `key`; its allocation event, still to come, says `id`.
    /// When that event was applied already (the walk finished late), its
    /// block and figures move to the stack now.
    pub fn remap_stack(&mut self, id: u64, key: u64) {
        match self.pending.remove(&id) {
            Some((i, ptr)) => self.move_pending(i, ptr, key),
            None => {
                self.remap.insert(id, key);
            }
        }
    }

    /// Entry `i`, one call's under its stack id, joins stack `stack`.
    fn move_pending(&mut self, i: u32, ptr: u64, stack: u64) {
        let old = self.stacks[i as usize].0;
        let key = CountKey { stack, ..old };
        self.index.remove(&old);
        let Some(&j) = self.index.get(&key) else {
            // The stack's first entry: renamed in place.
            self.stacks[i as usize].0 = key;
            self.index.insert(key, i);
            return;
        };
        if let Some(b) = self.blocks.get_mut(&ptr).filter(|b| b.stack == i) {
            b.stack = j;
        }
        let from = std::mem::replace(&mut self.stacks[i as usize].1, KeyStats::new());
        let to = &mut self.stacks[j as usize].1;
        to.allocations += from.allocations;
        to.allocated_bytes += from.allocated_bytes;
        to.frees += from.frees;
        to.freed_bytes += from.freed_bytes;
        to.live_blocks += from.live_blocks;
        to.live_bytes += from.live_bytes;
        // Its maximum had the block at most once; the sum bounds it.
        to.max_live_bytes = to.max_live_bytes.max(to.live_bytes);
        to.live_bytes_at_peak += from.live_bytes_at_peak;
        to.temporaries += from.temporaries;
        let _ = to.sizes.add(&from.sizes);
        let _ = to.lifetimes.add(&from.lifetimes);
        to.max_size = to.max_size.max(from.max_size);
        to.max_lifetime = to.max_lifetime.max(from.max_lifetime);
        self.free_slots.push(i);
    }

    /// Takes one raw ring-buffer record; it is applied by [`Self::flush`].
    pub fn on_bytes(&mut self, bytes: &[u8]) {
        let kind = bytes
            .get(..4)
            .map(|b| u32::from_ne_bytes(b.try_into().unwrap()));
        let ev = match kind {
            Some(EVENT_ALLOC) if bytes.len() >= std::mem::size_of::<AllocEvent>() => {
                // SAFETY: plain old data, and the record is at least its size.
                Event::Alloc(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
            }
            Some(EVENT_FREE) if bytes.len() >= std::mem::size_of::<FreeEvent>() => {
                // SAFETY: as above.
                Event::Free(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
            }
            _ => {
                self.bad_events += 1;
                return;
            }
        };
        self.waiting.push(ev);
    }

    /// Applies the events taken so far in time-stamp order: all of them
    /// (`upto` None, once no more can come), or those stamped no later than
    /// `upto`, a time read before the rings were drained.
    ///
    /// Each CPU has its own ring, so events arrive out of order between
    /// CPUs. Events that must be in order (an allocation, the free of that
    /// block, its next allocation) are: the later one is stamped after the
    /// earlier one was committed. So when an event stamped by `upto` is
    /// here, every event it depends on was committed before `upto`, and
    /// was drained with it. Later events wait for the next drain.
    pub fn flush(&mut self, upto: Option<u64>) {
        // Stable: events of one ring keep their order on equal stamps.
        self.waiting.sort_by_key(Event::ts);
        let n = match upto {
            Some(t) => self.waiting.partition_point(|e| e.ts() <= t),
            None => self.waiting.len(),
        };
        let mut waiting = std::mem::take(&mut self.waiting);
        for ev in waiting.drain(..n) {
            match ev {
                Event::Alloc(a) => self.on_alloc(&a),
                Event::Free(f) => self.on_free(&f),
                Event::Kept(kept) => self.on_kept_free(&kept),
            }
        }
        self.waiting = waiting;
    }

    pub fn on_alloc(&mut self, ev: &AllocEvent) {
        let mut key = ev.key;
        let mut unwalked = false;
        if is_miss_stack_id(key.stack) {
            match self.remap.remove(&key.stack) {
                Some(k) => key.stack = k,
                None => unwalked = true,
            }
        }
        let ev = &AllocEvent { key, ..*ev };
        if ev.old_ptr != 0 {
            // A resize released its old block: only if that block is still
            // the one that existed when the call began. Not finding it is
            // no news (a block from before attach, or one the allocator's
            // own free call already released, as glibc's realloc(p, 0)
            // does).
            if let Some(b) = self.blocks.get(&ev.old_ptr) {
                if b.ts <= ev.entry_ts {
                    self.release(ev.old_ptr, ev.ts);
                }
            }
        }
        if ev.ptr == 0 {
            return;
        }
        if self.blocks.contains_key(&ev.ptr) {
            self.stale += 1;
            self.release(ev.ptr, ev.ts);
        }
        if self.blocks.len() >= self.capacity {
            self.untracked += 1;
            return;
        }
        let stack = match self.index.get(&ev.key) {
            Some(&i) => i,
            None => {
                let i = match self.free_slots.pop() {
                    Some(i) => {
                        self.stacks[i as usize].0 = ev.key;
                        i
                    }
                    None => {
                        self.stacks.push((ev.key, KeyStats::new()));
                        self.stacks.len() as u32 - 1
                    }
                };
                self.index.insert(ev.key, i);
                i
            }
        };
        if unwalked {
            self.pending.insert(ev.key.stack, (stack, ev.ptr));
        }
        self.blocks.insert(
            ev.ptr,
            Block {
                stack,
                size: ev.size,
                ts: ev.ts,
            },
        );
        let st = &mut self.stacks[stack as usize].1;
        st.allocations += 1;
        st.allocated_bytes += ev.size;
        st.live_blocks += 1;
        st.live_bytes += ev.size;
        st.max_live_bytes = st.max_live_bytes.max(st.live_bytes);
        record(&mut st.sizes, ev.size);
        st.max_size = st.max_size.max(ev.size);
        self.live_bytes += ev.size;
        if self.live_bytes > self.peak_bytes {
            self.peak_bytes = self.live_bytes;
            self.peak_ts = ev.ts;
            self.peak_pending = true;
        }
    }

    /// A free the ring had no room for, kept in the kernel's map of lost
    /// frees: applied in its time order, as its event would have been.
    pub fn on_lost_free(&mut self, kept: LostFree) {
        self.waiting.push(Event::Kept(kept));
    }

    /// A block whose allocation event the ring had no room for, kept in
    /// the kernel's map of lost allocations: applied in its time order, as
    /// its event would have been.
    pub fn on_lost_alloc(&mut self, kept: LostAlloc) {
        self.waiting.push(Event::Alloc(AllocEvent {
            kind: EVENT_ALLOC,
            _pad: 0,
            ts: kept.ts,
            ptr: kept.ptr,
            size: kept.size,
            key: kept.key,
            old_ptr: 0,
            entry_ts: 0,
        }));
    }

    fn on_kept_free(&mut self, kept: &LostFree) {
        match self.blocks.get(&kept.ptr) {
            Some(b) if b.ts <= kept.born_by => {
                self.release(kept.ptr, kept.ts);
            }
            // A resize's old block that is not (or no longer) the one the
            // call released is no news; a free of an unknown block is.
            Some(_) => {}
            None if kept.born_by == kept.ts => self.frees_unknown += 1,
            None => {}
        }
    }

    pub fn on_free(&mut self, ev: &FreeEvent) {
        if !self.release(ev.ptr, ev.ts) {
            self.frees_unknown += 1;
        }
    }

    /// Closes the block at `ptr`, freed at `ts`; false if there is none.
    fn release(&mut self, ptr: u64, ts: u64) -> bool {
        let Some(block) = self.blocks.remove(&ptr) else {
            return false;
        };
        // Leaving a peak: record every stack's share of it, once.
        if self.peak_pending {
            self.take_peak_shares();
        }
        let st = &mut self.stacks[block.stack as usize].1;
        st.frees += 1;
        st.freed_bytes += block.size;
        st.live_blocks -= 1;
        st.live_bytes -= block.size;
        let lifetime = ts.saturating_sub(block.ts);
        record(&mut st.lifetimes, lifetime);
        st.max_lifetime = st.max_lifetime.max(lifetime);
        if lifetime < self.temporary_ns {
            st.temporaries += 1;
        }
        self.live_bytes -= block.size;
        true
    }

    fn take_peak_shares(&mut self) {
        for (_, st) in &mut self.stacks {
            st.live_bytes_at_peak = st.live_bytes;
        }
        self.peak_pending = false;
    }

    /// Call once no more events will come.
    pub fn finish(&mut self) {
        if self.peak_pending {
            self.take_peak_shares();
        }
    }

    /// Most blocks tracked at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Every stack that allocated a tracked block.
    pub fn stacks(&self) -> impl Iterator<Item = &(CountKey, KeyStats)> {
        self.stacks.iter()
    }

    pub fn key_stats(&self, key: &CountKey) -> Option<&KeyStats> {
        self.index.get(key).map(|&i| &self.stacks[i as usize].1)
    }

    /// The outstanding blocks per stack at `now`; those allocated at
    /// least `min_age_ns` before count as old.
    pub fn outstanding(&self, now: u64, min_age_ns: u64) -> HashMap<CountKey, Outstanding> {
        let mut out: HashMap<CountKey, Outstanding> = HashMap::new();
        for block in self.blocks.values() {
            let key = self.stacks[block.stack as usize].0;
            let o = out.entry(key).or_default();
            if o.blocks == 0 || block.ts < o.oldest_ts {
                o.oldest_ts = block.ts;
            }
            o.blocks += 1;
            o.bytes += block.size;
            if now.saturating_sub(block.ts) >= min_age_ns {
                o.old_blocks += 1;
                o.old_bytes += block.size;
            }
        }
        out
    }

    /// The statistics of one stack, with its `outstanding` blocks.
    pub fn stats(
        &self,
        key: &CountKey,
        outstanding: Option<&Outstanding>,
        now: u64,
    ) -> Option<LiveStats> {
        let st = self.key_stats(key);
        if st.is_none() && outstanding.is_none() {
            return None;
        }
        let o = outstanding.copied().unwrap_or_default();
        // The histogram gives the highest value equivalent to a quantile's
        // (within 1%): never above the exact maximum.
        let percentiles = |h: &Histogram<u64>, max: u64| {
            (!h.is_empty()).then(|| Percentiles {
                p50: h.value_at_quantile(0.50).min(max),
                p90: h.value_at_quantile(0.90).min(max),
                p99: h.value_at_quantile(0.99).min(max),
                max,
            })
        };
        Some(LiveStats {
            allocations: st.map_or(0, |s| s.allocations),
            allocated_bytes: st.map_or(0, |s| s.allocated_bytes),
            frees: st.map_or(0, |s| s.frees),
            outstanding: o.blocks,
            outstanding_bytes: o.bytes,
            oldest_age_secs: if o.blocks > 0 {
                now.saturating_sub(o.oldest_ts) as f64 / 1e9
            } else {
                0.0
            },
            old_outstanding: o.old_blocks,
            old_outstanding_bytes: o.old_bytes,
            max_live_bytes: st.map_or(0, |s| s.max_live_bytes),
            live_bytes_at_peak: st.map_or(0, |s| s.live_bytes_at_peak),
            temporaries: st.map_or(0, |s| s.temporaries),
            size: st.and_then(|s| percentiles(&s.sizes, s.max_size)),
            lifetime_ns: st.and_then(|s| percentiles(&s.lifetimes, s.max_lifetime)),
        })
    }
}

/// Records into an auto-resizing histogram (memory grows with the largest
/// value seen, not with a fixed range); values beyond its reach are clamped.
fn record(h: &mut Histogram<u64>, v: u64) {
    if h.record(v).is_err() {
        h.saturating_record(v);
    }
}

/// Outstanding blocks of one stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outstanding {
    pub blocks: u64,
    pub bytes: u64,
    pub oldest_ts: u64,
    /// Blocks (and their bytes) allocated at least `--min-age` ago.
    pub old_blocks: u64,
    pub old_bytes: u64,
}

/// CLOCK_MONOTONIC in ns: the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests;
