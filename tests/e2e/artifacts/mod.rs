//! Profiles as artifacts: the JSON profile (`--output`) and what is made
//! from it offline (`mtrace report`, `mtrace diff`), the pprof and
//! speedscope exports, and snapshots written while tracing goes on.
//!
//! Every mtrace profile a test here writes is validated against
//! tracer/schema/profile.schema.json ([`validate_profile`]).

mod bad_input;
mod diff;
mod pprof;
mod schema_roundtrip;
mod snapshots;
mod speedscope;

use std::{
    collections::BTreeMap,
    fs,
    io::Read,
    path::{Path, PathBuf},
};

use serde_json::Value;

use crate::{
    counts::COUNTS_SITES,
    support::{run_mtrace, Finished, Fixture, Mtrace},
};

// ---------------------------------------------------------------------------
// The profile schema

pub fn schema_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("schema/profile.schema.json")
}

/// Loads the profile at `path`, asserts that it validates against the
/// schema (listing every error), and returns it.
pub fn validate_profile(path: &Path) -> Value {
    let schema_text = fs::read_to_string(schema_path())
        .unwrap_or_else(|e| panic!("reading {}: {e}", schema_path().display()));
    let schema: Value = serde_json::from_str(&schema_text).expect("the schema is not JSON");
    let validator = jsonschema::validator_for(&schema).expect("the schema does not compile");
    let text = fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading profile {}: {e}", path.display()));
    let doc: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("profile {} is not JSON: {e}", path.display()));
    let errors: Vec<String> = validator
        .iter_errors(&doc)
        .map(|e| format!("  at {:?}: {e}", e.instance_path().to_string()))
        .collect();
    assert!(
        errors.is_empty(),
        "{} does not validate against {}:\n{}",
        path.display(),
        schema_path().display(),
        errors.join("\n")
    );
    doc
}

/// `path` as &str (temp paths are UTF-8).
pub fn s(path: &Path) -> &str {
    path.to_str().expect("path not UTF-8")
}

/// (allocator function, direct caller) -> [calls, bytes] of the counts
/// fixture.
pub fn expected_sites() -> BTreeMap<(String, String), [i64; 2]> {
    COUNTS_SITES
        .iter()
        .map(|&(f, c, calls, bytes)| ((f.to_string(), c.to_string()), [calls as i64, bytes as i64]))
        .collect()
}

/// A launch-mode trace of `fixture` (counts or counts-plus20) with `args`
/// before `--`; asserts that mtrace exits 0.
pub fn trace_counts(fixture: Fixture, args: &[&str]) -> Finished {
    let mut all: Vec<&str> = args.to_vec();
    all.push("--");
    all.push(fixture.path_str());
    let mut m = Mtrace::start(&all);
    m.wait_tracing();
    let out = m.finish();
    out.assert_exit(0);
    out
}

/// The table of a launch-mode run: stdout without the fixture's own
/// `done` line, which comes before mtrace's header.
pub fn live_table(out: &Finished) -> String {
    let lines: Vec<&str> = out.stdout.lines().collect();
    let header = lines
        .iter()
        .position(|l| l.starts_with("mtrace: pid "))
        .unwrap_or_else(|| panic!("no report header\n{}", out.describe()));
    assert_eq!(
        &lines[..header],
        &["done"],
        "expected only the fixture's `done` before the report\n{}",
        out.describe()
    );
    let mut table = String::new();
    for l in &lines[header..] {
        table.push_str(l);
        table.push('\n');
    }
    table
}

/// `mtrace report ARGS` (no privilege needed): exit 0, and the table.
pub fn report(args: &[&str]) -> Finished {
    let mut all = vec!["report"];
    all.extend_from_slice(args);
    let out = run_mtrace(&all);
    out.assert_exit(0);
    out
}

pub fn gunzip(path: &Path) -> Vec<u8> {
    let file = fs::File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("{} is not gzip: {e}", path.display()));
    raw
}
