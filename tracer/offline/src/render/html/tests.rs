//! The HTML report's tests: the page's parts, escaping and its limits.

use super::*;
use base64::Engine as _;

use super::flames::svg_height;
use super::summary::LIVE_LOSSES;
use crate::profile::{LiveStats, LiveTotals, Percentiles, TimePoint, Timeline};
use crate::render::test_util::{entry, profile};

fn opts() -> ReportOptions {
    ReportOptions {
        top: 1,
        threshold_pct: 0.0,
        sort: crate::render::SortKey::Calls,
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
    let serde_json::Value::Object(fields) = serde_json::to_value(LiveTotals::default()).unwrap()
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
    assert!(page.contains("<th>leak suspects (at least 0 s old)</th><td>100 blocks, 6.2 KiB</td>"));
}

#[test]
fn svg_height_is_read() {
    assert_eq!(
        svg_height(b"<?xml?><svg version=\"1.1\" width=\"100%\" height=\"342\" x=\"1\">"),
        Some(342)
    );
    assert_eq!(svg_height(b"<svg>"), None);
}
