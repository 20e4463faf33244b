//! Profiles of one trace joined into one: the images of a process that
//! called `exec` (each symbolized with its own mappings, since the same
//! addresses mean other code after an exec). Stacks are matched by what
//! they say (function, file, line, object, inlined), never by address.

use std::{
    hash::{Hash, Hasher},
    sync::Arc,
};

use foldhash::HashMap;

use super::{Frame, LiveStats, LiveTotals, Profile, StackEntry, StackQuality};

/// `a.f += b.f` for each field named.
macro_rules! add_fields {
    ($a:expr, $b:expr; $($f:ident),* $(,)?) => {
        $( $a.$f += $b.$f; )*
    };
}

/// What makes two stacks the same row: the allocator function, the thread,
/// the process (its pid, and its command when the pid is forgotten, 0:
/// [`Merged::forget_pids`]), every frame as symbolized ([`FrameKey`]) and
/// the object size.
pub(crate) type StackKey = (
    String,
    Option<u32>,
    Option<(u32, Option<String>)>,
    Vec<FrameKey>,
    Option<u64>,
);

/// A frame as a row's key reads it: its function, file, line, object and
/// whether it is inlined, compared by those alone and hashed by their
/// hash, taken once when the key is made. It shares the frame rather
/// than copying its names: a trace of deep stacks joins thousands of rows
/// of 30-60 frames each, and copying every name of every frame for the
/// key cost more than the rest of the join; hashing the names each time
/// the index looks a row up or grows cost as much again.
#[derive(Clone, Debug)]
pub(crate) struct FrameKey(Arc<Frame>, u64);

impl FrameKey {
    fn new(frame: &Arc<Frame>) -> FrameKey {
        use std::hash::BuildHasher;
        // Fixed: equal fields hash the same in every key of the run.
        let hash = foldhash::fast::FixedState::with_seed(0).hash_one(Self::fields_of(frame));
        FrameKey(frame.clone(), hash)
    }

    /// The fields that make two frames the same.
    fn fields_of(f: &Frame) -> (&str, Option<&str>, Option<u32>, Option<&str>, bool) {
        (
            &f.function,
            f.file.as_deref(),
            f.line,
            f.module.as_deref(),
            f.inlined,
        )
    }
}

impl PartialEq for FrameKey {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.1 == other.1 && Self::fields_of(&self.0) == Self::fields_of(&other.0))
    }
}

impl Eq for FrameKey {}

impl Hash for FrameKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.1);
    }
}

pub(crate) fn key(e: &StackEntry) -> StackKey {
    (
        e.func.clone(),
        e.thread.as_ref().map(|t| t.tid),
        e.process
            .as_ref()
            .map(|p| (p.pid, (p.pid == 0).then(|| p.name.clone()))),
        e.frames.iter().map(FrameKey::new).collect(),
        e.object_size,
    )
}

/// Joins `parts` (oldest first) into one profile. The metadata is the
/// last part's (its duration runs from the start of the trace), with the
/// probes of every part; counts, losses and stack quality are summed;
/// stacks that read the same are one row.
pub fn merge(parts: Vec<Profile>) -> Profile {
    let mut merged = Merged::default();
    for part in parts {
        merged.add(part);
    }
    merged.into_profile()
}

/// Profiles joined one at a time, as [`merge`] joins them, each in time
/// that grows with its own size only (the rows' index is kept): a tree
/// of thousands of processes adds each as it goes.
#[derive(Default)]
pub struct Merged {
    out: Option<Profile>,
    index: HashMap<StackKey, usize>,
    /// Most rows kept ([`Merged::keep_at_most`]), and the frame that
    /// stands for the stacks beyond them.
    cap: Option<(usize, Arc<Frame>)>,
}

impl Merged {
    /// The profiles joined so far.
    pub fn get(&self) -> Option<&Profile> {
        self.out.as_ref()
    }

    /// From now on a row whose stack is not among the rows kept, once
    /// `rows` are kept, is joined into its process's row of stacks beyond
    /// (one per function, process and object size, its only frame saying
    /// so), and its calls are counted in `losses.gone_stacks_beyond`. The
    /// rows then grow with the processes' commands, not their stacks.
    pub fn keep_at_most(&mut self, rows: usize) {
        let marker = Frame {
            function: format!("[stacks beyond the {rows} kept of processes gone]"),
            ..Frame::default()
        };
        self.cap = Some((rows, Arc::new(marker)));
    }

    /// The profiles joined so far with `part` (newer than every one of
    /// them) joined in, as [`Merged::add`] would, leaving these as they
    /// are: a copy of the rows so far and a look-up of each of `part`'s,
    /// not a new index of every row.
    pub fn with(&self, part: Profile) -> Profile {
        let Some(out) = &self.out else {
            return part;
        };
        let mut out = out.clone();
        let mut fresh: HashMap<StackKey, usize> = HashMap::default();
        join_part(&mut out, part, |stacks, entry| {
            let k = key(&entry);
            match self.index.get(&k).or_else(|| fresh.get(&k)) {
                Some(&i) => add_row(&mut stacks[i], entry),
                None => {
                    fresh.insert(k, stacks.len());
                    stacks.push(entry);
                }
            }
        });
        out
    }

    pub fn into_profile(self) -> Profile {
        self.out.unwrap_or_default()
    }

    /// Processes that are gone are joined per command name: every row
    /// that names its process by pid names it by pid 0 from now on, and
    /// rows that then read the same are one. What a long trace keeps of
    /// processes come and gone grows with the commands and stacks it saw,
    /// not with the processes.
    pub fn forget_pids(&mut self) {
        let Some(out) = self.out.as_mut() else {
            return;
        };
        let rows = std::mem::take(&mut out.stacks);
        self.index.clear();
        for mut entry in rows {
            if let Some(p) = entry.process.as_mut() {
                p.pid = 0;
            }
            join_row(&mut out.stacks, &mut self.index, entry);
        }
    }

    /// Joins `part` (newer than every part so far).
    pub fn add(&mut self, part: Profile) {
        let Some(out) = self.out.as_mut() else {
            self.index = part
                .stacks
                .iter()
                .enumerate()
                .map(|(i, e)| (key(e), i))
                .collect();
            self.out = Some(part);
            self.apply_cap();
            return;
        };
        let index = &mut self.index;
        let cap = self.cap.as_ref();
        let mut beyond = 0;
        join_part(out, part, |stacks, mut entry| {
            if let Some((rows, marker)) = cap {
                if stacks.len() >= *rows && !index.contains_key(&key(&entry)) {
                    beyond += entry.counts.calls;
                    entry = beyond_row(entry, marker);
                }
            }
            join_row(stacks, index, entry);
        });
        out.losses.gone_stacks_beyond += beyond;
    }

    /// The rows past the cap of a first part, joined into their rows of
    /// stacks beyond.
    fn apply_cap(&mut self) {
        let (Some(out), Some((rows, marker))) = (self.out.as_mut(), self.cap.as_ref()) else {
            return;
        };
        if out.stacks.len() <= *rows {
            return;
        }
        let over = out.stacks.split_off(*rows);
        for e in &over {
            self.index.remove(&key(e));
        }
        for entry in over {
            out.losses.gone_stacks_beyond += entry.counts.calls;
            join_row(&mut out.stacks, &mut self.index, beyond_row(entry, marker));
        }
    }
}

/// `entry` as a row of stacks beyond the rows kept: its only frame
/// `marker`, cut.
fn beyond_row(mut entry: StackEntry, marker: &Arc<Frame>) -> StackEntry {
    entry.frames = vec![marker.clone()];
    entry.truncated = true;
    entry
}

/// Joins `part` (newer) into `out`: its rows by `join`, its metadata,
/// totals, losses and the rest as [`merge`] says.
fn join_part(
    out: &mut Profile,
    mut part: Profile,
    mut join: impl FnMut(&mut Vec<StackEntry>, StackEntry),
) {
    // An exec frees the whole heap: the trace's peak is the highest
    // of the parts' (the earliest of equal ones), and each stack's
    // share of it is its share in that part.
    let peak = |p: &Profile| p.live.as_ref().map_or(0, |l| l.peak_bytes);
    let not_at_peak = if peak(&part) > peak(out) {
        &mut out.stacks
    } else {
        &mut part.stacks
    };
    for live in not_at_peak.iter_mut().filter_map(|e| e.live.as_mut()) {
        live.live_bytes_at_peak = 0;
    }
    for probe in &part.meta.probes {
        if !out.meta.probes.contains(probe) {
            out.meta.probes.push(probe.clone());
        }
    }
    out.meta = super::Meta {
        probes: std::mem::take(&mut out.meta.probes),
        ..part.meta
    };
    for entry in part.stacks {
        join(&mut out.stacks, entry);
    }
    for (func, counts) in part.totals.per_func {
        out.totals.per_func.entry(func).or_default().add(counts);
    }
    out.totals.allocs.add(part.totals.allocs);
    out.totals.frees += part.totals.frees;
    out.totals.frees_counted &= part.totals.frees_counted;
    out.totals.nested += part.totals.nested;
    add_fields!(out.losses, part.losses; map_full, stack_walk_failed, stack_collisions,
        stack_map_full, caller_unreadable, thread_names_full, gone_stacks_beyond);
    out.losses.host = match (out.losses.host, part.losses.host) {
        (Some(a), Some(b)) => Some(a.plus(&b)),
        (a, b) => a.or(b),
    };
    out.stack_quality = match (out.stack_quality.take(), part.stack_quality) {
        (Some(a), Some(b)) => Some(add_quality(a, b)),
        (a, b) => a.or(b),
    };
    out.live = match (out.live.take(), part.live) {
        (Some(a), Some(b)) => Some(add_live_totals(a, b)),
        (a, b) => a.or(b),
    };
    out.snapshot = part.snapshot;
    out.go_heaps.extend(part.go_heaps);
    out.unseen.extend(part.unseen);
}

/// `entry` into `stacks` (indexed by `index`): added to the row that
/// reads the same, whose frames become `entry`'s (the newest addresses),
/// or a row of its own.
fn join_row(stacks: &mut Vec<StackEntry>, index: &mut HashMap<StackKey, usize>, entry: StackEntry) {
    let k = key(&entry);
    match index.get(&k) {
        Some(&i) => add_row(&mut stacks[i], entry),
        None => {
            index.insert(k, stacks.len());
            stacks.push(entry);
        }
    }
}

/// `entry` added to `row`, which reads the same; the row's frames become
/// `entry`'s (the newest addresses).
fn add_row(row: &mut StackEntry, entry: StackEntry) {
    row.counts.add(entry.counts);
    row.truncated |= entry.truncated;
    row.live = add_live(row.live.take(), entry.live);
    if let Some(in_use) = entry.in_use {
        row.in_use.get_or_insert_default().add(in_use);
    }
    row.frames = entry.frames;
}

fn add_quality(mut a: StackQuality, b: StackQuality) -> StackQuality {
    add_fields!(a, b; calls, whole, finished_by_tracer, walked_in_kernel, held_for_tracer,
        not_held);
    a.frame_limit = a.frame_limit.or(b.frame_limit);
    a.python = match (a.python, b.python) {
        (Some(mut x), Some(y)) => {
            add_fields!(x, y; with_frames, no_interpreter, no_thread_state, no_code_running,
                threads_beyond, cut, unreadable, unnamed, notices_lost, not_known);
            Some(x)
        }
        (x, y) => x.or(y),
    };
    a.perf_map = match (a.perf_map, b.perf_map) {
        (Some(x), Some(y)) => Some(x.plus(y)),
        (x, y) => x.or(y),
    };
    a.symbols = match (a.symbols, b.symbols) {
        (Some(x), Some(y)) => Some(x.latest(y)),
        (x, y) => x.or(y),
    };
    for (cause, n) in b.truncated {
        *a.truncated.entry(cause).or_default() += n;
    }
    a
}

/// One stack's blocks over two images: sums, and the larger of the
/// maxima. The size and lifetime percentiles cannot be combined from
/// percentiles: those of the part with more allocations stand.
fn add_live(a: Option<LiveStats>, b: Option<LiveStats>) -> Option<LiveStats> {
    let (mut a, b) = match (a, b) {
        (Some(a), Some(b)) => (a, b),
        (a, b) => return a.or(b),
    };
    if b.allocations > a.allocations {
        a.size = b.size;
        a.lifetime_ns = b.lifetime_ns;
    }
    // live_bytes_at_peak: at most one of them is not zero (see `merge`).
    add_fields!(a, b; allocations, allocated_bytes, frees, outstanding, outstanding_bytes,
        old_outstanding, old_outstanding_bytes, live_bytes_at_peak, temporaries);
    a.oldest_age_secs = a.oldest_age_secs.max(b.oldest_age_secs);
    a.max_live_bytes = a.max_live_bytes.max(b.max_live_bytes);
    Some(a)
}

/// The heap over two images: an exec frees the whole heap, so the peak is
/// the higher of the two peaks.
fn add_live_totals(mut a: LiveTotals, b: LiveTotals) -> LiveTotals {
    if b.peak_bytes > a.peak_bytes {
        a.peak_bytes = b.peak_bytes;
        a.peak_secs = b.peak_secs;
    }
    add_fields!(a, b; outstanding, outstanding_bytes, old_outstanding, old_outstanding_bytes,
        tracked_allocations, temporaries, failed, untracked, frees_unknown, events_lost, stale,
        pending_full, frees_kept, frees_lost, allocs_kept, allocs_lost, inline_unfinished);
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{Counts, Frame, Probe};
    use std::sync::Arc;

    fn entry(func: &str, frames: &[(&str, u64)], calls: u64) -> StackEntry {
        StackEntry {
            func: func.into(),
            frames: frames
                .iter()
                .map(|(f, addr)| {
                    Arc::new(Frame {
                        function: f.to_string(),
                        addr: *addr,
                        ..Frame::default()
                    })
                })
                .collect(),
            counts: Counts {
                calls,
                bytes: calls * 10,
            },
            ..StackEntry::default()
        }
    }

    fn part(stacks: Vec<StackEntry>, probe: &str, object: &str) -> Profile {
        let mut p = Profile {
            stacks,
            ..Profile::default()
        };
        for s in &p.stacks {
            p.totals.allocs.add(s.counts);
            p.totals
                .per_func
                .entry(s.func.clone())
                .or_default()
                .add(s.counts);
        }
        p.meta.allocator_object = object.into();
        p.meta.probes = vec![Probe {
            function: probe.into(),
            ..Probe::default()
        }];
        p
    }

    /// Gone processes of one command become one row per stack under pid
    /// 0; a later process keeps its pid until the next forgetting.
    #[test]
    fn forgotten_pids_join_rows_of_one_command() {
        let of = |pid: u32, calls: u64| {
            let mut e = entry("malloc", &[("work", 0x1000)], calls);
            e.process = Some(crate::profile::ProcessRef {
                pid,
                name: "worker".into(),
            });
            part(vec![e], "malloc", "libc.so.6")
        };
        let mut m = Merged::default();
        m.add(of(10, 3));
        m.add(of(11, 4));
        assert_eq!(m.get().unwrap().stacks.len(), 2);
        m.forget_pids();
        m.add(of(12, 5));
        let rows: Vec<(u32, u64)> = m
            .get()
            .unwrap()
            .stacks
            .iter()
            .map(|e| (e.process.as_ref().unwrap().pid, e.counts.calls))
            .collect();
        assert_eq!(rows, [(0, 7), (12, 5)]);
        m.forget_pids();
        assert_eq!(m.get().unwrap().stacks.len(), 1);
        assert_eq!(m.get().unwrap().totals.allocs.calls, 12);
    }

    /// Past the rows kept, a gone process's new stacks join its row of
    /// stacks beyond (one per function and process), their calls counted
    /// as lost to their stacks; stacks already kept still join their rows,
    /// and no call leaves the totals.
    #[test]
    fn rows_beyond_the_cap_join_one_row_and_are_counted() {
        let of = |pid: u32, name: &str, stacks: &[(&str, u64)]| {
            let rows = stacks
                .iter()
                .map(|&(f, calls)| {
                    let mut e = entry("malloc", &[(f, 0x1000)], calls);
                    e.process = Some(crate::profile::ProcessRef {
                        pid,
                        name: name.into(),
                    });
                    e
                })
                .collect();
            part(rows, "malloc", "libc.so.6")
        };
        let mut m = Merged::default();
        m.keep_at_most(3);
        m.add(of(0, "cc1", &[("a", 1), ("b", 2), ("c", 3), ("d", 4)]));
        m.add(of(0, "cc1", &[("a", 10), ("e", 5), ("f", 6)]));
        m.add(of(0, "as", &[("g", 7)]));
        let p = m.get().unwrap();
        let rows: Vec<(&str, &str, u64, bool)> = p
            .stacks
            .iter()
            .map(|e| {
                (
                    e.process.as_ref().unwrap().name.as_str(),
                    e.frames[0].function.as_str(),
                    e.counts.calls,
                    e.truncated,
                )
            })
            .collect();
        let beyond = "[stacks beyond the 3 kept of processes gone]";
        assert_eq!(
            rows,
            [
                ("cc1", "a", 11, false),
                ("cc1", "b", 2, false),
                ("cc1", "c", 3, false),
                ("cc1", beyond, 15, true),
                ("as", beyond, 7, true),
            ]
        );
        assert_eq!(p.losses.gone_stacks_beyond, 4 + 5 + 6 + 7);
        assert_eq!(p.totals.allocs.calls, 1 + 2 + 3 + 4 + 10 + 5 + 6 + 7);
        // More of the same commands add no row.
        m.add(of(0, "cc1", &[("h", 1), ("i", 1)]));
        assert_eq!(m.get().unwrap().stacks.len(), 5);
        assert_eq!(m.get().unwrap().losses.gone_stacks_beyond, 24);
    }

    /// A reading joins the newest part to the parts so far as `add` would,
    /// and leaves them as they were.
    #[test]
    fn with_joins_as_add_does_and_keeps_the_parts() {
        let (a, mut b) = images();
        b.stacks.push(entry("calloc", &[("work", 0x7100)], 4));
        let mut m = Merged::default();
        m.add(a.clone());
        let read = m.with(b.clone());
        assert_eq!(read, merge(vec![a.clone(), b.clone()]));
        assert_eq!(read.stacks.len(), 3);
        assert_eq!(m.get(), Some(&a));
        assert_eq!(Merged::default().with(b.clone()), b);
    }

    /// `env` (libc) and the program it runs (jemalloc).
    fn images() -> (Profile, Profile) {
        let env = part(
            vec![
                entry("malloc", &[("setlocale", 0x1000), ("main", 0x2000)], 3),
                entry("malloc", &[("xstrdup", 0x1100), ("main", 0x2000)], 1),
            ],
            "malloc",
            "libc.so.6",
        );
        let prog = part(
            vec![
                entry("malloc", &[("setlocale", 0x7000), ("main", 0x8000)], 5),
                entry("calloc", &[("work", 0x7100)], 2),
            ],
            "calloc",
            "libjemalloc.so.2",
        );
        (env, prog)
    }

    /// `env` (libc) then the program it runs (jemalloc): the same stack
    /// at other addresses is one row, the rest stay apart, totals add up,
    /// the metadata is the program's with both images' probes.
    #[test]
    fn images_of_one_process_join_by_symbolized_stacks() {
        let (env, prog) = images();
        let m = merge(vec![env, prog]);
        assert_eq!(m.stacks.len(), 3);
        assert_eq!(m.stacks[0].counts.calls, 8);
        assert_eq!(m.stacks[0].frames[0].addr, 0x7000);
        assert_eq!(m.totals.allocs.calls, 11);
        assert_eq!(m.totals.per_func["malloc"].calls, 9);
        assert_eq!(m.meta.allocator_object, "libjemalloc.so.2");
        let probes: Vec<&str> = m.meta.probes.iter().map(|p| p.function.as_str()).collect();
        assert_eq!(probes, ["malloc", "calloc"]);
        assert_eq!(merge(vec![]), Profile::default());
    }
}
