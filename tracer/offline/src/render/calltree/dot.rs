//! The call graph (`--dot`): each function's self and total weight and
//! each caller-to-callee edge's, written as Graphviz `dot` text.

use std::collections::BTreeMap;
use std::fmt::Write;

use foldhash::{HashMap, HashSet};

use crate::profile::Profile;
use crate::render::text::{bytes, count, WIDTH};
use crate::render::{is_allocation, percent, StackWeight};

use super::{min_share, Names};

/// One function of the graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FuncWeight {
    /// Of the stacks it calls the allocator from.
    pub own: u64,
    /// Of the stacks it is in (once per stack, however often it recurs).
    pub total: u64,
}

/// Functions and caller-to-callee edges, weighted by `weight`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Graph {
    pub funcs: BTreeMap<String, FuncWeight>,
    pub edges: BTreeMap<(String, String), u64>,
    /// All of the weight.
    pub all: u64,
}

/// The call graph of every allocation stack weighted by `weight`. Summed
/// by the names' numbers, each name copied once.
pub fn graph(profile: &Profile, weight: StackWeight) -> Graph {
    let mut names = Names::default();
    let mut funcs: HashMap<u32, FuncWeight> = HashMap::default();
    let mut edges: HashMap<(u32, u32), u64> = HashMap::default();
    let mut all = 0;
    for entry in profile.stacks.iter().filter(|e| is_allocation(e)) {
        let w = weight.of(entry);
        if w == 0 {
            continue;
        }
        all += w;
        let mut path = Vec::new();
        names.path(entry, &mut path);
        let mut seen = HashSet::default();
        for &name in &path {
            if seen.insert(name) {
                funcs.entry(name).or_default().total += w;
            }
        }
        if let Some(&direct) = path.last() {
            funcs.entry(direct).or_default().own += w;
        }
        let mut seen_edges = HashSet::default();
        for pair in path.windows(2) {
            if seen_edges.insert((pair[0], pair[1])) {
                *edges.entry((pair[0], pair[1])).or_default() += w;
            }
        }
    }
    let name = |n: u32| names.names[n as usize].to_string();
    Graph {
        funcs: funcs.into_iter().map(|(n, f)| (name(n), f)).collect(),
        edges: edges
            .into_iter()
            .map(|((a, b), w)| ((name(a), name(b)), w))
            .collect(),
        all,
    }
}

/// `"text"` for Graphviz: `\` and `"` escaped, line breaks as `\n`.
fn quoted(text: &str) -> String {
    let mut q = String::with_capacity(text.len() + 2);
    q.push('"');
    for c in text.chars() {
        match c {
            '"' | '\\' => {
                q.push('\\');
                q.push(c);
            }
            '\n' => q.push_str("\\n"),
            c if c.is_control() => q.push(' '),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

/// A name cut to fit a node (long C++ and Rust names).
fn short_name(name: &str) -> String {
    const MAX: usize = WIDTH / 2;
    if name.chars().count() <= MAX {
        name.to_string()
    } else {
        let head: String = name.chars().take(MAX - 3).collect();
        format!("{head}...")
    }
}

/// The graph as Graphviz `dot` text: functions with at least
/// `threshold_pct` ([`MIN_SHARE_PCT`] when it is 0) of the total as boxes
/// labelled with their self and total, filled from white to red by self
/// share and lettered larger by it; edges between them as wide as their
/// share, labelled with their weight.
///
/// [`MIN_SHARE_PCT`]: super::MIN_SHARE_PCT
pub fn render_dot(profile: &Profile, weight: StackWeight, threshold_pct: f64) -> String {
    let g = graph(profile, weight);
    let min_pct = min_share(threshold_pct);
    let amount = |v: u64| {
        if weight.is_bytes() {
            bytes(v)
        } else {
            count(v, "call")
        }
    };
    let meta = &profile.meta;
    let mut out = String::from("digraph mtrace {\n");
    let title = format!(
        "mtrace: {} (pid {})\n{} in all ({}); nodes under {min_pct}% left out",
        meta.command,
        meta.pid,
        amount(g.all),
        weight.unit()
    );
    let _ = writeln!(
        out,
        "  graph [label={}, labelloc=t, fontname=\"sans\"];",
        quoted(&title)
    );
    out.push_str("  node [shape=box, style=filled, fontname=\"sans\"];\n");
    out.push_str("  edge [fontname=\"sans\", fontsize=10];\n");
    let kept: Vec<(&String, &FuncWeight)> = g
        .funcs
        .iter()
        .filter(|(_, f)| percent(f.total, g.all) >= min_pct)
        .collect();
    let ids: HashMap<&str, usize> = kept
        .iter()
        .enumerate()
        .map(|(i, (name, _))| (name.as_str(), i))
        .collect();
    for (i, (name, f)) in kept.iter().enumerate() {
        let own_share = percent(f.own, g.all);
        let label = format!(
            "{}\nself {} ({own_share:.1}%)\ntotal {} ({:.1}%)",
            short_name(name),
            amount(f.own),
            amount(f.total),
            percent(f.total, g.all)
        );
        let _ = writeln!(
            out,
            "  n{i} [label={}, tooltip={}, fillcolor=\"{}\", fontsize={:.0}];",
            quoted(&label),
            quoted(name),
            shade(own_share / 100.0),
            10.0 + 14.0 * own_share / 100.0
        );
    }
    let max_edge = g.edges.values().copied().max().unwrap_or(1).max(1);
    for ((from, to), w) in &g.edges {
        let (Some(a), Some(b)) = (ids.get(from.as_str()), ids.get(to.as_str())) else {
            continue;
        };
        let _ = writeln!(
            out,
            "  n{a} -> n{b} [label={}, weight={w}, penwidth={:.2}];",
            quoted(&amount(*w)),
            1.0 + 4.0 * *w as f64 / max_edge as f64
        );
    }
    out.push_str("}\n");
    out
}

/// `#rrggbb` from near white (share 0) to red (share 1).
fn shade(share: f64) -> String {
    let t = share.clamp(0.0, 1.0);
    let mix = |from: f64, to: f64| (from + (to - from) * t).round() as u8;
    format!(
        "#{:02x}{:02x}{:02x}",
        mix(248.0, 214.0),
        mix(248.0, 39.0),
        mix(248.0, 40.0)
    )
}
