//! Python frames on the host engine: a script traced `--file-wide` (its
//! process tree told in the kernel, each interpreter file's layout given
//! to the programs once, a process's own `_PyRuntime` found from its
//! mappings) has the Python frames and counts a trace of it alone has.

use std::path::PathBuf;

use super::assert_chain;
use crate::support::{
    python::{available, run_named, script, N},
    scopes::{assert_same_as_alone, tally},
};

/// The chain script traced file-wide and alone, under Debian's python3.11
/// (libpython linked in, its file known before the command runs) and
/// pyenv's 3.12 and 3.9 (a shared libpython, found in the process's
/// mappings; 3.9 tells threads apart by their fs base): the same chain of
/// Python frames and lines with exactly `N` calls, every stack through the
/// script's `leaf` frame for frame the same (native and Python frames),
/// the same calls per function and direct caller, every whole stack one
/// the trace alone has, and the same count of stacks with Python frames.
#[test]
fn python_frames_file_wide_are_those_of_a_trace_alone() {
    let dir = bpf_tempdir!();
    let path = script(dir.path());
    let script = path.to_str().unwrap();
    let n = N.to_string();
    for (python, minor) in available(vec![
        (PathBuf::from("/usr/bin/python3.11"), 11),
        (
            PathBuf::from("/root/.pyenv/versions/3.12.1/bin/python3"),
            12,
        ),
        (PathBuf::from("/root/.pyenv/versions/3.9.18/bin/python3"), 9),
    ]) {
        let py = python.to_str().unwrap();
        let (out, alone) = run_named(&["--", py, script, &n]);
        out.assert_exit(0);
        assert_chain(
            &alone,
            script,
            minor,
            &format!("{py} alone\n{}", out.describe()),
        );
        let (out, wide) = run_named(&["--file-wide", "--", py, script, &n]);
        out.assert_exit(0);
        let d = format!("{py} --file-wide\n{}", out.describe());
        assert_eq!(wide.doc["meta"]["scope"], "tree", "{d}");
        assert_chain(&wide, script, minor, &d);
        assert_eq!(
            wide.doc["meta"]["python"], alone.doc["meta"]["python"],
            "{d}"
        );
        let leaf = |t: std::collections::BTreeMap<(String, String), u64>| {
            t.into_iter()
                .filter(|((_, s), _)| s.starts_with("leaf ") || s.contains(" <- leaf "))
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        let (all_wide, all_alone) = (tally(&wide, &|_, _| true), tally(&alone, &|_, _| true));
        let first = leaf(all_alone.clone());
        assert_eq!(first.values().sum::<u64>(), N, "{d}");
        assert_eq!(leaf(all_wide.clone()), first, "{d}");
        assert_same_as_alone(&all_wide, &all_alone, &d);
        let with =
            |p: &crate::support::Profile| p.doc["stack_quality"]["python"]["with_frames"].as_u64();
        assert_eq!(with(&wide), with(&alone), "{d}");
    }
}
