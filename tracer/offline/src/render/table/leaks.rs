//! The live-mode parts of the table: lines under each stack, the heap
//! summary and the leak suspects.

use std::fmt::{self, Write};

use crate::profile::{LiveStats, LiveTotals, Percentiles, Profile};

use crate::render::apart::{told_apart, with_offset};
use crate::render::suspects;
use crate::render::text::{bytes, count, duration_ns, frame_text, wrap_list, FrameTexts, Paint};

/// `p50 64 B, p90 64 B, p99 64 B, max 64 B`
fn percentiles(p: &Percentiles, fmt: impl Fn(u64) -> String) -> String {
    format!(
        "p50 {}, p90 {}, p99 {}, max {}",
        fmt(p.p50),
        fmt(p.p90),
        fmt(p.p99),
        fmt(p.max)
    )
}

/// The indented lines under a table row:
///
/// ```text
///     live: 100 outstanding (6.2 KiB, oldest 0.01 s), max live 6.2 KiB,
///     live: 6.2 KiB at the peak, 0 of 100 temporary
///     size: p50 64 B, p90 64 B, p99 64 B, max 64 B
///     lifetime: none freed
/// ```
pub fn row_lines(live: &LiveStats) -> String {
    let mut outstanding = format!(
        "{} outstanding ({}",
        live.outstanding,
        bytes(live.outstanding_bytes)
    );
    if live.outstanding > 0 {
        let _ = write!(outstanding, ", oldest {:.2} s", live.oldest_age_secs);
    }
    outstanding.push(')');
    let items = [
        outstanding,
        format!("max live {}", bytes(live.max_live_bytes)),
        format!("{} at the peak", bytes(live.live_bytes_at_peak)),
        format!("{} of {} temporary", live.temporaries, live.allocations),
    ];
    let mut out = wrap_list("    live", &items, "");
    if let Some(size) = &live.size {
        let _ = writeln!(out, "    size: {}", percentiles(size, bytes));
        let _ = match &live.lifetime_ns {
            Some(life) => writeln!(out, "    lifetime: {}", percentiles(life, duration_ns)),
            None => writeln!(out, "    lifetime: none freed"),
        };
    }
    out
}

/// Heap summary and leak suspects, after the totals, written to `to`
/// (the suspects' frames line by line).
pub fn summary<'a>(
    to: &mut impl Write,
    profile: &'a Profile,
    totals: &LiveTotals,
    top: usize,
    frames: &mut FrameTexts<'a>,
) -> fmt::Result {
    let paint = frames.paint();
    let mut items = vec![
        format!(
            "peak {} at {:.3} s",
            bytes(totals.peak_bytes),
            totals.peak_secs
        ),
        format!(
            "at the end {} ({}) outstanding",
            count(totals.outstanding, "block"),
            bytes(totals.outstanding_bytes)
        ),
        format!("{} tracked allocations", totals.tracked_allocations),
        format!(
            "{} temporary (freed under {})",
            totals.temporaries,
            duration_ns(totals.temporary_under_ns)
        ),
        format!("failed allocations (not blocks) {}", totals.failed),
        format!(
            "untracked (live map of {} full) {}",
            totals.live_map_size, totals.untracked
        ),
        format!(
            "frees of blocks allocated before attach or untracked {}",
            totals.frees_unknown
        ),
        format!("events lost {}", totals.events_lost),
        format!(
            "frees kept aside and applied {}, frees lost {}",
            totals.frees_kept, totals.frees_lost
        ),
        format!(
            "allocations kept aside and applied {}, allocations lost {}",
            totals.allocs_kept, totals.allocs_lost
        ),
        format!("missed frees {}", totals.stale),
        format!("calls not followed {}", totals.pending_full),
    ];
    // Only a Python interpreter with its allocator copied into its
    // callers has such calls (the profile's JSON has the 0 of the others).
    if totals.inline_unfinished > 0 {
        items.push(format!(
            "inlined allocator calls whose block was not seen {}",
            totals.inline_unfinished
        ));
    }
    let mut out = wrap_list("live", &items, "");
    // Events lost but kept aside were applied: only blocks never followed
    // call for larger maps.
    if totals.untracked > 0 || totals.allocs_lost > 0 {
        let note = paint.warn("note:");
        let _ = writeln!(
            out,
            "{note} some blocks were not followed: raise --live-map-size, \
             --event-buffer-size\n{note} outstanding counts cover tracked blocks only"
        );
    }

    let suspects = suspects(profile);
    let age = if totals.min_age_secs > 0.0 {
        format!(", at least {} s old", totals.min_age_secs)
    } else {
        String::new()
    };
    let title = format!("leak suspects (outstanding at the end{age})");
    let missing = not_followed(profile, totals, paint);
    if suspects.is_empty() {
        if missing.is_empty() {
            let _ = writeln!(out, "\n{}: none", paint.strong(&title));
        } else {
            let _ = writeln!(
                out,
                "\n{}: none among the blocks followed\n{missing}",
                paint.alert(&title)
            );
        }
        return to.write_str(&out);
    }
    let _ = writeln!(
        out,
        "\n{}: {}, {}",
        paint.alert(&title),
        count(totals.old_outstanding, "block"),
        bytes(totals.old_outstanding_bytes)
    );
    out.push_str(&missing);
    // A free lost outright leaves its block listed here though it was
    // freed. Say so rather than state leaks as facts. (Frees whose event
    // was lost but that were kept aside were applied.)
    if totals.frees_lost > 0 {
        let _ = writeln!(
            out,
            "{} {} lost; a lost free leaves its block among these",
            paint.warn("uncertain:"),
            count(totals.frees_lost, "free"),
        );
    }
    to.write_str(&out)?;
    let shown = if top == 0 {
        suspects.len()
    } else {
        top.min(suspects.len())
    };
    let listed = &suspects[..shown];
    let apart = told_apart(listed.iter().map(|(e, _)| (&e.func, e.frames.as_slice())));
    for (i, (entry, live)) in listed.iter().enumerate() {
        let first = format!(
            "#{}  {}  {}  oldest {:.2} s  ",
            i + 1,
            count(live.old_outstanding, "block"),
            bytes(live.old_outstanding_bytes),
            live.oldest_age_secs,
        );
        writeln!(to, "{}{}", paint.strong(&first), paint.func(&entry.func))?;
        for (d, frame) in entry.frames.iter().enumerate() {
            if apart.contains(&(i, d)) {
                writeln!(to, "    {}", frame_text(&with_offset(frame), paint))?;
            } else {
                writeln!(to, "    {}", frames.get(frame))?;
            }
        }
    }
    if suspects.len() > shown {
        let hidden = suspects.len() - shown;
        writeln!(
            to,
            "{hidden} more leak {} hidden by --top",
            if hidden == 1 { "suspect" } else { "suspects" }
        )?;
    }
    Ok(())
}

/// The `uncertain:` lines of blocks never followed, each of which may be a
/// leak the suspects cannot name: allocations the full block table did
/// not follow, and those lost outright (their event and the queue kept
/// aside both full, or the call not followed to its return). Empty when
/// there are none, or when `--min-age` is longer than the trace: blocks
/// allocated during it cannot be old enough to count.
fn not_followed(profile: &Profile, totals: &LiveTotals, paint: Paint) -> String {
    let mut out = String::new();
    if totals.min_age_secs > profile.meta.duration_secs {
        return out;
    }
    let uncertain = paint.warn("uncertain:");
    if totals.untracked > 0 {
        // Frees of blocks not followed count with those of blocks
        // allocated before attach: the difference is a lower bound.
        let unfreed = totals.untracked.saturating_sub(totals.frees_unknown);
        let _ = writeln!(
            out,
            "{uncertain} {} not followed (the live map was full),\n{uncertain} {}leaks among them cannot be named",
            count(totals.untracked, "allocation"),
            if unfreed > 0 {
                format!("at least {unfreed} not seen freed; ")
            } else {
                String::new()
            }
        );
    }
    if totals.allocs_lost > 0 {
        let _ = writeln!(
            out,
            "{uncertain} {} lost (their ring and the queue kept aside full),",
            count(totals.allocs_lost, "allocation")
        );
    }
    if totals.pending_full > 0 {
        let _ = writeln!(
            out,
            "{uncertain} {} not followed to the return (no per-thread storage),",
            count(totals.pending_full, "call")
        );
    }
    let lost = totals.allocs_lost + totals.pending_full;
    if lost > 0 {
        let _ = writeln!(
            out,
            "{uncertain} at most {} missing from these",
            count(lost, "leak")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The summary of `p` as text, every suspect shown.
    fn summary_text(p: &Profile, totals: &LiveTotals) -> String {
        let mut text = String::new();
        summary(
            &mut text,
            p,
            totals,
            0,
            &mut FrameTexts::new(Paint::default()),
        )
        .unwrap();
        text
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
        let text = summary_text(&p, &totals);
        let big = text.find("big_leak").unwrap();
        let small = text.find("small_leak").unwrap();
        assert!(big < small, "{text}");
        assert!(text.contains("leak suspects (outstanding at the end): 11 blocks, 4.6 KiB\n"));
        // Frees whose events were lost but kept aside were applied: the
        // suspects stand.
        let kept = LiveTotals {
            events_lost: 3,
            frees_kept: 3,
            ..totals.clone()
        };
        let text = summary_text(&p, &kept);
        assert!(text.contains("11 blocks, 4.6 KiB\n#1"), "{text}");
        let lost = LiveTotals {
            events_lost: 5,
            frees_kept: 3,
            frees_lost: 2,
            ..totals.clone()
        };
        let text = summary_text(&p, &lost);
        assert!(
            text.contains(
                "4.6 KiB\nuncertain: 2 frees lost; a lost free leaves its block among these\n"
            ),
            "{text}"
        );
        // Allocations kept aside were applied: the suspects stand, and
        // the table's hint to raise the buffers is not given.
        let kept = LiveTotals {
            events_lost: 3,
            allocs_kept: 3,
            ..totals.clone()
        };
        let text = summary_text(&p, &kept);
        assert!(text.contains("11 blocks, 4.6 KiB\n#1"), "{text}");
        assert!(!text.contains("note:"), "{text}");
        // Allocations lost outright, and calls not followed to their
        // return: each may be a leak missing from the suspects.
        let lost = LiveTotals {
            events_lost: 7,
            allocs_kept: 2,
            allocs_lost: 5,
            pending_full: 1,
            ..totals.clone()
        };
        let text = summary_text(&p, &lost);
        assert!(
            text.contains(
                "4.6 KiB\n\
                 uncertain: 5 allocations lost (their ring and the queue kept aside full),\n\
                 uncertain: 1 call not followed to the return (no per-thread storage),\n\
                 uncertain: at most 6 leaks missing from these\n#1"
            ),
            "{text}"
        );
        assert!(
            text.contains("note: some blocks were not followed"),
            "{text}"
        );
    }

    /// A full live map: blocks not followed may be leaks, so no suspect
    /// among those followed is not "none"; with --min-age beyond the
    /// trace's length none of them can be old enough.
    #[test]
    fn blocks_not_followed_are_never_called_no_leaks() {
        let mut p = crate::render::test_util::profile(vec![crate::render::test_util::entry(
            "malloc",
            &["churn", "main"],
            10,
            640,
        )]);
        p.meta.duration_secs = 2.0;
        let full = LiveTotals {
            untracked: 3000,
            frees_unknown: 1766,
            live_map_size: 1024,
            ..LiveTotals::default()
        };
        let text = summary_text(&p, &full);
        assert!(
            text.contains(
                "leak suspects (outstanding at the end): none among the blocks followed\n\
                 uncertain: 3000 allocations not followed (the live map was full),\n\
                 uncertain: at least 1234 not seen freed; leaks among them cannot be named\n"
            ),
            "{text}"
        );
        let old = LiveTotals {
            min_age_secs: 3600.0,
            ..full.clone()
        };
        let text = summary_text(&p, &old);
        assert!(
            text.contains("leak suspects (outstanding at the end, at least 3600 s old): none\n"),
            "{text}"
        );
        // Allocations lost outright are never "none" either.
        let lost = LiveTotals {
            untracked: 0,
            allocs_lost: 1,
            ..full.clone()
        };
        let text = summary_text(&p, &lost);
        assert!(
            text.contains(
                "leak suspects (outstanding at the end): none among the blocks followed\n\
                 uncertain: 1 allocation lost (their ring and the queue kept aside full),\n\
                 uncertain: at most 1 leak missing from these\n"
            ),
            "{text}"
        );
        let followed = LiveTotals {
            untracked: 0,
            ..full
        };
        let text = summary_text(&p, &followed);
        assert!(
            text.contains("leak suspects (outstanding at the end): none\n"),
            "{text}"
        );
    }
}
