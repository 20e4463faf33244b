//! Python frames on the host engine: a script traced `--file-wide` (its
//! process tree told in the kernel, each interpreter file's layout given
//! to the programs once, a process's own `_PyRuntime` found from its
//! mappings) has the Python frames and counts a trace of it alone has.

use std::collections::BTreeMap;

use super::{assert_chain, three_kinds};
use crate::support::{
    python::{available, run_named, script, N},
    scopes::tally,
    Profile,
};

/// The chain script traced file-wide and alone, under Debian's python3.11
/// (libpython linked in, its file known before the command runs) and
/// pyenv's 3.12 and 3.9 (a shared libpython, found from the executable's
/// run path; 3.9 tells threads apart by their fs base): the same chain of
/// Python frames and lines with exactly `N` calls, every stack through the
/// script's `leaf` frame for frame the same (native and Python frames,
/// calls), and the same interpreter said. (Other stacks' counts are not
/// compared: an interpreter's own start-up allocates differently from
/// run to run, its hashes seeded afresh.)
#[test]
fn python_frames_file_wide_are_those_of_a_trace_alone() {
    let dir = bpf_tempdir!();
    let path = script(dir.path());
    let script = path.to_str().unwrap();
    let n = N.to_string();
    for (python, minor) in available(three_kinds()) {
        let py = python.to_str().unwrap();
        let (out, alone) = run_named(&["--", py, script, &n]);
        out.assert_exit(0);
        let a = format!("{py} alone\n{}", out.describe());
        assert_chain(&alone, script, minor, &a);
        let (out, wide) = run_named(&["--file-wide", "--", py, script, &n]);
        out.assert_exit(0);
        let d = format!("{py} --file-wide\n{}", out.describe());
        assert_eq!(wide.doc["meta"]["scope"], "tree", "{d}");
        assert_chain(&wide, script, minor, &d);
        assert_eq!(
            wide.doc["meta"]["python"], alone.doc["meta"]["python"],
            "{d}"
        );
        let through_leaf = |p: &Profile| -> BTreeMap<(String, String), u64> {
            tally(p, &|_, _| true)
                .into_iter()
                .filter(|((_, s), _)| s.starts_with("leaf ") || s.contains(" <- leaf "))
                .collect()
        };
        let first = through_leaf(&alone);
        assert_eq!(first.values().sum::<u64>(), N, "{a}");
        assert_eq!(through_leaf(&wide), first, "{d}");
    }
}
