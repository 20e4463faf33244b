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

/// Reads a profile file; every failure is a one-line error with exit code 2.
pub fn read(path: &Path) -> Result<Profile> {
    let text = std::fs::read_to_string(path).map_err(|e| bad_input(path, e))?;
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
        None => return Err("profile has no schema_version".into()),
    }
    serde_json::from_value::<FileIn>(value)
        .map(|f| f.profile)
        .map_err(|e| format!("malformed profile: {e}"))
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
            counts: Counts {
                calls: 1000,
                bytes: 48000,
            },
            live: None,
        });
        p
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
