//! The value parsers of the arguments that clap does not parse itself:
//! durations, byte counts, ages, spans, ring sizes and percentages, each
//! with a one-line error that names the value given.

use std::time::Duration;

/// The longest `--duration` and `--interval`: beyond any trace, and far
/// from overflowing a deadline or a `Duration` made of it.
const MAX_SECS: f64 = 1e9;

/// The shortest: a millisecond, the resolution of mtrace's timers (a
/// shorter period would be rounded to nothing).
const MIN_SECS: f64 = 1e-3;

pub(super) fn parse_duration(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(v.is_finite() && v > 0.0) {
        Err(format!(
            "duration must be a positive number of seconds, not {s}"
        ))
    } else if v < MIN_SECS {
        Err(format!(
            "duration must be at least {MIN_SECS} seconds, not {s}"
        ))
    } else if v > MAX_SECS {
        Err(format!(
            "duration must be at most {MAX_SECS:e} seconds, not {s}"
        ))
    } else {
        Ok(v)
    }
}

pub(super) fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a number of bytes"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => {
            return Err(format!(
                "`{s}`: unknown unit (use B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    match n.checked_mul(mult) {
        Some(v) if v > 0 => Ok(v),
        _ => Err(format!(
            "`{s}` must be at least one byte and fit in 64 bits"
        )),
    }
}

pub(super) fn parse_age(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("age must be zero or more seconds, not {s}"))
    }
}

pub(super) fn parse_span(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("`{s}` is not a duration like 500us, 1ms or 2s: {e}"))
}

pub(super) fn parse_ring_size(s: &str) -> Result<u32, String> {
    power_of_two_at_least(s, 4096, "the event buffer", "4096 bytes")
}

/// The buffer of stack copies: a power of two that holds the largest
/// copy several times over.
pub(super) fn parse_unwind_ring_size(s: &str) -> Result<u32, String> {
    power_of_two_at_least(s, 1 << 20, "the unwind buffer", "1048576 bytes (1 MiB)")
}

/// A buffer's size in bytes: a power of two of at least `least` (said
/// as `least_said`), else why not, naming the buffer as `what`.
fn power_of_two_at_least(s: &str, least: u32, what: &str, least_said: &str) -> Result<u32, String> {
    let v: u32 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of bytes"))?;
    if v >= least && v.is_power_of_two() {
        Ok(v)
    } else {
        Err(format!(
            "{what} must be a power of two of at least {least_said}, not {s}"
        ))
    }
}

pub(super) fn parse_percent(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("`{s}` is not a percentage"))?;
    if (0.0..=100.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("threshold must be between 0 and 100, not {s}"))
    }
}
