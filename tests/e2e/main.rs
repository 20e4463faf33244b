//! End-to-end tests of mtrace: real probes on real fixture processes
//! (tests/fixtures/*.c, compiled with cc on first use). They need root;
//! without it they are skipped, unless the environment variable CI is set.
//!
//!     cargo test --release -p tracer --test e2e
//!
//! The tests assert on the JSON profile mtrace writes with `-o`
//! (support/profile.rs). table.rs checks the human table itself; what
//! other tests need of the report's text (what only the report shows)
//! they read through the table's parser (support/table.rs), never by
//! searching stdout. support/ holds the helpers: the fixtures, child
//! processes, running mtrace, the profile, the table's and the diff's
//! parsers. The renderers' exact outputs are golden files of the
//! tracer-offline crate (tracer/offline/tests/render.rs).

/// Returns from the test (after a note on stderr) when BPF cannot be used;
/// under CI, fails instead (`support::require_bpf`).
macro_rules! need_bpf {
    () => {
        if !crate::support::require_bpf() {
            return;
        }
    };
}

/// For a test that probes file-wide (`--file-wide`, `--all`): it runs
/// alone (`support::require_bpf_alone`), then a fresh temporary
/// directory for its files.
macro_rules! host_tempdir {
    () => {{
        if !crate::support::require_bpf_alone() {
            return;
        }
        tempfile::tempdir().unwrap()
    }};
}

/// `need_bpf!()`, then a fresh temporary directory for the test's files.
macro_rules! bpf_tempdir {
    () => {{
        need_bpf!();
        tempfile::tempdir().unwrap()
    }};
}

mod agent;
mod artifacts;
mod calltree;
mod coexist;
mod conventions;
mod counts;
mod edge;
mod errors;
mod exec;
mod families;
mod golang;
mod hostile;
mod jit;
mod lifecycle;
mod live;
mod losses;
mod names;
mod outputs;
mod pertest;
mod python;
mod sampling;
mod scopes;
mod support;
mod symbols;
mod table;
mod threads;
mod tree;
mod unwind;
mod watch;
mod weights;
