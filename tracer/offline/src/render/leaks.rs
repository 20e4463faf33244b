//! The live-mode parts of the table: a line per stack, the heap summary and
//! the leak suspects.

use std::fmt::Write;

use crate::profile::{LiveStats, LiveTotals, Percentiles, Profile, StackEntry};

/// `1.3us`, `250ms`, `2.50s`.
pub fn duration_ns(ns: u64) -> String {
    let ns_f = ns as f64;
    if ns < 1_000 {
        format!("{ns}ns")
    } else if ns < 1_000_000 {
        format!("{:.1}us", ns_f / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.1}ms", ns_f / 1e6)
    } else {
        format!("{:.2}s", ns_f / 1e9)
    }
}

fn percentiles(p: &Percentiles, fmt: impl Fn(u64) -> String) -> String {
    format!(
        "p50 {} p90 {} p99 {} max {}",
        fmt(p.p50),
        fmt(p.p90),
        fmt(p.p99),
        fmt(p.max)
    )
}

/// The indented lines under a table row.
pub fn row_lines(live: &LiveStats) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "    live: {} outstanding ({} bytes",
        live.outstanding, live.outstanding_bytes
    );
    if live.outstanding > 0 {
        let _ = write!(out, ", oldest {:.2} s", live.oldest_age_secs);
    }
    let _ = writeln!(
        out,
        "), max live {} bytes, {} bytes at the peak, {} of {} temporary",
        live.max_live_bytes, live.live_bytes_at_peak, live.temporaries, live.allocations
    );
    if let Some(size) = &live.size {
        let _ = write!(out, "    size {}", percentiles(size, |v| v.to_string()));
        match &live.lifetime_ns {
            Some(life) => {
                let _ = writeln!(out, "; lifetime {}", percentiles(life, duration_ns));
            }
            None => out.push_str("; none freed\n"),
        }
    }
    out
}

/// The leak suspects: stacks with blocks at least `--min-age` old still
/// allocated at the end, most bytes first.
pub fn suspects(profile: &Profile) -> Vec<(&StackEntry, &LiveStats)> {
    let mut suspects: Vec<_> = profile
        .stacks
        .iter()
        .filter_map(|e| e.live.as_ref().map(|l| (e, l)))
        .filter(|(_, l)| l.old_outstanding > 0)
        .collect();
    suspects.sort_by(|a, b| {
        b.1.old_outstanding_bytes
            .cmp(&a.1.old_outstanding_bytes)
            .then(b.1.old_outstanding.cmp(&a.1.old_outstanding))
    });
    suspects
}

/// Heap summary and leak suspects, after the totals.
pub fn summary(profile: &Profile, totals: &LiveTotals, top: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "live: peak {} bytes at {:.3} s; at the end {} blocks ({} bytes) outstanding; {} tracked allocations, {} temporary (freed under {})",
        totals.peak_bytes,
        totals.peak_secs,
        totals.outstanding,
        totals.outstanding_bytes,
        totals.tracked_allocations,
        totals.temporaries,
        duration_ns(totals.temporary_under_ns),
    );
    let _ = writeln!(
        out,
        "live: failed allocations (not blocks) {}, untracked (live map of {} full) {}, frees of blocks allocated before attach or untracked {}, events lost {} (of them frees kept aside and applied {}, frees lost {}), missed frees {}, calls not followed {}",
        totals.failed,
        totals.live_map_size,
        totals.untracked,
        totals.frees_unknown,
        totals.events_lost,
        totals.frees_kept,
        totals.frees_lost,
        totals.stale,
        totals.pending_full,
    );
    if totals.untracked > 0 || totals.events_lost > 0 {
        out.push_str(
            "note: some blocks were not followed (raise --live-map-size or --event-buffer-size); outstanding counts cover tracked blocks only\n",
        );
    }

    let suspects = suspects(profile);
    let age = if totals.min_age_secs > 0.0 {
        format!(", at least {} s old", totals.min_age_secs)
    } else {
        String::new()
    };
    if suspects.is_empty() {
        let _ = writeln!(out, "\nleak suspects (outstanding at the end{age}): none");
        return out;
    }
    // A free lost outright leaves its block listed here though it was
    // freed. Say so rather than state leaks as facts. (Frees whose event
    // was lost but that were kept aside were applied.)
    let caveat = if totals.frees_lost > 0 {
        format!(
            " (uncertain: {} frees were lost, and a lost free leaves its block among these)",
            totals.frees_lost
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "\nleak suspects (outstanding at the end{age}): {} blocks, {} bytes{caveat}",
        totals.old_outstanding, totals.old_outstanding_bytes
    );
    let shown = if top == 0 {
        suspects.len()
    } else {
        top.min(suspects.len())
    };
    for (i, (entry, live)) in suspects.iter().take(shown).enumerate() {
        let _ = writeln!(
            out,
            "#{}  {} blocks  {} bytes  oldest {:.2} s  {}",
            i + 1,
            live.old_outstanding,
            live.old_outstanding_bytes,
            live.oldest_age_secs,
            entry.func
        );
        for frame in &entry.frames {
            let _ = writeln!(out, "    {}", frame.describe());
        }
    }
    if suspects.len() > shown {
        let _ = writeln!(
            out,
            "{} more leak suspects hidden by --top",
            suspects.len() - shown
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(duration_ns(999), "999ns");
        assert_eq!(duration_ns(1_300), "1.3us");
        assert_eq!(duration_ns(250_000_000), "250.0ms");
        assert_eq!(duration_ns(2_500_000_000), "2.50s");
    }

    #[test]
    fn suspects_are_listed_by_bytes() {
        let mut p = crate::render::test_util::profile(vec![
            crate::render::test_util::entry("malloc", &["small_leak", "main"], 10, 640),
            crate::render::test_util::entry("malloc", &["big_leak", "main"], 1, 4096),
        ]);
        // Every block still live and old: (blocks, bytes) of each stack.
        for (stack, (blocks, bytes)) in p.stacks.iter_mut().zip([(10, 640), (1, 4096)]) {
            stack.live = Some(LiveStats {
                outstanding: blocks,
                outstanding_bytes: bytes,
                old_outstanding: blocks,
                old_outstanding_bytes: bytes,
                ..LiveStats::default()
            });
        }
        let totals = LiveTotals {
            old_outstanding: 11,
            old_outstanding_bytes: 4736,
            ..LiveTotals::default()
        };
        let text = summary(&p, &totals, 0);
        let big = text.find("big_leak").unwrap();
        let small = text.find("small_leak").unwrap();
        assert!(big < small, "{text}");
        assert!(text.contains("leak suspects (outstanding at the end): 11 blocks, 4736 bytes\n"));
        // Frees whose events were lost but kept aside were applied: the
        // suspects stand.
        let kept = LiveTotals {
            events_lost: 3,
            frees_kept: 3,
            ..totals.clone()
        };
        let text = summary(&p, &kept, 0);
        assert!(text.contains("11 blocks, 4736 bytes\n"), "{text}");
        let lost = LiveTotals {
            events_lost: 5,
            frees_kept: 3,
            frees_lost: 2,
            ..totals.clone()
        };
        let text = summary(&p, &lost, 0);
        assert!(
            text.contains("4736 bytes (uncertain: 2 frees were lost, and a lost free leaves its block among these)"),
            "{text}"
        );
    }
}
