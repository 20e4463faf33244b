//! What a trace counted between two readings of it: the `?seconds=N`
//! profiles of `mtrace agent`.
//!
//! Cumulative counts (calls and bytes per stack, per function, the totals
//! and the losses) are the later reading less the earlier one; what is a
//! state rather than a count (the blocks still allocated, live mode's
//! heap) is the later reading's as it is. Go's own `?seconds=` subtracts
//! the in-use values too, which makes them meaningless (golang/go#57765).

use std::{
    collections::HashMap,
    hash::{DefaultHasher, Hash, Hasher},
};

use super::{merge, Counts, LiveStats, Losses, Profile};

/// What [`since`] needs of the earlier reading: all of it but its stacks,
/// and each stack's counts by a 128-bit hash of its key (the function,
/// thread, process and frames that make it one stack). A window under way
/// keeps this rather than the reading: a few megabytes where a reading of
/// a large trace is hundreds.
pub struct Start {
    head: Profile,
    stacks: HashMap<u128, (Counts, Option<LiveStats>)>,
}

impl Start {
    pub fn of(earlier: &Profile) -> Start {
        Start {
            head: without_stacks(earlier),
            stacks: earlier
                .stacks
                .iter()
                .map(|e| (key_hash(e), (e.counts, e.live.clone())))
                .collect(),
        }
    }
}

/// Two SipHashes of the stack's key, under different prefixes: two keys
/// of one trace meet with a chance of about n²/2¹²⁹.
fn key_hash(e: &super::StackEntry) -> u128 {
    let key = merge::key(e);
    let half = |prefix: u8| {
        let mut h = DefaultHasher::new();
        prefix.hash(&mut h);
        key.hash(&mut h);
        h.finish()
    };
    (u128::from(half(0)) << 64) | u128::from(half(1))
}

/// `p` without its stacks (and its timeline): what a copy that selects or
/// scales stacks starts from, without copying the hundreds of megabytes
/// of frames a large trace holds.
pub fn without_stacks(p: &Profile) -> Profile {
    Profile {
        meta: p.meta.clone(),
        stacks: Vec::new(),
        totals: p.totals.clone(),
        losses: p.losses,
        stack_quality: p.stack_quality.clone(),
        live: p.live.clone(),
        snapshot: None,
        timeline: None,
        go_heaps: p.go_heaps.clone(),
        unseen: p.unseen.clone(),
        tests: Vec::new(),
        groups: Vec::new(),
    }
}

/// `later` less `earlier`, two readings of one trace, `later` taken
/// second. A stack that `later` has and `earlier` lacks counts whole; one
/// with no new calls stays only while it still holds live blocks.
pub fn between(earlier: &Profile, later: &Profile) -> Profile {
    since(&Start::of(earlier), later.clone())
}

/// [`between`]: `later` less the reading `start` was taken of, made of
/// `later` itself.
pub fn since(start: &Start, later: Profile) -> Profile {
    let earlier = &start.head;
    let mut out = later;
    out.stacks.retain_mut(|e| {
        if let Some((counts, live)) = start.stacks.get(&key_hash(e)) {
            e.counts.calls = e.counts.calls.saturating_sub(counts.calls);
            e.counts.bytes = e.counts.bytes.saturating_sub(counts.bytes);
            if let (Some(now), Some(then)) = (e.live.as_mut(), live.as_ref()) {
                now.allocations = now.allocations.saturating_sub(then.allocations);
                now.allocated_bytes = now.allocated_bytes.saturating_sub(then.allocated_bytes);
                now.frees = now.frees.saturating_sub(then.frees);
                now.temporaries = now.temporaries.saturating_sub(then.temporaries);
            }
        }
        // A Go heap row's in-use figure is a state, as live mode's blocks.
        e.counts.calls > 0
            || e.live.as_ref().is_some_and(|l| l.outstanding > 0)
            || e.in_use.is_some_and(|u| u.bytes > 0)
    });
    let t = &mut out.totals;
    for (func, counts) in t.per_func.iter_mut() {
        if let Some(old) = earlier.totals.per_func.get(func) {
            counts.calls = counts.calls.saturating_sub(old.calls);
            counts.bytes = counts.bytes.saturating_sub(old.bytes);
        }
    }
    t.per_func.retain(|_, c| c.calls > 0);
    t.allocs.calls = t.allocs.calls.saturating_sub(earlier.totals.allocs.calls);
    t.allocs.bytes = t.allocs.bytes.saturating_sub(earlier.totals.allocs.bytes);
    t.frees = t.frees.saturating_sub(earlier.totals.frees);
    t.nested = t.nested.saturating_sub(earlier.totals.nested);
    out.losses = losses_between(&earlier.losses, &out.losses);
    if let (Some(now), Some(then)) = (out.live.as_mut(), earlier.live.as_ref()) {
        now.tracked_allocations = now
            .tracked_allocations
            .saturating_sub(then.tracked_allocations);
        now.temporaries = now.temporaries.saturating_sub(then.temporaries);
        now.failed = now.failed.saturating_sub(then.failed);
        now.untracked = now.untracked.saturating_sub(then.untracked);
        now.frees_unknown = now.frees_unknown.saturating_sub(then.frees_unknown);
        now.events_lost = now.events_lost.saturating_sub(then.events_lost);
        now.frees_kept = now.frees_kept.saturating_sub(then.frees_kept);
        now.frees_lost = now.frees_lost.saturating_sub(then.frees_lost);
        now.allocs_kept = now.allocs_kept.saturating_sub(then.allocs_kept);
        now.allocs_lost = now.allocs_lost.saturating_sub(then.allocs_lost);
    }
    // A Go heap's allocations are counted as its rows are; what it has in
    // use is a state.
    for now in &mut out.go_heaps {
        if let Some(then) = earlier.go_heaps.iter().find(|h| h.pid == now.pid) {
            now.allocated.calls = now.allocated.calls.saturating_sub(then.allocated.calls);
            now.allocated.bytes = now.allocated.bytes.saturating_sub(then.allocated.bytes);
        }
    }
    if let (Some(now), Some(then)) = (out.meta.sampling.as_mut(), earlier.meta.sampling.as_ref()) {
        now.samples = now.samples.saturating_sub(then.samples);
    }
    if let (Some(now), Some(then)) = (out.stack_quality.as_mut(), earlier.stack_quality.as_ref()) {
        now.calls = now.calls.saturating_sub(then.calls);
        now.whole = now.whole.saturating_sub(then.whole);
        now.finished_by_tracer = now
            .finished_by_tracer
            .saturating_sub(then.finished_by_tracer);
        now.walked_in_kernel = now.walked_in_kernel.saturating_sub(then.walked_in_kernel);
        now.held_for_tracer = now.held_for_tracer.saturating_sub(then.held_for_tracer);
        now.not_held = now.not_held.saturating_sub(then.not_held);
        for (why, n) in now.truncated.iter_mut() {
            *n = n.saturating_sub(then.truncated.get(why).copied().unwrap_or(0));
        }
        now.truncated.retain(|_, n| *n > 0);
    }
    out.meta.duration_secs = (out.meta.duration_secs - earlier.meta.duration_secs).max(0.0);
    if let (Some(now), Some(then)) = (out.meta.windows.as_mut(), earlier.meta.windows.as_ref()) {
        now.probed_secs = (now.probed_secs - then.probed_secs).max(0.0);
        now.trapped_secs = (now.trapped_secs - then.trapped_secs).max(0.0);
        now.windows = now.windows.saturating_sub(then.windows);
    }
    out.timeline = None;
    out.snapshot = None;
    out
}

/// Scales the windows' counts of `profile` to its whole duration (the
/// ratio estimator: duration over time probed), once; says so in
/// `meta.windows.scale`. A profile without windows is left as it is.
pub fn scale_windows(profile: &mut Profile) {
    let Some(w) = profile.meta.windows.as_mut() else {
        return;
    };
    if w.scale != 0.0 {
        return;
    }
    // Probes in throughout (the windows back to back; the readings' own
    // moments differ by milliseconds): the counts are exact.
    let factor = if w.probed_secs > 0.0 && w.probed_secs < profile.meta.duration_secs * 0.995 {
        profile.meta.duration_secs / w.probed_secs
    } else {
        1.0
    };
    w.scale = factor;
    if factor == 1.0 {
        return;
    }
    let scale = |n: &mut u64| *n = (*n as f64 * factor).round() as u64;
    let t = &mut profile.totals;
    // Go heap rows are read whole at each reading, windows or not.
    let rows = profile.stacks.iter_mut().filter(|e| !super::is_go_heap(e));
    let counts = (rows.map(|e| &mut e.counts))
        .chain(t.per_func.values_mut())
        .chain([&mut t.allocs]);
    for c in counts {
        scale(&mut c.calls);
        scale(&mut c.bytes);
    }
    scale(&mut t.frees);
}

fn losses_between(earlier: &Losses, later: &Losses) -> Losses {
    Losses {
        map_full: later.map_full.saturating_sub(earlier.map_full),
        stack_walk_failed: later
            .stack_walk_failed
            .saturating_sub(earlier.stack_walk_failed),
        stack_collisions: later
            .stack_collisions
            .saturating_sub(earlier.stack_collisions),
        stack_map_full: later.stack_map_full.saturating_sub(earlier.stack_map_full),
        caller_unreadable: later
            .caller_unreadable
            .saturating_sub(earlier.caller_unreadable),
        thread_names_full: later
            .thread_names_full
            .saturating_sub(earlier.thread_names_full),
        gone_stacks_beyond: later
            .gone_stacks_beyond
            .saturating_sub(earlier.gone_stacks_beyond),
        host: match (later.host, earlier.host) {
            (Some(l), Some(e)) => Some(l.since(&e)),
            (l, _) => l,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{Counts, LiveStats, StackEntry};

    fn entry(func: &str, caller: &str, calls: u64, bytes: u64) -> StackEntry {
        StackEntry {
            func: func.into(),
            frames: vec![std::sync::Arc::new(crate::profile::Frame {
                function: caller.into(),
                ..Default::default()
            })],
            counts: Counts { calls, bytes },
            ..Default::default()
        }
    }

    fn profile(stacks: Vec<StackEntry>, secs: f64) -> Profile {
        let mut p = Profile {
            stacks,
            ..Default::default()
        };
        p.meta.duration_secs = secs;
        for e in &p.stacks {
            p.totals.allocs.add(e.counts);
            p.totals
                .per_func
                .entry(e.func.clone())
                .or_default()
                .add(e.counts);
        }
        p
    }

    #[test]
    fn counts_are_subtracted_and_new_stacks_kept_whole() {
        let a = profile(
            vec![entry("malloc", "f", 10, 100), entry("malloc", "g", 5, 50)],
            2.0,
        );
        let b = profile(
            vec![
                entry("malloc", "f", 14, 140),
                entry("malloc", "g", 5, 50),
                entry("calloc", "h", 3, 9),
            ],
            7.5,
        );
        let d = between(&a, &b);
        let rows: Vec<(&str, u64, u64)> = d
            .stacks
            .iter()
            .map(|e| {
                (
                    e.frames[0].function.as_str(),
                    e.counts.calls,
                    e.counts.bytes,
                )
            })
            .collect();
        assert_eq!(rows, [("f", 4, 40), ("h", 3, 9)]);
        assert_eq!(
            d.totals.allocs,
            Counts {
                calls: 7,
                bytes: 49
            }
        );
        assert_eq!(
            d.totals.per_func["malloc"],
            Counts {
                calls: 4,
                bytes: 40
            }
        );
        assert_eq!(d.totals.per_func["calloc"], Counts { calls: 3, bytes: 9 });
        assert_eq!(d.meta.duration_secs, 5.5);
    }

    #[test]
    fn windows_scale_to_the_whole_duration_once() {
        let mut p = profile(vec![entry("malloc", "f", 10, 1000)], 60.0);
        p.meta.windows = Some(crate::profile::WindowsInfo {
            probed_secs: 6.0,
            windows: 3,
            ..Default::default()
        });
        scale_windows(&mut p);
        scale_windows(&mut p);
        assert_eq!(
            p.stacks[0].counts,
            Counts {
                calls: 100,
                bytes: 10_000
            }
        );
        assert_eq!(
            p.totals.allocs,
            Counts {
                calls: 100,
                bytes: 10_000
            }
        );
        assert_eq!(p.meta.windows.as_ref().unwrap().scale, 10.0);
        // A window of the agent: its own probed time, its own scale.
        let mut a = profile(vec![entry("malloc", "f", 10, 1000)], 60.0);
        a.meta.windows = Some(crate::profile::WindowsInfo {
            probed_secs: 6.0,
            ..Default::default()
        });
        let mut b = profile(vec![entry("malloc", "f", 14, 1400)], 80.0);
        b.meta.windows = Some(crate::profile::WindowsInfo {
            probed_secs: 8.0,
            ..Default::default()
        });
        let mut d = between(&a, &b);
        scale_windows(&mut d);
        assert_eq!(
            d.stacks[0].counts,
            Counts {
                calls: 40,
                bytes: 4000
            }
        );
    }

    #[test]
    fn what_is_still_allocated_is_the_later_state() {
        let live = |allocations, outstanding| LiveStats {
            allocations,
            outstanding,
            outstanding_bytes: outstanding * 8,
            ..Default::default()
        };
        let mut a = entry("malloc", "f", 10, 80);
        a.live = Some(live(10, 6));
        let mut b = entry("malloc", "f", 10, 80);
        b.live = Some(live(10, 6));
        let d = between(&profile(vec![a], 1.0), &profile(vec![b], 2.0));
        // No new call, but six blocks still held: the row stays, with its
        // in-use state whole and nothing allocated in the window.
        assert_eq!(d.stacks.len(), 1);
        let l = d.stacks[0].live.as_ref().unwrap();
        assert_eq!((d.stacks[0].counts.calls, l.allocations), (0, 0));
        assert_eq!((l.outstanding, l.outstanding_bytes), (6, 48));
    }
}
