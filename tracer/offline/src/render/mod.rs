//! Renderers: a symbolized [`Profile`] (or a [`crate::diff::Diff`]) in,
//! bytes out, no I/O. The table, the leak summary, folded stacks and
//! flame graphs (plain and differential), pprof, speedscope, the diff
//! table.
//!
//! [`select`] picks and orders the rows the table shows; the folded and
//! flame graph renderers always use every stack.

use std::cmp::Ordering;
use std::sync::Arc;

pub use crate::profile::{is_allocation, Weight, FREE_FUNC};
use crate::profile::{
    Counts, Frame, FrameOrder, LiveStats, ProcessRef, Profile, StackEntry, Thread,
};

pub mod apart;
pub mod calltree;
pub mod diff_report;
pub mod diff_table;
pub mod flamegraph;
pub mod folded;
pub mod html;
pub mod pprof;
pub mod speedscope;
pub mod table;
pub mod text;
pub mod weight;

pub use weight::StackWeight;

/// Which count orders the rows (of the table, the tree, `mtrace top`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortKey {
    Calls,
    Bytes,
    /// Live mode: bytes still allocated. Where a row has no live
    /// statistics (merged rows, the tree's nodes) it orders by bytes.
    Live,
}

/// What the table shows.
#[derive(Clone, Debug)]
pub struct ReportOptions {
    /// Keep at most this many rows; 0 keeps all.
    pub top: usize,
    /// Hide rows with fewer calls than this percentage of all allocation
    /// calls; 0 hides nothing.
    pub threshold_pct: f64,
    pub sort: SortKey,
    /// Keep rows of different threads apart (otherwise they are merged).
    pub per_thread: bool,
    /// Rows split per process (they carry it when traced so).
    pub per_process: bool,
    /// Colour (ANSI styles): only for a terminal that wants them.
    pub color: bool,
}

/// One row to show: an allocator function reached through one stack, from
/// one thread when split per thread.
#[derive(Clone, Debug, PartialEq)]
pub struct Row<'a> {
    pub func: &'a str,
    /// Innermost first.
    pub frames: &'a [Arc<Frame>],
    pub truncated: bool,
    /// Always `None` unless [`ReportOptions::per_thread`] is set.
    pub thread: Option<&'a Thread>,
    /// Always `None` unless [`ReportOptions::per_process`] is set.
    pub process: Option<&'a ProcessRef>,
    pub counts: Counts,
    /// Live mode: the entry's live statistics (`None` when several entries
    /// were merged into this row: percentiles do not add up).
    pub live: Option<&'a LiveStats>,
    /// A Go heap row: what its stack holds in use (Go's estimate).
    pub in_use: Option<Counts>,
    /// A Go heap row: the size of each of its objects.
    pub object_size: Option<u64>,
}

/// Rows left out of a [`Selection`] for one reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hidden {
    pub rows: usize,
    pub counts: Counts,
}

/// The rows to show, in order, and what was left out.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selection<'a> {
    pub rows: Vec<Row<'a>>,
    /// Rows under `--threshold`.
    pub hidden_by_threshold: Hidden,
    /// Rows that passed the threshold but fell beyond `--top`.
    pub hidden_by_top: Hidden,
}

/// Picks the rows to show: merges threads (unless per thread), hides rows
/// under the threshold, sorts by the sort key (descending) and keeps the top
/// rows. `free` entries are never rows. Go heap rows
/// ([`crate::profile::GO_HEAP_FUNC`]) come after the malloc rows, top rows
/// of their own, most bytes in use first whatever the sort key (as Go's
/// heap profile shows first), their share against Go's totals.
pub fn select<'a>(profile: &'a Profile, opts: &ReportOptions) -> Selection<'a> {
    let (go, malloc): (Vec<_>, Vec<_>) = merge_rows(profile, opts.per_thread, opts.per_process)
        .into_iter()
        .partition(|(_, r)| r.func == crate::profile::GO_HEAP_FUNC);
    let mut selection = select_rows(malloc, profile.totals.allocs.calls, opts);
    if go.is_empty() {
        return selection;
    }
    let go_total = profile.go_heaps.iter().map(|g| g.allocated.calls).sum();
    let go_opts = ReportOptions {
        sort: SortKey::Live,
        ..opts.clone()
    };
    let go = select_rows(go, go_total, &go_opts);
    selection.rows.extend(go.rows);
    for (mine, theirs) in [
        (&mut selection.hidden_by_threshold, go.hidden_by_threshold),
        (&mut selection.hidden_by_top, go.hidden_by_top),
    ] {
        mine.rows += theirs.rows;
        mine.counts.add(theirs.counts);
    }
    selection
}

/// [`select`] of `rows`, against `total` calls.
fn select_rows<'a>(
    mut rows: Vec<(Vec<u32>, Row<'a>)>,
    total: u64,
    opts: &ReportOptions,
) -> Selection<'a> {
    let mut selection = Selection::default();
    rows.retain(|(_, row)| {
        let keep = passes_threshold(row.counts.calls, total, opts.threshold_pct)
            || row.in_use.is_some_and(|u| u.bytes > 0);
        if !keep {
            selection.hidden_by_threshold.rows += 1;
            selection.hidden_by_threshold.counts.add(row.counts);
        }
        keep
    });

    // No two rows are equal in this order: it needs no stable sort.
    rows.sort_unstable_by(|a, b| compare_rows(a, b, opts.sort));

    if opts.top > 0 && rows.len() > opts.top {
        for (_, row) in rows.drain(opts.top..) {
            selection.hidden_by_top.rows += 1;
            selection.hidden_by_top.counts.add(row.counts);
        }
    }
    selection.rows = rows.into_iter().map(|(_, row)| row).collect();
    selection
}

/// The leak suspects: stacks with blocks at least `--min-age` old still
/// allocated at the end, most bytes first.
pub fn suspects(profile: &Profile) -> Vec<(&StackEntry, &LiveStats)> {
    let mut suspects: Vec<_> = profile
        .stacks
        .iter()
        .filter_map(|e| e.live.as_ref().map(|l| (e, l)))
        .filter(|(_, l)| l.old_outstanding > 0)
        .collect();
    suspects.sort_by(|a, b| {
        b.1.old_outstanding_bytes
            .cmp(&a.1.old_outstanding_bytes)
            .then(b.1.old_outstanding.cmp(&a.1.old_outstanding))
    });
    suspects
}

/// Percentage of `part` in `total`, 0 when `total` is 0.
pub fn percent(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        part as f64 * 100.0 / total as f64
    }
}

/// Whether a row with `calls` calls is shown under `threshold_pct`.
fn passes_threshold(calls: u64, total: u64, threshold_pct: f64) -> bool {
    if threshold_pct.is_nan() || threshold_pct <= 0.0 {
        return true;
    }
    calls as f64 * 100.0 >= threshold_pct * total as f64
}

/// Rows identical but for the thread (unless `per_thread`), summed; each
/// with its frames' numbers in the profile's [`FrameOrder`], by which
/// rows are told apart and ordered. Entries of one row are found next to
/// each other once sorted by what makes a row.
fn merge_rows(profile: &Profile, per_thread: bool, per_process: bool) -> Vec<(Vec<u32>, Row<'_>)> {
    let stacks = || profile.stacks.iter().filter(|e| is_allocation(e));
    let order = FrameOrder::of(stacks());
    let mut entries: Vec<(Vec<u32>, Row<'_>)> = stacks()
        .map(|entry| {
            let row = Row {
                func: &entry.func,
                frames: &entry.frames,
                truncated: entry.truncated,
                thread: entry.thread.as_ref().filter(|_| per_thread),
                process: entry.process.as_ref().filter(|_| per_process),
                counts: entry.counts,
                live: entry.live.as_ref(),
                in_use: entry.in_use,
                object_size: entry.object_size,
            };
            (order.ranks(&entry.frames), row)
        })
        .collect();
    entries.sort_unstable_by(|a, b| row_key(a).cmp(&row_key(b)));
    // In place: a row is the first of its entries, the others summed
    // into it.
    entries.dedup_by(|next, row| {
        let same = row_key(next) == row_key(row);
        if same {
            row.1.counts.add(next.1.counts);
            if let Some(u) = next.1.in_use {
                row.1.in_use.get_or_insert_default().add(u);
            }
            // Live statistics of one entry only: percentiles do not add
            // up.
            row.1.live = None;
        }
        same
    });
    entries
}

/// What makes a row: entries with equal keys are one row.
type RowKey<'k, 'a> = (
    &'a str,
    &'k [u32],
    bool,
    Option<&'a Thread>,
    Option<&'a ProcessRef>,
    Option<u64>,
);

fn row_key<'k, 'a>((ranks, r): &'k (Vec<u32>, Row<'a>)) -> RowKey<'k, 'a> {
    (
        r.func,
        ranks,
        r.truncated,
        r.thread,
        r.process,
        r.object_size,
    )
}

/// Descending by the sort key, then by the other count; then ascending by
/// function, frames (their numbers), truncation and thread so the order
/// is total.
fn compare_rows(
    (a_ranks, a): &(Vec<u32>, Row<'_>),
    (b_ranks, b): &(Vec<u32>, Row<'_>),
    sort: SortKey,
) -> Ordering {
    let key = |r: &Row<'_>| match sort {
        SortKey::Calls => (r.counts.calls, r.counts.bytes),
        SortKey::Bytes => (r.counts.bytes, r.counts.calls),
        SortKey::Live => (
            r.live
                .map(|l| l.outstanding_bytes)
                .or(r.in_use.map(|u| u.bytes))
                .unwrap_or(0),
            r.counts.bytes,
        ),
    };
    key(b)
        .cmp(&key(a))
        .then_with(|| a.func.cmp(b.func))
        .then_with(|| a_ranks.cmp(b_ranks))
        .then_with(|| a.truncated.cmp(&b.truncated))
        .then_with(|| a.thread.cmp(&b.thread))
        .then_with(|| a.process.cmp(&b.process))
        .then_with(|| a.object_size.cmp(&b.object_size))
}

/// Helpers to build profiles by hand in the renderers' tests.
#[cfg(test)]
pub(crate) mod test_util {
    use std::sync::Arc;

    use crate::profile::{Counts, Frame, Profile, StackEntry, Thread};

    pub fn frame(function: &str) -> Frame {
        Frame {
            function: function.to_string(),
            file: None,
            line: None,
            module: None,
            addr: 0,
            inlined: false,
            ..Default::default()
        }
    }

    /// Frames from names given innermost first.
    pub fn frames(names: &[&str]) -> Vec<Arc<Frame>> {
        names.iter().map(|n| Arc::new(frame(n))).collect()
    }

    pub fn entry(func: &str, names: &[&str], calls: u64, bytes: u64) -> StackEntry {
        StackEntry {
            func: func.to_string(),
            frames: frames(names),
            truncated: false,
            thread: None,
            process: None,
            counts: Counts { calls, bytes },
            live: None,
            in_use: None,
            object_size: None,
        }
    }

    pub fn on_thread(mut e: StackEntry, tid: u32, name: &str) -> StackEntry {
        e.thread = Some(Thread {
            tid,
            name: name.to_string(),
        });
        e
    }

    /// A profile whose totals are the sums of its stacks.
    pub fn profile(stacks: Vec<StackEntry>) -> Profile {
        let mut p = Profile {
            stacks,
            ..Default::default()
        };
        for e in &p.stacks {
            p.totals
                .per_func
                .entry(e.func.clone())
                .or_default()
                .add(e.counts);
            if e.func == "free" {
                p.totals.frees += e.counts.calls;
            } else {
                p.totals.allocs.add(e.counts);
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::test_util::{entry, on_thread, profile};
    use super::*;

    fn opts(top: usize, threshold_pct: f64, sort: SortKey, per_thread: bool) -> ReportOptions {
        ReportOptions {
            top,
            threshold_pct,
            sort,
            per_thread,
            per_process: false,
            color: false,
        }
    }

    fn callers<'a>(sel: &Selection<'a>) -> Vec<&'a str> {
        sel.rows
            .iter()
            .map(|r| r.frames[0].function.as_str())
            .collect()
    }

    fn sample() -> Profile {
        profile(vec![
            entry("malloc", &["a", "main"], 50, 500),
            entry("malloc", &["b", "main"], 30, 3000),
            entry("calloc", &["c", "main"], 15, 150),
            entry("malloc", &["d", "main"], 5, 5),
        ])
    }

    #[test]
    fn sorts_by_calls_descending() {
        let p = sample();
        let sel = select(&p, &opts(0, 0.0, SortKey::Calls, false));
        assert_eq!(callers(&sel), ["a", "b", "c", "d"]);
        assert_eq!(sel.hidden_by_threshold, Hidden::default());
        assert_eq!(sel.hidden_by_top, Hidden::default());
    }

    #[test]
    fn sorts_by_bytes_descending() {
        let p = sample();
        let sel = select(&p, &opts(0, 0.0, SortKey::Bytes, false));
        assert_eq!(callers(&sel), ["b", "a", "c", "d"]);
    }

    #[test]
    fn ties_broken_by_other_count_then_func_then_frames() {
        let p = profile(vec![
            entry("malloc", &["z"], 10, 100),
            entry("malloc", &["y"], 10, 200),
            entry("calloc", &["x"], 10, 100),
            entry("malloc", &["w"], 10, 100),
        ]);
        let sel = select(&p, &opts(0, 0.0, SortKey::Calls, false));
        assert_eq!(callers(&sel), ["y", "x", "w", "z"]);
    }

    #[test]
    fn threshold_hides_small_rows() {
        let p = sample(); // 100 calls in all
        let sel = select(&p, &opts(0, 15.0, SortKey::Calls, false));
        // 15 calls is exactly 15%: kept.
        assert_eq!(callers(&sel), ["a", "b", "c"]);
        assert_eq!(
            sel.hidden_by_threshold,
            Hidden {
                rows: 1,
                counts: Counts { calls: 5, bytes: 5 }
            }
        );
        assert_eq!(sel.hidden_by_top, Hidden::default());

        let sel = select(&p, &opts(0, 15.1, SortKey::Calls, false));
        assert_eq!(callers(&sel), ["a", "b"]);
        assert_eq!(sel.hidden_by_threshold.rows, 2);
        assert_eq!(sel.hidden_by_threshold.counts.calls, 20);
    }

    #[test]
    fn threshold_zero_hides_nothing() {
        let mut p = sample();
        p.stacks.push(entry("malloc", &["e"], 0, 0));
        let sel = select(&p, &opts(0, 0.0, SortKey::Calls, false));
        assert_eq!(sel.rows.len(), 5);
        assert_eq!(sel.hidden_by_threshold.rows, 0);
    }

    #[test]
    fn top_keeps_first_rows_and_counts_the_rest() {
        let p = sample();
        let sel = select(&p, &opts(2, 0.0, SortKey::Calls, false));
        assert_eq!(callers(&sel), ["a", "b"]);
        assert_eq!(
            sel.hidden_by_top,
            Hidden {
                rows: 2,
                counts: Counts {
                    calls: 20,
                    bytes: 155
                }
            }
        );
        // Threshold applies first; top counts only what passed it.
        let sel = select(&p, &opts(2, 10.0, SortKey::Calls, false));
        assert_eq!(sel.hidden_by_threshold.rows, 1);
        assert_eq!(sel.hidden_by_top.rows, 1);
        assert_eq!(sel.hidden_by_top.counts.calls, 15);
        // Top 0 keeps all.
        let sel = select(&p, &opts(0, 0.0, SortKey::Calls, false));
        assert_eq!(sel.rows.len(), 4);
    }

    #[test]
    fn threads_merged_unless_per_thread() {
        let p = profile(vec![
            on_thread(entry("malloc", &["a", "main"], 10, 100), 1, "main"),
            on_thread(entry("malloc", &["a", "main"], 20, 200), 2, "worker"),
            on_thread(entry("malloc", &["b", "main"], 25, 250), 2, "worker"),
        ]);
        let sel = select(&p, &opts(0, 0.0, SortKey::Calls, false));
        assert_eq!(callers(&sel), ["a", "b"]);
        assert_eq!(
            sel.rows[0].counts,
            Counts {
                calls: 30,
                bytes: 300
            }
        );
        assert!(sel.rows.iter().all(|r| r.thread.is_none()));

        let sel = select(&p, &opts(0, 0.0, SortKey::Calls, true));
        assert_eq!(callers(&sel), ["b", "a", "a"]);
        let threads: Vec<u32> = sel
            .rows
            .iter()
            .map(|r| r.thread.map_or(0, |t| t.tid))
            .collect();
        assert_eq!(threads, [2, 2, 1]);
    }

    #[test]
    fn merged_rows_are_judged_by_the_threshold_as_a_whole() {
        // Each thread alone is under 30%, together they are 40%.
        let p = profile(vec![
            on_thread(entry("malloc", &["a"], 20, 0), 1, "t1"),
            on_thread(entry("malloc", &["a"], 20, 0), 2, "t2"),
            entry("malloc", &["b"], 60, 0),
        ]);
        let sel = select(&p, &opts(0, 30.0, SortKey::Calls, false));
        assert_eq!(callers(&sel), ["b", "a"]);
        let sel = select(&p, &opts(0, 30.0, SortKey::Calls, true));
        assert_eq!(callers(&sel), ["b"]);
        assert_eq!(sel.hidden_by_threshold.rows, 2);
    }

    #[test]
    fn truncated_rows_stay_apart_and_free_is_not_a_row() {
        let mut cut = entry("malloc", &["a"], 3, 30);
        cut.truncated = true;
        let p = profile(vec![
            entry("malloc", &["a"], 5, 50),
            cut,
            entry("free", &["a"], 9, 0),
        ]);
        let sel = select(&p, &opts(0, 0.0, SortKey::Calls, false));
        assert_eq!(sel.rows.len(), 2);
        assert!(!sel.rows[0].truncated);
        assert!(sel.rows[1].truncated);
        assert!(sel.rows.iter().all(|r| r.func == "malloc"));
    }
}
