//! Snapshots: profiles written while tracing goes on (`--interval`,
//! SIGUSR1), each with what changed since the previous one.
//! The tracer's snapshot sink names and writes the files.

use std::collections::HashMap;

use crate::profile::{Counts, Profile, Snapshot, StackEntry};

/// Identity of a stack within one trace: addresses are stable while the
/// target lives.
type Key = (String, Vec<u64>, Option<u32>, bool);

fn key(e: &StackEntry) -> Key {
    (
        e.func.clone(),
        e.frames.iter().map(|f| f.addr).collect(),
        e.thread.as_ref().map(|t| t.tid),
        e.truncated,
    )
}

/// What changed from `prev` (None: from nothing) to `now`.
pub fn delta(index: u32, elapsed_secs: f64, prev: Option<&Profile>, now: &Profile) -> Snapshot {
    let before: HashMap<Key, Counts> = prev
        .map(|p| p.stacks.iter().map(|e| (key(e), e.counts)).collect())
        .unwrap_or_default();
    let delta_stacks = now
        .stacks
        .iter()
        .filter_map(|e| {
            let b = before.get(&key(e)).copied().unwrap_or_default();
            let d = Counts {
                calls: e.counts.calls.saturating_sub(b.calls),
                bytes: e.counts.bytes.saturating_sub(b.bytes),
            };
            (d.calls > 0 || d.bytes > 0).then(|| StackEntry {
                counts: d,
                ..e.clone()
            })
        })
        .collect();
    let (prev_allocs, prev_frees) = prev
        .map(|p| (p.totals.allocs, p.totals.frees))
        .unwrap_or_default();
    Snapshot {
        index,
        elapsed_secs,
        delta_allocs: Counts {
            calls: now.totals.allocs.calls.saturating_sub(prev_allocs.calls),
            bytes: now.totals.allocs.bytes.saturating_sub(prev_allocs.bytes),
        },
        delta_frees: now.totals.frees.saturating_sub(prev_frees),
        delta_stacks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Frame;
    use std::sync::Arc;

    fn entry(addr: u64, calls: u64) -> StackEntry {
        StackEntry {
            func: "malloc".into(),
            frames: vec![Arc::new(Frame {
                function: "f".into(),
                addr,
                ..Frame::default()
            })],
            truncated: false,
            thread: None,
            process: None,
            counts: Counts {
                calls,
                bytes: calls * 8,
            },
            live: None,
            in_use: None,
            object_size: None,
        }
    }

    fn profile(stacks: Vec<StackEntry>) -> Profile {
        let mut p = Profile::default();
        for e in &stacks {
            p.totals.allocs.add(e.counts);
        }
        p.stacks = stacks;
        p
    }

    #[test]
    fn first_snapshot_is_everything() {
        let now = profile(vec![entry(1, 10)]);
        let s = delta(1, 1.0, None, &now);
        assert_eq!(s.delta_allocs.calls, 10);
        assert_eq!(s.delta_stacks.len(), 1);
    }

    #[test]
    fn later_snapshot_is_the_change() {
        let prev = profile(vec![entry(1, 10), entry(2, 5)]);
        let now = profile(vec![entry(1, 25), entry(2, 5), entry(3, 1)]);
        let s = delta(2, 2.0, Some(&prev), &now);
        assert_eq!(s.delta_allocs.calls, 16);
        assert_eq!(s.delta_stacks.len(), 2);
        assert_eq!(s.delta_stacks[0].counts.calls, 15);
        assert_eq!(s.delta_stacks[1].counts.calls, 1);
    }
}
