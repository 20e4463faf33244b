//! The HTML report: one self-contained page (no network at view time)
//! with the summary and every loss counter, a sortable table of stacks,
//! flame graphs of each weight (toggled), leak suspects, size and lifetime
//! distributions and the trace over time.
//!
//! The flame graphs are inferno's SVGs, each in an iframe of its own (a
//! `data:` URL) so that inferno's script (zoom, search) runs once per
//! graph, loaded when first shown; the charts are plotters' SVGs inline
//! ([`plots`]). The page's own script (report.js) only sorts tables and
//! switches the flame graph. Each part of the page is a file of its own:
//! `summary.rs`, `flames.rs`, `stacks.rs` (the tables) and `charts.rs`.

use std::fmt::Write as _;

use anyhow::Result;

use super::{
    select,
    text::{printable, shown_profile},
    ReportOptions,
};
use crate::profile::Profile;

mod charts;
mod flames;
mod stacks;
mod summary;
#[cfg(test)]
mod tests;

use charts::{distributions, timeline};
use flames::flame_graphs;
use stacks::{groups, leak_suspects, stacks};
use summary::summary;

pub mod plots;

const STYLE: &str = include_str!("report.css");
const SCRIPT: &str = include_str!("report.js");

/// Rows at most in the table of stacks (the page stays quick to open).
pub const MAX_ROWS: usize = 5000;

/// Stacks at most in each distribution chart.
const SPREAD_STACKS: usize = 12;

/// Renders `profile` as an HTML page. Of `opts`, the table keeps the
/// threshold and the split by thread or process, and starts in the sort
/// order; every stack passing the threshold is a row (up to [`MAX_ROWS`]).
pub fn render(profile: &Profile, opts: &ReportOptions) -> Result<String> {
    // Names as the table shows them: control characters escaped, a name
    // of more than NAME_CHARS characters cut (the flame graphs' too).
    let profile = &*shown_profile(profile);
    let meta = &profile.meta;
    let title = format!("mtrace: {} (pid {})", meta.command, meta.pid);
    let all = ReportOptions {
        top: MAX_ROWS,
        ..opts.clone()
    };
    let selection = select(profile, &all);
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{}</title><link rel=\"icon\" href=\"data:,\"><style>{STYLE}</style></head>\n<body>\n\
         <header><h1>{}</h1><nav><a href=\"#summary\">summary</a> <a href=\"#flamegraph\">flame graph</a> \
         <a href=\"#stacks\">stacks</a>{} <a href=\"#distributions\">distributions</a> \
         <a href=\"#timeline\">over time</a></nav></header>\n",
        esc(&title),
        esc(&title),
        if profile.live.is_some() {
            " <a href=\"#leaks\">leak suspects</a>"
        } else {
            ""
        },
    );
    summary(&mut out, profile);
    flame_graphs(&mut out, profile, opts.per_thread, &title)?;
    stacks(
        &mut out,
        profile,
        &selection.rows,
        selection.hidden_by_threshold.rows + selection.hidden_by_top.rows,
    );
    groups(&mut out, "tests", "Tests", "test", &profile.tests);
    groups(&mut out, "groups", "Groups", "group", &profile.groups);
    if profile.live.is_some() {
        leak_suspects(&mut out, profile);
    }
    distributions(&mut out, profile, &selection.rows)?;
    timeline(&mut out, profile)?;
    let version = if meta.mtrace_version.is_empty() {
        env!("CARGO_PKG_VERSION")
    } else {
        &meta.mtrace_version
    };
    let _ = write!(
        out,
        "<footer>mtrace {}</footer>\n<script>{SCRIPT}</script>\n</body></html>\n",
        esc(version)
    );
    Ok(out)
}

/// `s` with the characters HTML gives a meaning escaped (text and
/// attribute values alike), and those a terminal acts on written as
/// their escapes, as the table writes them ([`printable`]): the page
/// carries no raw control character, whatever the profile held.
pub fn esc(s: &str) -> String {
    let s = printable(s);
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A `<tr>` of a key and an already escaped value.
fn kv(out: &mut String, key: &str, value: &str) {
    let _ = writeln!(out, "<tr><th>{}</th><td>{value}</td></tr>", esc(key));
}
