//! The report's summary: the run, its totals, live mode's heap and every loss
//! counter.

use std::fmt::Write as _;

use super::{esc, kv};
use crate::profile::{LiveTotals, Profile};
use crate::render::text::{bytes, duration_ns};

/// Live mode's loss counters (fields of [`LiveTotals`]), shown with the
/// other losses.
pub(super) const LIVE_LOSSES: [&str; 10] = [
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
pub(super) fn blocks(n: u64, size: u64) -> String {
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

pub(super) fn summary(out: &mut String, profile: &Profile) {
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
            if q.held_for_tracer > 0 {
                kv(
                    out,
                    "threads held for the tracer to finish their walks",
                    &q.held_for_tracer.to_string(),
                );
            }
            if q.not_held > 0 {
                kv(
                    out,
                    "walks in threads that block SIGURG, not held",
                    &q.not_held.to_string(),
                );
            }
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
