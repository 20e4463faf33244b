//! The human-readable report.
//!
//! ```text
//! mtrace: pid 1234 (./fixture arg), 1.23 s, probes in /usr/lib/x86_64-linux-gnu/libc.so.6
//!
//! #1  1000 calls  72.13%  48000 bytes  avg 48  malloc
//!     make_node (list.c:12)
//!     main (main.c:30)
//!
//! 3 more stacks (136 calls, 2000 bytes) hidden by --threshold
//! total: 1386 allocation calls, 66000 bytes requested, 1200 frees (malloc 1000, calloc 386)
//! lost: map full 0, stack walk failed 0, stack collisions 0, stack map full 0, caller unreadable 0, thread names 0
//! ```

use std::fmt::Write as _;

use crate::profile::{Losses, Profile, StackQuality};

use super::{percent, select, Hidden, ReportOptions, Row, FREE_FUNC};

/// Renders the report. Every line ends with a newline.
pub fn render(profile: &Profile, opts: &ReportOptions) -> String {
    let mut out = String::new();
    out.push_str(&header(profile));
    out.push('\n');

    let selection = select(profile, opts);
    let total_calls = profile.totals.allocs.calls;
    let hidden_rows = selection.hidden_by_threshold.rows + selection.hidden_by_top.rows;
    if selection.rows.is_empty() && hidden_rows == 0 {
        out.push_str("\nno allocations traced\n");
    }
    for (i, row) in selection.rows.iter().enumerate() {
        out.push('\n');
        write_row(&mut out, i + 1, row, total_calls);
    }

    out.push('\n');
    write_hidden(&mut out, selection.hidden_by_threshold, "--threshold");
    write_hidden(&mut out, selection.hidden_by_top, "--top");
    out.push_str(&totals_line(profile));
    out.push('\n');
    if profile.totals.nested > 0 {
        let _ = writeln!(
            out,
            "nested allocator calls not counted twice: {}",
            profile.totals.nested
        );
    }
    if let Some(q) = &profile.stack_quality {
        out.push_str(&quality_line(q));
        out.push('\n');
    }
    if let Some(line) = single_stepped_line(profile) {
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str(&losses_line(&profile.losses));
    out.push('\n');
    if let Some(note) = losses_note(&profile.losses) {
        out.push_str(&note);
        out.push('\n');
    }
    if let Some(live) = &profile.live {
        out.push_str(&super::leaks::summary(profile, live, opts.top));
    }
    out
}

/// `mtrace: pid 1234 (./fixture arg), 1.23 s, probes in /usr/lib/.../libc.so.6`
fn header(profile: &Profile) -> String {
    let meta = &profile.meta;
    let mut line = format!("mtrace: pid {}", meta.pid);
    if !meta.command.is_empty() {
        let _ = write!(line, " ({})", meta.command);
    }
    let _ = write!(line, ", {:.2} s", meta.duration_secs);
    if !meta.allocator_object.is_empty() {
        let _ = write!(line, ", probes in {}", meta.allocator_object);
        if !meta.allocator_family.is_empty() && !meta.allocator_version.is_empty() {
            let _ = write!(
                line,
                " ({} {})",
                meta.allocator_family, meta.allocator_version
            );
        } else if !meta.allocator_family.is_empty() {
            let _ = write!(line, " ({})", meta.allocator_family);
        }
    }
    if !meta.processes.is_empty() {
        let traced = meta.processes.iter().filter(|p| p.traced).count();
        let exited = meta
            .processes
            .iter()
            .filter(|p| p.traced && p.exit_code.is_some())
            .count();
        let _ = write!(
            line,
            "\nprocesses: {traced} traced ({exited} exited during the trace)"
        );
        let untraced: Vec<String> = meta
            .processes
            .iter()
            .filter(|p| !p.traced)
            .map(|p| {
                format!(
                    "{} (pid {}): {}",
                    p.name,
                    p.pid,
                    p.not_traced.as_deref().unwrap_or("not traced")
                )
            })
            .collect();
        if !untraced.is_empty() {
            let _ = write!(
                line,
                ", {} not traced: {}",
                untraced.len(),
                untraced.join("; ")
            );
        }
    }
    if let Some(s) = &meta.sampling {
        let how = match s.kind.as_str() {
            "bytes" => format!("one sample per {} bytes on average", s.rate),
            _ => format!("one call in {}", s.rate),
        };
        let _ = write!(
            line,
            "\nsampled: {how}, {} samples; calls and bytes are unbiased estimates, frees are not counted",
            s.samples
        );
    }
    line
}

/// `#1  1000 calls  72.13%  48000 bytes  avg 48  malloc` and the frames.
fn write_row(out: &mut String, rank: usize, row: &Row<'_>, total_calls: u64) {
    let counts = row.counts;
    let avg = counts.bytes.checked_div(counts.calls).unwrap_or(0);
    let _ = write!(
        out,
        "#{rank}  {} calls  {:.2}%  {} bytes  avg {avg}  {}",
        counts.calls,
        percent(counts.calls, total_calls),
        counts.bytes,
        row.func,
    );
    if let Some(process) = row.process {
        let _ = write!(out, "  process {} (pid {})", process.name, process.pid);
    }
    if let Some(thread) = row.thread {
        let _ = write!(out, "  thread {} (tid {})", thread.name, thread.tid);
    }
    if row.truncated {
        out.push_str("  [stack truncated]");
    }
    out.push('\n');
    if row.frames.is_empty() {
        out.push_str("    [no frames]\n");
    }
    for frame in row.frames {
        out.push_str("    ");
        out.push_str(&frame.describe());
        if frame.inlined {
            out.push_str(" [inlined]");
        }
        out.push('\n');
    }
    if let Some(live) = row.live {
        out.push_str(&super::leaks::row_lines(live));
    }
}

/// `2 more stacks (15 calls, 300 bytes) hidden by --top`
fn write_hidden(out: &mut String, hidden: Hidden, option: &str) {
    if hidden.rows == 0 {
        return;
    }
    let noun = if hidden.rows == 1 { "stack" } else { "stacks" };
    let _ = writeln!(
        out,
        "{} more {noun} ({} calls, {} bytes) hidden by {option}",
        hidden.rows, hidden.counts.calls, hidden.counts.bytes
    );
}

/// `total: N allocation calls, B bytes requested, F frees (malloc 1000, calloc 250)`,
/// allocation functions with calls listed by calls, most first.
/// The probed functions the kernel cannot emulate the first instruction
/// of (it single-steps them, about 20 µs a call instead of 1), with the
/// calls that paid it; `None` when no call did.
fn single_stepped_line(profile: &Profile) -> Option<String> {
    let mut paid: Vec<String> = Vec::new();
    for p in profile.meta.probes.iter().filter(|p| !p.emulated) {
        let calls = profile
            .totals
            .per_func
            .get(&p.function)
            .map_or(0, |c| c.calls);
        let entry = format!("{} {calls}", p.function);
        if calls > 0 && !paid.contains(&entry) {
            paid.push(entry);
        }
    }
    (!paid.is_empty()).then(|| {
        format!(
            "single-stepped probes (about 20 us a call instead of 1): {}",
            paid.join(", ")
        )
    })
}

fn totals_line(profile: &Profile) -> String {
    let totals = &profile.totals;
    let mut line = format!(
        "total: {} allocation calls, {} bytes requested, {}",
        totals.allocs.calls,
        totals.allocs.bytes,
        if totals.frees_counted {
            format!("{} frees", totals.frees)
        } else {
            "frees not counted".to_string()
        }
    );
    let mut funcs: Vec<(&str, u64)> = totals
        .per_func
        .iter()
        .filter(|(name, counts)| name.as_str() != FREE_FUNC && counts.calls > 0)
        .map(|(name, counts)| (name.as_str(), counts.calls))
        .collect();
    // Most calls first; per_func is sorted by name, which breaks ties.
    funcs.sort_by_key(|&(_, calls)| std::cmp::Reverse(calls));
    if !funcs.is_empty() {
        let list: Vec<String> = funcs
            .iter()
            .map(|(name, calls)| format!("{name} {calls}"))
            .collect();
        let _ = write!(line, " ({})", list.join(", "));
    }
    line
}

/// `stacks: 99.95% whole (to the thread's first frame); cut short: no_cfi 12`
pub fn quality_line(q: &StackQuality) -> String {
    // Never "100.00%" unless every stack is whole.
    let pct = q.whole_pct();
    let shown = if q.whole < q.calls {
        (pct * 100.0).floor() / 100.0
    } else {
        pct
    };
    let mut line = format!("stacks: {shown:.2}% whole (to the thread's first frame)");
    let cut: Vec<String> = q
        .truncated
        .iter()
        .filter(|(_, &n)| n > 0)
        .map(|(why, n)| format!("{why} {n}"))
        .collect();
    if !cut.is_empty() {
        let _ = write!(line, "; cut short: {}", cut.join(", "));
    }
    line
}

/// Printed in every report, even when nothing was lost.
fn losses_line(l: &Losses) -> String {
    format!(
        "lost: map full {}, stack walk failed {}, stack collisions {}, stack map full {}, \
         caller unreadable {}, thread names {}",
        l.map_full,
        l.stack_walk_failed,
        l.stack_collisions,
        l.stack_map_full,
        l.caller_unreadable,
        l.thread_names_full
    )
}

/// What the nonzero losses mean and which option helps, or `None` when
/// nothing was lost.
fn losses_note(l: &Losses) -> Option<String> {
    let mut parts = Vec::new();
    if l.map_full > 0 {
        parts.push("map full: allocations in the totals but in no stack (raise --count-map-size)");
    }
    if l.stack_walk_failed > 0 {
        parts.push("stack walk failed: counted under the direct caller only");
    }
    if l.stack_collisions > 0 || l.stack_map_full > 0 {
        parts.push(
            "stack collisions/stack map full: counted under the direct caller only \
             (raise --stack-map-size)",
        );
    }
    if l.caller_unreadable > 0 {
        parts.push("caller unreadable: the return address could not be read");
    }
    if l.thread_names_full > 0 {
        parts.push("thread names: name map full, names read from /proc instead");
    }
    if parts.is_empty() {
        None
    } else {
        Some(format!("note: {}", parts.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{entry, on_thread, profile};
    use super::super::SortKey;
    use super::*;
    use crate::profile::{Counts, Frame};

    const NO_LOSSES: &str = "lost: map full 0, stack walk failed 0, stack collisions 0, \
                             stack map full 0, caller unreadable 0, thread names 0";

    fn all(per_thread: bool) -> ReportOptions {
        ReportOptions {
            top: 0,
            threshold_pct: 0.0,
            sort: SortKey::Calls,
            per_thread,
            per_process: false,
        }
    }

    fn sample() -> Profile {
        let mut leaf = entry("malloc", &[], 1000, 48000);
        leaf.frames = vec![
            Frame {
                function: "make_node".into(),
                file: Some("/src/list.c".into()),
                line: Some(12),
                module: Some("/tmp/fixture".into()),
                addr: 0x1234,
                inlined: true,
                ..Default::default()
            },
            Frame {
                function: "main".into(),
                file: Some("/src/main.c".into()),
                line: Some(30),
                module: Some("/tmp/fixture".into()),
                addr: 0x1300,
                inlined: false,
                ..Default::default()
            },
        ];
        let mut p = profile(vec![
            leaf,
            entry("calloc", &["zeroed", "main"], 250, 2500),
            entry("realloc", &["grow", "main"], 136, 15500),
            entry("free", &["drop_node", "main"], 1200, 0),
        ]);
        p.meta.pid = 1234;
        p.meta.command = "./fixture arg".into();
        p.meta.duration_secs = 1.234;
        p.meta.allocator_object = "/usr/lib/x86_64-linux-gnu/libc.so.6".into();
        p
    }

    fn lines(s: &str) -> Vec<&str> {
        s.lines().collect()
    }

    #[test]
    fn full_report() {
        let out = render(&sample(), &all(false));
        let expected = "\
mtrace: pid 1234 (./fixture arg), 1.23 s, probes in /usr/lib/x86_64-linux-gnu/libc.so.6

#1  1000 calls  72.15%  48000 bytes  avg 48  malloc
    make_node (list.c:12) [inlined]
    main (main.c:30)

#2  250 calls  18.04%  2500 bytes  avg 10  calloc
    zeroed
    main

#3  136 calls  9.81%  15500 bytes  avg 113  realloc
    grow
    main

total: 1386 allocation calls, 66000 bytes requested, 1200 frees (malloc 1000, calloc 250, realloc 136)
"
        .to_string()
            + NO_LOSSES
            + "\n";
        assert_eq!(out, expected);
    }

    #[test]
    fn hidden_rows_are_reported() {
        let mut o = all(false);
        o.threshold_pct = 10.0;
        o.top = 1;
        let out = render(&sample(), &o);
        let l = lines(&out);
        assert!(l.contains(&"1 more stack (136 calls, 15500 bytes) hidden by --threshold"));
        assert!(l.contains(&"1 more stack (250 calls, 2500 bytes) hidden by --top"));
        assert!(!out.contains("#2"));
    }

    #[test]
    fn per_thread_rows_name_their_thread() {
        let p = profile(vec![
            on_thread(entry("malloc", &["a"], 3, 30), 42, "worker"),
            on_thread(entry("malloc", &["a"], 1, 10), 7, "main"),
        ]);
        let out = render(&p, &all(true));
        let l = lines(&out);
        assert!(
            l.contains(&"#1  3 calls  75.00%  30 bytes  avg 10  malloc  thread worker (tid 42)")
        );
        assert!(l.contains(&"#2  1 calls  25.00%  10 bytes  avg 10  malloc  thread main (tid 7)"));

        let out = render(&p, &all(false));
        assert!(lines(&out).contains(&"#1  4 calls  100.00%  40 bytes  avg 10  malloc"));
        assert!(!out.contains("(tid "));
    }

    #[test]
    fn truncated_rows_are_marked() {
        let mut e = entry("malloc", &["a"], 2, 20);
        e.truncated = true;
        let out = render(&profile(vec![e]), &all(false));
        assert!(lines(&out)
            .contains(&"#1  2 calls  100.00%  20 bytes  avg 10  malloc  [stack truncated]"));
    }

    #[test]
    fn empty_profile_says_so_and_still_prints_losses() {
        let out = render(&Profile::default(), &all(false));
        let l = lines(&out);
        assert_eq!(l[0], "mtrace: pid 0, 0.00 s");
        assert!(l.contains(&"no allocations traced"));
        assert!(l.contains(&"total: 0 allocation calls, 0 bytes requested, 0 frees"));
        assert_eq!(l.last(), Some(&NO_LOSSES));
    }

    #[test]
    fn losses_and_nested_are_explained() {
        let mut p = sample();
        p.totals.nested = 5;
        p.losses.map_full = 3;
        p.losses.stack_collisions = 2;
        let out = render(&p, &all(false));
        let l = lines(&out);
        assert!(l.contains(&"nested allocator calls not counted twice: 5"));
        assert!(l.contains(
            &"lost: map full 3, stack walk failed 0, stack collisions 2, stack map full 0, \
              caller unreadable 0, thread names 0"
        ));
        let note = l.last().copied().unwrap_or_default();
        assert!(note.starts_with("note: "));
        assert!(note.contains("--count-map-size"));
        assert!(note.contains("--stack-map-size"));
        assert!(!note.contains("caller unreadable"));
    }

    #[test]
    fn single_stepped_probes_that_were_hit_are_named() {
        let mut p = sample();
        let probe = |function: &str, emulated| crate::profile::Probe {
            function: function.into(),
            emulated,
            ..crate::profile::Probe::default()
        };
        p.meta.probes = vec![
            probe("malloc", false),
            probe("reallocarray", false),
            probe("calloc", true),
        ];
        p.totals.per_func.insert(
            "calloc".into(),
            Counts {
                calls: 7,
                bytes: 70,
            },
        );
        let out = render(&p, &all(false));
        let line = "single-stepped probes (about 20 us a call instead of 1): malloc 1000";
        assert!(lines(&out).contains(&line), "{out}");
        p.meta.probes[0].emulated = true;
        assert!(!render(&p, &all(false)).contains("single-stepped"));
    }

    #[test]
    fn no_nested_line_when_zero() {
        let out = render(&sample(), &all(false));
        assert!(!out.contains("nested"));
        assert!(!out.contains("note:"));
    }

    #[test]
    fn zero_calls_do_not_divide_by_zero() {
        let mut p = profile(vec![entry("malloc", &["a"], 0, 0)]);
        p.totals.per_func.insert("calloc".into(), Counts::default());
        let out = render(&p, &all(false));
        assert!(lines(&out).contains(&"#1  0 calls  0.00%  0 bytes  avg 0  malloc"));
        assert!(lines(&out).contains(&"total: 0 allocation calls, 0 bytes requested, 0 frees"));
    }
}
