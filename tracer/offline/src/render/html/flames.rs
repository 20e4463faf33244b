//! The flame graphs of each weight, each an inferno SVG in an iframe of its
//! own, loaded when first shown.

use std::fmt::Write as _;

use anyhow::Result;
use base64::Engine as _;

use super::esc;
use crate::profile::{LiveStats, Profile, StackEntry};
use crate::render::{
    flamegraph::{self, Kind},
    folded, Weight,
};

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

pub(super) fn flame_graphs(
    out: &mut String,
    profile: &Profile,
    per_thread: bool,
    title: &str,
) -> Result<()> {
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
pub(super) fn svg_height(svg: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(svg).ok()?;
    let root = &text[text.find("<svg")?..];
    let root = &root[..root.find('>')?];
    let at = root.find(" height=\"")? + " height=\"".len();
    root[at..].split('"').next()?.parse().ok()
}
