//! `--file-wide` on a command: its process tree told from other
//! processes in the kernel, each run counted as traced alone; mtrace
//! killed leaves no breakpoint. (A cgroup traced file-wide is in
//! scopes.rs, beside the same test without `--file-wide`.)

use crate::support::{
    cgroup::TestCgroup,
    longrun::sigkilled_mtrace_leaves_no_breakpoints_in,
    scopes::{assert_same_as_alone, tally},
    Fixture,
};

/// `--file-wide -- CMD`: the command's process tree told from other
/// processes in the kernel (each child joins at its fork), the allocator
/// files probed once before the command's first instruction. A shell runs
/// the counts fixture, then a shell that runs it, and exits 3; the same
/// fixture run meanwhile outside the tree is not counted. Each run in the
/// tree is counted as a trace of it alone counts it, per function and
/// whole stack, frame for frame; the command's status is mtrace's.
#[test]
fn a_command_traced_file_wide_counts_its_tree_as_a_trace_of_it_alone() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let counts = Fixture::Counts.path_str();
    let (out, p) = crate::support::run_profiled(&["--", counts]);
    out.assert_exit(0);
    let alone = tally(&p, &|_, _| true);
    let mut outside = std::process::Command::new("sh")
        .args([
            "-c",
            &format!("for i in 1 2 3 4 5 6; do {counts} >/dev/null; sleep 0.05; done"),
        ])
        .spawn()
        .unwrap();
    let script = format!("{counts} >/dev/null; sh -c '{counts} >/dev/null'; exit 3");
    let (out, p) =
        crate::support::run_profiled(&["--file-wide", "--per-process", "--", "sh", "-c", &script]);
    outside.wait().unwrap();
    out.assert_exit(3);
    let d = out.describe();
    assert_eq!(p.doc["meta"]["scope"], "tree", "{d}");
    let runs: Vec<u64> = p.doc["meta"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "counts")
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(runs.len(), 2, "{}\n{d}", p.doc["meta"]["processes"]);
    for pid in runs {
        assert_same_as_alone(
            &tally(&p, &move |p, n| p == pid && n == "counts"),
            &alone,
            &d,
        );
    }
}

/// mtrace `--file-wide` killed with SIGKILL while it traces a cgroup
/// leaves no breakpoint in its processes.
#[test]
fn sigkilled_mtrace_file_wide_leaves_no_breakpoints() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let cg = TestCgroup::new("kill-fw");
    let path = cg.path().to_string();
    sigkilled_mtrace_leaves_no_breakpoints_in(&|pid| {
        cg.add(pid);
        vec!["--file-wide".into(), "--cgroup".into(), path.clone()]
    });
}
