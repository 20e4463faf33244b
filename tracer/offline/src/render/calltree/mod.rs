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
//!
//! This file holds what the two share: the numbered function names of the
//! stacks and the share under which nodes are left out. The tree is in
//! `tree.rs` and the graph in `dot.rs`.

use std::sync::Arc;

use foldhash::HashMap;

use crate::profile::{Frame, StackEntry};

mod dot;
#[cfg(test)]
mod tests;
mod tree;

pub use dot::{graph, render_dot, FuncWeight, Graph};
pub use tree::{build, render_tree, render_tree_per_thread_to, render_tree_to, Node, Tree};

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
