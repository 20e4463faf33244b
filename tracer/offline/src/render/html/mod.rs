//! The HTML report: one self-contained page (no network at view time)
//! with the summary and every loss counter, a sortable table of stacks,
//! flame graphs of each weight (toggled), leak suspects, size and lifetime
//! distributions and the trace over time.
//!
//! The flame graphs are inferno's SVGs, each in an iframe of its own (a
//! `data:` URL) so that inferno's script (zoom, search) runs once per
//! graph, loaded when first shown; the charts are plotters' SVGs inline ([`plots`]). The page's own
//! script (report.js) only sorts tables and switches the flame graph.

use std::{fmt::Write as _, sync::Arc};

use anyhow::Result;
use base64::Engine as _;

use super::{
    flamegraph::{self, Kind},
    folded, percent, select, suspects,
    text::{bytes, duration_ns, printable, short_count, shown_profile},
    ReportOptions, Row, Weight,
};
use crate::profile::{groups::GroupTotals, Frame, LiveStats, LiveTotals, Profile, StackEntry};

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

/// Live mode's loss counters (fields of [`LiveTotals`]), shown with the
/// other losses.
const LIVE_LOSSES: [&str; 10] = [
    "untracked",
    "frees_unknown",
    "events_lost",
    "frees_kept",
    "frees_lost",
    "allocs_kept",
    "allocs_lost",
    "stale",
    "pending_full",
    "inline_unfinished",
];

/// Every field of a struct of loss counters, labelled by its name (a
/// counter added to the profile shows without a change here), those
/// above 0 marked; `only`, when given, picks the fields.
fn loss_counters<T: serde::Serialize>(out: &mut String, value: &T, only: Option<&[&str]>) {
    if let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(value) {
        for (name, v) in fields {
            if only.is_some_and(|o| !o.contains(&name.as_str())) {
                continue;
            }
            let shown = match v.as_u64() {
                Some(n) if n > 0 => format!("<b class=\"lost\">{n}</b>"),
                _ => esc(&v.to_string()),
            };
            kv(out, &name.replace('_', " "), &shown);
        }
    }
}

/// `N blocks, X`.
fn blocks(n: u64, size: u64) -> String {
    format!("{n} blocks, {}", bytes(size))
}

/// The heap table of live mode: what [`LiveTotals`] holds but its losses.
fn live_heap(out: &mut String, live: &LiveTotals) {
    out.push_str("<table class=\"kv\"><caption>live heap (as traced)</caption>\n");
    kv(
        out,
        "peak",
        &format!("{} at {:.3} s", bytes(live.peak_bytes), live.peak_secs),
    );
    kv(
        out,
        "outstanding at the end",
        &blocks(live.outstanding, live.outstanding_bytes),
    );
    kv(
        out,
        &format!("leak suspects (at least {} s old)", live.min_age_secs),
        &blocks(live.old_outstanding, live.old_outstanding_bytes),
    );
    kv(
        out,
        "tracked allocations",
        &live.tracked_allocations.to_string(),
    );
    kv(
        out,
        &format!(
            "temporaries (freed under {})",
            duration_ns(live.temporary_under_ns)
        ),
        &live.temporaries.to_string(),
    );
    kv(
        out,
        "failed allocations (not blocks)",
        &live.failed.to_string(),
    );
    kv(out, "live map size", &live.live_map_size.to_string());
    out.push_str("</table>\n");
}

fn summary(out: &mut String, profile: &Profile) {
    let meta = &profile.meta;
    out.push_str("<section id=\"summary\"><h2>Summary</h2><div class=\"cards\">\n<table class=\"kv\"><caption>trace</caption>\n");
    kv(out, "target", &esc(&meta.command));
    kv(out, "pid", &meta.pid.to_string());
    if !meta.executable.is_empty() {
        kv(out, "executable", &esc(&meta.executable));
    }
    let mut mode = meta.mode.clone();
    if let Some(s) = &meta.sampling {
        let how = match s.kind.as_str() {
            "bytes" => format!("one sample per {} bytes on average", s.rate),
            _ => format!("one call in {}", s.rate),
        };
        let _ = write!(
            mode,
            ", sampled: {how}, {} samples (counts are estimates)",
            s.samples
        );
    }
    kv(out, "mode", &esc(&mode));
    kv(out, "started", &esc(&meta.start_time));
    kv(out, "duration", &format!("{:.3} s", meta.duration_secs));
    kv(out, "kernel", &esc(&meta.kernel_release));
    let mut allocator = meta.allocator_object.clone();
    for part in [&meta.allocator_family, &meta.allocator_version] {
        if !part.is_empty() {
            let _ = write!(allocator, " {part}");
        }
    }
    kv(out, "allocator", &esc(&allocator));
    let probes: Vec<&str> = meta.probes.iter().map(|p| p.function.as_str()).collect();
    kv(out, "probes", &esc(&probes.join(", ")));
    if !meta.processes.is_empty() {
        let traced = meta.processes.iter().filter(|p| p.traced).count();
        kv(
            out,
            "processes",
            &format!("{} ({traced} traced)", meta.processes.len()),
        );
    }
    out.push_str("</table>\n<table class=\"kv\"><caption>totals</caption>\n");
    let totals = &profile.totals;
    kv(out, "allocation calls", &totals.allocs.calls.to_string());
    kv(
        out,
        "bytes requested",
        &format!("{} ({})", totals.allocs.bytes, bytes(totals.allocs.bytes)),
    );
    let frees = if totals.frees_counted {
        totals.frees.to_string()
    } else {
        "not counted (count mode probes only the allocating functions)".to_string()
    };
    kv(out, "frees", &esc(&frees));
    kv(
        out,
        "nested allocator calls (not counted twice)",
        &totals.nested.to_string(),
    );
    for (func, c) in &totals.per_func {
        kv(out, func, &format!("{} calls, {} bytes", c.calls, c.bytes));
    }
    out.push_str("</table>\n<table class=\"kv\"><caption>losses</caption>\n");
    loss_counters(out, &profile.losses, None);
    if let Some(live) = &profile.live {
        loss_counters(out, live, Some(&LIVE_LOSSES));
    }
    out.push_str("</table>\n<table class=\"kv\"><caption>stack quality</caption>\n");
    match &profile.stack_quality {
        Some(q) => {
            kv(
                out,
                "whole stacks",
                &format!("{:.2}% ({} of {} calls)", q.whole_pct(), q.whole, q.calls),
            );
            for (cause, n) in &q.truncated {
                kv(
                    out,
                    &format!("cut short: {}", cause.replace('_', " ")),
                    &format!("<b class=\"lost\">{n}</b>"),
                );
            }
            kv(
                out,
                "walks finished by the tracer",
                &q.finished_by_tracer.to_string(),
            );
            kv(
                out,
                "stacks walked in the kernel (the rest reused a remembered walk)",
                &q.walked_in_kernel.to_string(),
            );
        }
        None => kv(out, "whole stacks", "not recorded in this profile"),
    }
    out.push_str("</table>\n");
    if let Some(live) = &profile.live {
        live_heap(out, live);
    }
    if !meta.processes.is_empty() {
        out.push_str("<table class=\"kv\"><caption>processes</caption>\n");
        for p in &meta.processes {
            let status = match (p.traced, &p.not_traced, p.exit_code) {
                (false, why, _) => format!("not traced: {}", why.as_deref().unwrap_or("")),
                (true, _, Some(code)) => format!("traced, exited {code}"),
                (true, _, None) => "traced".to_string(),
            };
            kv(
                out,
                &format!("{} (pid {})", p.name, p.pid),
                &esc(&format!("{}: {status}", p.command)),
            );
        }
        out.push_str("</table>\n");
    }
    out.push_str("</div></section>\n");
}

/// What a flame graph can weigh: the form's value, its label, and the
/// count of one stack.
type FlameWeight = (&'static str, &'static str, Weight, fn(&StackEntry) -> u64);

fn live_of(e: &StackEntry) -> Option<&LiveStats> {
    e.live.as_ref()
}

fn flame_weights(live: bool) -> Vec<FlameWeight> {
    let mut w: Vec<FlameWeight> = vec![
        ("calls", "allocation calls", Weight::Calls, |e| {
            e.counts.calls
        }),
        ("bytes", "bytes requested", Weight::Bytes, |e| {
            e.counts.bytes
        }),
    ];
    if live {
        w.push(("inuse", "in use at the end (bytes)", Weight::Bytes, |e| {
            live_of(e).map_or(0, |l| l.outstanding_bytes)
        }));
        w.push(("leaked", "leak suspects (bytes)", Weight::Bytes, |e| {
            live_of(e).map_or(0, |l| l.old_outstanding_bytes)
        }));
    }
    w
}

fn flame_graphs(out: &mut String, profile: &Profile, per_thread: bool, title: &str) -> Result<()> {
    let weights = flame_weights(profile.live.is_some());
    out.push_str(
        "<section id=\"flamegraph\"><h2>Flame graph</h2>\n<form class=\"weights\">weight:",
    );
    for (i, (value, label, _, _)) in weights.iter().enumerate() {
        let _ = write!(
            out,
            " <label><input type=\"radio\" name=\"weight\" value=\"{value}\"{}> {label}</label>",
            if i == 0 { " checked" } else { "" }
        );
    }
    out.push_str("</form>\n");
    for (i, (value, label, weight, count)) in weights.iter().enumerate() {
        let lines = folded::render_by(profile, per_thread, *count);
        // Only the graph shown is loaded: inferno's script lays a graph
        // out as it loads, which a hidden frame cannot (report.js loads
        // the others when they are chosen).
        let (hidden, src) = if i == 0 {
            ("", "src")
        } else {
            (" hidden", "data-src")
        };
        match flamegraph::render(&lines, &format!("{title}: {label}"), *weight, Kind::Plain) {
            Ok(svg) => {
                let height = svg_height(&svg).unwrap_or(600);
                let _ = writeln!(
                    out,
                    "<iframe class=\"flame\" data-weight=\"{value}\" title=\"flame graph: {label}\" \
                     style=\"height:{height}px\" {src}=\"data:image/svg+xml;base64,{}\"{hidden}></iframe>",
                    base64::engine::general_purpose::STANDARD.encode(&svg)
                );
            }
            Err(e) => {
                let _ = writeln!(
                    out,
                    "<p class=\"note flame\" data-weight=\"{value}\"{hidden}>No flame graph of {label}: {}.</p>",
                    esc(&e.to_string())
                );
            }
        }
    }
    out.push_str("</section>\n");
    Ok(())
}

/// The height inferno gave its SVG (its root element's `height`).
fn svg_height(svg: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(svg).ok()?;
    let root = &text[text.find("<svg")?..];
    let root = &root[..root.find('>')?];
    let at = root.find(" height=\"")? + " height=\"".len();
    root[at..].split('"').next()?.parse().ok()
}

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
fn groups(out: &mut String, id: &str, title: &str, noun: &str, rows: &[GroupTotals]) {
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

fn stacks(out: &mut String, profile: &Profile, rows: &[Row<'_>], hidden: usize) {
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

fn leak_suspects(out: &mut String, profile: &Profile) {
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

/// A chart in its figure.
fn figure(out: &mut String, svg: &str) {
    let _ = writeln!(out, "<figure class=\"plot\">{svg}</figure>");
}

/// Up to 40 characters of a frame name, for chart labels.
fn label(name: &str) -> String {
    const MAX: usize = 40;
    if name.chars().count() <= MAX {
        name.to_string()
    } else {
        let cut: String = name.chars().take(MAX - 1).collect();
        format!("{cut}…")
    }
}

fn distributions(out: &mut String, profile: &Profile, rows: &[Row<'_>]) -> Result<()> {
    out.push_str("<section id=\"distributions\"><h2>Sizes and lifetimes</h2>\n");
    // Calls by each stack's mean request size, in power-of-two classes.
    let mut classes = [0u64; 65];
    for r in rows.iter().filter(|r| r.counts.calls > 0) {
        let mean = r.counts.bytes / r.counts.calls;
        let class = if mean == 0 {
            0
        } else {
            64 - mean.leading_zeros() as usize
        };
        classes[class] += r.counts.calls;
    }
    // The classes with calls only: one huge request would spread the
    // others over tens of empty classes.
    let bars: Vec<(String, u64)> = (0..classes.len())
        .filter(|&i| classes[i] > 0)
        .map(|i| {
            let from = if i == 0 { 0 } else { 1u64 << (i - 1) };
            (bytes(from), classes[i])
        })
        .collect();
    if !bars.is_empty() {
        figure(
            out,
            &plots::histogram(
                "Allocation calls by their stack's mean request size",
                "mean size (bytes requested / calls of a stack), from (classes up to twice that; empty ones left out)",
                "calls",
                &bars,
            )?,
        );
    }
    if profile.live.is_none() {
        out.push_str(
            "<p class=\"note\">Per-stack size and lifetime percentiles are measured in live mode (<code>--live</code>).</p></section>\n",
        );
        return Ok(());
    }
    let mut with_live: Vec<(&Row<'_>, &LiveStats)> =
        rows.iter().filter_map(|r| r.live.map(|l| (r, l))).collect();
    with_live.sort_by_key(|(_, l)| std::cmp::Reverse(l.allocations));
    let spreads =
        |pick: fn(&LiveStats) -> Option<crate::profile::Percentiles>| -> Vec<plots::Spread> {
            with_live
                .iter()
                .filter_map(|(r, l)| {
                    let p = pick(l)?;
                    let caller = r
                        .frames
                        .first()
                        .map_or("[unknown]", |f| f.function.as_str());
                    Some(plots::Spread {
                        label: label(&format!("{} ← {}", r.func, caller)),
                        values: [p.p50, p.p90, p.p99, p.max],
                    })
                })
                .take(SPREAD_STACKS)
                .collect()
        };
    let sizes = spreads(|l| l.size);
    if !sizes.is_empty() {
        figure(
            out,
            &plots::spread(
                "Requested size per stack (most allocations first)",
                "bytes",
                &sizes,
                |v| bytes(v as u64),
            )?,
        );
    }
    let lifetimes = spreads(|l| l.lifetime_ns);
    if lifetimes.is_empty() {
        out.push_str("<p class=\"note\">No block was freed while traced: no lifetimes.</p>\n");
    } else {
        figure(
            out,
            &plots::spread(
                "Lifetime of freed blocks per stack (most allocations first)",
                "lifetime",
                &lifetimes,
                |v| duration_ns(v as u64),
            )?,
        );
    }
    out.push_str(
        "<p class=\"note\">Percentiles from histograms of 2 significant digits.</p></section>\n",
    );
    Ok(())
}

fn timeline(out: &mut String, profile: &Profile) -> Result<()> {
    out.push_str("<section id=\"timeline\"><h2>Over time</h2>\n");
    let points = match &profile.timeline {
        Some(t) if !t.points.is_empty() => &t.points,
        Some(_) => {
            out.push_str("<p class=\"note\">The timeline of this profile has no point: nothing to plot over time.</p></section>\n");
            return Ok(());
        }
        None => {
            out.push_str(
                "<p class=\"note\">This profile has no timeline (profiles of older mtrace versions and snapshots have none): nothing to plot over time.</p></section>\n",
            );
            return Ok(());
        }
    };
    // Rates over each point's own interval (the last one may be shorter).
    let mut calls = Vec::with_capacity(points.len());
    let mut frees = Vec::new();
    let mut bytes_rate = Vec::with_capacity(points.len());
    let mut prev = 0.0;
    for p in points {
        let dt = p.t - prev;
        prev = p.t;
        if dt > 0.0 {
            calls.push((p.t, p.calls as f64 / dt));
            bytes_rate.push((p.t, p.bytes as f64 / dt));
            if let Some(f) = p.frees {
                frees.push((p.t, f as f64 / dt));
            }
        }
    }
    let series = |name, points| plots::Series { name, points };
    let mut rates = vec![series("allocation calls/s", calls)];
    if !frees.is_empty() {
        rates.push(series("frees/s", frees));
    }
    let title = if rates.len() > 1 {
        "Allocation calls and frees per second"
    } else {
        "Allocation calls per second"
    };
    figure(out, &plots::line(title, "per second", &rates, short_count)?);
    let bytes_rate = [series("bytes/s", bytes_rate)];
    figure(
        out,
        &plots::line("Bytes requested per second", "bytes/s", &bytes_rate, |v| {
            bytes(v as u64)
        })?,
    );
    let live: Vec<(f64, f64)> = points
        .iter()
        .filter_map(|p| p.live_bytes.map(|b| (p.t, b as f64)))
        .collect();
    if !live.is_empty() {
        figure(
            out,
            &plots::line(
                "Live heap (allocated, not yet freed, as traced)",
                "bytes",
                &[series("live bytes", live)],
                |v| bytes(v as u64),
            )?,
        );
    }
    out.push_str("</section>\n");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{entry, profile};
    use super::*;
    use crate::profile::{LiveTotals, Percentiles, TimePoint, Timeline};

    fn opts() -> ReportOptions {
        ReportOptions {
            top: 1,
            threshold_pct: 0.0,
            sort: super::super::SortKey::Calls,
            per_thread: false,
            per_process: false,
            color: false,
        }
    }

    fn live_profile() -> Profile {
        let mut p = profile(vec![
            entry("malloc", &["leak_site", "main"], 100, 6400),
            entry("malloc", &["churn<T>", "main"], 1000, 32000),
            entry("free", &["churn<T>", "main"], 1000, 0),
        ]);
        p.meta.command = "./live --x".into();
        p.meta.pid = 42;
        p.meta.mode = "live".into();
        p.stacks[0].live = Some(LiveStats {
            allocations: 100,
            outstanding: 100,
            outstanding_bytes: 6400,
            old_outstanding: 100,
            old_outstanding_bytes: 6400,
            size: Some(Percentiles {
                p50: 64,
                p90: 64,
                p99: 64,
                max: 64,
            }),
            ..LiveStats::default()
        });
        p.stacks[1].live = Some(LiveStats {
            allocations: 1000,
            frees: 1000,
            temporaries: 1000,
            size: Some(Percentiles {
                p50: 32,
                p90: 32,
                p99: 32,
                max: 32,
            }),
            lifetime_ns: Some(Percentiles {
                p50: 900,
                p90: 1500,
                p99: 4000,
                max: 20000,
            }),
            ..LiveStats::default()
        });
        p.live = Some(LiveTotals {
            old_outstanding: 100,
            old_outstanding_bytes: 6400,
            events_lost: 5,
            frees_kept: 2,
            frees_lost: 3,
            ..LiveTotals::default()
        });
        p.timeline = Some(Timeline {
            interval_secs: 0.5,
            points: (1..=4)
                .map(|i| TimePoint {
                    t: i as f64 * 0.5,
                    calls: 100 * i,
                    bytes: 1000 * i,
                    frees: Some(10),
                    live_bytes: Some(500 * i),
                })
                .collect(),
        });
        p
    }

    /// The flame graph SVG of `weight`, decoded from its `data:` URL.
    fn flame(page: &str, weight: &str) -> Option<String> {
        let at = page.find(&format!("data-weight=\"{weight}\""))?;
        let rest = &page[at..];
        let b64 = rest.split("base64,").nth(1)?.split('"').next()?;
        let svg = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
        String::from_utf8(svg).ok()
    }

    #[test]
    fn live_page_has_every_part() -> Result<()> {
        let page = render(&live_profile(), &opts())?;
        for part in [
            "<section id=\"summary\"",
            "<section id=\"flamegraph\"",
            "<section id=\"stacks\"",
            "<section id=\"leaks\"",
            "<section id=\"distributions\"",
            "<section id=\"timeline\"",
            "Allocation calls and frees per second",
            "Bytes requested per second",
            "Live heap",
            "Requested size per stack",
            "Lifetime of freed blocks",
            "events lost</th><td><b class=\"lost\">5</b>",
            "Uncertain: 3 frees were lost",
        ] {
            assert!(page.contains(part), "no {part}");
        }
        // Every stack is a row, whatever --top says; free is not one.
        assert_eq!(page.matches("<tr><td data-v=").count(), 2 + 1);
        // Names are escaped.
        assert!(page.contains("churn&lt;T&gt;"));
        assert!(!page.contains("churn<T>"));
        // One flame graph per weight; leaked bytes are the leak's only.
        for w in ["calls", "bytes", "inuse", "leaked"] {
            assert!(
                flame(&page, w).is_some_and(|s| s.contains("leak_site")),
                "{w}"
            );
        }
        let leaked = flame(&page, "leaked").unwrap();
        assert!(!leaked.contains("churn"));
        assert!(
            leaked.contains("leak_site (6,400 bytes, 100.00%)"),
            "{leaked}"
        );
        Ok(())
    }

    #[test]
    fn count_page_says_what_it_lacks() -> Result<()> {
        let mut p = live_profile();
        p.live = None;
        p.timeline = None;
        for s in &mut p.stacks {
            s.live = None;
        }
        let page = render(&p, &opts())?;
        assert!(page.contains("This profile has no timeline"));
        assert!(page.contains("measured in live mode"));
        assert!(!page.contains("id=\"leaks\""));
        assert!(!page.contains("data-weight=\"inuse\""));
        assert!(flame(&page, "calls").is_some());
        Ok(())
    }

    #[test]
    fn nothing_is_loaded_from_elsewhere() -> Result<()> {
        let page = render(&live_profile(), &opts())?;
        for attr in ["src=\"", "href=\""] {
            for value in page.split(attr).skip(1) {
                assert!(
                    value.starts_with("data:") || value.starts_with('#'),
                    "{attr}{}",
                    &value[..value.len().min(40)]
                );
            }
        }
        assert!(!page.contains("url("));
        Ok(())
    }

    #[test]
    fn empty_profile_renders() -> Result<()> {
        let page = render(&Profile::default(), &opts())?;
        assert!(page.contains("No flame graph of allocation calls"));
        assert!(page.contains("0 stacks"));
        Ok(())
    }

    /// Every field of the live totals is on the page: the loss counters
    /// among the losses, the rest in the heap table (a field added to
    /// [`LiveTotals`] fails this until it is shown).
    #[test]
    fn every_live_total_is_shown() {
        let shown_in_heap = [
            "peak_bytes",
            "peak_secs",
            "outstanding",
            "outstanding_bytes",
            "old_outstanding",
            "old_outstanding_bytes",
            "min_age_secs",
            "temporary_under_ns",
            "tracked_allocations",
            "temporaries",
            "failed",
            "live_map_size",
        ];
        let serde_json::Value::Object(fields) =
            serde_json::to_value(LiveTotals::default()).unwrap()
        else {
            panic!("not an object")
        };
        for name in fields.keys() {
            assert!(
                LIVE_LOSSES.contains(&name.as_str()) ^ shown_in_heap.contains(&name.as_str()),
                "{name}"
            );
        }
        let page = render(&live_profile(), &opts()).unwrap();
        for loss in LIVE_LOSSES {
            assert!(
                page.contains(&format!("<th>{}</th>", loss.replace('_', " "))),
                "{loss}"
            );
        }
        assert!(
            page.contains("<th>leak suspects (at least 0 s old)</th><td>100 blocks, 6.2 KiB</td>")
        );
    }

    #[test]
    fn svg_height_is_read() {
        assert_eq!(
            svg_height(b"<?xml?><svg version=\"1.1\" width=\"100%\" height=\"342\" x=\"1\">"),
            Some(342)
        );
        assert_eq!(svg_height(b"<svg>"), None);
    }
}
