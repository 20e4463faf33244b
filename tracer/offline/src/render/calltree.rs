//! The call tree (`--tree`) and the call graph (`--dot`), both built from
//! every allocation stack.
//!
//! The tree is heaptrack's top-down view: from each thread's outermost
//! frame (`_start`, `start_thread`) down to the functions that call the
//! allocator, each node with its total (the calls and bytes of every stack
//! through it) and its self (the calls it made to the allocator itself).
//! Children are ordered by the sort key; nodes under a share of all calls
//! (or bytes) are left out and summed on one line.
//!
//! The graph is pprof's `-dot`: a node per function (its self and total in
//! the chosen weight, shaded by its self share), an edge per caller and
//! callee (weighted by what went through it). Graphviz text is written by
//! hand: it is a few lines of `digraph` syntax, and no kept crate adds
//! more than quoting.
//!
//! In both, the allocator function is not a node: a stack's counts are
//! the self of its direct caller.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use crate::profile::{Counts, Profile, StackEntry};

use super::text::{bytes, count, printable_profile, WIDTH};
use super::{is_allocation, percent, SortKey, StackWeight};

/// Nodes under this share of all (in percent) are left out unless
/// `--threshold` gives another.
pub const MIN_SHARE_PCT: f64 = 1.0;

/// The share under which nodes are left out: `--threshold` when given
/// (above 0), [`MIN_SHARE_PCT`] otherwise.
fn min_share(threshold_pct: f64) -> f64 {
    if threshold_pct > 0.0 {
        threshold_pct
    } else {
        MIN_SHARE_PCT
    }
}

/// Deeper nodes are indented no further (their depth is written instead).
const MAX_INDENT: usize = 24;

/// A node of the top-down tree.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    /// Every stack through this node.
    pub total: Counts,
    /// Stacks whose direct caller is this node.
    pub own: Counts,
    /// Its children, as indexes into [`Tree::nodes`].
    pub children: Vec<usize>,
}

/// The top-down tree, its nodes in one vector (no node owns another, so
/// no walk of it, not even its drop, recurses as deep as a stack is).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tree {
    /// `nodes[0]` is the unnamed root.
    pub nodes: Vec<Node>,
}

impl Tree {
    pub fn root(&self) -> &Node {
        &self.nodes[0]
    }

    /// The child of `node` named `name`.
    pub fn child(&self, node: &Node, name: &str) -> Option<&Node> {
        node.children
            .iter()
            .map(|&i| &self.nodes[i])
            .find(|c| c.name == name)
    }
}

/// The frame names of `entry`, outermost first (`[no frames]` when it has
/// none).
fn path(entry: &StackEntry) -> Vec<&str> {
    if entry.frames.is_empty() {
        return vec!["[no frames]"];
    }
    entry
        .frames
        .iter()
        .rev()
        .map(|f| {
            if f.function.trim().is_empty() {
                "[unknown]"
            } else {
                f.function.as_str()
            }
        })
        .collect()
}

/// The tree of every allocation stack under an unnamed root whose total
/// is all of them; children in no particular order. Linear in the frames
/// of the stacks: a node's child is found by hashing its name.
pub fn build(profile: &Profile) -> Tree {
    let mut nodes = vec![Node::default()];
    let mut child_of: HashMap<(usize, &str), usize> = HashMap::new();
    for entry in profile.stacks.iter().filter(|e| is_allocation(e)) {
        nodes[0].total.add(entry.counts);
        let mut at = 0;
        for name in path(entry) {
            let next = nodes.len();
            let child = *child_of.entry((at, name)).or_insert(next);
            if child == next {
                nodes.push(Node {
                    name: name.to_string(),
                    ..Node::default()
                });
                nodes[at].children.push(child);
            }
            at = child;
            nodes[at].total.add(entry.counts);
        }
        nodes[at].own.add(entry.counts);
    }
    Tree { nodes }
}

/// The tree keeps no live bytes per node: [`SortKey::Live`] orders by bytes.
fn key(c: Counts, sort: SortKey) -> (u64, u64) {
    match sort {
        SortKey::Calls => (c.calls, c.bytes),
        SortKey::Bytes | SortKey::Live => (c.bytes, c.calls),
    }
}

/// The indented tree:
///
/// ```text
/// call tree, top-down (nodes under 1% of calls left out)
///     calls  share       bytes  self calls   self bytes  function
///     11603 100.0%     8.0 EiB           0          0 B  _start
///     11603 100.0%     8.0 EiB           0          0 B    __libc_start_main_impl
/// ```
///
/// Nodes under `threshold_pct` of the sort key (under [`MIN_SHARE_PCT`]
/// when it is 0) are left out. Every line ends with a newline.
pub fn render_tree(profile: &Profile, sort: SortKey, threshold_pct: f64) -> String {
    let profile = &*printable_profile(profile);
    let tree = build(profile);
    let root = tree.root();
    let min_pct = min_share(threshold_pct);
    let what = match sort {
        SortKey::Calls => "calls",
        SortKey::Bytes | SortKey::Live => "bytes",
    };
    let mut out = format!("call tree, top-down (nodes under {min_pct}% of {what} left out)\n");
    if root.total == Counts::default() {
        out.push_str("no allocations traced\n");
        return out;
    }
    let _ = writeln!(
        out,
        "{:>9} {:>6} {:>11}  {:>10} {:>12}  function",
        "calls", "share", "bytes", "self calls", "self bytes"
    );
    let mut hidden = Hidden::default();
    let all = key(root.total, sort).0;
    write_nodes(&mut out, &tree, sort, all, min_pct, &mut hidden);
    if hidden.nodes > 0 {
        let _ = writeln!(
            out,
            "{} left out ({}, {}; --threshold to change)",
            count(hidden.nodes as u64, "smaller node"),
            count(hidden.counts.calls, "call"),
            bytes(hidden.counts.bytes)
        );
    }
    out
}

/// Nodes left out of the tree (whole subtrees counted once, at their top).
#[derive(Default)]
struct Hidden {
    nodes: usize,
    counts: Counts,
}

/// The nodes under the root, depth first, each node's children by the
/// sort key. The nodes still to write are on a stack of their own, not
/// the call stack: a stack of any depth is written.
fn write_nodes(
    out: &mut String,
    tree: &Tree,
    sort: SortKey,
    all: u64,
    min_pct: f64,
    hidden: &mut Hidden,
) {
    // Children pushed in reverse, so the first pops first.
    let push_children = |todo: &mut Vec<(usize, usize)>, node: &Node, depth: usize| {
        let mut children: Vec<usize> = node.children.clone();
        children.sort_by(|&a, &b| {
            let (a, b) = (&tree.nodes[a], &tree.nodes[b]);
            key(b.total, sort)
                .cmp(&key(a.total, sort))
                .then_with(|| a.name.cmp(&b.name))
        });
        todo.extend(children.into_iter().rev().map(|c| (c, depth)));
    };
    let mut todo = Vec::new();
    push_children(&mut todo, tree.root(), 0);
    while let Some((i, depth)) = todo.pop() {
        let child = &tree.nodes[i];
        let share = percent(key(child.total, sort).0, all);
        if share < min_pct {
            hidden.nodes += 1;
            hidden.counts.add(child.total);
            continue;
        }
        let indent = if depth <= MAX_INDENT {
            "  ".repeat(depth)
        } else {
            format!("{}[{depth}] ", "  ".repeat(MAX_INDENT))
        };
        let _ = writeln!(
            out,
            "{:>9} {:>5.1}% {:>11}  {:>10} {:>12}  {indent}{}",
            child.total.calls,
            share,
            bytes(child.total.bytes),
            child.own.calls,
            bytes(child.own.bytes),
            child.name
        );
        push_children(&mut todo, child, depth + 1);
    }
}

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

/// The call graph of every allocation stack weighted by `weight`.
pub fn graph(profile: &Profile, weight: StackWeight) -> Graph {
    let mut g = Graph::default();
    for entry in profile.stacks.iter().filter(|e| is_allocation(e)) {
        let w = weight.of(entry);
        if w == 0 {
            continue;
        }
        g.all += w;
        let names = path(entry);
        let mut seen = BTreeSet::new();
        for name in &names {
            if seen.insert(*name) {
                g.funcs.entry(name.to_string()).or_default().total += w;
            }
        }
        if let Some(direct) = names.last() {
            g.funcs.entry(direct.to_string()).or_default().own += w;
        }
        let mut seen_edges = BTreeSet::new();
        for pair in names.windows(2) {
            if seen_edges.insert((pair[0], pair[1])) {
                *g.edges
                    .entry((pair[0].to_string(), pair[1].to_string()))
                    .or_default() += w;
            }
        }
    }
    g
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

#[cfg(test)]
mod tests {
    use super::super::test_util::{entry, profile};
    use super::*;

    /// main -> a -> malloc (10 calls, 100 bytes), main -> a -> b -> malloc
    /// (5, 5000), main -> c -> calloc (1, 1), and a thread's start -> w.
    fn sample() -> Profile {
        profile(vec![
            entry("malloc", &["a", "main", "_start"], 10, 100),
            entry("malloc", &["b", "a", "main", "_start"], 5, 5000),
            entry("calloc", &["c", "main", "_start"], 1, 1),
            entry("malloc", &["w", "start_thread"], 4, 40),
            entry("free", &["a", "main", "_start"], 99, 0),
        ])
    }

    #[test]
    fn totals_and_self_per_node() {
        let tree = build(&sample());
        let root = tree.root();
        assert_eq!(
            root.total,
            Counts {
                calls: 20,
                bytes: 5141
            }
        );
        let start = tree.child(root, "_start").unwrap();
        let main = tree.child(start, "main").unwrap();
        assert_eq!(
            main.total,
            Counts {
                calls: 16,
                bytes: 5101
            }
        );
        assert_eq!(main.own, Counts::default());
        let a = tree.child(main, "a").unwrap();
        assert_eq!(
            a.total,
            Counts {
                calls: 15,
                bytes: 5100
            }
        );
        assert_eq!(
            a.own,
            Counts {
                calls: 10,
                bytes: 100
            }
        );
    }

    #[test]
    fn tree_text_by_calls_and_by_bytes() {
        let text = render_tree(&sample(), SortKey::Calls, 0.0);
        let expected = "\
call tree, top-down (nodes under 1% of calls left out)
    calls  share       bytes  self calls   self bytes  function
       16  80.0%     5.0 KiB           0          0 B  _start
       16  80.0%     5.0 KiB           0          0 B    main
       15  75.0%     5.0 KiB          10        100 B      a
        5  25.0%     4.9 KiB           5      4.9 KiB        b
        1   5.0%         1 B           1          1 B      c
        4  20.0%        40 B           0          0 B  start_thread
        4  20.0%        40 B           4         40 B    w
";
        assert_eq!(text, expected);
        // By bytes, over 1%: c (1 byte) and start_thread (40) are left
        // out, and said so.
        let text = render_tree(&sample(), SortKey::Bytes, 0.0);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].ends_with("(nodes under 1% of bytes left out)"));
        assert!(
            lines[2].ends_with("  _start") && lines[2].contains(" 99.2%"),
            "{text}"
        );
        assert!(!text.contains("  c\n"), "{text}");
        assert_eq!(
            lines.last().copied(),
            Some("2 smaller nodes left out (5 calls, 41 B; --threshold to change)")
        );
        // A higher threshold prunes more, a lower one less.
        let text = render_tree(&sample(), SortKey::Calls, 50.0);
        assert!(
            !text.contains("start_thread") && text.contains("    a\n"),
            "{text}"
        );
        let text = render_tree(&sample(), SortKey::Bytes, 0.01);
        assert!(
            text.contains("      c\n") && !text.contains("left out ("),
            "{text}"
        );
    }

    #[test]
    fn deep_trees_stop_indenting() {
        let names: Vec<String> = (0..40).map(|i| format!("f{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let text = render_tree(
            &profile(vec![entry("malloc", &refs, 1, 1)]),
            SortKey::Calls,
            0.0,
        );
        let last = text.lines().last().unwrap();
        assert!(
            last.ends_with(&format!("{}[39] f0", "  ".repeat(MAX_INDENT))),
            "{last}"
        );
    }

    #[test]
    fn a_stack_of_100k_frames_is_written_whole() {
        let p = crate::profile::synthetic::one_deep_stack(100_000);
        let text = render_tree(&p, SortKey::Calls, 0.0);
        assert_eq!(text.lines().count(), 2 + 100_000);
        let last = text.lines().last().unwrap();
        assert!(last.ends_with("[99999] f0"), "{last}");
        // The tree is dropped without recursing, too.
        assert_eq!(build(&p).nodes.len(), 1 + 100_000);
    }

    #[test]
    fn a_node_of_100k_children() {
        let p = crate::profile::synthetic::siblings(100_000);
        let tree = build(&p);
        let main = tree.child(tree.root(), "main").unwrap();
        assert_eq!(main.children.len(), 100_000);
        assert_eq!(main.total.calls, 100_000);
        let text = render_tree(&p, SortKey::Calls, 0.0);
        assert!(
            text.ends_with(
                "100000 smaller nodes left out (100000 calls, 781.2 KiB; --threshold to change)\n"
            ),
            "{text}"
        );
        let text = render_tree(&p, SortKey::Calls, 0.0001);
        assert_eq!(text.lines().count(), 3 + 100_000);
    }

    #[test]
    fn graph_weights_functions_and_edges() {
        let g = graph(&sample(), StackWeight::Calls);
        assert_eq!(g.all, 20);
        assert_eq!(g.funcs["a"], FuncWeight { own: 10, total: 15 });
        assert_eq!(g.funcs["main"], FuncWeight { own: 0, total: 16 });
        assert_eq!(g.edges[&("main".into(), "a".into())], 15);
        assert_eq!(g.edges[&("a".into(), "b".into())], 5);
        // Recursion counts a stack once per function and per edge.
        let rec = profile(vec![entry("malloc", &["r", "r", "r", "main"], 3, 3)]);
        let g = graph(&rec, StackWeight::Calls);
        assert_eq!(g.funcs["r"], FuncWeight { own: 3, total: 3 });
        assert_eq!(g.edges[&("r".into(), "r".into())], 3);
        let g = graph(&sample(), StackWeight::Bytes);
        assert_eq!(
            g.funcs["b"],
            FuncWeight {
                own: 5000,
                total: 5000
            }
        );
    }

    #[test]
    fn dot_text() {
        let mut p = sample();
        p.meta.command = "./app \"x\"".into();
        let dot = render_dot(&p, StackWeight::Calls, 0.0);
        assert!(dot.starts_with("digraph mtrace {\n") && dot.ends_with("}\n"));
        assert!(dot.contains("label=\"mtrace: ./app \\\"x\\\" (pid 0)\\n20 calls in all (calls)"));
        // Nodes in name order: _start, a, b, c, main, start_thread, w.
        assert!(dot.contains(
            "  n1 [label=\"a\\nself 10 calls (50.0%)\\ntotal 15 calls (75.0%)\", tooltip=\"a\", \
             fillcolor=\"#e79090\", fontsize=17];"
        ), "{dot}");
        assert!(
            dot.contains("  n4 -> n1 [label=\"15 calls\", weight=15, penwidth=4.75];"),
            "{dot}"
        );
        assert!(dot.contains("fillcolor=\"#f8f8f8\""), "{dot}");
        // Bytes: c (1 byte of 5141), start_thread and w (40 bytes) are
        // under 1%: they and their edges are gone.
        let dot = render_dot(&p, StackWeight::Bytes, 0.0);
        for gone in ["c", "w", "start_thread"] {
            assert!(!dot.contains(&format!("tooltip=\"{gone}\"")), "{dot}");
        }
        assert!(dot.contains("  n1 -> n2 [label=\"4.9 KiB\", weight=5000, penwidth=4.92];"));
        assert_eq!(dot.matches(" -> ").count(), 3, "{dot}");
    }
}
