//! Helpers shared by the end-to-end tests:
//!
//! - [`fixtures`]: the fixture programs, compiled once per test run;
//! - [`process`]: child processes that are killed when a test fails, line
//!   readers with timeouts;
//! - [`mtrace`]: running mtrace;
//! - [`profile`]: loading and querying the JSON profile (`-o`), which is
//!   what the tests assert on;
//! - [`table`]: the parser of the human table (the table's own tests are
//!   tests/e2e/table.rs);
//! - [`diff`]: the parser of `mtrace diff`'s table;
//! - [`longrun`]: the longrun fixture, to see probes come and go;
//! - [`live`]: the live fixture in live mode;
//! - [`python`]: the Python scripts and their frames in a profile;
//! - [`scopes`]: stacks tallied per process, against a trace alone;
//! - [`protoc`]: pprof files decoded by protoc;
//! - [`symbols`]: stripped programs, their debug files, debuginfod;
//! - [`cgroup`]: a cgroup of the test's own;
//! - [`agent`], [`http`], [`pprof`], [`prometheus`]: `mtrace agent` and
//!   the clients that read it.

pub mod agent;
pub mod cgroup;
pub mod counts;
pub mod diff;
pub mod fixtures;
pub mod gdb;
pub mod http;
pub mod live;
pub mod longrun;
pub mod mtrace;
pub mod pprof;
pub mod process;
pub mod profile;
pub mod prometheus;
pub mod protoc;
pub mod python;
pub mod scopes;
pub mod symbols;
pub mod table;
pub mod unwind;

use std::{fs, io::Read, os::unix::fs::PermissionsExt, path::Path};

pub use fixtures::{copy_executable, Fixture};
pub use mtrace::{
    mtrace_path, run_mtrace, run_profiled, trace_by_pid, trace_fixture, Finished, Mtrace,
};
pub use process::{dead_pid, read_mem, FixtureProc, Proc, EXIT_TIMEOUT, LINE_TIMEOUT};
pub use profile::{validate_against, validate_profile, Profile};

/// The BPF tests need root. Returns false (after a note on stderr) when the
/// test should be skipped; when the environment variable `CI` is set, not
/// being root fails the test instead.
#[must_use]
pub fn require_bpf() -> bool {
    let ok = require(
        unsafe { libc::geteuid() } == 0,
        "the e2e tests need root (BPF and uprobes)",
    );
    if ok {
        hold(false);
    }
    ok
}

/// [`require_bpf`] for a test that probes every process on the host
/// (`--all`): it runs alone, once every other BPF test has ended and
/// before any starts. Its breakpoints would be in every other test's
/// processes, whose checks that their code is restored after mtrace,
/// or whose timing, they would upset.
pub fn require_bpf_alone() -> bool {
    let ok = require(
        unsafe { libc::geteuid() } == 0,
        "the e2e tests need root (BPF and uprobes)",
    );
    if ok {
        hold(true);
    }
    ok
}

/// Held shared by every BPF test, alone by a host-wide one, until the
/// test's thread ends (or the thread's next test takes it again).
static HOST_WIDE: std::sync::RwLock<()> = std::sync::RwLock::new(());

enum Held {
    Shared(#[allow(dead_code)] std::sync::RwLockReadGuard<'static, ()>),
    Alone(#[allow(dead_code)] std::sync::RwLockWriteGuard<'static, ()>),
}

thread_local! {
    static HELD: std::cell::RefCell<Option<Held>> = const { std::cell::RefCell::new(None) };
}

fn hold(alone: bool) {
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        // What this thread held for an earlier test (or earlier in this
        // one) first: a lock is never waited for while holding it.
        *h = None;
        *h = Some(if alone {
            Held::Alone(HOST_WIDE.write().unwrap_or_else(|e| e.into_inner()))
        } else {
            Held::Shared(HOST_WIDE.read().unwrap_or_else(|e| e.into_inner()))
        });
    });
}

/// Whether what a test needs (`needed`) holds. When it does not: false,
/// after a note on stderr, so that the test can be skipped; when the
/// environment variable `CI` is set, a failure instead, naming `what`.
#[must_use]
pub fn require(needed: bool, what: &str) -> bool {
    if needed {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("{what}, and CI is set: not skipping");
    }
    eprintln!("skipped: {what} (set CI to make this a failure)");
    false
}

/// Names of the files in `dir`, sorted.
pub fn names_in(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A fresh directory under /tmp that every user can enter (tempfile makes
/// them 0700).
pub fn public_tempdir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("mtrace-e2e-")
        .tempdir_in("/tmp")
        .unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// Is `program` on PATH?
pub fn have(program: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `path` as &str (temp paths are UTF-8).
pub fn s(path: &Path) -> &str {
    path.to_str().expect("path not UTF-8")
}

/// The bytes of the gzip file at `path`.
pub fn gunzip(path: &Path) -> Vec<u8> {
    let file = fs::File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("{} is not gzip: {e}", path.display()));
    raw
}
