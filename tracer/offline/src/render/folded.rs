//! The collapsed ("folded") stack format read by inferno and flamegraph.pl:
//! one line per distinct stack, outermost frame first, the allocator
//! function last, then the count.
//!
//! ```text
//! main;make_node_[i];malloc 1000
//! worker-1234;start_thread;work;calloc 250
//! ```

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::diff::Diff;
use crate::profile::{Profile, StackEntry};

use super::{is_allocation, StackWeight, Weight};

/// Renders every allocation stack of `profile` weighted by `weight` (a
/// live weight counts nothing outside live mode). Stacks with a zero count are left out, identical stacks are summed, lines are
/// sorted. With `per_thread`, stacks that carry a thread get a root frame
/// `NAME-TID`. Every line ends with a newline; no stacks give "".
pub fn render(profile: &Profile, weight: StackWeight, per_thread: bool) -> String {
    render_by(profile, per_thread, |e| weight.of(e))
}

/// [`render`] with each stack's count given by `count`.
pub fn render_by(
    profile: &Profile,
    per_thread: bool,
    count: impl Fn(&StackEntry) -> u64,
) -> String {
    let mut stacks: BTreeMap<String, u64> = BTreeMap::new();
    for entry in profile.stacks.iter().filter(|e| is_allocation(e)) {
        let count = count(entry);
        if count == 0 {
            continue;
        }
        let sum = stacks.entry(stack_line(entry, per_thread)).or_insert(0);
        *sum = sum.saturating_add(count);
    }
    let mut out = String::new();
    for (stack, count) in &stacks {
        let _ = writeln!(out, "{stack} {count}");
    }
    out
}

/// `[NAME-TID;]outermost;...;caller;func`
fn stack_line(entry: &StackEntry, per_thread: bool) -> String {
    let mut parts: Vec<String> = Vec::with_capacity(entry.frames.len() + 2);
    if let Some(process) = &entry.process {
        parts.push(clean(&format!("{}-{}", process.name, process.pid)));
    }
    if per_thread {
        if let Some(thread) = &entry.thread {
            parts.push(clean(&format!("{}-{}", thread.name, thread.tid)));
        }
    }
    for frame in entry.frames.iter().rev() {
        let mut name = clean(&frame.function);
        if frame.inlined {
            name.push_str("_[i]");
        }
        parts.push(name);
    }
    parts.push(clean(&entry.func));
    parts.join(";")
}

/// A frame name safe for the format: `;` (the frame separator) becomes `:`,
/// line breaks and other control characters become spaces, and an empty
/// name becomes `[unknown]`.
pub(crate) fn clean(name: &str) -> String {
    let cleaned: String = name
        .chars()
        .map(|c| match c {
            ';' => ':',
            c if c.is_control() => ' ',
            c => c,
        })
        .collect();
    let trimmed = cleaned.trim();
    if trimmed.is_empty() {
        "[unknown]".to_string()
    } else {
        trimmed.to_string()
    }
}

/// The differential collapsed format (as inferno's `diff-folded` and
/// `difffolded.pl` write it): `root;...;caller;malloc BASE NEW`, frames
/// outermost first, the allocator function last, counts of `weight`. Keys
/// that only differ by module are summed into one line; lines where both
/// counts are 0 are left out; lines are sorted. Every line ends with a
/// newline.
pub fn differential(diff: &Diff, weight: Weight) -> String {
    let mut lines: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for row in &diff.rows {
        let (b, n) = (weight.of(row.change.base), weight.of(row.change.new));
        if b == 0 && n == 0 {
            continue;
        }
        let mut parts: Vec<String> = row
            .key
            .frames
            .iter()
            .rev()
            .map(|f| clean(&f.function))
            .collect();
        parts.push(clean(&row.key.func));
        let sums = lines.entry(parts.join(";")).or_default();
        sums.0 = sums.0.saturating_add(b);
        sums.1 = sums.1.saturating_add(n);
    }
    let mut out = String::new();
    for (stack, (b, n)) in &lines {
        let _ = writeln!(out, "{stack} {b} {n}");
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::test_util::{entry, on_thread, profile};
    use super::*;

    #[test]
    fn root_first_allocator_last() {
        let p = profile(vec![entry("malloc", &["leaf", "mid", "main"], 3, 30)]);
        assert_eq!(
            render(&p, StackWeight::Calls, false),
            "main;mid;leaf;malloc 3\n"
        );
    }

    #[test]
    fn weight_selects_the_count() {
        let p = profile(vec![entry("calloc", &["a"], 3, 96)]);
        assert_eq!(render(&p, StackWeight::Calls, false), "a;calloc 3\n");
        assert_eq!(render(&p, StackWeight::Bytes, false), "a;calloc 96\n");
    }

    #[test]
    fn identical_stacks_merge_and_lines_sort() {
        let mut truncated = entry("malloc", &["b", "main"], 1, 10);
        truncated.truncated = true;
        let p = profile(vec![
            entry("malloc", &["b", "main"], 2, 20),
            entry("malloc", &["a", "main"], 4, 40),
            truncated,
            on_thread(entry("malloc", &["a", "main"], 5, 50), 9, "t"),
        ]);
        assert_eq!(
            render(&p, StackWeight::Calls, false),
            "main;a;malloc 9\nmain;b;malloc 3\n"
        );
    }

    #[test]
    fn zero_counts_are_dropped() {
        let p = profile(vec![
            entry("malloc", &["a"], 2, 0),
            entry("malloc", &["b"], 0, 0),
        ]);
        assert_eq!(render(&p, StackWeight::Calls, false), "a;malloc 2\n");
        assert_eq!(render(&p, StackWeight::Bytes, false), "");
    }

    #[test]
    fn inlined_frames_are_annotated() {
        let mut e = entry("malloc", &["inner", "outer"], 1, 8);
        Arc::make_mut(&mut e.frames[0]).inlined = true;
        let p = profile(vec![e]);
        assert_eq!(
            render(&p, StackWeight::Calls, false),
            "outer;inner_[i];malloc 1\n"
        );
    }

    #[test]
    fn separators_in_names_are_replaced() {
        let p = profile(vec![entry(
            "malloc",
            &["<[u8; 8] as Foo>::bar", "two\nlines", ""],
            1,
            1,
        )]);
        assert_eq!(
            render(&p, StackWeight::Calls, false),
            "[unknown];two lines;<[u8: 8] as Foo>::bar;malloc 1\n"
        );
    }

    #[test]
    fn per_thread_adds_a_root_frame() {
        let p = profile(vec![
            on_thread(entry("malloc", &["a"], 1, 1), 1234, "worker"),
            on_thread(entry("malloc", &["a"], 2, 2), 1, "main"),
            entry("malloc", &["a"], 4, 4),
        ]);
        assert_eq!(
            render(&p, StackWeight::Calls, true),
            "a;malloc 4\nmain-1;a;malloc 2\nworker-1234;a;malloc 1\n"
        );
        assert_eq!(render(&p, StackWeight::Calls, false), "a;malloc 7\n");
    }

    #[test]
    fn live_weights_count_in_use_and_leaked_bytes() {
        let live = |inuse, leaked| {
            Some(crate::profile::LiveStats {
                outstanding_bytes: inuse,
                old_outstanding_bytes: leaked,
                ..Default::default()
            })
        };
        let mut p = profile(vec![
            entry("malloc", &["leak", "main"], 100, 6400),
            entry("malloc", &["young", "main"], 5, 500),
            entry("malloc", &["churn", "main"], 9, 90),
        ]);
        p.stacks[0].live = live(6400, 6400);
        p.stacks[1].live = live(500, 0);
        p.stacks[2].live = live(0, 0);
        assert_eq!(
            render(&p, StackWeight::InUse, false),
            "main;leak;malloc 6400\nmain;young;malloc 500\n"
        );
        assert_eq!(
            render(&p, StackWeight::Leaked, false),
            "main;leak;malloc 6400\n"
        );
    }

    #[test]
    fn free_is_left_out() {
        let p = profile(vec![
            entry("free", &["a"], 5, 0),
            entry("malloc", &["a"], 1, 16),
        ]);
        assert_eq!(render(&p, StackWeight::Calls, false), "a;malloc 1\n");
    }
}
