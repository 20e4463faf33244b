//! The top-down call tree (`--tree`): built from the stacks' paths of
//! numbered names, node by node, and written as indented text, whole or
//! per thread.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::{self, Write};

use crate::profile::{is_go_heap, Counts, Profile, Thread};
use crate::render::text::{bytes, count, cut, printable, printable_profile};
use crate::render::{is_allocation, percent, SortKey};

use super::{min_share, Names};

/// Deeper nodes are indented no further (their depth is written instead).
pub(super) const MAX_INDENT: usize = 24;

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
///
/// [`MIN_SHARE_PCT`]: super::MIN_SHARE_PCT
pub fn render_tree(profile: &Profile, sort: SortKey, threshold_pct: f64) -> String {
    let mut out = String::new();
    // Writing to a string does not fail.
    let _ = render_tree_to(&mut out, profile, sort, threshold_pct);
    out
}

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

/// [`render_tree`], written to `out` line by line as it is made: the text
/// is never held whole (a stack may be thousands of frames deep). Stops
/// at the first failed write.
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
