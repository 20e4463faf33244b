//! The sortable table of stacks, the tables of tests and groups, and live
//! mode's leak suspects.

use std::{fmt::Write as _, sync::Arc};

use super::{esc, MAX_ROWS};
use crate::profile::{groups::GroupTotals, Frame, LiveStats, Profile};
use crate::render::{
    percent, suspects,
    text::{bytes, duration_ns},
    Row,
};

/// A `<td>` sorted by `v`, showing `text`.
fn num_cell(out: &mut String, v: f64, text: &str) {
    let _ = write!(out, "<td data-v=\"{v}\">{}</td>", esc(text));
}

/// The frames of a stack, innermost first, the first one as the summary.
fn stack_cell(out: &mut String, entry_frames: &[Arc<Frame>], truncated: bool) {
    let first = entry_frames
        .first()
        .map_or("[unknown]".to_string(), |f| f.describe());
    let _ = write!(
        out,
        "<td class=\"stack\" data-v=\"{}\"><details><summary>{}</summary><ol>",
        esc(&first),
        esc(&first)
    );
    for f in entry_frames.iter().skip(1) {
        let _ = write!(out, "<li>{}</li>", esc(&f.describe()));
    }
    if truncated {
        out.push_str("<li class=\"note\">(stack cut short)</li>");
    }
    out.push_str("</ol></details></td>");
}

/// A sortable table of tests (`--per-test`) or groups (`--group`), where
/// the profile has them.
pub(super) fn groups(out: &mut String, id: &str, title: &str, noun: &str, rows: &[GroupTotals]) {
    if rows.is_empty() {
        return;
    }
    let live = rows.iter().any(|g| g.live.is_some());
    let _ = write!(
        out,
        "<section id=\"{id}\"><h2>{title}</h2>\n<table class=\"sortable\"><thead><tr><th>{noun}</th>\
         <th class=\"num\">calls</th><th class=\"num\">bytes</th>"
    );
    if live {
        out.push_str("<th class=\"num\">outstanding</th><th class=\"num\">in use</th>");
    }
    out.push_str("</tr></thead><tbody>\n");
    for g in rows {
        let _ = write!(out, "<tr><td>{}</td>", esc(&g.name));
        num_cell(out, g.counts.calls as f64, &g.counts.calls.to_string());
        num_cell(out, g.counts.bytes as f64, &bytes(g.counts.bytes));
        if let Some(l) = g.live {
            num_cell(out, l.outstanding as f64, &l.outstanding.to_string());
            num_cell(out, l.outstanding_bytes as f64, &bytes(l.outstanding_bytes));
        } else if live {
            out.push_str("<td></td><td></td>");
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</tbody></table></section>\n");
}

pub(super) fn stacks(out: &mut String, profile: &Profile, rows: &[Row<'_>], hidden: usize) {
    let live = profile.live.is_some();
    let total = profile.totals.allocs;
    let split = rows
        .iter()
        .any(|r| r.thread.is_some() || r.process.is_some());
    let _ = write!(
        out,
        "<section id=\"stacks\"><h2>Stacks</h2><p class=\"note\">{} stacks{}; click a column to sort, a stack to unfold it.</p>\n\
         <table class=\"sortable stacks\"><thead><tr><th class=\"num\">#</th><th>function</th><th>stack (innermost first)</th>",
        rows.len(),
        if hidden > 0 {
            format!(", {hidden} more hidden by --threshold or beyond {MAX_ROWS}")
        } else {
            String::new()
        }
    );
    if split {
        out.push_str("<th>thread / process</th>");
    }
    out.push_str("<th class=\"num\">calls</th><th class=\"num\">% calls</th><th class=\"num\">bytes</th><th class=\"num\">% bytes</th><th class=\"num\">avg size</th>");
    if live {
        out.push_str(
            "<th class=\"num\">in use</th><th class=\"num\">leaked</th><th class=\"num\">temporaries</th>\
             <th class=\"num\">size p50</th><th class=\"num\">size p99</th><th class=\"num\">size max</th>\
             <th class=\"num\">lifetime p50</th><th class=\"num\">lifetime p99</th>",
        );
    }
    out.push_str("</tr></thead><tbody>\n");
    for (i, row) in rows.iter().enumerate() {
        let c = row.counts;
        let _ = write!(
            out,
            "<tr><td data-v=\"{}\">{}</td><td>{}</td>",
            i + 1,
            i + 1,
            esc(row.func)
        );
        stack_cell(out, row.frames, row.truncated);
        if split {
            let mut who = Vec::new();
            if let Some(t) = row.thread {
                who.push(format!("{} ({})", t.name, t.tid));
            }
            if let Some(p) = row.process {
                who.push(format!("{} (pid {})", p.name, p.pid));
            }
            let _ = write!(out, "<td>{}</td>", esc(&who.join(", ")));
        }
        num_cell(out, c.calls as f64, &c.calls.to_string());
        let pc = percent(c.calls, total.calls);
        num_cell(out, pc, &format!("{pc:.2}%"));
        num_cell(out, c.bytes as f64, &bytes(c.bytes));
        let pb = percent(c.bytes, total.bytes);
        num_cell(out, pb, &format!("{pb:.2}%"));
        let avg = c.bytes.checked_div(c.calls).unwrap_or(0);
        num_cell(out, avg as f64, &bytes(avg));
        if live {
            live_cells(out, row.live);
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</tbody></table></section>\n");
}

fn live_cells(out: &mut String, live: Option<&LiveStats>) {
    let Some(l) = live else {
        // Several entries merged into the row: their percentiles do not add.
        for _ in 0..8 {
            num_cell(out, -1.0, "–");
        }
        return;
    };
    for b in [l.outstanding_bytes, l.old_outstanding_bytes] {
        num_cell(out, b as f64, &bytes(b));
    }
    num_cell(out, l.temporaries as f64, &l.temporaries.to_string());
    for v in l
        .size
        .map_or([None; 3], |p| [Some(p.p50), Some(p.p99), Some(p.max)])
    {
        match v {
            Some(v) => num_cell(out, v as f64, &bytes(v)),
            None => num_cell(out, -1.0, "–"),
        }
    }
    for v in l
        .lifetime_ns
        .map_or([None; 2], |p| [Some(p.p50), Some(p.p99)])
    {
        match v {
            Some(v) => num_cell(out, v as f64, &duration_ns(v)),
            None => num_cell(out, -1.0, "none freed"),
        }
    }
}

pub(super) fn leak_suspects(out: &mut String, profile: &Profile) {
    let Some(totals) = &profile.live else { return };
    let suspects = suspects(profile);
    let age = if totals.min_age_secs > 0.0 {
        format!(", at least {} s old", totals.min_age_secs)
    } else {
        String::new()
    };
    let _ = write!(
        out,
        "<section id=\"leaks\"><h2>Leak suspects</h2><p class=\"note\">Blocks still allocated when tracing ended{age}: {} blocks, {}.",
        totals.old_outstanding,
        bytes(totals.old_outstanding_bytes)
    );
    if totals.frees_lost > 0 {
        let _ = write!(
            out,
            " Uncertain: {} frees were lost, and a lost free leaves its block among these.",
            totals.frees_lost
        );
    }
    // As the table says it: blocks the full map did not follow, and
    // allocations lost outright, may be leaks too.
    let young = totals.min_age_secs > profile.meta.duration_secs;
    let untracked = totals.untracked > 0 && !young;
    if untracked {
        let _ = write!(
            out,
            " Uncertain: {} allocations were not followed (the live map of {} was full): leaks among them cannot be named; raise --live-map-size.",
            totals.untracked, totals.live_map_size
        );
    }
    let lost = totals.allocs_lost + totals.pending_full;
    if lost > 0 && !young {
        let _ = write!(
            out,
            " Uncertain: {} allocations were lost (their ring and the queue kept aside full, or the call not followed to its return): at most {lost} leaks are missing from these; raise --event-buffer-size.",
            lost
        );
    }
    out.push_str("</p>\n");
    if suspects.is_empty() {
        out.push_str(if untracked || (lost > 0 && !young) {
            "<p>None among the blocks followed.</p></section>\n"
        } else {
            "<p>None.</p></section>\n"
        });
        return;
    }
    out.push_str(
        "<table class=\"sortable leaks\"><thead><tr><th class=\"num\">blocks</th><th class=\"num\">bytes</th>\
         <th class=\"num\">oldest</th><th>function</th><th>stack (innermost first)</th></tr></thead><tbody>\n",
    );
    for (entry, l) in suspects {
        out.push_str("<tr>");
        num_cell(
            out,
            l.old_outstanding as f64,
            &l.old_outstanding.to_string(),
        );
        num_cell(
            out,
            l.old_outstanding_bytes as f64,
            &bytes(l.old_outstanding_bytes),
        );
        num_cell(
            out,
            l.oldest_age_secs,
            &format!("{:.2} s", l.oldest_age_secs),
        );
        let _ = write!(out, "<td>{}</td>", esc(&entry.func));
        stack_cell(out, &entry.frames, entry.truncated);
        out.push_str("</tr>\n");
    }
    out.push_str("</tbody></table></section>\n");
}
