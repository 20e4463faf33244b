//! The diff table of `mtrace diff`: total and per-stack changes, largest
//! first.
//!
//! ```text
//! total: calls 1000 -> 1200 (+200, +20.00%), bytes 48000 -> 57600 (+9600, +20.00%)
//!
//! #1  calls +200 (+20.00%, 1000 -> 1200)  bytes +9600 (+20.00%, 48000 -> 57600)  malloc
//!     alloc_small [fixture]
//!     main [fixture]
//!
//! 3 stacks unchanged
//! ```

use std::fmt::{self, Write};
use std::sync::Arc;

use foldhash::HashMap;

use super::{text::cut, Weight};
use crate::diff::{pct_change, Change, Diff, DiffRow, KeyFrame};

/// `+200`, `-3`, `+0`.
fn signed(delta: i128) -> String {
    format!("{delta:+}")
}

/// `calls 1000 -> 1200 (+200, +20.00%)`
fn side_by_side(change: &Change, weight: Weight) -> String {
    describe_change(change, weight, false)
}

/// `calls +200 (+20.00%, 1000 -> 1200)`
fn row_delta(change: &Change, weight: Weight) -> String {
    describe_change(change, weight, true)
}

fn describe_change(change: &Change, weight: Weight, delta_first: bool) -> String {
    let (b, n) = (weight.of(change.base), weight.of(change.new));
    let (delta, pct) = (signed(change.delta(weight)), pct_change(b, n));
    if delta_first {
        format!("{} {delta} ({pct}, {b} -> {n})", weight.unit())
    } else {
        format!("{} {b} -> {n} ({delta}, {pct})", weight.unit())
    }
}

/// Each test's and group's change, after the table, where the diff has
/// them:
///
/// ```text
/// test tests::parse: calls 5001 -> 10002 (+5001, +100.00%), bytes 80016 -> 160032 (+80016, +100.00%)
/// ```
pub fn render_groups_to(to: &mut impl Write, diff: &Diff) -> fmt::Result {
    for (noun, list) in [("test", &diff.tests), ("group", &diff.groups)] {
        if list.is_empty() {
            continue;
        }
        to.write_char('\n')?;
        for g in list {
            writeln!(
                to,
                "{noun} {}: {}, {}",
                cut(&g.name),
                side_by_side(&g.change, Weight::Calls),
                side_by_side(&g.change, Weight::Bytes)
            )?;
        }
    }
    Ok(())
}

pub fn render_table(diff: &Diff, top: usize) -> String {
    let mut out = String::new();
    // Writing to a string does not fail.
    let _ = render_table_to(&mut out, diff, top);
    out
}

/// [`render_table`], written to `to` row by row, each frame's line as it
/// is made: the text is never held whole. Stops at the first failed
/// write.
pub fn render_table_to(to: &mut impl Write, diff: &Diff, top: usize) -> fmt::Result {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "total: {}, {}",
        side_by_side(&diff.total, Weight::Calls),
        side_by_side(&diff.total, Weight::Bytes)
    );
    if diff.in_stacks != diff.total {
        let _ = writeln!(
            out,
            "in stacks: {}, {} (the rest is in the totals only: allocations lost to a full map)",
            side_by_side(&diff.in_stacks, Weight::Calls),
            side_by_side(&diff.in_stacks, Weight::Bytes)
        );
    }

    if let (Some(b), Some(n)) = diff.whole_pct {
        if b < 99.0 || n < 99.0 {
            let _ = writeln!(
                out,
                "whole stacks: {b:.2}% -> {n:.2}% (stacks cut short match less well across runs)"
            );
        }
    }

    let changed: Vec<&DiffRow> = diff
        .rows
        .iter()
        .filter(|r| !r.change.is_unchanged())
        .collect();
    let unchanged = diff.rows.len() - changed.len();
    let shown = if top == 0 {
        changed.len()
    } else {
        top.min(changed.len())
    };
    to.write_str(&out)?;
    let mut frames = FrameLines::default();
    for (i, row) in changed[..shown].iter().enumerate() {
        to.write_char('\n')?;
        write_row(to, i + 1, row, &mut frames)?;
    }

    let mut out = String::from("\n");
    if changed.is_empty() {
        out.push_str("no stack changed\n");
    }
    let hidden = &changed[shown..];
    if !hidden.is_empty() {
        let (mut calls, mut bytes) = (0i128, 0i128);
        for row in hidden {
            calls += row.change.delta(Weight::Calls);
            bytes += row.change.delta(Weight::Bytes);
        }
        let _ = writeln!(
            out,
            "{} more changed stack{} (calls {}, bytes {}) hidden by --top",
            hidden.len(),
            if hidden.len() == 1 { "" } else { "s" },
            signed(calls),
            signed(bytes)
        );
    }
    if unchanged > 0 {
        let _ = writeln!(
            out,
            "{unchanged} stack{} unchanged",
            if unchanged == 1 { "" } else { "s" }
        );
    }
    to.write_str(&out)
}

/// Each key frame's line, `    function [module]`, made once per [`Arc`]
/// of it however many rows name it.
#[derive(Default)]
struct FrameLines {
    made: HashMap<*const KeyFrame, String>,
}

impl FrameLines {
    /// The line of `frame`, which the diff keeps (and so its address)
    /// while this lives.
    fn get(&mut self, frame: &Arc<KeyFrame>) -> &str {
        self.made.entry(Arc::as_ptr(frame)).or_insert_with(|| {
            let mut line = format!("    {}", cut(&frame.function));
            if let Some(module) = &frame.module {
                let _ = write!(line, " [{}]", cut(module));
            }
            line
        })
    }
}

/// `#1  calls +200 (+20.00%, 1000 -> 1200)  bytes ...  malloc` and the
/// frames, `function [module]`, innermost first.
fn write_row(
    out: &mut impl Write,
    rank: usize,
    row: &DiffRow,
    frames: &mut FrameLines,
) -> fmt::Result {
    write!(
        out,
        "#{rank}  {}  {}  {}",
        row_delta(&row.change, Weight::Calls),
        row_delta(&row.change, Weight::Bytes),
        cut(&row.key.func)
    )?;
    if row.key.truncated {
        out.write_str("  [stack truncated]")?;
    }
    out.write_char('\n')?;
    if row.key.frames.is_empty() {
        out.write_str("    [no frames]\n")?;
    }
    for frame in &row.key.frames {
        writeln!(out, "{}", frames.get(frame))?;
    }
    Ok(())
}
