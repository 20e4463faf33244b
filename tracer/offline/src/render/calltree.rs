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

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::{self, Write};
use std::sync::Arc;

use foldhash::{HashMap, HashSet};

use crate::profile::{is_go_heap, Counts, Frame, Profile, StackEntry, Thread};

use super::text::{bytes, count, cut, printable, printable_profile, WIDTH};
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
pub struct Node<'a> {
    /// The function's name, the profile's own (not a copy per node).
    pub name: &'a str,
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
pub struct Tree<'a> {
    /// `nodes[0]` is the unnamed root.
    pub nodes: Vec<Node<'a>>,
}

impl<'a> Tree<'a> {
    pub fn root(&self) -> &Node<'a> {
        &self.nodes[0]
    }

    /// The child of `node` named `name`.
    pub fn child(&self, node: &Node<'a>, name: &str) -> Option<&Node<'a>> {
        node.children
            .iter()
            .map(|&i| &self.nodes[i])
            .find(|c| c.name == name)
    }
}

/// The function names of frames, each numbered: equal names get one
/// number. A frame's name is looked at (and hashed) once per [`Arc`] of
/// it, so the stacks through a frame cost a pointer's lookup each,
/// however long its name.
#[derive(Default)]
struct Names<'a> {
    by_arc: HashMap<*const Frame, u32>,
    by_name: HashMap<&'a str, u32>,
    names: Vec<&'a str>,
}

impl<'a> Names<'a> {
    /// The number of `name`.
    fn number(&mut self, name: &'a str) -> u32 {
        let next = self.names.len() as u32;
        let n = *self.by_name.entry(name).or_insert(next);
        if n == next {
            self.names.push(name);
        }
        n
    }

    /// Appends the numbers of `entry`'s frame names to `path`, outermost
    /// first (of `[no frames]` when it has none); a blank name is
    /// `[unknown]`.
    fn path(&mut self, entry: &'a StackEntry, path: &mut Vec<u32>) {
        if entry.frames.is_empty() {
            path.push(self.number("[no frames]"));
            return;
        }
        for f in entry.frames.iter().rev() {
            let n = match self.by_arc.get(&Arc::as_ptr(f)) {
                Some(&n) => n,
                None => {
                    let name = if f.function.trim().is_empty() {
                        "[unknown]"
                    } else {
                        f.function.as_str()
                    };
                    let n = self.number(name);
                    self.by_arc.insert(Arc::as_ptr(f), n);
                    n
                }
            };
            path.push(n);
        }
    }
}

/// Every allocation stack as the path of its names' numbers from the
/// root (outermost first), the paths in their order: the stacks through
/// a node of the tree are then one run of them, and a node's children
/// are found by scanning its run. A tree is walked without keeping its
/// nodes: a number per frame of a stack, and the nodes on the way.
struct Paths<'a> {
    names: Names<'a>,
    /// Every path's numbers, one path after another.
    ids: Vec<u32>,
    /// Each stack's path (`ids[start..end]`) and counts, in the order of
    /// the paths.
    stacks: Vec<(usize, usize, Counts)>,
}

/// A node of the tree as [`Paths`] finds it.
struct Run {
    /// Its frames from the root (1 for a thread's outermost frame).
    depth: usize,
    name: u32,
    /// The stacks through it: `Paths::stacks[lo..hi]`.
    lo: usize,
    hi: usize,
    total: Counts,
}

impl<'a> Paths<'a> {
    fn of(profile: &'a Profile) -> Paths<'a> {
        let mut names = Names::default();
        let allocations = || profile.stacks.iter().filter(|e| is_allocation(e));
        // As many numbers as frames (or one), no more.
        let mut ids = Vec::with_capacity(allocations().map(|e| e.frames.len().max(1)).sum());
        let mut stacks = Vec::with_capacity(allocations().count());
        for entry in allocations() {
            let start = ids.len();
            names.path(entry, &mut ids);
            stacks.push((start, ids.len(), entry.counts));
        }
        stacks.sort_unstable_by(|a, b| ids[a.0..a.1].cmp(&ids[b.0..b.1]));
        Paths { names, ids, stacks }
    }

    fn path(&self, i: usize) -> &[u32] {
        let (start, end, _) = self.stacks[i];
        &self.ids[start..end]
    }

    /// The root: every stack.
    fn root(&self) -> Run {
        let mut total = Counts::default();
        for s in &self.stacks {
            total.add(s.2);
        }
        Run {
            depth: 0,
            name: 0,
            lo: 0,
            hi: self.stacks.len(),
            total,
        }
    }

    /// What `node`'s stacks call the allocator from the node itself
    /// (those whose path ends there: they come first in its run), and
    /// its children, in the order of their numbers.
    fn children(&self, node: &Run) -> (Counts, Vec<Run>) {
        let depth = node.depth;
        let mut own = Counts::default();
        let mut i = node.lo;
        while i < node.hi && self.path(i).len() == depth {
            own.add(self.stacks[i].2);
            i += 1;
        }
        let mut children = Vec::new();
        while i < node.hi {
            let name = self.path(i)[depth];
            let lo = i;
            let mut total = Counts::default();
            while i < node.hi && self.path(i)[depth] == name {
                total.add(self.stacks[i].2);
                i += 1;
            }
            children.push(Run {
                depth: depth + 1,
                name,
                lo,
                hi: i,
                total,
            });
        }
        (own, children)
    }
}

/// The tree of every allocation stack under an unnamed root whose total
/// is all of them; children in no particular order. Each node is made
/// once, by scanning the run of stacks through its parent.
pub fn build(profile: &Profile) -> Tree<'_> {
    let paths = Paths::of(profile);
    let root = paths.root();
    let mut nodes = vec![Node {
        total: root.total,
        ..Node::default()
    }];
    let mut todo = vec![(0, root)];
    while let Some((at, run)) = todo.pop() {
        let (own, children) = paths.children(&run);
        nodes[at].own = own;
        for child in children {
            let i = nodes.len();
            nodes.push(Node {
                name: paths.names.names[child.name as usize],
                total: child.total,
                ..Node::default()
            });
            nodes[at].children.push(i);
            todo.push((i, child));
        }
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
    let mut out = String::new();
    // Writing to a string does not fail.
    let _ = render_tree_to(&mut out, profile, sort, threshold_pct);
    out
}

/// [`render_tree`], written to `out` line by line as it is made: the text
/// is never held whole (a stack may be thousands of frames deep). Stops
/// at the first failed write.
/// [`render_tree_to`] for each thread of a profile split per thread, most
/// calls first, under a line naming it and its totals: each thread's tree
/// on its own, its shares of that thread's calls or bytes.
pub fn render_tree_per_thread_to(
    out: &mut impl Write,
    profile: &Profile,
    sort: SortKey,
    threshold_pct: f64,
) -> fmt::Result {
    let mut by_thread: BTreeMap<&Thread, Profile> = BTreeMap::new();
    for e in &profile.stacks {
        if let Some(t) = &e.thread {
            by_thread
                .entry(t)
                .or_insert_with(|| crate::profile::window::without_stacks(profile))
                .stacks
                .push(e.clone());
        }
    }
    if by_thread.is_empty() {
        return render_tree_to(out, profile, sort, threshold_pct);
    }
    let mut threads: Vec<(&Thread, Counts, Profile)> = by_thread
        .into_iter()
        .map(|(t, p)| {
            let mut total = Counts::default();
            for e in p
                .stacks
                .iter()
                .filter(|e| is_allocation(e) && !is_go_heap(e))
            {
                total.add(e.counts);
            }
            (t, total, p)
        })
        .collect();
    // Stable: threads of equal counts stay in the order of their ids.
    threads.sort_by_key(|(_, total, _)| std::cmp::Reverse(key(*total, sort)));
    for (i, (t, total, one)) in threads.iter().enumerate() {
        if i > 0 {
            out.write_char('\n')?;
        }
        writeln!(
            out,
            "thread {} ({}): {} calls, {}",
            printable(&t.name),
            t.tid,
            total.calls,
            bytes(total.bytes)
        )?;
        render_tree_to(out, one, sort, threshold_pct)?;
    }
    Ok(())
}

pub fn render_tree_to(
    out: &mut impl Write,
    profile: &Profile,
    sort: SortKey,
    threshold_pct: f64,
) -> fmt::Result {
    let profile = &*printable_profile(profile);
    let paths = Paths::of(profile);
    let root = paths.root();
    let min_pct = min_share(threshold_pct);
    let what = match sort {
        SortKey::Calls => "calls",
        SortKey::Bytes | SortKey::Live => "bytes",
    };
    writeln!(
        out,
        "call tree, top-down (nodes under {min_pct}% of {what} left out)"
    )?;
    if root.total == Counts::default() {
        return out.write_str("no allocations traced\n");
    }
    writeln!(
        out,
        "{:>9} {:>6} {:>11}  {:>10} {:>12}  function",
        "calls", "share", "bytes", "self calls", "self bytes"
    )?;
    let mut hidden = Hidden::default();
    let all = key(root.total, sort).0;
    write_nodes(out, &paths, root, sort, all, min_pct, &mut hidden)?;
    if hidden.nodes > 0 {
        writeln!(
            out,
            "{} left out ({}, {}; --threshold to change)",
            count(hidden.nodes as u64, "smaller node"),
            count(hidden.counts.calls, "call"),
            bytes(hidden.counts.bytes)
        )?;
    }
    Ok(())
}

/// Nodes left out of the tree (whole subtrees counted once, at their top).
#[derive(Default)]
struct Hidden {
    nodes: usize,
    counts: Counts,
}

/// The nodes under the root, depth first, each node's children by the
/// sort key. The nodes still to write are on a stack of their own, not
/// the call stack: a stack of any depth is written. A node left out is
/// not looked into.
fn write_nodes(
    out: &mut impl Write,
    paths: &Paths<'_>,
    root: Run,
    sort: SortKey,
    all: u64,
    min_pct: f64,
    hidden: &mut Hidden,
) -> fmt::Result {
    let names = &paths.names.names;
    // Each name cut once, however many nodes it names.
    let shown: Vec<Cow<'_, str>> = names.iter().map(|n| cut(n)).collect();
    let mut todo = vec![root];
    while let Some(node) = todo.pop() {
        let (own, mut children) = paths.children(&node);
        if node.depth > 0 {
            let depth = node.depth - 1;
            let indent = if depth <= MAX_INDENT {
                "  ".repeat(depth)
            } else {
                format!("{}[{depth}] ", "  ".repeat(MAX_INDENT))
            };
            writeln!(
                out,
                "{:>9} {:>5.1}% {:>11}  {:>10} {:>12}  {indent}{}",
                node.total.calls,
                percent(key(node.total, sort).0, all),
                bytes(node.total.bytes),
                own.calls,
                bytes(own.bytes),
                shown[node.name as usize]
            )?;
        }
        children.sort_by(|a, b| {
            key(b.total, sort)
                .cmp(&key(a.total, sort))
                .then_with(|| names[a.name as usize].cmp(names[b.name as usize]))
        });
        // Pushed in reverse, so the first pops first.
        for child in children.into_iter().rev() {
            if percent(key(child.total, sort).0, all) < min_pct {
                hidden.nodes += 1;
                hidden.counts.add(child.total);
            } else {
                todo.push(child);
            }
        }
    }
    Ok(())
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
        let p = sample();
        let tree = build(&p);
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
