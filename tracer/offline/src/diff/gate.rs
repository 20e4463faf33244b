//! The `--fail-if` gate: a small condition language (`calls>+5%`,
//! `bytes>+1MiB`), parsed exactly and checked on the totals or on every
//! stack of a [`Diff`].

use std::fmt;

use super::{pct_change, Change, Diff, StackKey};
use crate::profile::Weight;

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
