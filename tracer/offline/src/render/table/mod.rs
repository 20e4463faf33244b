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
//!
//! This file writes the rows; each other part of the report is a file of
//! its own: the header in `header.rs`, the totals and the losses in
//! `totals.rs`, the lines by test and by group in `groups.rs`, and the
//! live-mode lines and leak suspects in `leaks.rs`.

use std::fmt::{self, Write};

use crate::profile::{Profile, GO_HEAP_FUNC};

use super::apart::{told_apart, with_offset};
use super::text::{
    bytes, count, frame_text, map_names, printable, quality_lines, shown, FrameTexts, Paint,
};
use super::{percent, select, Hidden, ReportOptions, Row};
use header::header;
use totals::{go_totals_lines, losses_lines, losses_notes, single_stepped_lines, totals_lines};

mod groups;
mod header;
mod leaks;
#[cfg(test)]
mod tests;
mod totals;

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
