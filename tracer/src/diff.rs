//! `mtrace diff BASE.json NEW.json`: compares two saved profiles, the CI
//! regression gate.
//!
//! Stacks are matched across runs and builds by a [`StackKey`]: the
//! allocator function and, per frame, the function name and the basename of
//! its object (the traced program itself is just `<program>`). Addresses, files, lines, build ids and threads are left out,
//! so two runs of one binary, or two builds of it, line up; entries that map
//! to the same key are summed.
//!
//! ```text
//! total: calls 1000 -> 1200 (+200, +20.00%), bytes 48000 -> 57600 (+9600, +20.00%)
//!
//! #1  calls +200 (+20.00%, 1000 -> 1200)  bytes +9600 (+20.00%, 48000 -> 57600)  malloc
//!     alloc_small [fixture]
//!     main [fixture]
//!
//! 3 stacks unchanged
//! ```
//!
//! Conditions (`--fail-if calls>+5%`) are checked by [`check`]; the
//! differential folded format (`root;...;caller;malloc BASE NEW`) and its
//! red/blue flame graph come from [`differential_folded`] and
//! [`differential_flamegraph`].

use std::cmp::{Ordering, Reverse};
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use anyhow::{bail, Context};
use inferno::flamegraph::{from_lines, Options};
use serde::Serialize;

use crate::profile::{short_path, Counts, Frame, Profile, StackEntry};
use crate::render::{is_allocation, Weight};

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
        KeyFrame {
            function: frame.function.clone(),
            module,
        }
    }
}

/// Identifies a stack across runs and builds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct StackKey {
    /// Allocator function (`malloc`, `aligned_alloc/memalign`, ...).
    pub func: String,
    /// Innermost first, like [`StackEntry::frames`]. Whether a frame was
    /// inlined is left out: it is a compiler decision that may change
    /// between builds while the source-level stack stays the same.
    pub frames: Vec<KeyFrame>,
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
                .map(|f| KeyFrame::of(f, program))
                .collect(),
            truncated: entry.truncated,
        }
    }

    /// `malloc <- alloc_small <- main`: the allocator function, then the
    /// frames' function names innermost first. After [`MAX_CHAIN_FRAMES`]
    /// frames the rest is only counted (`<- ... (+3 frames)`).
    pub fn chain(&self) -> String {
        let mut out = self.func.clone();
        for frame in self.frames.iter().take(MAX_CHAIN_FRAMES) {
            out.push_str(" <- ");
            out.push_str(&frame.function);
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
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Diff {
    /// Exact totals ([`crate::profile::Totals::allocs`]): they include
    /// allocations that found the kernel map full and are in no stack.
    pub total: Change,
    /// Sums over the stacks (allocations only).
    pub in_stacks: Change,
    /// Every stack of either side, unchanged ones included, by absolute
    /// change: calls, then bytes, largest first; then by key.
    pub rows: Vec<DiffRow>,
}

/// Compares `base` with `new`. `free` entries are left out.
pub fn diff(base: &Profile, new: &Profile) -> Diff {
    let mut by_key: BTreeMap<StackKey, Change> = BTreeMap::new();
    let mut in_stacks = Change::default();
    for entry in base.stacks.iter().filter(|e| is_allocation(e)) {
        add(
            &mut by_key
                .entry(StackKey::of(entry, Some(&base.meta.executable)))
                .or_default()
                .base,
            entry.counts,
        );
        add(&mut in_stacks.base, entry.counts);
    }
    for entry in new.stacks.iter().filter(|e| is_allocation(e)) {
        add(
            &mut by_key
                .entry(StackKey::of(entry, Some(&new.meta.executable)))
                .or_default()
                .new,
            entry.counts,
        );
        add(&mut in_stacks.new, entry.counts);
    }
    let mut rows: Vec<DiffRow> = by_key
        .into_iter()
        .map(|(key, change)| DiffRow { key, change })
        .collect();
    rows.sort_by(compare_rows);
    Diff {
        total: Change {
            base: base.totals.allocs,
            new: new.totals.allocs,
        },
        in_stacks,
        rows,
    }
}

/// [`Counts::add`], saturating: a corrupt file must not panic the gate.
fn add(to: &mut Counts, c: Counts) {
    to.calls = to.calls.saturating_add(c.calls);
    to.bytes = to.bytes.saturating_add(c.bytes);
}

fn compare_rows(a: &DiffRow, b: &DiffRow) -> Ordering {
    let size = |r: &DiffRow| {
        (
            Reverse(r.change.delta(Weight::Calls).unsigned_abs()),
            Reverse(r.change.delta(Weight::Bytes).unsigned_abs()),
        )
    };
    size(a).cmp(&size(b)).then_with(|| a.key.cmp(&b.key))
}

// ---------------------------------------------------------------------------
// Conditions

/// A number kept exactly as written: `num / den`. Thresholds are compared in
/// integers so that `calls>+5%` on 1000 -> 1050 is exactly on the edge (not
/// violated) instead of depending on floating-point rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ratio {
    num: u128,
    den: u128,
}

impl Ratio {
    #[cfg(test)]
    pub fn as_f64(self) -> f64 {
        self.num as f64 / self.den as f64
    }
}

/// What a condition's number means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Threshold {
    /// An increase by this many calls or bytes (units already applied).
    Amount(Ratio),
    /// An increase by this percentage of the base value.
    Percent(Ratio),
}

/// A parsed `--fail-if` condition: the new value grew by more than (or at
/// least) the threshold. Only increases are gated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    /// As the user wrote it, trimmed (for messages).
    pub text: String,
    pub metric: Weight,
    /// `>=` rather than `>`.
    pub inclusive: bool,
    pub threshold: Threshold,
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Condition {
    /// Whether going from `base` to `new` (of [`Self::metric`]) violates the
    /// condition.
    pub fn violated_by(&self, base: u64, new: u64) -> bool {
        // Bounds (see `parse_decimal`): num < 10^18 * 2^30 < 2^90, den <=
        // 10^9 < 2^30, values < 2^64: every product below is < 2^127.
        let delta = i128::from(new) - i128::from(base);
        let (lhs, rhs) = match self.threshold {
            Threshold::Amount(r) => (delta * r.den as i128, r.num as i128),
            Threshold::Percent(r) => {
                if base == 0 && new > 0 {
                    // Something from nothing has no finite percentage: count
                    // it as an infinite increase, which violates every
                    // percent condition. Per stack that is the point (a new
                    // allocation site is the starkest regression and must
                    // not slip through `calls>+5%`); on totals it only
                    // happens when the base traced no allocation at all.
                    return true;
                }
                (
                    delta * 100 * r.den as i128,
                    r.num as i128 * i128::from(base),
                )
            }
        };
        if self.inclusive {
            lhs >= rhs
        } else {
            lhs > rhs
        }
    }
}

/// Byte units: SI (powers of 1000) and IEC (powers of 1024), matched
/// without regard to case (`kb`, `kB`, `KB`).
const BYTE_UNITS: &[(&str, u128)] = &[
    ("b", 1),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
];

const UNIT_LIST: &str = "%, B, KiB, MiB, GiB, KB, MB or GB";

/// Parses `calls>+5%`, `bytes>=+1.5MiB`, `calls>100`, ... (spaces allowed
/// between the parts). The sign is optional and means an increase; `-` is
/// refused, as are `<` and `=`: only growth is a regression.
pub fn parse_condition(s: &str) -> Result<Condition, String> {
    let text = s.trim();
    let bad = |why: String| format!("bad --fail-if '{text}': {why}");
    if text.is_empty() {
        return Err(bad(
            "empty condition; expected for example 'calls>+5%' or 'bytes>+1MiB'".into(),
        ));
    }

    // calls / bytes
    let name_end = text
        .find(|c: char| !c.is_ascii_alphabetic())
        .unwrap_or(text.len());
    let name = &text[..name_end];
    let metric = match name.to_ascii_lowercase().as_str() {
        "calls" => Weight::Calls,
        "bytes" => Weight::Bytes,
        "" => return Err(bad("expected 'calls' or 'bytes' at the start".into())),
        _ => {
            return Err(bad(format!(
                "unknown measure '{name}': expected 'calls' or 'bytes'"
            )))
        }
    };

    // > / >=
    let rest = text[name_end..].trim_start();
    let (op, inclusive, rest) = if let Some(r) = rest.strip_prefix(">=") {
        (">=", true, r)
    } else if let Some(r) = rest.strip_prefix('>') {
        (">", false, r)
    } else if rest.is_empty() {
        return Err(bad(format!("expected '>' or '>=' after '{name}'")));
    } else {
        let found: String = rest.chars().take_while(|c| "<=!>".contains(*c)).collect();
        let found = if found.is_empty() {
            rest.chars().next().map(String::from).unwrap_or_default()
        } else {
            found
        };
        return Err(bad(format!(
            "expected '>' or '>=' after '{name}', found '{found}' (only increases are gated)"
        )));
    };

    // [+]number
    let rest = rest.trim_start();
    let rest = match rest.strip_prefix('-') {
        Some(_) => {
            return Err(bad(format!(
                "the threshold is an increase ('+5%' or '5%'), not '{}'",
                rest.trim_end()
            )))
        }
        None => rest.strip_prefix('+').unwrap_or(rest).trim_start(),
    };
    let num_end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let number = &rest[..num_end];
    if number.is_empty() {
        return Err(bad(format!("expected a number after '{op}'")));
    }
    let (mantissa, den) = parse_decimal(number).map_err(bad)?;

    // unit
    let unit = rest[num_end..].trim();
    let threshold = if unit == "%" {
        Threshold::Percent(Ratio { num: mantissa, den })
    } else if unit.is_empty() {
        Threshold::Amount(Ratio { num: mantissa, den })
    } else {
        let lower = unit.to_ascii_lowercase();
        let factor = BYTE_UNITS
            .iter()
            .find(|(u, _)| *u == lower)
            .map(|&(_, f)| f);
        match (metric, factor) {
            (Weight::Bytes, Some(f)) => Threshold::Amount(Ratio {
                num: mantissa * f,
                den,
            }),
            (Weight::Calls, Some(_)) => {
                return Err(bad(format!(
                    "'calls' takes a plain count or a percentage, not '{unit}'"
                )))
            }
            (Weight::Bytes, None) if matches!(lower.as_str(), "k" | "m" | "g") => {
                return Err(bad(format!(
                    "ambiguous unit '{unit}': write {0}iB (powers of 1024) or {0}B (powers of 1000)",
                    unit.to_ascii_uppercase()
                )))
            }
            (Weight::Bytes, None) => {
                return Err(bad(format!(
                    "unknown unit '{unit}' after '{number}': expected {UNIT_LIST}"
                )))
            }
            (Weight::Calls, None) => {
                return Err(bad(format!(
                    "unexpected '{unit}' after '{number}': expected a plain count or a percentage"
                )))
            }
        }
    };
    Ok(Condition {
        text: text.to_string(),
        metric,
        inclusive,
        threshold,
    })
}

/// `12.5` -> (125, 10). At most 18 significant digits and 9 decimals, which
/// keeps [`Condition::violated_by`]'s arithmetic within `i128`.
fn parse_decimal(s: &str) -> Result<(u128, u128), String> {
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, f),
        None => (s, ""),
    };
    if frac.contains('.') || (int.is_empty() && frac.is_empty()) || s.ends_with('.') {
        return Err(format!("'{s}' is not a number"));
    }
    if frac.len() > 9 {
        return Err(format!("'{s}' has too many decimals (at most 9)"));
    }
    let digits = format!("{int}{frac}");
    let significant = digits.trim_start_matches('0');
    if significant.len() > 18 {
        return Err(format!("'{s}' is too large"));
    }
    let mantissa: u128 = if significant.is_empty() {
        0
    } else {
        significant
            .parse()
            .map_err(|_| format!("'{s}' is not a number"))?
    };
    Ok((mantissa, 10u128.pow(frac.len() as u32)))
}

/// A condition that failed, on the totals or on one stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The condition as written (`calls>+5%`).
    pub condition: String,
    pub metric: Weight,
    /// `None` for the totals.
    pub stack: Option<StackKey>,
    pub base: u64,
    pub new: u64,
}

/// `regression: calls>+5%: total calls 1000 -> 1200 (+20.00%)` or
/// `regression: calls>+5%: malloc <- alloc_small <- main: 1000 -> 1200 (+20.00%)`.
impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "regression: {}: ", self.condition)?;
        match &self.stack {
            None => write!(f, "total {}", self.metric.unit())?,
            Some(key) => f.write_str(&key.chain())?,
        }
        write!(
            f,
            "{} {} -> {} ({})",
            if self.stack.is_some() { ":" } else { "" },
            self.base,
            self.new,
            pct_change(self.base, self.new)
        )
    }
}

/// Checks `conditions` on the totals, or with `per_stack` on every stack
/// (and then not on the totals). Violations come by condition, then in the
/// order of [`Diff::rows`].
pub fn check(diff: &Diff, conditions: &[Condition], per_stack: bool) -> Vec<Violation> {
    let mut out = Vec::new();
    for cond in conditions {
        let mut judge = |stack: Option<&StackKey>, change: &Change| {
            let (base, new) = (cond.metric.of(change.base), cond.metric.of(change.new));
            if cond.violated_by(base, new) {
                out.push(Violation {
                    condition: cond.text.clone(),
                    metric: cond.metric,
                    stack: stack.cloned(),
                    base,
                    new,
                });
            }
        };
        if per_stack {
            for row in &diff.rows {
                judge(Some(&row.key), &row.change);
            }
        } else {
            judge(None, &diff.total);
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Report

/// `+20.00%`, `-100.00%`, `+0.00%` (0 -> 0), or `new` (0 -> something).
fn pct_change(base: u64, new: u64) -> String {
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

/// `+200`, `-3`, `+0`.
fn signed(delta: i128) -> String {
    format!("{delta:+}")
}

/// `calls 1000 -> 1200 (+200, +20.00%)`
fn side_by_side(change: &Change, weight: Weight) -> String {
    let (b, n) = (weight.of(change.base), weight.of(change.new));
    format!(
        "{} {b} -> {n} ({}, {})",
        weight.unit(),
        signed(change.delta(weight)),
        pct_change(b, n)
    )
}

/// `calls +200 (+20.00%, 1000 -> 1200)`
fn row_delta(change: &Change, weight: Weight) -> String {
    let (b, n) = (weight.of(change.base), weight.of(change.new));
    format!(
        "{} {} ({}, {b} -> {n})",
        weight.unit(),
        signed(change.delta(weight)),
        pct_change(b, n)
    )
}

/// The human-readable diff: the totals, the `top` most changed stacks (0:
/// all), then how many were left out. Every line ends with a newline.
pub fn render_table(diff: &Diff, top: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "total: {}, {}",
        side_by_side(&diff.total, Weight::Calls),
        side_by_side(&diff.total, Weight::Bytes)
    );
    if diff.in_stacks != diff.total {
        let _ = writeln!(
            out,
            "in stacks: {}, {} (the rest is in the totals only: allocations lost to a full map)",
            side_by_side(&diff.in_stacks, Weight::Calls),
            side_by_side(&diff.in_stacks, Weight::Bytes)
        );
    }

    let changed: Vec<&DiffRow> = diff
        .rows
        .iter()
        .filter(|r| !r.change.is_unchanged())
        .collect();
    let unchanged = diff.rows.len() - changed.len();
    let shown = if top == 0 {
        changed.len()
    } else {
        top.min(changed.len())
    };
    for (i, row) in changed[..shown].iter().enumerate() {
        out.push('\n');
        write_row(&mut out, i + 1, row);
    }

    out.push('\n');
    if changed.is_empty() {
        out.push_str("no stack changed\n");
    }
    let hidden = &changed[shown..];
    if !hidden.is_empty() {
        let (mut calls, mut bytes) = (0i128, 0i128);
        for row in hidden {
            calls += row.change.delta(Weight::Calls);
            bytes += row.change.delta(Weight::Bytes);
        }
        let _ = writeln!(
            out,
            "{} more changed stack{} (calls {}, bytes {}) hidden by --top",
            hidden.len(),
            if hidden.len() == 1 { "" } else { "s" },
            signed(calls),
            signed(bytes)
        );
    }
    if unchanged > 0 {
        let _ = writeln!(
            out,
            "{unchanged} stack{} unchanged",
            if unchanged == 1 { "" } else { "s" }
        );
    }
    out
}

/// `#1  calls +200 (+20.00%, 1000 -> 1200)  bytes ...  malloc` and the
/// frames, `function [module]`, innermost first.
fn write_row(out: &mut String, rank: usize, row: &DiffRow) {
    let _ = write!(
        out,
        "#{rank}  {}  {}  {}",
        row_delta(&row.change, Weight::Calls),
        row_delta(&row.change, Weight::Bytes),
        row.key.func
    );
    if row.key.truncated {
        out.push_str("  [stack truncated]");
    }
    out.push('\n');
    if row.key.frames.is_empty() {
        out.push_str("    [no frames]\n");
    }
    for frame in &row.key.frames {
        out.push_str("    ");
        out.push_str(&frame.function);
        if let Some(module) = &frame.module {
            let _ = write!(out, " [{module}]");
        }
        out.push('\n');
    }
}

// ---------------------------------------------------------------------------
// Differential flame graph

/// The differential collapsed format (as inferno's `diff-folded` and
/// `difffolded.pl` write it): `root;...;caller;malloc BASE NEW`, frames
/// outermost first, the allocator function last, counts of `weight`. Keys
/// that only differ by module are summed into one line; lines where both
/// counts are 0 are left out; lines are sorted. Every line ends with a
/// newline.
pub fn differential_folded(diff: &Diff, weight: Weight) -> String {
    let mut lines: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for row in &diff.rows {
        let (b, n) = (weight.of(row.change.base), weight.of(row.change.new));
        if b == 0 && n == 0 {
            continue;
        }
        let mut parts: Vec<String> = row
            .key
            .frames
            .iter()
            .rev()
            .map(|f| crate::render::folded::clean(&f.function))
            .collect();
        parts.push(crate::render::folded::clean(&row.key.func));
        let sums = lines.entry(parts.join(";")).or_default();
        sums.0 = sums.0.saturating_add(b);
        sums.1 = sums.1.saturating_add(n);
    }
    let mut out = String::new();
    for (stack, (b, n)) in &lines {
        let _ = writeln!(out, "{stack} {b} {n}");
    }
    out
}

/// Draws [`differential_folded`] output as an SVG. Frame widths are the NEW
/// counts; each stack's allocator frame is red when it grew and blue when
/// it shrank (inferno colours the last frame of each line by `NEW - BASE`,
/// the frames below it stay near white). Stacks gone from NEW have no
/// width, as in any differential flame graph: the table lists them.
pub fn differential_flamegraph(
    folded: &str,
    title: &str,
    weight: Weight,
) -> anyhow::Result<Vec<u8>> {
    let lines: Vec<&str> = folded.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        bail!("no allocation stacks to draw");
    }
    let new_is_empty = lines.iter().all(|l| {
        l.split_whitespace()
            .next_back()
            .and_then(|n| n.parse::<u64>().ok())
            == Some(0)
    });
    if new_is_empty {
        bail!("no allocations in the new profile: the differential flame graph is sized by it");
    }
    // `Options` is non-exhaustive: start from the defaults.
    let mut options = Options::default();
    options.title = title.to_string();
    options.subtitle =
        Some("red: grew, blue: shrank (allocator frames); widths: new profile".into());
    options.count_name = weight.unit().to_string();
    // `NEW - BASE`: growth is red.
    options.negate_differentials = false;
    options.hash = true;
    let mut svg = Vec::new();
    from_lines(&mut options, lines, &mut svg)
        .context("inferno could not draw the differential flame graph")?;
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Thread;
    use crate::render::test_util::{entry, on_thread, profile};

    /// A frame as symbolization makes it, with everything that must not
    /// matter filled in.
    fn sym(function: &str, module: &str, addr: u64, line: u32) -> Frame {
        Frame {
            function: function.into(),
            file: Some(format!("/src/{function}.c")),
            line: Some(line),
            module: Some(module.into()),
            build_id: Some(format!("{addr:x}")),
            file_offset: Some(addr & 0xfff),
            addr,
            inlined: false,
        }
    }

    fn stack(func: &str, frames: Vec<Frame>, calls: u64, bytes: u64) -> StackEntry {
        StackEntry {
            func: func.into(),
            frames,
            truncated: false,
            thread: None,
            counts: Counts { calls, bytes },
            live: None,
        }
    }

    /// alloc_small: 1000 calls of 48 bytes; alloc_big: 100 calls of 4096;
    /// zeroed: 50 callocs of 10. `small` scales alloc_small's calls.
    fn run(small: u64, module_dir: &str, addr_shift: u64) -> Profile {
        let m = format!("{module_dir}/fixture");
        let f = |name: &str, addr: u64, line: u32| sym(name, &m, addr + addr_shift, line);
        profile(vec![
            stack(
                "malloc",
                vec![f("alloc_small", 0x1100, 10), f("main", 0x1500, 40)],
                small,
                small * 48,
            ),
            stack(
                "malloc",
                vec![f("alloc_big", 0x1200, 20), f("main", 0x1510, 41)],
                100,
                409600,
            ),
            stack(
                "calloc",
                vec![f("zeroed", 0x1300, 30), f("main", 0x1520, 42)],
                50,
                500,
            ),
            stack("free", vec![f("drop", 0x1400, 5)], 900, 0),
        ])
    }

    fn cond(s: &str) -> Condition {
        parse_condition(s).unwrap()
    }

    fn names(key: &StackKey) -> Vec<&str> {
        key.frames.iter().map(|f| f.function.as_str()).collect()
    }

    // -- diff ---------------------------------------------------------------

    #[test]
    fn identical_profiles_have_no_change() {
        let d = diff(&run(1000, "/tmp", 0), &run(1000, "/tmp", 0));
        assert_eq!(d.total.base, d.total.new);
        assert_eq!(
            d.total.new,
            Counts {
                calls: 1150,
                bytes: 458100
            }
        );
        assert_eq!(d.in_stacks, d.total);
        assert_eq!(d.rows.len(), 3, "free is not a row");
        assert!(d.rows.iter().all(|r| r.change.is_unchanged()));
        let conds = [cond("calls>+5%"), cond("bytes>+0"), cond("calls>0%")];
        assert!(check(&d, &conds, false).is_empty());
        assert!(check(&d, &conds, true).is_empty());
        let table = render_table(&d, 0);
        assert_eq!(
            table,
            "total: calls 1150 -> 1150 (+0, +0.00%), bytes 458100 -> 458100 (+0, +0.00%)\n\
             \n\
             no stack changed\n\
             3 stacks unchanged\n"
        );
    }

    #[test]
    fn one_site_up_twenty_percent() {
        let base = profile(vec![
            stack(
                "malloc",
                vec![
                    sym("alloc_small", "/b/fixture", 1, 1),
                    sym("main", "/b/fixture", 2, 2),
                ],
                1000,
                48000,
            ),
            stack("malloc", vec![sym("other", "/b/fixture", 3, 3)], 1000, 1000),
        ]);
        let new = profile(vec![
            stack(
                "malloc",
                vec![
                    sym("alloc_small", "/b/fixture", 1, 1),
                    sym("main", "/b/fixture", 2, 2),
                ],
                1200,
                57600,
            ),
            stack("malloc", vec![sym("other", "/b/fixture", 3, 3)], 1000, 1000),
        ]);
        let d = diff(&base, &new);
        assert_eq!(d.total.base.calls, 2000);
        assert_eq!(d.total.new.calls, 2200);
        assert_eq!(d.rows[0].change.delta(Weight::Calls), 200);
        assert_eq!(d.rows[0].change.delta(Weight::Bytes), 9600);
        assert_eq!(names(&d.rows[0].key), ["alloc_small", "main"]);

        // Totals: +10%.
        let v = check(&d, &[cond("calls>+5%")], false);
        assert_eq!(
            v,
            [Violation {
                condition: "calls>+5%".into(),
                metric: Weight::Calls,
                stack: None,
                base: 2000,
                new: 2200
            }]
        );
        assert_eq!(
            v[0].to_string(),
            "regression: calls>+5%: total calls 2000 -> 2200 (+10.00%)"
        );
        assert!(check(&d, &[cond("calls>+10%")], false).is_empty());
        assert_eq!(check(&d, &[cond("calls>=+10%")], false).len(), 1);

        // Per stack: exactly that stack, and not the totals.
        let v = check(&d, &[cond("calls>+5%")], true);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].stack.as_ref(), Some(&d.rows[0].key));
        assert_eq!((v[0].base, v[0].new), (1000, 1200));
        assert_eq!(
            v[0].to_string(),
            "regression: calls>+5%: malloc <- alloc_small <- main: 1000 -> 1200 (+20.00%)"
        );
        assert!(check(&d, &[cond("calls>+20%")], true).is_empty());
        assert_eq!(check(&d, &[cond("calls>=20%")], true).len(), 1);
    }

    #[test]
    fn exact_totals_and_stack_sums_are_both_kept() {
        let base = run(1000, "/tmp", 0);
        let mut new = run(1000, "/tmp", 0);
        // 30 allocations found the map full: in the totals, in no stack.
        new.totals.allocs.calls += 30;
        new.totals.allocs.bytes += 300;
        let d = diff(&base, &new);
        assert_eq!(d.total.new.calls, 1180);
        assert_eq!(d.in_stacks.new.calls, 1150);
        assert!(d.rows.iter().all(|r| r.change.is_unchanged()));
        // The gate reads the exact totals.
        assert_eq!(check(&d, &[cond("calls>+2%")], false).len(), 1);
        assert!(check(&d, &[cond("calls>+2%")], true).is_empty());
        let table = render_table(&d, 0);
        assert!(table.lines().any(|l| l.starts_with(
            "in stacks: calls 1150 -> 1150 (+0, +0.00%), bytes 458100 -> 458100 (+0, +0.00%)"
        )));
    }

    #[test]
    fn matching_ignores_addresses_lines_threads_and_module_directories() {
        let base = run(1000, "/home/ci/build-1", 0);
        let mut new = run(1000, "/home/ci/build-2", 0x40);
        for (i, e) in new.stacks.iter_mut().enumerate() {
            for f in &mut e.frames {
                f.line = f.line.map(|l| l + 7);
                f.file = Some("/elsewhere/x.c".into());
                f.inlined = true;
            }
            e.thread = Some(Thread {
                tid: 100 + i as u32,
                name: "w".into(),
            });
        }
        new.stacks[0].frames[1].module = Some("/home/ci/build-2/fixture (deleted)".into());
        let d = diff(&base, &new);
        assert_eq!(d.rows.len(), 3);
        assert!(d.rows.iter().all(|r| r.change.is_unchanged()), "{d:#?}");
        assert_eq!(d.rows[0].key.frames[0].module.as_deref(), Some("fixture"));
    }

    #[test]
    fn matching_respects_function_and_module_names() {
        let base = profile(vec![stack(
            "malloc",
            vec![sym("a", "/x/libfoo.so", 1, 1)],
            10,
            10,
        )]);
        for changed in [
            stack("malloc", vec![sym("b", "/x/libfoo.so", 1, 1)], 10, 10),
            stack("malloc", vec![sym("a", "/x/libbar.so", 1, 1)], 10, 10),
            stack("calloc", vec![sym("a", "/x/libfoo.so", 1, 1)], 10, 10),
            stack(
                "malloc",
                vec![sym("a", "/x/libfoo.so", 1, 1), sym("main", "/x/m", 2, 2)],
                10,
                10,
            ),
        ] {
            let d = diff(&base, &profile(vec![changed.clone()]));
            assert_eq!(d.rows.len(), 2, "{changed:?}");
            assert!(d.rows.iter().all(|r| !r.change.is_unchanged()));
        }
        let mut cut = stack("malloc", vec![sym("a", "/x/libfoo.so", 1, 1)], 10, 10);
        cut.truncated = true;
        assert_eq!(diff(&base, &profile(vec![cut])).rows.len(), 2);
    }

    #[test]
    fn entries_with_the_same_key_are_summed() {
        // Per-thread splits, and two call sites on one line (two addresses).
        let base = profile(vec![
            on_thread(entry("malloc", &["a", "main"], 10, 100), 1, "t1"),
            on_thread(entry("malloc", &["a", "main"], 20, 200), 2, "t2"),
        ]);
        let mut second = entry("malloc", &["a", "main"], 5, 50);
        second.frames[0].addr = 0x99;
        let new = profile(vec![entry("malloc", &["a", "main"], 30, 300), second]);
        let d = diff(&base, &new);
        assert_eq!(d.rows.len(), 1);
        assert_eq!(
            d.rows[0].change.base,
            Counts {
                calls: 30,
                bytes: 300
            }
        );
        assert_eq!(
            d.rows[0].change.new,
            Counts {
                calls: 35,
                bytes: 350
            }
        );
    }

    #[test]
    fn new_and_gone_stacks() {
        let base = profile(vec![
            entry("malloc", &["kept"], 100, 100),
            entry("malloc", &["gone"], 7, 70),
        ]);
        let new = profile(vec![
            entry("malloc", &["kept"], 100, 100),
            entry("malloc", &["leak", "main"], 3, 3000),
        ]);
        let d = diff(&base, &new);
        let gone = d
            .rows
            .iter()
            .find(|r| r.key.frames[0].function == "gone")
            .unwrap();
        assert_eq!(gone.change.new, Counts::default());
        let leak = d
            .rows
            .iter()
            .find(|r| r.key.frames[0].function == "leak")
            .unwrap();
        assert_eq!(leak.change.base, Counts::default());

        // A new stack is an infinite percentage increase...
        let v = check(&d, &[cond("calls>+1000000%")], true);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].stack.as_ref(), Some(&leak.key));
        assert_eq!(
            v[0].to_string(),
            "regression: calls>+1000000%: malloc <- leak <- main: 0 -> 3 (new)"
        );
        // ... but absolute thresholds still apply as written.
        assert!(check(&d, &[cond("calls>+3")], true).is_empty());
        assert_eq!(check(&d, &[cond("calls>=+3")], true).len(), 1);
        // A gone stack never violates: only growth is gated.
        assert!(check(&d, &[cond("calls>=0%")], true)
            .iter()
            .all(|v| v.stack.as_ref() != Some(&gone.key)));

        let table = render_table(&d, 0);
        assert!(
            table.contains(
                "#1  calls -7 (-100.00%, 7 -> 0)  bytes -70 (-100.00%, 70 -> 0)  malloc\n    \
                 gone\n"
            ),
            "{table}"
        );
        assert!(
            table.contains(
                "#2  calls +3 (new, 0 -> 3)  bytes +3000 (new, 0 -> 3000)  malloc\n    \
                 leak\n    main\n"
            ),
            "{table}"
        );
        assert!(table.ends_with("\n1 stack unchanged\n"));
    }

    #[test]
    fn empty_base_totals_are_an_infinite_increase() {
        let d = diff(
            &Profile::default(),
            &profile(vec![entry("malloc", &["a"], 1, 1)]),
        );
        let v = check(&d, &[cond("calls>+50%")], false);
        assert_eq!(
            v[0].to_string(),
            "regression: calls>+50%: total calls 0 -> 1 (new)"
        );
        let both_empty = diff(&Profile::default(), &Profile::default());
        assert!(check(&both_empty, &[cond("calls>+0%"), cond("bytes>0")], false).is_empty());
        assert_eq!(
            render_table(&both_empty, 0),
            "total: calls 0 -> 0 (+0, +0.00%), bytes 0 -> 0 (+0, +0.00%)\n\nno stack changed\n"
        );
    }

    #[test]
    fn rows_sort_by_absolute_calls_then_bytes_then_key() {
        let base = profile(vec![
            entry("malloc", &["down"], 50, 0),
            entry("malloc", &["up"], 10, 0),
            entry("malloc", &["bytes_only"], 10, 10),
            entry("malloc", &["b_tie"], 10, 10),
            entry("malloc", &["a_tie"], 10, 10),
            entry("malloc", &["same"], 10, 10),
        ]);
        let new = profile(vec![
            entry("malloc", &["down"], 10, 0),
            entry("malloc", &["up"], 40, 0),
            entry("malloc", &["bytes_only"], 10, 9000),
            entry("malloc", &["b_tie"], 15, 20),
            entry("malloc", &["a_tie"], 5, 0),
            entry("malloc", &["same"], 10, 10),
        ]);
        let d = diff(&base, &new);
        let order: Vec<&str> = d
            .rows
            .iter()
            .map(|r| r.key.frames[0].function.as_str())
            .collect();
        assert_eq!(
            order,
            ["down", "up", "a_tie", "b_tie", "bytes_only", "same"]
        );
    }

    #[test]
    fn several_conditions_and_bytes_units() {
        let base = profile(vec![entry("malloc", &["a"], 100, 10 << 20)]);
        let new = profile(vec![entry("malloc", &["a"], 100, (10 << 20) + (1 << 20))]);
        let d = diff(&base, &new); // +1 MiB = +1048576 bytes, +10%
        let fails = |s: &str| !check(&d, &[cond(s)], false).is_empty();
        assert!(!fails("bytes>+1MiB"));
        assert!(fails("bytes>=+1MiB"));
        assert!(fails("bytes>+1MB"));
        assert!(fails("bytes>+1023KiB"));
        assert!(!fails("bytes>+1024KiB"));
        assert!(fails("bytes>+1048575"));
        assert!(fails("bytes>+1048575B"));
        assert!(!fails("bytes>+1048576b"));
        assert!(fails("bytes>+0.0009GiB"));
        assert!(!fails("bytes>+0.001GiB"));
        assert!(fails("bytes>+1.048575MB"));
        assert!(!fails("bytes>+1.048576MB"));
        assert!(!fails("bytes>10%"));
        assert!(fails("bytes>=10%"));
        assert!(fails("bytes>9.999999999%"));
        assert!(!fails("calls>0"));
        let v = check(
            &d,
            &[
                cond("calls>0"),
                cond("bytes>512KiB"),
                cond("bytes > +2 MB"),
                cond("bytes>+5%"),
            ],
            false,
        );
        let texts: Vec<&str> = v.iter().map(|v| v.condition.as_str()).collect();
        assert_eq!(texts, ["bytes>512KiB", "bytes>+5%"]);
        assert_eq!(
            v[0].to_string(),
            "regression: bytes>512KiB: total bytes 10485760 -> 11534336 (+10.00%)"
        );
    }

    #[test]
    fn percent_edges_are_exact() {
        let fails = |c: &str, b: u64, n: u64| cond(c).violated_by(b, n);
        assert!(!fails("calls>+5%", 1000, 1050));
        assert!(fails("calls>+5%", 1000, 1051));
        assert!(fails("calls>=+5%", 1000, 1050));
        assert!(!fails("calls>0.1%", 3000, 3003));
        assert!(fails("calls>0.1%", 3000, 3004));
        assert!(!fails("calls>+5%", 1000, 900));
        assert!(fails("calls>1.5", 10, 12));
        assert!(!fails("calls>1.5", 10, 11));
        assert!(fails("calls>=1.5", 10, 12));
        assert!(!fails("calls>=1.5", 10, 11));
        // Largest values do not overflow.
        assert!(fails("calls>999999999999999999%", 1, u64::MAX));
        assert!(!fails("calls>999999999999999999%", u64::MAX, u64::MAX));
        assert!(fails("bytes>+1", 0, u64::MAX));
        assert!(!fails("bytes>+999999999999999999GiB", 0, u64::MAX));
    }

    // -- parsing ------------------------------------------------------------

    #[test]
    fn parses_conditions() {
        let c = cond("calls>+5%");
        assert_eq!(c.metric, Weight::Calls);
        assert!(!c.inclusive);
        assert_eq!(c.threshold, Threshold::Percent(Ratio { num: 5, den: 1 }));
        assert_eq!(c.to_string(), "calls>+5%");

        let c = cond("  bytes >= 1.5 MiB ");
        assert_eq!(c.text, "bytes >= 1.5 MiB");
        assert_eq!(c.metric, Weight::Bytes);
        assert!(c.inclusive);
        assert_eq!(
            c.threshold,
            Threshold::Amount(Ratio {
                num: 15 << 20,
                den: 10
            })
        );
        assert_eq!(
            cond("bytes>+2MB").threshold,
            Threshold::Amount(Ratio {
                num: 2_000_000,
                den: 1
            })
        );
        assert_eq!(
            cond("bytes>+512KiB").threshold,
            Threshold::Amount(Ratio {
                num: 512 << 10,
                den: 1
            })
        );
        assert_eq!(
            cond("bytes>3gb").threshold,
            Threshold::Amount(Ratio {
                num: 3_000_000_000,
                den: 1
            })
        );
        assert_eq!(
            cond("calls>+100").threshold,
            Threshold::Amount(Ratio { num: 100, den: 1 })
        );
        assert_eq!(
            cond("calls>5%"),
            Condition {
                text: "calls>5%".into(),
                ..cond("calls>+5%")
            }
        );
        assert_eq!(
            cond("CALLS>.5%").threshold,
            Threshold::Percent(Ratio { num: 5, den: 10 })
        );
        assert_eq!(
            cond("calls>007").threshold,
            Threshold::Amount(Ratio { num: 7, den: 1 })
        );
        assert_eq!(
            cond("calls>2.25%").threshold,
            Threshold::Percent(Ratio { num: 225, den: 100 })
        );
        assert_eq!(Ratio { num: 225, den: 100 }.as_f64(), 2.25);
    }

    #[test]
    fn parse_errors_name_the_bad_part() {
        let err = |s: &str| parse_condition(s).unwrap_err();
        assert_eq!(
            err("calls>>5"),
            "bad --fail-if 'calls>>5': expected a number after '>'"
        );
        assert_eq!(
            err("calls>="),
            "bad --fail-if 'calls>=': expected a number after '>='"
        );
        assert_eq!(
            err("calls>%"),
            "bad --fail-if 'calls>%': expected a number after '>'"
        );
        assert_eq!(
            err(""),
            "bad --fail-if '': empty condition; expected for example 'calls>+5%' or 'bytes>+1MiB'"
        );
        assert_eq!(
            err("allocs>5%"),
            "bad --fail-if 'allocs>5%': unknown measure 'allocs': expected 'calls' or 'bytes'"
        );
        assert_eq!(
            err(">5%"),
            "bad --fail-if '>5%': expected 'calls' or 'bytes' at the start"
        );
        assert_eq!(
            err("calls"),
            "bad --fail-if 'calls': expected '>' or '>=' after 'calls'"
        );
        assert_eq!(
            err("calls<5%"),
            "bad --fail-if 'calls<5%': expected '>' or '>=' after 'calls', found '<' (only increases are gated)"
        );
        assert_eq!(
            err("calls=5"),
            "bad --fail-if 'calls=5': expected '>' or '>=' after 'calls', found '=' (only increases are gated)"
        );
        assert_eq!(
            err("calls 5"),
            "bad --fail-if 'calls 5': expected '>' or '>=' after 'calls', found '5' (only increases are gated)"
        );
        assert_eq!(
            err("calls>-5%"),
            "bad --fail-if 'calls>-5%': the threshold is an increase ('+5%' or '5%'), not '-5%'"
        );
        assert_eq!(
            err("calls>1.2.3"),
            "bad --fail-if 'calls>1.2.3': '1.2.3' is not a number"
        );
        assert_eq!(
            err("calls>5."),
            "bad --fail-if 'calls>5.': '5.' is not a number"
        );
        assert_eq!(
            err("calls>."),
            "bad --fail-if 'calls>.': '.' is not a number"
        );
        assert_eq!(
            err("calls>0.0000000001%"),
            "bad --fail-if 'calls>0.0000000001%': '0.0000000001' has too many decimals (at most 9)"
        );
        assert_eq!(
            err("calls>1000000000000000000"),
            "bad --fail-if 'calls>1000000000000000000': '1000000000000000000' is too large"
        );
        assert_eq!(
            err("bytes>5XB"),
            "bad --fail-if 'bytes>5XB': unknown unit 'XB' after '5': expected %, B, KiB, MiB, GiB, KB, MB or GB"
        );
        assert_eq!(
            err("bytes>5M"),
            "bad --fail-if 'bytes>5M': ambiguous unit 'M': write MiB (powers of 1024) or MB (powers of 1000)"
        );
        assert_eq!(
            err("calls>5MiB"),
            "bad --fail-if 'calls>5MiB': 'calls' takes a plain count or a percentage, not 'MiB'"
        );
        assert_eq!(
            err("calls>5%%"),
            "bad --fail-if 'calls>5%%': unexpected '%%' after '5': expected a plain count or a percentage"
        );
        assert_eq!(
            err("bytes>5% extra"),
            "bad --fail-if 'bytes>5% extra': unknown unit '% extra' after '5': expected %, B, KiB, MiB, GiB, KB, MB or GB"
        );
    }

    // -- report -------------------------------------------------------------

    #[test]
    fn table_shows_totals_top_stacks_and_the_rest() {
        let base = run(1000, "/tmp", 0);
        let mut new = run(1200, "/tmp", 0);
        new.stacks[1].counts = Counts {
            calls: 90,
            bytes: 368640,
        };
        new.stacks.push(stack(
            "malloc",
            vec![sym("fresh", "/tmp/fixture", 9, 9)],
            1,
            16,
        ));
        new = profile(new.stacks);
        let d = diff(&base, &new);
        assert_eq!(
            render_table(&d, 0),
            "total: calls 1150 -> 1341 (+191, +16.61%), bytes 458100 -> 426756 (-31344, -6.84%)\n\
             \n\
             #1  calls +200 (+20.00%, 1000 -> 1200)  bytes +9600 (+20.00%, 48000 -> 57600)  malloc\n    \
             alloc_small [fixture]\n    \
             main [fixture]\n\
             \n\
             #2  calls -10 (-10.00%, 100 -> 90)  bytes -40960 (-10.00%, 409600 -> 368640)  malloc\n    \
             alloc_big [fixture]\n    \
             main [fixture]\n\
             \n\
             #3  calls +1 (new, 0 -> 1)  bytes +16 (new, 0 -> 16)  malloc\n    \
             fresh [fixture]\n\
             \n\
             1 stack unchanged\n"
        );
        let top1 = render_table(&d, 1);
        assert!(top1.contains("#1  "));
        assert!(!top1.contains("#2"));
        assert!(top1.ends_with(
            "\n\n2 more changed stacks (calls -9, bytes -40944) hidden by --top\n1 stack unchanged\n"
        ));
        assert_eq!(render_table(&d, 3), render_table(&d, 0));
        assert_eq!(render_table(&d, 30), render_table(&d, 0));
    }

    #[test]
    fn table_marks_truncated_and_frameless_stacks() {
        let mut cut = entry("malloc", &["a"], 2, 20);
        cut.truncated = true;
        let d = diff(
            &Profile::default(),
            &profile(vec![cut, entry("calloc", &[], 1, 1)]),
        );
        let t = render_table(&d, 0);
        assert!(t.contains("#1  calls +2 (new, 0 -> 2)  bytes +20 (new, 0 -> 20)  malloc  [stack truncated]\n    a\n"), "{t}");
        assert!(t.contains("calloc\n    [no frames]\n"), "{t}");
    }

    #[test]
    fn long_stacks_are_shortened_in_messages() {
        let deep: Vec<String> = (0..12).map(|i| format!("f{i}")).collect();
        let deep: Vec<&str> = deep.iter().map(String::as_str).collect();
        let mut e = entry("malloc", &deep, 1, 1);
        let key = StackKey::of(&e, None);
        assert_eq!(
            key.chain(),
            "malloc <- f0 <- f1 <- f2 <- f3 <- f4 <- f5 <- f6 <- f7 <- ... (+4 frames)"
        );
        e.frames.truncate(9);
        e.truncated = true;
        assert_eq!(
            StackKey::of(&e, None).chain(),
            "malloc <- f0 <- f1 <- f2 <- f3 <- f4 <- f5 <- f6 <- f7 <- ... (+1 frame) [stack truncated]"
        );
    }

    // -- differential flame graph -------------------------------------------

    #[test]
    fn differential_folded_format() {
        let base = profile(vec![
            entry("malloc", &["leaf", "mid", "main"], 10, 100),
            entry("calloc", &["gone", "main"], 4, 0),
            entry("free", &["leaf", "main"], 9, 0),
        ]);
        let mut odd = entry("malloc", &["<[u8; 8] as Foo>::bar", ""], 1, 8);
        odd.frames[0].module = Some("/lib/a.so".into());
        let mut odd_elsewhere = odd.clone();
        odd_elsewhere.frames[0].module = Some("/lib/b.so".into());
        let new = profile(vec![
            entry("malloc", &["leaf", "mid", "main"], 12, 96),
            entry("malloc", &["fresh", "main"], 3, 30),
            odd,
            odd_elsewhere,
        ]);
        let d = diff(&base, &new);
        assert_eq!(
            differential_folded(&d, Weight::Calls),
            "[unknown];<[u8: 8] as Foo>::bar;malloc 0 2\n\
             main;fresh;malloc 0 3\n\
             main;gone;calloc 4 0\n\
             main;mid;leaf;malloc 10 12\n"
        );
        // Bytes: the calloc had 0 bytes on both sides and is left out.
        assert_eq!(
            differential_folded(&d, Weight::Bytes),
            "[unknown];<[u8: 8] as Foo>::bar;malloc 0 16\n\
             main;fresh;malloc 0 30\n\
             main;mid;leaf;malloc 100 96\n"
        );
        assert_eq!(differential_folded(&Diff::default(), Weight::Calls), "");
    }

    #[test]
    fn differential_flamegraph_draws_an_svg() -> anyhow::Result<()> {
        let base = run(1000, "/tmp", 0);
        let new = run(1200, "/tmp", 0);
        let folded = differential_folded(&diff(&base, &new), Weight::Calls);
        let svg = differential_flamegraph(&folded, "mtrace diff test", Weight::Calls)?;
        let svg = String::from_utf8(svg)?;
        assert!(svg.contains("<svg"));
        assert!(svg.contains("mtrace diff test"));
        assert!(svg.contains("alloc_small"));
        // The grown allocator frame is titled with its change: +200 of
        // 1350 new calls.
        assert!(
            svg.contains("malloc (1,200 calls, 88.89%; +14.81%)"),
            "{svg}"
        );
        // Red for growth: inferno's color_scale gives r = 255, g = b < 250.
        assert!(svg.contains("fill=\"rgb(255,100,100)\""), "{svg}");
        assert_eq!(
            svg,
            String::from_utf8(differential_flamegraph(
                &folded,
                "mtrace diff test",
                Weight::Calls
            )?)?
        );

        let bytes = differential_flamegraph("main;malloc 10 20\n", "t", Weight::Bytes)?;
        assert!(String::from_utf8(bytes)?.contains("bytes"));
        Ok(())
    }

    #[test]
    fn differential_flamegraph_refuses_nothing_to_draw() {
        assert!(differential_flamegraph("", "t", Weight::Calls).is_err());
        assert!(differential_flamegraph("\n \n", "t", Weight::Calls).is_err());
        let err = differential_flamegraph("main;malloc 5 0\n", "t", Weight::Calls).unwrap_err();
        assert!(err.to_string().contains("new profile"));
    }
}
