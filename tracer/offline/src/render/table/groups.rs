//! The table's lines by test (`--per-test`) and by group (`--group`),
//! after the totals:
//!
//! ```text
//! by test (3 tests):
//!       20001 calls  312.5 KiB  tests::allocates_twenty_thousand_boxes
//!        5001 calls   78.1 KiB  tests::allocates_five_thousand_boxes
//!        1001 calls   15.6 KiB  tests::allocates_one_thousand_boxes
//! outside any test: 677 calls, 98.4 KiB
//! ```
//!
//! With `--per-thread`, each thread's totals come first (`by thread`,
//! named `NAME (TID)`).
//!
//! In live mode each line ends with the blocks still outstanding
//! (`, 3 live (24 B)`). Rows go in the table's order (calls, bytes, or
//! bytes outstanding) and at most `--top` of them are shown.

use std::fmt::{self, Write};

use crate::profile::groups::{self, GroupTotals};
use crate::profile::Profile;
use crate::render::text::{bytes, count, shown};
use crate::render::{ReportOptions, SortKey};

/// The lines of `profile`'s tests and groups, if it has any.
pub fn lines(out: &mut impl Write, profile: &Profile, opts: &ReportOptions) -> fmt::Result {
    if opts.per_thread {
        let threads = groups::threads(profile);
        if !threads.is_empty() {
            section(out, "thread", &threads, opts)?;
        }
    }
    if !profile.tests.is_empty() {
        section(out, "test", &profile.tests, opts)?;
        let outside = groups::outside(profile, &profile.tests);
        writeln!(
            out,
            "outside any test: {}, {}",
            count(outside.calls, "call"),
            bytes(outside.bytes)
        )?;
    }
    if !profile.groups.is_empty() {
        section(out, "group", &profile.groups, opts)?;
    }
    Ok(())
}

fn section(
    out: &mut impl Write,
    noun: &str,
    rows: &[GroupTotals],
    opts: &ReportOptions,
) -> fmt::Result {
    let mut sorted: Vec<&GroupTotals> = rows.iter().collect();
    let key = |g: &GroupTotals| match opts.sort {
        SortKey::Calls => g.counts.calls,
        SortKey::Bytes => g.counts.bytes,
        SortKey::Live => g.live.map_or(g.counts.bytes, |l| l.outstanding_bytes),
    };
    // Stable: equal rows keep their order (tests by name, groups as named).
    sorted.sort_by_key(|g| std::cmp::Reverse(key(g)));
    writeln!(out, "by {noun} ({}):", count(rows.len() as u64, noun))?;
    let listed = if opts.top == 0 {
        sorted.len()
    } else {
        opts.top.min(sorted.len())
    };
    for g in &sorted[..listed] {
        write!(
            out,
            "{:>11} calls {:>10}  {}",
            g.counts.calls,
            bytes(g.counts.bytes),
            shown(&g.name)
        )?;
        if let Some(l) = g.live {
            write!(
                out,
                ", {} live ({})",
                l.outstanding,
                bytes(l.outstanding_bytes)
            )?;
        }
        out.write_char('\n')?;
    }
    if listed < sorted.len() {
        writeln!(
            out,
            "{} more {noun}{} hidden by --top",
            sorted.len() - listed,
            if sorted.len() - listed == 1 { "" } else { "s" }
        )?;
    }
    Ok(())
}
