//! The JSON profile file: a [`Profile`] with a format tag and a schema
//! version, written by `--output` and snapshots, read by `mtrace report`
//! and `mtrace diff`. The schema is `tracer/schema/profile.schema.json`.
//! Writing files is the tracer's `sinks` (one place for every output).

use std::path::Path;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::{error::UserError, profile::Profile};

/// The `format` field of every profile file.
pub const FORMAT: &str = "mtrace-profile";
/// Bumped on any incompatible change of the file's layout.
pub const SCHEMA_VERSION: u32 = 1;

/// Exit code for unreadable, truncated or wrong-version input.
pub const EXIT_BAD_INPUT: i32 = 2;

#[derive(Serialize)]
struct FileOut<'a> {
    format: &'static str,
    schema_version: u32,
    #[serde(flatten)]
    profile: &'a Profile,
}

#[derive(Deserialize)]
struct FileIn {
    #[serde(flatten)]
    profile: Profile,
}

pub fn to_json(profile: &Profile) -> String {
    let doc = FileOut {
        format: FORMAT,
        schema_version: SCHEMA_VERSION,
        profile,
    };
    // Serializing plain data to a String cannot fail.
    serde_json::to_string_pretty(&doc).expect("profile serializes") + "\n"
}

fn bad_input(path: &Path, what: impl std::fmt::Display) -> anyhow::Error {
    anyhow::Error::new(UserError::with_code(
        format!("{}: {what}", path.display()),
        EXIT_BAD_INPUT,
    ))
}

/// The largest profile file `report` and `diff` read (a profile of a
/// million stacks is some 600 MB).
pub const MAX_PROFILE_BYTES: u64 = 1 << 30;

/// Reads a profile file; every failure is a one-line error with exit code
/// 2. Only regular files up to [`MAX_PROFILE_BYTES`] are read (not
/// `/dev/zero`, a FIFO or a sparse file of terabytes), and no more than
/// that many bytes even if the file grows meanwhile.
pub fn read(path: &Path) -> Result<Profile> {
    use std::{io::Read, os::unix::fs::OpenOptionsExt};
    // Non-blocking: opening a FIFO must not wait for a writer (it is then
    // refused as not a regular file).
    const O_NONBLOCK: i32 = 0o4000;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(O_NONBLOCK)
        .open(path)
        .map_err(|e| bad_input(path, e))?;
    let meta = file.metadata().map_err(|e| bad_input(path, e))?;
    if !meta.is_file() {
        return Err(bad_input(path, "not a regular file"));
    }
    if meta.len() > MAX_PROFILE_BYTES {
        return Err(bad_input(
            path,
            format!(
                "{} bytes, over the {} MiB a profile may have",
                meta.len(),
                MAX_PROFILE_BYTES >> 20
            ),
        ));
    }
    let mut text = String::new();
    file.take(MAX_PROFILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| bad_input(path, e))?;
    if text.len() as u64 > MAX_PROFILE_BYTES {
        return Err(bad_input(path, "grew over the size a profile may have"));
    }
    parse(&text).map_err(|what| bad_input(path, what))
}

/// Parses the text of a profile file, or says what is wrong with it.
pub fn parse(text: &str) -> Result<Profile, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        if e.is_eof() {
            format!("truncated profile (ends at line {})", e.line())
        } else {
            format!("not a JSON profile: {e}")
        }
    })?;
    let format = value.get("format").and_then(|f| f.as_str());
    if format != Some(FORMAT) {
        return Err(format!(
            "not an mtrace profile (format is {}, expected \"{FORMAT}\")",
            format.map_or("missing".to_string(), |f| format!("\"{f}\""))
        ));
    }
    match value.get("schema_version").and_then(|v| v.as_u64()) {
        Some(v) if v == SCHEMA_VERSION as u64 => {}
        Some(v) => {
            return Err(format!(
                "profile schema version {v} is not supported by this mtrace (it reads version {SCHEMA_VERSION})"
            ))
        }
        None => {
            return Err(match value.get("schema_version") {
                Some(v) => format!("schema_version must be a number, found {v}"),
                None => "profile has no schema_version".into(),
            })
        }
    }
    let profile = serde_json::from_value::<FileIn>(value)
        .map(|f| f.profile)
        .map_err(|e| format!("malformed profile: {e}"))?;
    check_values(&profile)?;
    Ok(profile)
}

/// Values no trace produces: a corrupt (or hand-edited) profile.
fn check_values(p: &Profile) -> Result<(), String> {
    let d = p.meta.duration_secs;
    if !d.is_finite() || d < 0.0 {
        return Err(format!("corrupt profile: duration_secs is {d}"));
    }
    // Exact counts: the stacks hold at most the totals (calls that found
    // the aggregation map full are in the totals only). Sampled counts
    // are rounded estimates, a call each at most.
    let slack = if p.meta.sampling.is_some() {
        p.stacks.len() as u64
    } else {
        0
    };
    let in_stacks = p
        .stacks
        .iter()
        .filter(|e| super::is_allocation(e))
        .try_fold(0u64, |sum, e| sum.checked_add(e.counts.calls));
    match in_stacks {
        Some(n) if n <= p.totals.allocs.calls.saturating_add(slack) => Ok(()),
        Some(n) => Err(format!(
            "corrupt profile: its stacks hold {n} allocation calls, its totals {}",
            p.totals.allocs.calls
        )),
        None => Err("corrupt profile: the stacks' calls overflow".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{Counts, Frame, StackEntry};

    fn sample() -> Profile {
        let mut p = Profile::default();
        p.meta.pid = 42;
        p.meta.command = "./fixture".into();
        p.meta.mode = "count".into();
        p.stacks.push(StackEntry {
            func: "malloc".into(),
            frames: vec![Frame {
                function: "alloc_small".into(),
                file: Some("/src/counts.c".into()),
                line: Some(25),
                module: Some("/tmp/counts".into()),
                build_id: Some("abcd".into()),
                file_offset: Some(0x1234),
                addr: 0x5555_1234,
                inlined: false,
            }],
            truncated: false,
            thread: None,
            process: None,
            counts: Counts {
                calls: 1000,
                bytes: 48000,
            },
            live: None,
        });
        p.totals.allocs = Counts {
            calls: 1000,
            bytes: 48000,
        };
        p
    }

    #[test]
    fn values_no_trace_produces_are_refused() {
        let mut p = sample();
        assert!(parse(&to_json(&p)).is_ok());
        p.stacks[0].counts.calls = u64::MAX;
        let e = parse(&to_json(&p)).unwrap_err();
        assert!(e.starts_with("corrupt profile: its stacks hold"), "{e}");
        let mut p = sample();
        p.meta.duration_secs = -1.0;
        let e = parse(&to_json(&p)).unwrap_err();
        assert_eq!(e, "corrupt profile: duration_secs is -1");
    }

    #[test]
    fn a_schema_version_of_the_wrong_type_says_so() {
        let text = to_json(&sample()).replace("\"schema_version\": 1", "\"schema_version\": \"1\"");
        assert_eq!(
            parse(&text).unwrap_err(),
            "schema_version must be a number, found \"1\""
        );
    }

    #[test]
    fn round_trips() {
        let p = sample();
        let text = to_json(&p);
        assert!(text.contains("\"schema_version\": 1"));
        assert_eq!(parse(&text).unwrap(), p);
    }

    #[test]
    fn truncated_input_is_named() {
        let text = to_json(&sample());
        let err = parse(&text[..text.len() / 2]).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
    }

    #[test]
    fn wrong_version_is_refused() {
        let text = to_json(&sample()).replace("\"schema_version\": 1", "\"schema_version\": 99");
        let err = parse(&text).unwrap_err();
        assert!(err.contains("version 99"), "{err}");
    }

    #[test]
    fn output_validates_against_the_schema() {
        let schema: serde_json::Value =
            serde_json::from_str(include_str!("../../../schema/profile.schema.json")).unwrap();
        let validator = jsonschema::validator_for(&schema).unwrap();
        let mut p = sample();
        let doc: serde_json::Value = serde_json::from_str(&to_json(&p)).unwrap();
        let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{errors:?}");
        // A snapshot validates too, and a stray field does not.
        p.snapshot = Some(crate::profile::Snapshot {
            index: 1,
            ..Default::default()
        });
        let doc: serde_json::Value = serde_json::from_str(&to_json(&p)).unwrap();
        assert!(validator.is_valid(&doc));
        let mut bad = doc.clone();
        bad["meta"]["surprise"] = serde_json::json!(1);
        assert!(!validator.is_valid(&bad));
    }

    #[test]
    fn other_json_is_refused() {
        assert!(parse("{\"a\": 1}")
            .unwrap_err()
            .contains("not an mtrace profile"));
        assert!(parse("garbage").unwrap_err().contains("not a JSON profile"));
    }
}
