//! The `--fail-if` gate: a small condition language (`calls>+5%`,
//! `bytes>+1MiB`), parsed exactly and checked on the totals or on every
//! stack of a [`Diff`].

use std::fmt;

use super::{pct_change, Change, Diff, StackKey};
use crate::profile::Weight;
use crate::render::text::bytes;

/// A number kept exactly as written: `num / den`. Thresholds are compared in
/// integers so that `calls>+5%` on 1000 -> 1050 is exactly on the edge (not
/// violated) instead of depending on floating-point rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ratio {
    pub(crate) num: u128,
    pub(crate) den: u128,
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

/// A stack's part in a change of the totals: its key and how much the
/// gated count moved on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Moved {
    pub key: StackKey,
    pub delta: i128,
}

/// How many stacks a regression of the totals names: those that grew most.
pub const MOVED_NAMED: usize = 3;

/// A condition that failed, on the totals or on one stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The condition as written (`calls>+5%`).
    pub condition: String,
    pub metric: Weight,
    /// `None` for the totals.
    pub stack: Option<StackKey>,
    /// A test's or a group's, on it (`--per-test`, `--per-group`).
    pub group: Option<(Scope, String)>,
    pub base: u64,
    pub new: u64,
    /// On the totals: the stacks that grew most in the gated count, at most
    /// [`MOVED_NAMED`], largest first (none on a stack).
    pub moved: Vec<Moved>,
}

/// `1000 -> 1200 (+200, +20.00%)` for calls, `46.9 KiB -> 56.2 KiB (+9.4
/// KiB, +20.00%)` for bytes: a size is read in units, its exact figures
/// are in the JSON.
pub fn describe_move(metric: Weight, base: u64, new: u64) -> String {
    let delta = i128::from(new) - i128::from(base);
    format!(
        "{} -> {} ({}, {})",
        amount(metric, base),
        amount(metric, new),
        signed_amount(metric, delta),
        pct_change(base, new)
    )
}

/// `1200` calls, `46.9 KiB`.
pub fn amount(metric: Weight, n: u64) -> String {
    match metric {
        Weight::Bytes => bytes(n),
        Weight::Calls => n.to_string(),
    }
}

/// `+200` calls, `+9.4 KiB`, `-512 B`.
pub fn signed_amount(metric: Weight, delta: i128) -> String {
    let sign = if delta < 0 { '-' } else { '+' };
    let size = u64::try_from(delta.unsigned_abs()).unwrap_or(u64::MAX);
    format!("{sign}{}", amount(metric, size))
}

/// `regression: calls>+5%: total calls 1000 -> 1200 (+200, +20.00%); grew
/// most: +150 malloc <- parse <- main, +50 ...` or `regression: calls>+5%:
/// malloc <- alloc_small <- main: 1000 -> 1200 (+200, +20.00%)`.
impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "regression: {}: ", self.condition)?;
        match (&self.stack, &self.group) {
            (Some(key), _) => write!(f, "{}: ", key.chain())?,
            (None, Some((scope, name))) => write!(f, "{} {name}: ", scope.noun())?,
            (None, None) => write!(f, "total {} ", self.metric.unit())?,
        }
        f.write_str(&describe_move(self.metric, self.base, self.new))?;
        for (i, m) in self.moved.iter().enumerate() {
            f.write_str(if i == 0 { "; grew most: " } else { ", " })?;
            write!(
                f,
                "{} {}",
                signed_amount(self.metric, m.delta),
                m.key.chain()
            )?;
        }
        Ok(())
    }
}

/// What a condition is judged on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Totals,
    Stacks,
    Tests,
    Groups,
}

impl Scope {
    /// `totals`, `stacks`, `tests`, `groups`: the JSON's word.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Totals => "totals",
            Scope::Stacks => "stacks",
            Scope::Tests => "tests",
            Scope::Groups => "groups",
        }
    }

    /// What a person reads: `totals`, `every stack`, `every test`, `every group`.
    pub fn every(self) -> &'static str {
        match self {
            Scope::Totals => "totals",
            Scope::Stacks => "every stack",
            Scope::Tests => "every test",
            Scope::Groups => "every group",
        }
    }

    /// `test`, `group` (and `stack`, `total`).
    pub fn noun(self) -> &'static str {
        match self {
            Scope::Totals => "total",
            Scope::Stacks => "stack",
            Scope::Tests => "test",
            Scope::Groups => "group",
        }
    }
}

/// One condition judged: on the totals, on every stack, every test or
/// every group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub condition: Condition,
    /// [`Outcome::scope`] is [`Scope::Stacks`].
    pub per_stack: bool,
    pub scope: Scope,
    /// Empty when it held.
    pub violations: Vec<Violation>,
    /// Stacks (tests, groups) on which it would have failed but for the
    /// noise floor.
    pub within_noise: usize,
}

/// How the conditions are applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateOptions {
    /// On every stack instead of the totals.
    pub per_stack: bool,
    /// On every test of [`Diff::tests`] (as well as on every stack, with
    /// `per_stack`; instead of the totals).
    pub per_test: bool,
    /// On every group of [`Diff::groups`].
    pub per_group: bool,
    /// Per stack: a change of at most this many calls, of the stack's own
    /// average size, is noise and never a regression (see [`is_noise`]).
    pub noise_floor: u64,
}

/// The default `--noise-floor`: a stack's count moving by one or two calls
/// between identical runs is what hash seeds and timing do (perl's hashes
/// split at other times in each run).
pub const DEFAULT_NOISE_FLOOR: u64 = 2;

/// Whether `change` on one stack is within `floor` calls: its calls moved
/// by at most `floor`, and its bytes by at most `floor` allocations of up
/// to twice the stack's larger average size (a stack's sizes vary around
/// their average; calls of the same count growing in size are still seen).
pub fn is_noise(change: &Change, floor: u64) -> bool {
    let calls = change.delta(Weight::Calls).unsigned_abs();
    let bytes = change.delta(Weight::Bytes).unsigned_abs();
    let avg = |c: crate::profile::Counts| c.bytes.checked_div(c.calls).unwrap_or(0) + 1;
    let size = u128::from(avg(change.base).max(avg(change.new)));
    calls <= u128::from(floor) && bytes <= u128::from(floor) * 2 * size
}

/// Judges each of `conditions` on every scope asked for (every stack,
/// every test, every group), or on the totals when none is: an outcome
/// per condition and scope. Changes within the noise floor, on anything
/// but the totals, are left out. Violations come in the order of
/// [`Diff::rows`], [`Diff::tests`] or [`Diff::groups`].
pub fn judge(diff: &Diff, conditions: &[Condition], options: GateOptions) -> Vec<Outcome> {
    let mut scopes: Vec<Scope> = [
        (options.per_stack, Scope::Stacks),
        (options.per_test, Scope::Tests),
        (options.per_group, Scope::Groups),
    ]
    .into_iter()
    .filter_map(|(on, s)| on.then_some(s))
    .collect();
    if scopes.is_empty() {
        scopes.push(Scope::Totals);
    }
    let mut outcomes = Vec::new();
    for cond in conditions {
        for &scope in &scopes {
            let mut violations = Vec::new();
            let mut within_noise = 0;
            let mut judge = |stack: Option<&StackKey>, group: Option<&str>, change: &Change| {
                let (base, new) = (cond.metric.of(change.base), cond.metric.of(change.new));
                if !cond.violated_by(base, new) {
                    return;
                }
                if scope != Scope::Totals && is_noise(change, options.noise_floor) {
                    within_noise += 1;
                } else {
                    violations.push(Violation {
                        condition: cond.text.clone(),
                        metric: cond.metric,
                        stack: stack.cloned(),
                        group: group.map(|g| (scope, g.to_string())),
                        base,
                        new,
                        moved: if scope == Scope::Totals {
                            grew_most(diff, cond.metric)
                        } else {
                            Vec::new()
                        },
                    });
                }
            };
            match scope {
                Scope::Totals => judge(None, None, &diff.total),
                Scope::Stacks => {
                    for row in &diff.rows {
                        judge(Some(&row.key), None, &row.change);
                    }
                }
                Scope::Tests | Scope::Groups => {
                    let list = if scope == Scope::Tests {
                        &diff.tests
                    } else {
                        &diff.groups
                    };
                    for g in list {
                        judge(None, Some(&g.name), &g.change);
                    }
                }
            }
            outcomes.push(Outcome {
                condition: cond.clone(),
                per_stack: scope == Scope::Stacks,
                scope,
                violations,
                within_noise,
            });
        }
    }
    outcomes
}

/// The stacks whose `metric` grew most, at most [`MOVED_NAMED`].
fn grew_most(diff: &Diff, metric: Weight) -> Vec<Moved> {
    let mut grown: Vec<Moved> = diff
        .rows
        .iter()
        .map(|r| Moved {
            key: r.key.clone(),
            delta: r.change.delta(metric),
        })
        .filter(|m| m.delta > 0)
        .collect();
    grown.sort_by(|a, b| b.delta.cmp(&a.delta).then_with(|| a.key.cmp(&b.key)));
    grown.truncate(MOVED_NAMED);
    grown
}

/// Every violation of [`judge`] without a noise floor, by condition.
pub fn check(diff: &Diff, conditions: &[Condition], per_stack: bool) -> Vec<Violation> {
    let options = GateOptions {
        per_stack,
        noise_floor: 0,
        ..GateOptions::default()
    };
    judge(diff, conditions, options)
        .into_iter()
        .flat_map(|o| o.violations)
        .collect()
}
