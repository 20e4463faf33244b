//! Profiles as artifacts: the JSON profile (`--output`) and what is made
//! from it offline (`mtrace report`, `mtrace diff`), the pprof and
//! speedscope exports, and snapshots written while tracing goes on.
//!
//! Every mtrace profile a test here writes is validated against
//! tracer/schema/profile.schema.json
//! ([`validate_profile`](crate::support::validate_profile)).

mod bad_input;
mod ci_recipe;
pub(crate) mod diff;
mod html;
pub(crate) mod pprof;
mod scale;
mod schema_roundtrip;
mod snapshots;
mod speedscope;

use std::{collections::BTreeMap, fs, io::Read, path::Path};

use crate::{
    support::counts::COUNTS_SITES,
    support::{run_mtrace, Finished, Fixture, Mtrace},
};

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
