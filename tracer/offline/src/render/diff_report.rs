//! `mtrace diff --format json|markdown|junit`: the diff and the gate's
//! verdict in the forms CI systems read.
//!
//! - JSON ([`json`]): every changed stack and every condition's result,
//!   exact figures; its schema is `tracer/schema/diff.schema.json`.
//! - Markdown ([`markdown`]): the verdict, the totals, each test and group
//!   with its own verdict, and the top changed stacks, fit for a pull
//!   request comment or `$GITHUB_STEP_SUMMARY`.
//! - JUnit XML ([`junit`]): one test case per condition, failed with the
//!   regressions it found, for test reporters.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::Weight;
use crate::diff::gate::{amount, describe_move, signed_amount, Outcome, Scope};
use crate::diff::{Change, Diff, DiffRow, GroupChange, StackKey};

/// The version of the diff JSON's layout.
pub const DIFF_SCHEMA_VERSION: u32 = 1;

/// One side of the comparison, as the reader is told it.
#[derive(Clone, Debug)]
pub struct Side<'a> {
    /// The profile's path, as given.
    pub path: &'a str,
    pub command: &'a str,
    pub start_time: &'a str,
}

/// Everything a diff report says.
#[derive(Clone, Debug)]
pub struct DiffReport<'a> {
    pub base: Side<'a>,
    pub new: Side<'a>,
    pub diff: &'a Diff,
    /// Each `--fail-if` condition, judged; none when nothing was gated.
    pub outcomes: &'a [Outcome],
    /// Changed stacks the markdown shows (0: all); JSON has them all.
    pub top: usize,
    /// `--noise-floor`, in calls (per stack).
    pub noise_floor: u64,
}

impl DiffReport<'_> {
    fn regressions(&self) -> usize {
        self.outcomes.iter().map(|o| o.violations.len()).sum()
    }

    fn changed(&self) -> impl Iterator<Item = &DiffRow> {
        self.diff.rows.iter().filter(|r| !r.change.is_unchanged())
    }

    fn unchanged(&self) -> usize {
        self.diff.rows.len() - self.changed().count()
    }
}

/// The report as JSON (one line and a newline).
pub fn json(r: &DiffReport) -> String {
    let side = |s: &Side| json!({"path": s.path, "command": s.command, "start_time": s.start_time});
    let counts = |c: &Change| json!({"calls": figures(c, Weight::Calls), "bytes": figures(c, Weight::Bytes)});
    let changed: Vec<Value> = r
        .changed()
        .map(|row| {
            let mut v = key_json(&row.key);
            v["calls"] = figures(&row.change, Weight::Calls);
            v["bytes"] = figures(&row.change, Weight::Bytes);
            v
        })
        .collect();
    let conditions: Vec<Value> = r
        .outcomes
        .iter()
        .map(|o| {
            let violations: Vec<Value> = o
                .violations
                .iter()
                .map(|v| {
                    json!({
                        "stack": v.stack.as_ref().map(key_json),
                        "test": v.group.as_ref().filter(|g| g.0 == Scope::Tests).map(|g| &g.1),
                        "group": v.group.as_ref().filter(|g| g.0 == Scope::Groups).map(|g| &g.1),
                        "base": v.base,
                        "new": v.new,
                        "delta": i128::from(v.new) - i128::from(v.base),
                        "change_pct": pct(v.base, v.new),
                        "grew_most": v.moved.iter().map(|m| json!({
                            "stack": key_json(&m.key),
                            "delta": m.delta,
                        })).collect::<Vec<_>>(),
                        "message": v.to_string(),
                    })
                })
                .collect();
            json!({
                "condition": o.condition.text,
                "metric": o.condition.metric.unit(),
                "scope": o.scope.name(),
                "passed": o.violations.is_empty(),
                "within_noise": o.within_noise,
                "violations": violations,
            })
        })
        .collect();
    let doc = json!({
        "format": "mtrace-diff",
        "schema_version": DIFF_SCHEMA_VERSION,
        "base": side(&r.base),
        "new": side(&r.new),
        "totals": counts(&r.diff.total),
        "in_stacks": counts(&r.diff.in_stacks),
        "whole_stacks_pct": {"base": r.diff.whole_pct.0, "new": r.diff.whole_pct.1},
        "changed": changed,
        "tests": groups_json(&r.diff.tests),
        "groups": groups_json(&r.diff.groups),
        "unchanged_stacks": r.unchanged(),
        "gate": {
            "gated": !r.outcomes.is_empty(),
            "noise_floor": r.noise_floor,
            "passed": r.regressions() == 0,
            "regressions": r.regressions(),
            "conditions": conditions,
        },
    });
    let mut out = doc.to_string();
    out.push('\n');
    out
}

/// Each test's or group's name and figures.
fn groups_json(list: &[GroupChange]) -> Vec<Value> {
    list.iter()
        .map(|g| {
            json!({
                "name": g.name,
                "calls": figures(&g.change, Weight::Calls),
                "bytes": figures(&g.change, Weight::Bytes),
            })
        })
        .collect()
}

/// `{"base", "new", "delta", "change_pct"}` of one count.
fn figures(c: &Change, weight: Weight) -> Value {
    let (b, n) = (weight.of(c.base), weight.of(c.new));
    json!({"base": b, "new": n, "delta": c.delta(weight), "change_pct": pct(b, n)})
}

/// The change in percent of the base; 0 from 0 to 0, none (`null`) from
/// nothing to something.
fn pct(base: u64, new: u64) -> Option<f64> {
    match (base, new) {
        (0, 0) => Some(0.0),
        (0, _) => None,
        _ => Some((i128::from(new) - i128::from(base)) as f64 * 100.0 / base as f64),
    }
}

fn key_json(key: &StackKey) -> Value {
    json!({
        "func": key.func,
        "frames": key.frames.iter().map(|f| json!({
            "function": f.function,
            "module": f.module,
        })).collect::<Vec<_>>(),
        "truncated": key.truncated,
    })
}

/// The longest name a markdown or XML line shows of a frame; the JSON keeps
/// names whole.
const NAME_SHOWN: usize = 160;

/// `name`, cut to [`NAME_SHOWN`] characters with `…` where it was cut.
fn shown(name: &str) -> String {
    match name.char_indices().nth(NAME_SHOWN) {
        Some((at, _)) => format!("{}…", &name[..at]),
        None => name.to_string(),
    }
}

/// `text` as a markdown code span inside a table cell: fenced by more
/// backticks than it holds in a row, its pipes escaped (GitHub's tables
/// split cells on a pipe even inside code).
fn code(text: &str) -> String {
    let text = shown(text).replace('|', "\\|");
    let mut run = 0;
    let mut longest = 0;
    for c in text.chars() {
        run = if c == '`' { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    let fence = "`".repeat(longest + 1);
    let pad = if text.starts_with('`') || text.ends_with('`') {
        " "
    } else {
        ""
    };
    format!("{fence}{pad}{text}{pad}{fence}")
}

/// `` `malloc` ← `alloc_small` ← `main` ``, at most eight frames.
fn chain_md(key: &StackKey) -> String {
    let mut out = code(&key.func);
    for f in key.frames.iter().take(crate::diff::MAX_CHAIN_FRAMES) {
        out.push_str(" ← ");
        out.push_str(&code(&f.function));
    }
    let rest = key
        .frames
        .len()
        .saturating_sub(crate::diff::MAX_CHAIN_FRAMES);
    if rest > 0 {
        let _ = write!(out, " ← … (+{rest})");
    }
    if key.truncated {
        out.push_str(" *(stack cut short)*");
    }
    out
}

/// `1,281 → 1,481 (+200, +15.61%)`.
fn move_md(metric: Weight, base: u64, new: u64) -> String {
    describe_move(metric, base, new).replace(" -> ", " → ")
}

/// The report as GitHub-flavoured markdown.
pub fn markdown(r: &DiffReport) -> String {
    let mut out = String::new();
    let n = r.regressions();
    let verdict = if r.outcomes.is_empty() {
        "compared (no gate)".to_string()
    } else if n == 0 {
        "✅ no regression".to_string()
    } else {
        format!("❌ {n} regression{}", if n == 1 { "" } else { "s" })
    };
    let _ = writeln!(out, "### mtrace diff: {verdict}\n");
    let _ = writeln!(
        out,
        "{} ({}, {}) → {} ({}, {})\n",
        code(r.base.path),
        code(r.base.command),
        r.base.start_time,
        code(r.new.path),
        code(r.new.command),
        r.new.start_time
    );
    out.push_str("| | base | new | change |\n|---|---:|---:|---:|\n");
    for (what, c) in [("total", &r.diff.total), ("in stacks", &r.diff.in_stacks)] {
        if what == "in stacks" && r.diff.in_stacks == r.diff.total {
            continue;
        }
        for w in [Weight::Calls, Weight::Bytes] {
            let (b, nw) = (w.of(c.base), w.of(c.new));
            let _ = writeln!(
                out,
                "| {what} {} | {} | {} | {} ({}) |",
                w.unit(),
                amount(w, b),
                amount(w, nw),
                signed_amount(w, c.delta(w)),
                crate::diff::pct_change(b, nw)
            );
        }
    }
    if !r.outcomes.is_empty() {
        out.push_str("\n**Gate**\n\n");
        for o in r.outcomes {
            let scope = o.scope.every();
            let noise = match o.within_noise {
                0 => String::new(),
                n => format!(
                    "; {n} stack{} within the noise floor ({} calls)",
                    if n == 1 { "" } else { "s" },
                    r.noise_floor
                ),
            };
            if o.violations.is_empty() {
                let _ = writeln!(
                    out,
                    "- ✅ {} ({scope}): held{noise}",
                    code(&o.condition.text)
                );
                continue;
            }
            let _ = writeln!(
                out,
                "- ❌ {} ({scope}): {} regression{}{noise}",
                code(&o.condition.text),
                o.violations.len(),
                if o.violations.len() == 1 { "" } else { "s" }
            );
            for v in o.violations.iter().take(MD_VIOLATIONS) {
                let what = match (&v.stack, &v.group) {
                    (Some(key), _) => chain_md(key),
                    (None, Some((scope, name))) => format!("{} {}", scope.noun(), code(name)),
                    (None, None) => format!("total {}", v.metric.unit()),
                };
                let _ = write!(out, "  - {what}: {}", move_md(v.metric, v.base, v.new));
                for (i, m) in v.moved.iter().enumerate() {
                    out.push_str(if i == 0 { "; grew most: " } else { ", " });
                    let _ = write!(
                        out,
                        "{} {}",
                        signed_amount(v.metric, m.delta),
                        chain_md(&m.key)
                    );
                }
                out.push('\n');
            }
            if o.violations.len() > MD_VIOLATIONS {
                let _ = writeln!(
                    out,
                    "  - … and {} more (all of them in `--format json`)",
                    o.violations.len() - MD_VIOLATIONS
                );
            }
        }
    }
    for scope in [Scope::Tests, Scope::Groups] {
        groups_md(&mut out, r, scope);
    }
    let changed: Vec<&DiffRow> = r.changed().collect();
    let shown_rows = if r.top == 0 {
        changed.len()
    } else {
        r.top.min(changed.len())
    };
    if changed.is_empty() {
        out.push_str("\nNo stack changed.\n");
    } else {
        let _ = writeln!(
            out,
            "\n**Changed stacks** ({} of {})\n",
            shown_rows,
            changed.len()
        );
        out.push_str("| # | calls | bytes | stack |\n|---:|---:|---:|---|\n");
        for (i, row) in changed[..shown_rows].iter().enumerate() {
            let c = &row.change;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                i + 1,
                move_md(Weight::Calls, c.base.calls, c.new.calls),
                move_md(Weight::Bytes, c.base.bytes, c.new.bytes),
                chain_md(&row.key)
            );
        }
    }
    let unchanged = r.unchanged();
    if unchanged > 0 {
        let _ = writeln!(
            out,
            "\n{unchanged} stack{} unchanged.",
            if unchanged == 1 { "" } else { "s" }
        );
    }
    out
}

/// Violations the markdown lists under a condition.
const MD_VIOLATIONS: usize = 10;

/// Tests (groups) the markdown's table of them shows.
const MD_GROUPS: usize = 50;

/// The table of the tests (`scope` [`Scope::Tests`]) or groups of `r`, if
/// it has any: each one's calls and bytes on both sides and its verdict
/// under the conditions gating every test (group): the conditions it
/// failed, `held`, or `not gated` when no condition gates them. The
/// failed ones come first; at most [`MD_GROUPS`] rows.
fn groups_md(out: &mut String, r: &DiffReport, scope: Scope) {
    let list = match scope {
        Scope::Tests => &r.diff.tests,
        _ => &r.diff.groups,
    };
    if list.is_empty() {
        return;
    }
    let gated: Vec<&Outcome> = r.outcomes.iter().filter(|o| o.scope == scope).collect();
    let failed = |g: &GroupChange| -> Vec<&str> {
        gated
            .iter()
            .filter(|o| {
                o.violations
                    .iter()
                    .any(|v| v.group.as_ref().is_some_and(|(_, n)| *n == g.name))
            })
            .map(|o| o.condition.text.as_str())
            .collect()
    };
    let mut rows: Vec<(&GroupChange, Vec<&str>)> = list.iter().map(|g| (g, failed(g))).collect();
    // Stable: each part keeps the diff's order.
    rows.sort_by_key(|(_, failed)| failed.is_empty());
    let noun = scope.noun();
    let _ = writeln!(
        out,
        "\n**{}{}s** ({} of {}{})\n",
        noun[..1].to_uppercase(),
        &noun[1..],
        rows.len().min(MD_GROUPS),
        rows.len(),
        match rows.iter().filter(|(_, f)| !f.is_empty()).count() {
            0 => String::new(),
            n => format!(", {n} failed"),
        }
    );
    let _ = writeln!(
        out,
        "| {noun} | calls | bytes | verdict |\n|---|---:|---:|---|"
    );
    for (g, failed) in rows.iter().take(MD_GROUPS) {
        let verdict = if gated.is_empty() {
            "not gated".to_string()
        } else if failed.is_empty() {
            "✅ held".to_string()
        } else {
            let conditions: Vec<String> = failed.iter().map(|c| code(c)).collect();
            format!("❌ {}", conditions.join(", "))
        };
        let c = &g.change;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {verdict} |",
            code(&g.name),
            move_md(Weight::Calls, c.base.calls, c.new.calls),
            move_md(Weight::Bytes, c.base.bytes, c.new.bytes),
        );
    }
    if rows.len() > MD_GROUPS {
        let _ = writeln!(
            out,
            "\n… and {} more {noun}s (all of them in `--format json`)",
            rows.len() - MD_GROUPS
        );
    }
}

/// `text` for XML character data or an attribute: the five markup
/// characters escaped, and characters XML 1.0 cannot carry at all (the
/// control characters but tab, newline and carriage return) replaced by
/// `\u{..}` in words.
fn xml(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{fffe}' || c == '\u{ffff}' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// One JUnit test case: its class, its name and its regressions (none:
/// it passed).
struct Case {
    class: &'static str,
    name: String,
    failures: Vec<String>,
}

/// The test cases of `r`: one per condition on the totals or on every
/// stack; one per condition and test (`--per-test`) or group
/// (`--per-group`), named by the test or group, so that a test reporter
/// shows each test's verdict.
fn cases(r: &DiffReport) -> Vec<Case> {
    let mut out = Vec::new();
    for o in r.outcomes {
        let list = match o.scope {
            Scope::Tests => &r.diff.tests,
            Scope::Groups => &r.diff.groups,
            Scope::Totals | Scope::Stacks => {
                out.push(Case {
                    class: "mtrace.diff",
                    name: format!("{} ({})", o.condition.text, o.scope.every()),
                    failures: o.violations.iter().map(|v| v.to_string()).collect(),
                });
                continue;
            }
        };
        let class = if o.scope == Scope::Tests {
            "mtrace.diff.tests"
        } else {
            "mtrace.diff.groups"
        };
        for g in list {
            out.push(Case {
                class,
                name: format!("{} ({})", g.name, o.condition.text),
                failures: o
                    .violations
                    .iter()
                    .filter(|v| v.group.as_ref().is_some_and(|(_, n)| *n == g.name))
                    .map(|v| v.to_string())
                    .collect(),
            });
        }
    }
    out
}

/// The report as JUnit XML: a suite `mtrace diff`, one test case per
/// condition (named by the condition and what it gates), or per condition
/// and test or group, failed with one line per regression. Without
/// conditions, one passing case says what was compared.
pub fn junit(r: &DiffReport) -> String {
    let cases = cases(r);
    let failures = cases.iter().filter(|c| !c.failures.is_empty()).count();
    let tests = cases.len().max(1);
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        out,
        "<testsuites name=\"mtrace diff\" tests=\"{tests}\" failures=\"{failures}\" errors=\"0\">"
    );
    let _ = writeln!(
        out,
        "  <testsuite name=\"mtrace diff\" tests=\"{tests}\" failures=\"{failures}\" errors=\"0\" skipped=\"0\">"
    );
    out.push_str("    <properties>\n");
    for (name, value) in [
        ("base", r.base.path),
        ("base.command", r.base.command),
        ("new", r.new.path),
        ("new.command", r.new.command),
    ] {
        let _ = writeln!(
            out,
            "      <property name=\"{name}\" value=\"{}\"/>",
            xml(&shown(value))
        );
    }
    out.push_str("    </properties>\n");
    let summary = format!(
        "total calls {}, total bytes {}",
        describe_move(
            Weight::Calls,
            r.diff.total.base.calls,
            r.diff.total.new.calls
        ),
        describe_move(
            Weight::Bytes,
            r.diff.total.base.bytes,
            r.diff.total.new.bytes
        )
    );
    if r.outcomes.is_empty() {
        let _ = writeln!(
            out,
            "    <testcase classname=\"mtrace.diff\" name=\"compared (no --fail-if)\">\n      <system-out>{}</system-out>\n    </testcase>",
            xml(&summary)
        );
    }
    for case in &cases {
        let _ = writeln!(
            out,
            "    <testcase classname=\"{}\" name=\"{}\">",
            case.class,
            xml(&shown(&case.name))
        );
        if let Some(first) = case.failures.first() {
            let lines: Vec<String> = case.failures.iter().map(|l| xml(&shown_line(l))).collect();
            let _ = writeln!(
                out,
                "      <failure type=\"regression\" message=\"{} regression{}: {}\">{}</failure>",
                case.failures.len(),
                if case.failures.len() == 1 { "" } else { "s" },
                xml(&shown_line(first)),
                lines.join("\n")
            );
        }
        let _ = writeln!(out, "      <system-out>{}</system-out>", xml(&summary));
        out.push_str("    </testcase>\n");
    }
    out.push_str("  </testsuite>\n</testsuites>\n");
    out
}

/// A regression's line for XML, cut to a few frames' worth.
fn shown_line(line: &str) -> String {
    match line.char_indices().nth(NAME_SHOWN * 8) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line.to_string(),
    }
}

#[cfg(test)]
mod tests;
