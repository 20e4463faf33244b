//! Matching two saved profiles stack by stack: the first half of
//! `mtrace diff BASE.json NEW.json`, the CI regression gate.
//!
//! Stacks are matched across runs and builds by a [`StackKey`]: the
//! allocator function and, per frame, the function name and the basename of
//! its object (the traced program itself is just `<program>`). Addresses,
//! files, lines, build ids and threads are left out, so two runs of one
//! binary, or two builds of it, line up; entries that map to the same key
//! are summed. A frame without a name is keyed without its address (see
//! [`stable_function`]).
//!
//! The `--fail-if` condition language lives in [`gate`]; the diff table in
//! [`crate::render::diff_table`]; the differential folded stacks and flame
//! graph in [`crate::render::folded`] and [`crate::render::flamegraph`].

pub mod gate;

use std::cmp::{Ordering, Reverse};
use std::fmt::Write as _;
use std::sync::Arc;

use foldhash::HashMap;
use serde::Serialize;

use crate::profile::{is_allocation, Weight};
use crate::profile::{short_path, Counts, Frame, Profile, StackEntry};
use crate::render::text::cut;

/// One frame of a [`StackKey`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct KeyFrame {
    pub function: String,
    /// Basename of the object (`libc.so.6`, `bench`), without a
    /// ` (deleted)` suffix: the object may sit in another directory, or have
    /// been rebuilt, in the other run.
    pub module: Option<String>,
}

/// How frames of the traced program itself name their module in a key: two
/// builds of a program may carry different file names (`bench-old`,
/// `bench-new`) and must still line up.
pub const PROGRAM_MODULE: &str = "<program>";

impl KeyFrame {
    /// `program`: the traced executable's path in the frame's profile.
    fn of(frame: &Frame, program: Option<&str>) -> KeyFrame {
        let module = frame
            .module
            .as_deref()
            .map(|m| m.strip_suffix(" (deleted)").unwrap_or(m))
            .map(|m| {
                if program.is_some_and(|p| {
                    !p.is_empty() && p.strip_suffix(" (deleted)").unwrap_or(p) == m
                }) {
                    PROGRAM_MODULE
                } else {
                    short_path(m)
                }
            })
            .filter(|m| !m.is_empty())
            .map(str::to_string);
        let function = stable_function(&frame.function, frame.module.as_deref(), module.as_deref());
        KeyFrame { function, module }
    }
}

/// A frame's function as a key: its name, or for a frame without one a
/// name that does not move between runs. An address (of a code object, of
/// anonymous code, of no mapping) changes from run to run and is left out;
/// a place in a file (`bench+0x142a`) keeps its offset but is named by the
/// key's module (`<program>+0x142a`), not by the file's name, which two
/// builds may not share.
fn stable_function(function: &str, module: Option<&str>, key_module: Option<&str>) -> String {
    for unnamed in ["[python code 0x", "[anonymous code 0x", "[unknown 0x"] {
        if function.starts_with(unnamed) && function.ends_with(']') {
            return format!("{}]", unnamed.trim_end_matches(" 0x"));
        }
    }
    if let (Some(m), Some(k)) = (module, key_module) {
        let file = short_path(m.strip_suffix(" (deleted)").unwrap_or(m));
        if let Some(offset) = function
            .strip_prefix(file)
            .and_then(|rest| rest.strip_prefix("+0x"))
        {
            if !offset.is_empty() && offset.bytes().all(|b| b.is_ascii_hexdigit()) {
                return format!("{k}+0x{offset}");
            }
        }
    }
    function.to_string()
}

/// Identifies a stack across runs and builds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct StackKey {
    /// Allocator function (`malloc`, `aligned_alloc/memalign`, ...).
    pub func: String,
    /// Innermost first, like [`StackEntry::frames`]. Whether a frame was
    /// inlined is left out: it is a compiler decision that may change
    /// between builds while the source-level stack stays the same. Keys
    /// through one frame share it.
    pub frames: Vec<Arc<KeyFrame>>,
    /// Only the direct caller is known (stack walk failed or collided).
    /// Kept apart, as in the main table, so a cut stack is not mistaken for
    /// a complete one-frame stack.
    pub truncated: bool,
}

impl StackKey {
    /// `program`: the traced executable's path (`Meta::executable`).
    pub fn of(entry: &StackEntry, program: Option<&str>) -> StackKey {
        StackKey {
            func: entry.func.clone(),
            frames: entry
                .frames
                .iter()
                .map(|f| Arc::new(KeyFrame::of(f, program)))
                .collect(),
            truncated: entry.truncated,
        }
    }

    /// `malloc <- alloc_small <- main`: the allocator function, then the
    /// frames' function names innermost first. After [`MAX_CHAIN_FRAMES`]
    /// frames the rest is only counted (`<- ... (+3 frames)`).
    pub fn chain(&self) -> String {
        let mut out = cut(&self.func).into_owned();
        for frame in self.frames.iter().take(MAX_CHAIN_FRAMES) {
            out.push_str(" <- ");
            out.push_str(&cut(&frame.function));
        }
        let rest = self.frames.len().saturating_sub(MAX_CHAIN_FRAMES);
        if rest > 0 {
            let _ = write!(
                out,
                " <- ... (+{rest} frame{})",
                if rest == 1 { "" } else { "s" }
            );
        }
        if self.truncated {
            out.push_str(" [stack truncated]");
        }
        out
    }
}

/// Frames named in [`StackKey::chain`]: enough to recognize a stack in a
/// one-line CI message without a deep C++ stack running over a screen.
pub const MAX_CHAIN_FRAMES: usize = 8;

/// The counts of one thing (a stack, or the totals) on both sides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Change {
    pub base: Counts,
    pub new: Counts,
}

impl Change {
    /// The base counts, or the new ones.
    fn side(&mut self, new: bool) -> &mut Counts {
        if new {
            &mut self.new
        } else {
            &mut self.base
        }
    }

    /// `new - base` of the count `weight` selects.
    pub fn delta(&self, weight: Weight) -> i128 {
        i128::from(weight.of(self.new)) - i128::from(weight.of(self.base))
    }

    /// Neither calls nor bytes changed.
    pub fn is_unchanged(&self) -> bool {
        self.base == self.new
    }
}

/// One stack of either profile.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DiffRow {
    pub key: StackKey,
    /// Zero on the side where the stack is missing.
    pub change: Change,
}

/// Two profiles compared.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Diff {
    /// Exact totals ([`crate::profile::Totals::allocs`]): they include
    /// allocations that found the kernel map full and are in no stack.
    pub total: Change,
    /// Sums over the stacks (allocations only).
    pub in_stacks: Change,
    /// Every stack of either side, unchanged ones included, by absolute
    /// change: calls, then bytes, largest first; then by key.
    pub rows: Vec<DiffRow>,
    /// The share of whole stacks, in percent, of base and new (when the
    /// profiles say): stacks cut short match worse across runs.
    pub whole_pct: (Option<f64>, Option<f64>),
    /// Each test of either side ([`Diff::with_groups`]); none unless
    /// asked for.
    pub tests: Vec<GroupChange>,
    /// Each group of either side; none unless asked for.
    pub groups: Vec<GroupChange>,
}

/// One test's or group's counts on both sides.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GroupChange {
    pub name: String,
    /// Zero on the side where it is missing.
    pub change: Change,
}

/// `base` and `new` joined by name: each name of either side once, in the
/// order first met (the base's, then the new side's others).
pub fn join_groups(
    base: &[crate::profile::groups::GroupTotals],
    new: &[crate::profile::groups::GroupTotals],
) -> Vec<GroupChange> {
    let mut out: Vec<GroupChange> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::default();
    for (side, is_new) in [(base, false), (new, true)] {
        for g in side {
            let i = *at.entry(&g.name).or_insert_with(|| {
                out.push(GroupChange {
                    name: g.name.clone(),
                    change: Change::default(),
                });
                out.len() - 1
            });
            add(out[i].change.side(is_new), g.counts);
        }
    }
    out
}

impl Diff {
    /// With each test's change (`per_test`), and each group's: by `rules`
    /// when there are any, or else as the profiles' files saved them (when
    /// both did: a group one side lacks is not known to be empty there).
    pub fn with_groups(
        mut self,
        base: &Profile,
        new: &Profile,
        per_test: bool,
        rules: &[crate::profile::groups::Rule],
    ) -> Diff {
        use crate::profile::groups;
        if per_test {
            self.tests = join_groups(&groups::tests(base), &groups::tests(new));
        }
        self.groups = if rules.is_empty() {
            if base.groups.is_empty() || new.groups.is_empty() {
                Vec::new()
            } else {
                join_groups(&base.groups, &new.groups)
            }
        } else {
            join_groups(&groups::groups(base, rules), &groups::groups(new, rules))
        };
        self
    }
}

/// The key frames of both sides of a diff, each distinct one once: a
/// frame is keyed once per [`Arc`] of it (per side: the program's path is
/// each side's own), and each distinct key frame is numbered in the order
/// of its content, so that stacks are matched and ordered by numbers, a
/// number per frame, however long the frames' names.
#[derive(Default)]
struct KeyFrames<'a> {
    /// By side, frame and program (its path's address).
    by_arc: HashMap<(bool, *const Frame, *const u8), u32>,
    numbers: HashMap<Arc<KeyFrame>, u32>,
    frames: Vec<Arc<KeyFrame>>,
    /// The frames whose addresses are keys of `by_arc` stay borrowed while
    /// this lives: no address is freed and reused meanwhile.
    _borrowed: std::marker::PhantomData<&'a Frame>,
}

impl<'a> KeyFrames<'a> {
    /// The numbers of `entry`'s key frames, in the order first met
    /// (`program`: the path of the program it ran).
    fn numbers(&mut self, entry: &'a StackEntry, is_new: bool, program: &'a str) -> Vec<u32> {
        entry
            .frames
            .iter()
            .map(|f| {
                let at = (is_new, Arc::as_ptr(f), program.as_ptr());
                if let Some(&n) = self.by_arc.get(&at) {
                    return n;
                }
                let key = Arc::new(KeyFrame::of(f, Some(program)));
                let next = self.frames.len() as u32;
                let n = *self.numbers.entry(key.clone()).or_insert(next);
                if n == next {
                    self.frames.push(key);
                }
                self.by_arc.insert(at, n);
                n
            })
            .collect()
    }

    /// Each number's rank in the order of the key frames' content.
    fn ranks(&self) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.frames.len() as u32).collect();
        order.sort_unstable_by(|&a, &b| self.frames[a as usize].cmp(&self.frames[b as usize]));
        let mut rank = vec![0; order.len()];
        for (r, &n) in order.iter().enumerate() {
            rank[n as usize] = r as u32;
        }
        rank
    }
}

/// Compares `base` with `new`. `free` entries are left out.
pub fn diff(base: &Profile, new: &Profile) -> Diff {
    type Key<'a> = (&'a str, Vec<u32>, bool);
    let mut frames = KeyFrames::default();
    let mut by_key: HashMap<Key<'_>, Change> = HashMap::default();
    let mut in_stacks = Change::default();
    for (profile, is_new) in [(base, false), (new, true)] {
        // A row under a process (a tree's, the host's) is of that
        // process's program.
        let programs: HashMap<u32, &str> = profile
            .meta
            .processes
            .iter()
            .filter(|p| !p.executable.is_empty())
            .map(|p| (p.pid, p.executable.as_str()))
            .collect();
        for entry in profile.stacks.iter().filter(|e| is_allocation(e)) {
            let program = entry
                .process
                .as_ref()
                .and_then(|p| programs.get(&p.pid).copied())
                .unwrap_or(&profile.meta.executable);
            let numbers = frames.numbers(entry, is_new, program);
            let key = (entry.func.as_str(), numbers, entry.truncated);
            add(by_key.entry(key).or_default().side(is_new), entry.counts);
            add(in_stacks.side(is_new), entry.counts);
        }
    }
    // Numbers in the order of content: ordering a key's numbers orders
    // its frames.
    let rank = frames.ranks();
    let mut rows: Vec<(Vec<u32>, DiffRow)> = by_key
        .into_iter()
        .map(|((func, numbers, truncated), change)| {
            let key = StackKey {
                func: func.to_string(),
                frames: numbers
                    .iter()
                    .map(|&n| frames.frames[n as usize].clone())
                    .collect(),
                truncated,
            };
            let ranks = numbers.iter().map(|&n| rank[n as usize]).collect();
            (ranks, DiffRow { key, change })
        })
        .collect();
    reconcile_unnamed(&mut rows);
    rows.sort_by(|(a_ranks, a), (b_ranks, b)| {
        compare_sizes(a, b)
            .then_with(|| a.key.func.cmp(&b.key.func))
            .then_with(|| a_ranks.cmp(b_ranks))
            .then_with(|| a.key.truncated.cmp(&b.key.truncated))
    });
    Diff {
        total: Change {
            base: base.totals.allocs,
            new: new.totals.allocs,
        },
        in_stacks,
        rows: rows.into_iter().map(|(_, row)| row).collect(),
        whole_pct: (
            base.stack_quality.as_ref().map(|q| q.whole_pct()),
            new.stack_quality.as_ref().map(|q| q.whole_pct()),
        ),
        tests: Vec::new(),
        groups: Vec::new(),
    }
}

/// First folds the rows blurred by an unnamed Python frame
/// ([`fold_blurred`]); then folds each stack seen on one side only into the
/// one stack seen only on the other side that is the same but for the names of frames in no
/// object file (Python's): a code object freed before the tracer read it
/// is unnamed in one run, or named by what took its place, and named in
/// another. With no such stack, or several, it stays apart. The counts
/// are still compared, so a real change is still seen.
fn reconcile_unnamed<K>(rows: &mut Vec<(K, DiffRow)>) {
    fold_blurred(rows);
    // By shape (the key with the names of frames in no object file left
    // out): the rows seen on the base side only, and on the new side only.
    let mut shapes: std::collections::BTreeMap<StackKey, (Vec<usize>, Vec<usize>)> =
        std::collections::BTreeMap::new();
    for (i, (_, r)) in rows.iter().enumerate() {
        let one_sided = r.change.base.calls == 0 || r.change.new.calls == 0;
        if !one_sided || !r.key.frames.iter().any(|f| f.module.is_none()) {
            continue;
        }
        let sides = shapes.entry(shape_of(&r.key)).or_default();
        if r.change.new.calls == 0 {
            sides.0.push(i);
        } else {
            sides.1.push(i);
        }
    }
    let mut gone = vec![false; rows.len()];
    for (base_only, new_only) in shapes.values() {
        if let ([b], [n]) = (&base_only[..], &new_only[..]) {
            let from = rows[*b].1.change.base;
            add(&mut rows[*n].1.change.base, from);
            gone[*b] = true;
        }
    }
    retain_kept(rows, &gone);
}

/// The key of `key` with the names of frames in no object file left out.
fn shape_of(key: &StackKey) -> StackKey {
    let mut shape = key.clone();
    for f in shape.frames.iter_mut().filter(|f| f.module.is_none()) {
        *f = std::sync::Arc::new(KeyFrame {
            function: String::new(),
            module: None,
        });
    }
    shape
}

/// How an unnamed Python frame reads in a key (see [`stable_function`]).
const UNNAMED_PYTHON: &str = "[python code]";

/// Folds together the rows of one shape where any of them has an unnamed
/// Python frame: such a frame may be any of the named ones of that shape
/// in the other run, and some of its calls may sit there under a name in
/// one run and apart, unnamed, in another. Compared apart, identical runs
/// would differ; summed, they are equal, and a real change of the shape is
/// still seen. Frames the folded rows name alike keep their name; the
/// others read `[python code]`.
fn fold_blurred<K>(rows: &mut Vec<(K, DiffRow)>) {
    let mut shapes: std::collections::BTreeMap<StackKey, Vec<usize>> =
        std::collections::BTreeMap::new();
    for (i, (_, r)) in rows.iter().enumerate() {
        if r.key.frames.iter().any(|f| f.module.is_none()) {
            shapes.entry(shape_of(&r.key)).or_default().push(i);
        }
    }
    let mut gone = vec![false; rows.len()];
    for members in shapes.values() {
        let blurred = members.iter().any(|&i| {
            rows[i]
                .1
                .key
                .frames
                .iter()
                .any(|f| f.module.is_none() && f.function == UNNAMED_PYTHON)
        });
        let Some((&into, others)) = members.split_first() else {
            continue;
        };
        if !blurred || others.is_empty() {
            continue;
        }
        for &i in others {
            let (base, new) = (rows[i].1.change.base, rows[i].1.change.new);
            let frames = rows[i].1.key.frames.clone();
            let row = &mut rows[into].1;
            add(&mut row.change.base, base);
            add(&mut row.change.new, new);
            for (f, other) in row.key.frames.iter_mut().zip(&frames) {
                if f != other {
                    *f = std::sync::Arc::new(KeyFrame {
                        function: UNNAMED_PYTHON.into(),
                        module: None,
                    });
                }
            }
            gone[i] = true;
        }
    }
    retain_kept(rows, &gone);
}

/// Drops the rows marked in `gone`.
fn retain_kept<K>(rows: &mut Vec<(K, DiffRow)>, gone: &[bool]) {
    let mut i = 0;
    rows.retain(|_| {
        i += 1;
        !gone[i - 1]
    });
}

/// [`Counts::add`], saturating: a corrupt file must not panic the gate.
fn add(to: &mut Counts, c: Counts) {
    to.calls = to.calls.saturating_add(c.calls);
    to.bytes = to.bytes.saturating_add(c.bytes);
}

/// Largest absolute change first: calls, then bytes. Rows of equal
/// changes are then ordered by key.
fn compare_sizes(a: &DiffRow, b: &DiffRow) -> Ordering {
    let size = |r: &DiffRow| {
        (
            Reverse(r.change.delta(Weight::Calls).unsigned_abs()),
            Reverse(r.change.delta(Weight::Bytes).unsigned_abs()),
        )
    };
    size(a).cmp(&size(b))
}

/// `+20.00%`, `-100.00%`, `+0.00%` (0 -> 0), or `new` (0 -> something).
pub fn pct_change(base: u64, new: u64) -> String {
    if base == 0 {
        return if new == 0 {
            "+0.00%".into()
        } else {
            "new".into()
        };
    }
    let delta = i128::from(new) - i128::from(base);
    format!("{:+.2}%", delta as f64 * 100.0 / base as f64)
}

#[cfg(test)]
mod tests;
