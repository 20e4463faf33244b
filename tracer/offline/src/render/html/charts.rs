//! The charts: the distributions of sizes and lifetimes, and the trace over
//! time (plotters' SVGs, drawn by [`super::plots`]).

use std::fmt::Write as _;

use anyhow::Result;

use super::{plots, SPREAD_STACKS};
use crate::profile::{LiveStats, Profile};
use crate::render::{
    text::{bytes, duration_ns, short_count},
    Row,
};

/// A chart in its figure.
fn figure(out: &mut String, svg: &str) {
    let _ = writeln!(out, "<figure class=\"plot\">{svg}</figure>");
}

/// Up to 40 characters of a frame name, for chart labels.
pub(super) fn label(name: &str) -> String {
    const MAX: usize = 40;
    if name.chars().count() <= MAX {
        name.to_string()
    } else {
        let cut: String = name.chars().take(MAX - 1).collect();
        format!("{cut}…")
    }
}

pub(super) fn distributions(out: &mut String, profile: &Profile, rows: &[Row<'_>]) -> Result<()> {
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

pub(super) fn timeline(out: &mut String, profile: &Profile) -> Result<()> {
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
