//! Golden files of the renderers, as inferno keeps them
//! (`tests/data/<tool>/results/`): one fixed profile in
//! (`tests/data/render/profile.json`), each renderer's output compared
//! with its file in `tests/data/render/results/`.
//!
//! The profile has several allocator functions, stacks sharing a prefix,
//! an inlined frame, a C++ frame longer than a line, two threads, a
//! truncated stack, a free, live statistics and leak suspects, a stack
//! quality line, a loss and a single-stepped probe.
//!
//! pprof is gzipped protobuf: its file is the decoded message's debug
//! dump (`{:#?}` of the `prost` types), not the bytes.
//!
//! When an output changes on purpose, regenerate the files and review the
//! change with `git diff`:
//!
//! ```text
//! MTRACE_BLESS=1 cargo test -p tracer-offline --test render
//! ```

use std::io::Read as _;
use std::path::{Path, PathBuf};

use prost::Message as _;
use tracer_offline::profile::{file, Profile};
use tracer_offline::render::{
    calltree, folded, pprof, speedscope, table, ReportOptions, SortKey, StackWeight,
};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/render")
}

fn input() -> Profile {
    file::read(&data().join("profile.json")).expect("the golden profile reads")
}

/// Compares `actual` with `results/NAME` (`MTRACE_BLESS` rewrites it).
fn check(name: &str, actual: &str) {
    tracer_offline::golden::check(&data().join("results"), name, actual);
}

fn options(sort: SortKey, per_thread: bool) -> ReportOptions {
    ReportOptions {
        top: 5,
        threshold_pct: 0.0,
        sort,
        per_thread,
        per_process: false,
        color: false,
    }
}

#[test]
fn table() {
    let p = input();
    check(
        "table.txt",
        &table::render(&p, &options(SortKey::Calls, false)),
    );
    check(
        "table-per-thread-by-bytes.txt",
        &table::render(&p, &options(SortKey::Bytes, true)),
    );
}

#[test]
fn calltree() {
    check(
        "calltree.txt",
        &calltree::render_tree(&input(), SortKey::Calls, 0.0),
    );
}

#[test]
fn folded() {
    let p = input();
    check(
        "folded-calls.txt",
        &folded::render(&p, StackWeight::Calls, false),
    );
    check(
        "folded-inuse-per-thread.txt",
        &folded::render(&p, StackWeight::InUse, true),
    );
}

#[test]
fn speedscope() {
    let json = speedscope::render(&input(), StackWeight::Bytes).expect("speedscope renders");
    // Pretty, so that a change is a readable diff.
    let value: serde_json::Value = serde_json::from_str(&json).expect("speedscope is JSON");
    check(
        "speedscope.json",
        &(serde_json::to_string_pretty(&value).unwrap() + "\n"),
    );
}

#[test]
fn pprof() {
    let gz = pprof::render(&input()).expect("pprof renders");
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz.as_slice())
        .read_to_end(&mut raw)
        .expect("pprof is gzipped");
    let message = pprof::proto::Profile::decode(raw.as_slice()).expect("pprof decodes");
    check("pprof.txt", &format!("{message:#?}\n"));
}
