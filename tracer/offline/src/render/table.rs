//! The human-readable report: lines of at most 80 columns (but for
//! frames and paths), sizes in binary units, colour when asked for.
//!
//! ```text
//! mtrace: pid 1234, 1.23 s
//! command: ./fixture arg
//! probes: /usr/lib/x86_64-linux-gnu/libc.so.6 (glibc 2.36)
//!
//! #1  1000 calls  72.13%  46.9 KiB  avg 48 B  malloc
//!     make_node (list.c:12)
//!     main (main.c:30)
//!
//! 3 more stacks (136 calls, 2.0 KiB) hidden by --threshold
//! total: 1386 allocation calls, 64.5 KiB requested, 1200 frees
//! by function: malloc 1000, calloc 386
//! lost: map full 0, stack walk failed 0, stack collisions 0, stack map full 0,
//! lost: caller unreadable 0, thread names 0
//! ```
//!
//! A labelled list too long for one line goes on over several, each with
//! the label ([`wrap_list`]). Call counts stay exact integers; sizes are
//! rounded to one decimal of KiB, MiB, ... (the JSON profile keeps bytes).

use std::fmt::{self, Write};

use crate::profile::{Losses, Profile, GO_HEAP_FUNC};

use super::apart::{told_apart, with_offset};
use super::text::{
    bytes, count, frame_text, map_names, printable, quality_lines, shown, thousands, wrap_list,
    FrameTexts, Paint,
};
use super::{percent, select, Hidden, ReportOptions, Row, FREE_FUNC};

mod groups;
mod leaks;

/// Untraced processes the header names one by one; the rest are counted.
const UNTRACED_SHOWN: usize = 10;

/// Renders the report. Every line ends with a newline.
pub fn render(profile: &Profile, opts: &ReportOptions) -> String {
    let mut out = String::new();
    // Writing to a string does not fail.
    let _ = render_to(&mut out, profile, opts);
    out
}

/// [`render`], written to `out` line by line as it is made: the text is
/// never held whole (a row may have thousands of frames). Stops at the
/// first failed write.
pub fn render_to(out: &mut impl Write, profile: &Profile, opts: &ReportOptions) -> fmt::Result {
    // Names made printable and cut, but the frames' names, which are cut
    // after their templates are folded (`FrameTexts`).
    let profile = &*map_names(profile, shown, printable);
    let paint = Paint::new(opts.color);
    let mut frames = FrameTexts::new(paint);
    out.write_str(&header(profile, paint))?;

    let selection = select(profile, opts);
    let hidden_rows = selection.hidden_by_threshold.rows + selection.hidden_by_top.rows;
    if selection.rows.is_empty() && hidden_rows == 0 && profile.unseen.is_empty() {
        out.write_str("\nno allocations traced\n")?;
    }
    let go_calls = profile.go_heaps.iter().map(|g| g.allocated.calls).sum();
    let apart = told_apart(selection.rows.iter().map(|r| {
        let key = (r.func, r.process.map(|p| p.pid), r.thread.map(|t| t.tid));
        (key, r.frames)
    }));
    for (i, row) in selection.rows.iter().enumerate() {
        out.write_char('\n')?;
        let total_calls = if row.func == GO_HEAP_FUNC {
            go_calls
        } else {
            profile.totals.allocs.calls
        };
        let offsets = |d: usize| apart.contains(&(i, d));
        write_row(out, i + 1, row, total_calls, &mut frames, offsets)?;
    }

    out.write_char('\n')?;
    write_hidden(out, selection.hidden_by_threshold, "--threshold")?;
    write_hidden(out, selection.hidden_by_top, "--top")?;
    out.write_str(&totals_lines(profile, paint))?;
    out.write_str(&go_totals_lines(profile))?;
    groups::lines(out, profile, opts)?;
    if profile.totals.nested > 0 {
        writeln!(
            out,
            "nested allocator calls not counted twice: {}",
            profile.totals.nested
        )?;
    }
    if let Some(q) = &profile.stack_quality {
        out.write_str(&quality_lines(q))?;
    }
    out.write_str(&single_stepped_lines(profile))?;
    out.write_str(&losses_lines(&profile.losses, paint))?;
    for note in losses_notes(&profile.losses) {
        writeln!(out, "{} {note}", paint.warn("note:"))?;
    }
    if let Some(live) = &profile.live {
        leaks::summary(out, profile, live, opts.top, &mut frames)?;
    }
    Ok(())
}

/// Processes shown by [`by_process`].
const BY_PROCESS_SHOWN: usize = 5;

/// Per process (rows split with `--per-process`): the processes that
/// allocated most, by calls, with their executable and cgroup.
fn by_process(profile: &Profile) -> String {
    // By pid and name: a process that exec'd is two programs.
    let mut per: std::collections::HashMap<(u32, &str), (u64, u64)> = Default::default();
    for e in profile.stacks.iter().filter(|e| e.func != FREE_FUNC) {
        if let Some(p) = &e.process {
            let sum = per.entry((p.pid, p.name.as_str())).or_default();
            sum.0 += e.counts.calls;
            sum.1 += e.counts.bytes;
        }
    }
    let mut rows: Vec<(u32, &str, u64, u64)> = per
        .into_iter()
        .map(|((pid, name), (c, b))| (pid, name, c, b))
        .collect();
    rows.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)).then(a.1.cmp(b.1)));
    let mut out = String::new();
    for &(pid, name, calls, b) in rows.iter().take(BY_PROCESS_SHOWN) {
        let meta = {
            let of_pid = || profile.meta.processes.iter().rev().filter(|p| p.pid == pid);
            of_pid()
                .find(|p| p.name == name)
                .or_else(|| of_pid().next())
        };
        let _ = write!(
            out,
            "by process: {} (pid {pid}): {} calls, {}",
            if name.is_empty() {
                meta.map_or("?", |m| m.name.as_str())
            } else {
                name
            },
            thousands(calls),
            bytes(b)
        );
        if let Some(m) = meta {
            if !m.executable.is_empty() {
                let _ = write!(out, ", {}", m.executable);
            }
            if !m.cgroup.is_empty() {
                let _ = write!(out, ", cgroup {}", m.cgroup);
            }
        }
        out.push('\n');
    }
    if rows.len() > BY_PROCESS_SHOWN {
        let _ = writeln!(
            out,
            "by process: {} more processes allocated",
            rows.len() - BY_PROCESS_SHOWN
        );
    }
    out
}

/// `mtrace: pid 1234, 1.23 s`, then `command:`, `probes:`, the processes
/// of a tree and how it was sampled, each on lines of its own.
fn header(profile: &Profile, paint: Paint) -> String {
    let meta = &profile.meta;
    let mut out = format!(
        "{} {:.2} s\n",
        paint.strong(&format!("mtrace: pid {},", meta.pid)),
        meta.duration_secs
    );
    if !meta.command.is_empty() {
        let _ = writeln!(out, "command: {}", meta.command);
    }
    if meta.scope == "host" {
        let _ = writeln!(
            out,
            "scope: the whole host (--all): file-wide probes in every process that maps an allocator; each call under its process and stack"
        );
    } else if !meta.scope.is_empty() {
        let _ = writeln!(
            out,
            "scope: the {} (--file-wide): file-wide probes in every process that maps an allocator, the scope's processes told from others in the kernel; each call under its process and stack",
            if meta.scope == "tree" { "command's process tree" } else { "cgroup" }
        );
    }
    if !meta.allocator_object.is_empty() {
        let _ = write!(out, "probes: {}", meta.allocator_object);
        match (
            meta.allocator_family.as_str(),
            meta.allocator_version.as_str(),
        ) {
            ("", _) => {}
            (family, "") => {
                let _ = write!(out, " ({family})");
            }
            (family, version) => {
                let _ = write!(out, " ({family} {version})");
            }
        }
        out.push('\n');
        if !meta.allocator_beside.is_empty() {
            let _ = writeln!(out, "probes: also {}", meta.allocator_beside);
        }
        if !meta.python.is_empty() {
            let _ = writeln!(out, "python: {}", meta.python);
        }
    }
    if !meta.processes.is_empty() {
        let traced = meta.processes.iter().filter(|p| p.traced).count();
        let exited = meta
            .processes
            .iter()
            .filter(|p| p.traced && p.exit_code.is_some())
            .count();
        let untraced: Vec<_> = meta.processes.iter().filter(|p| !p.traced).collect();
        // Processes beyond the profile's records were untraced too.
        let not_traced = untraced.len() as u64 + meta.processes_unlisted;
        if !meta.scope.is_empty() {
            // What exited is not followed there: every process is in, and
            // those beyond the records kept were counted all the same.
            let _ = write!(
                out,
                "processes: {} allocated (one per exec)",
                traced as u64 + meta.processes_unlisted
            );
            if meta.processes_unlisted > 0 {
                let _ = write!(
                    out,
                    ", the records of the newest {} kept",
                    meta.processes.len()
                );
            }
            out.push('\n');
        } else {
            let _ = write!(
                out,
                "processes: {traced} traced ({exited} exited during the trace)"
            );
            // Traced for a while, then out of the scope: a process that
            // left the traced cgroup.
            let left = meta
                .processes
                .iter()
                .filter(|p| p.traced && p.exit_code.is_none() && p.not_traced.is_some())
                .count();
            if left > 0 {
                let _ = write!(out, ", {left} let go when they left the cgroup");
            }
            if not_traced > 0 {
                let _ = write!(out, ", {not_traced} not traced");
            }
            out.push('\n');
            for p in untraced.iter().take(UNTRACED_SHOWN) {
                let _ = writeln!(
                    out,
                    "not traced: {} (pid {}): {}",
                    p.name,
                    p.pid,
                    p.not_traced.as_deref().unwrap_or("not traced")
                );
            }
            let rest = not_traced - untraced.len().min(UNTRACED_SHOWN) as u64;
            if rest > 0 {
                let _ = writeln!(
                    out,
                    "not traced: {rest} more ({} listed in the JSON profile)",
                    untraced.len().saturating_sub(UNTRACED_SHOWN)
                );
            }
        }
        out.push_str(&by_process(profile));
    }
    if let Some(s) = &meta.sampling {
        let how = match s.kind.as_str() {
            "bytes" => format!("one sample per {} on average", bytes(s.rate)),
            _ => format!("one call in {}", s.rate),
        };
        let _ = writeln!(out, "sampled: {how}, {}", count(s.samples, "sample"));
        out.push_str("sampled: calls and bytes are unbiased estimates, frees are not counted\n");
    }
    if let Some(w) = &meta.windows {
        out.push_str(&super::text::windows_line(w, meta.duration_secs));
        out.push('\n');
    }
    for g in &profile.go_heaps {
        let _ = writeln!(
            out,
            "go heap: pid {} ({}), {}: its runtime's own sampled profile, {}, scaled as Go's pprof scales it; allocated {}, in use as of its last garbage collection{}",
            g.pid,
            g.name,
            g.version,
            if g.rate == 1 {
                "every allocation".to_string()
            } else {
                format!("one sample per {} on average (MemProfileRate, read from it)", bytes(g.rate))
            },
            if g.since == "start" {
                "since it started"
            } else {
                "since mtrace came"
            },
            if g.read_at == "exit" {
                " (read at its exit)"
            } else {
                ""
            }
        );
    }
    for u in &profile.unseen {
        let _ = writeln!(
            out,
            "not seen: {} (pid {}): {}: {}",
            u.name, u.pid, u.heap, u.why
        );
    }
    out
}

/// `go heap: N objects, B allocated, M objects, B in use (estimates)` and
/// what could not be read, over every Go program read.
fn go_totals_lines(profile: &Profile) -> String {
    if profile.go_heaps.is_empty() {
        return String::new();
    }
    let mut allocated = crate::profile::Counts::default();
    let mut in_use = crate::profile::Counts::default();
    let (mut buckets, mut unreadable, mut inconsistent, mut cut) = (0, 0, 0, 0);
    for g in &profile.go_heaps {
        allocated.add(g.allocated);
        in_use.add(g.in_use);
        buckets += g.buckets;
        unreadable += g.unreadable;
        inconsistent += g.inconsistent;
        cut += u64::from(g.cut);
    }
    format!(
        "go heap: {} allocated, {}; {} in use, {} (estimates)\ngo heap: {} buckets read; lost: unreadable {unreadable}, caught mid-update {inconsistent}, walks cut {cut}\n",
        count(allocated.calls, "object"),
        bytes(allocated.bytes),
        count(in_use.calls, "object"),
        bytes(in_use.bytes),
        buckets
    )
}

/// `#1  1000 calls  72.13%  46.9 KiB  avg 48 B  malloc` and the frames.
fn write_row<'a>(
    out: &mut impl Write,
    rank: usize,
    row: &Row<'a>,
    total_calls: u64,
    frames: &mut FrameTexts<'a>,
    offset_shown: impl Fn(usize) -> bool,
) -> fmt::Result {
    let paint = frames.paint();
    let counts = row.counts;
    let avg = counts.bytes.checked_div(counts.calls).unwrap_or(0);
    // A Go heap row counts the objects Go's sampling stands for.
    let unit = if row.func == GO_HEAP_FUNC {
        "object"
    } else {
        "call"
    };
    let mut first = format!(
        "#{rank}  {}  {:.2}%  {}  avg {}  ",
        count(counts.calls, unit),
        percent(counts.calls, total_calls),
        bytes(counts.bytes),
        bytes(avg),
    );
    first = paint.strong(&first);
    first.push_str(&paint.func(row.func));
    out.write_str(&first)?;
    if let Some(process) = row.process {
        write!(out, "  process {} (pid {})", process.name, process.pid)?;
    }
    if let Some(thread) = row.thread {
        write!(out, "  thread {} (tid {})", thread.name, thread.tid)?;
    }
    if row.truncated {
        out.write_str(&paint.warn("  [stack truncated]"))?;
    }
    out.write_char('\n')?;
    if row.frames.is_empty() {
        out.write_str("    [no frames]\n")?;
    }
    for (d, frame) in row.frames.iter().enumerate() {
        if offset_shown(d) {
            writeln!(out, "    {}", frame_text(&with_offset(frame), paint))?
        } else {
            writeln!(out, "    {}", frames.get(frame))?
        }
    }
    if let Some(u) = row.in_use {
        write!(
            out,
            "    in use: {}, {}",
            count(u.calls, "object"),
            bytes(u.bytes)
        )?;
        match row.object_size {
            Some(size) => writeln!(out, "; objects of {}", bytes(size))?,
            None => out.write_char('\n')?,
        }
    }
    if let Some(live) = row.live {
        out.write_str(&leaks::row_lines(live))?;
    }
    Ok(())
}

/// `2 more stacks (15 calls, 300 B) hidden by --top`
fn write_hidden(out: &mut impl Write, hidden: Hidden, option: &str) -> fmt::Result {
    if hidden.rows == 0 {
        return Ok(());
    }
    writeln!(
        out,
        "{} more {} ({}, {}) hidden by {option}",
        hidden.rows,
        if hidden.rows == 1 { "stack" } else { "stacks" },
        count(hidden.counts.calls, "call"),
        bytes(hidden.counts.bytes)
    )
}

/// The probed functions the kernel cannot emulate the first instruction
/// of (it single-steps them, about 20 µs a call instead of 1), with the
/// calls that paid it; nothing when no call did.
fn single_stepped_lines(profile: &Profile) -> String {
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
    if paid.is_empty() {
        return String::new();
    }
    wrap_list("single-stepped probes (20 us a call, not 1)", &paid, "")
}

/// `total: N allocation calls, B requested, F frees`, then `by function:`
/// the allocation functions with calls, most first.
fn totals_lines(profile: &Profile, paint: Paint) -> String {
    let totals = &profile.totals;
    let mut out = format!(
        "{} {} requested, {}\n",
        paint.strong(&format!(
            "total: {},",
            count(totals.allocs.calls, "allocation call")
        )),
        bytes(totals.allocs.bytes),
        if totals.frees_counted {
            count(totals.frees, "free")
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
        out.push_str(&wrap_list("by function", &list, ""));
    }
    out
}

/// Printed in every report, even when nothing was lost; yellow when
/// something was.
fn losses_lines(l: &Losses, paint: Paint) -> String {
    let items = [
        ("map full", l.map_full),
        ("stack walk failed", l.stack_walk_failed),
        ("stack collisions", l.stack_collisions),
        ("stack map full", l.stack_map_full),
        ("caller unreadable", l.caller_unreadable),
        ("thread names", l.thread_names_full),
    ]
    .map(|(what, n)| format!("{what} {n}"));
    let text = wrap_list("lost", &items, "");
    let any = [
        l.map_full,
        l.stack_walk_failed,
        l.stack_collisions,
        l.stack_map_full,
        l.caller_unreadable,
        l.thread_names_full,
    ]
    .iter()
    .any(|&n| n > 0);
    if !any {
        return text;
    }
    text.lines()
        .map(|line| {
            let rest = line.strip_prefix("lost:").unwrap_or(line);
            format!("{}{rest}\n", paint.warn("lost:"))
        })
        .collect()
}

/// What the nonzero losses mean and which option helps, one note each
/// (each within 80 columns after `note: `).
fn losses_notes(l: &Losses) -> Vec<&'static str> {
    let mut notes = Vec::new();
    if l.map_full > 0 {
        notes.push("map full: calls in the totals, in no stack (raise --count-map-size)");
    }
    if l.stack_walk_failed > 0 {
        notes.push("stack walk failed: counted under the direct caller only");
    }
    if l.stack_collisions > 0 || l.stack_map_full > 0 {
        notes.push("stack map full or collisions: direct caller only (raise --stack-map-size)");
    }
    if l.caller_unreadable > 0 {
        notes.push("caller unreadable: the return address could not be read");
    }
    if l.thread_names_full > 0 {
        notes.push("thread names: name map full, names read from /proc instead");
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{entry, on_thread, profile};
    use super::super::SortKey;
    use super::*;
    use crate::profile::{Counts, Frame, StackQuality};
    use std::sync::Arc;

    const NO_LOSSES: &str = "\
lost: map full 0, stack walk failed 0, stack collisions 0, stack map full 0,
lost: caller unreadable 0, thread names 0";

    fn all(per_thread: bool) -> ReportOptions {
        ReportOptions {
            top: 0,
            threshold_pct: 0.0,
            sort: SortKey::Calls,
            per_thread,
            per_process: false,
            color: false,
        }
    }

    fn sample() -> Profile {
        let mut leaf = entry("malloc", &[], 1000, 48000);
        leaf.frames = vec![
            Arc::new(Frame {
                function: "make_node".into(),
                file: Some("/src/list.c".into()),
                line: Some(12),
                module: Some("/tmp/fixture".into()),
                addr: 0x1234,
                inlined: true,
                ..Default::default()
            }),
            Arc::new(Frame {
                function: "main".into(),
                file: Some("/src/main.c".into()),
                line: Some(30),
                module: Some("/tmp/fixture".into()),
                addr: 0x1300,
                inlined: false,
                ..Default::default()
            }),
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
mtrace: pid 1234, 1.23 s
command: ./fixture arg
probes: /usr/lib/x86_64-linux-gnu/libc.so.6

#1  1000 calls  72.15%  46.9 KiB  avg 48 B  malloc
    make_node (list.c:12) [inlined]
    main (main.c:30)

#2  250 calls  18.04%  2.4 KiB  avg 10 B  calloc
    zeroed
    main

#3  136 calls  9.81%  15.1 KiB  avg 113 B  realloc
    grow
    main

total: 1386 allocation calls, 64.5 KiB requested, 1200 frees
by function: malloc 1000, calloc 250, realloc 136
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
        assert!(l.contains(&"1 more stack (136 calls, 15.1 KiB) hidden by --threshold"));
        assert!(l.contains(&"1 more stack (250 calls, 2.4 KiB) hidden by --top"));
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
        assert!(l.contains(&"#1  3 calls  75.00%  30 B  avg 10 B  malloc  thread worker (tid 42)"));
        assert!(l.contains(&"#2  1 call  25.00%  10 B  avg 10 B  malloc  thread main (tid 7)"));

        let out = render(&p, &all(false));
        assert!(lines(&out).contains(&"#1  4 calls  100.00%  40 B  avg 10 B  malloc"));
        assert!(!out.contains("(tid "));
    }

    #[test]
    fn truncated_rows_are_marked() {
        let mut e = entry("malloc", &["a"], 2, 20);
        e.truncated = true;
        let out = render(&profile(vec![e]), &all(false));
        assert!(lines(&out)
            .contains(&"#1  2 calls  100.00%  20 B  avg 10 B  malloc  [stack truncated]"));
    }

    #[test]
    fn empty_profile_says_so_and_still_prints_losses() {
        let out = render(&Profile::default(), &all(false));
        let l = lines(&out);
        assert_eq!(l[0], "mtrace: pid 0, 0.00 s");
        assert_eq!(l[1], "");
        assert!(l.contains(&"no allocations traced"));
        assert!(l.contains(&"total: 0 allocation calls, 0 B requested, 0 frees"));
        assert!(out.ends_with(&format!("{NO_LOSSES}\n")));
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
        assert!(out.contains(
            "lost: map full 3, stack walk failed 0, stack collisions 2, stack map full 0,\n\
             lost: caller unreadable 0, thread names 0\n"
        ));
        let notes: Vec<&str> = l
            .iter()
            .copied()
            .filter(|l| l.starts_with("note: "))
            .collect();
        assert_eq!(notes.len(), 2, "{out}");
        assert!(notes[0].contains("--count-map-size"));
        assert!(notes[1].contains("--stack-map-size"));
        assert!(!out.contains("caller unreadable:"));
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
        let line = "single-stepped probes (20 us a call, not 1): malloc 1000";
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
        assert!(lines(&out).contains(&"#1  0 calls  0.00%  0 B  avg 0 B  malloc"));
        assert!(lines(&out).contains(&"total: 0 allocation calls, 0 B requested, 0 frees"));
    }

    /// A live profile of a process tree, sampled, with losses: every line
    /// but the frames within 80 columns.
    #[test]
    fn lines_fit_80_columns() {
        let mut p = sample();
        p.meta.allocator_family = "glibc".into();
        p.meta.allocator_version = "2.36".into();
        p.meta.processes = (0..3)
            .map(|i| crate::profile::ProcessMeta {
                pid: 100 + i,
                name: format!("worker{i}"),
                traced: i == 0,
                not_traced: (i > 0).then(|| "more than 1 process at once".to_string()),
                ..Default::default()
            })
            .collect();
        p.meta.sampling = Some(crate::profile::SamplingInfo {
            kind: "bytes".into(),
            rate: 512 * 1024,
            samples: 1,
        });
        for (i, name) in ["posix_memalign", "aligned_alloc", "reallocarray", "valloc"]
            .iter()
            .enumerate()
        {
            p.totals.per_func.insert(
                name.to_string(),
                Counts {
                    calls: 123_456 + i as u64,
                    bytes: 1,
                },
            );
        }
        p.losses = Losses {
            map_full: 123_456,
            stack_walk_failed: 123_456,
            stack_collisions: 123_456,
            stack_map_full: 123_456,
            caller_unreadable: 123_456,
            thread_names_full: 123_456,
        };
        p.stack_quality = Some(StackQuality {
            calls: 10,
            whole: 5,
            truncated: [
                "no_cfi",
                "max_frames",
                "bad_frame",
                "read_failed",
                "copy_lost",
            ]
            .iter()
            .map(|k| (k.to_string(), 1_000_000))
            .collect(),
            finished_by_tracer: 0,
            walked_in_kernel: 0,
            frame_limit: Some(126),
            python: Some(crate::profile::PythonQuality {
                with_frames: 1_000_000_000,
                no_interpreter: 1_000_000,
                no_thread_state: 1_000_000,
                no_code_running: 1_000_000,
                threads_beyond: 1_000_000,
                cut: 1_000_000,
                unreadable: 1_000_000,
                unnamed: 1_000_000,
                notices_lost: 1_000_000,
            }),
            perf_map: Some(crate::profile::PerfMapQuality {
                lines: 1_000_000_000_000,
                kept: 1_000_000_000,
                evicted: 1_000_000_000_000,
                names_cut: 1_000_000_000,
                bad_lines: 1_000_000_000,
                unread_bytes: 123 << 30,
                rereads: 1_000_000,
            }),
            symbols: Some(crate::profile::SymbolsQuality {
                stripped_files: 1_000_000,
                local: 1_000_000,
                fetched: 1_000_000,
                not_on_servers: 1_000_000,
                not_fetched: 1_000_000,
            }),
        });
        p.live = Some(crate::profile::LiveTotals {
            peak_bytes: 123 << 30,
            untracked: 5,
            events_lost: 1_000_000,
            live_map_size: 262_144,
            old_outstanding: 1,
            old_outstanding_bytes: 16384,
            ..Default::default()
        });
        p.stacks[0].live = Some(crate::profile::LiveStats {
            allocations: 1_000_000,
            outstanding: 1_000_000,
            outstanding_bytes: 1 << 40,
            oldest_age_secs: 12345.0,
            old_outstanding: 1,
            old_outstanding_bytes: 16384,
            max_live_bytes: 1 << 40,
            live_bytes_at_peak: 1 << 40,
            temporaries: 1_000_000,
            size: Some(crate::profile::Percentiles {
                p50: 16384,
                p90: 16384,
                p99: 1 << 30,
                max: 1 << 30,
            }),
            lifetime_ns: None,
            ..Default::default()
        });
        let out = render(&p, &all(false));
        let frames = ["    make_node", "    main", "    zeroed", "    grow"];
        for line in out.lines() {
            if !frames.iter().any(|f| line.starts_with(f)) {
                assert!(line.len() <= 80, "{} columns: {line:?}\n{out}", line.len());
            }
        }
        assert!(out.contains("\n#1  1 block  16.0 KiB  oldest "), "{out}");
        assert!(out.contains("\n    size: p50 16.0 KiB, p90 16.0 KiB, p99 1.0 GiB, max 1.0 GiB\n"));
        assert!(out.contains("\nsampled: one sample per 512.0 KiB on average, 1 sample\n"));
        assert!(out.contains("\nnot traced: worker2 (pid 102): more than 1 process at once\n"));
    }

    /// The host scope counts every process; those whose records were not
    /// kept are counted among those that allocated, never as untraced.
    #[test]
    fn host_scope_counts_processes_beyond_the_records_kept() {
        let mut p = sample();
        p.meta.scope = "host".into();
        p.meta.processes = (0..2)
            .map(|i| crate::profile::ProcessMeta {
                pid: 100 + i,
                name: format!("worker{i}"),
                traced: true,
                ..Default::default()
            })
            .collect();
        p.meta.processes_unlisted = 5;
        let out = render(&p, &all(false));
        assert!(
            out.contains(
                "\nprocesses: 7 allocated (one per exec), the records of the newest 2 kept\n"
            ),
            "{out}"
        );
        assert!(!out.contains("not traced"), "{out}");
    }

    #[test]
    fn colour_only_when_asked() {
        let mut o = all(false);
        assert!(!render(&sample(), &o).contains('\u{1b}'));
        o.color = true;
        let out = render(&sample(), &o);
        assert!(out.contains("\u{1b}[1m#1  1000 calls  72.15%  46.9 KiB  avg 48 B  \u{1b}[0m"));
        assert!(out.contains("main\u{1b}[2m (main.c:30)\u{1b}[0m"), "{out}");
    }
}
