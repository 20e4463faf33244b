//! Scopes beyond one process: `--cgroup` (every process of a cgroup v2
//! directory, present and to come, and none outside it).
//! A cgroup traced `--file-wide` is here too, beside the same test
//! without it; `all` holds `--all` (every process on the host),
//! `file_wide` a command's tree traced with the host engine.

mod all;
mod file_wide;

use std::{
    path::Path,
    time::{Duration, Instant},
};

use crate::{
    support::counts::assert_counts_sites_times,
    support::{
        cgroup::TestCgroup,
        longrun::{sigkilled_mtrace_leaves_no_breakpoints_in, Longrun},
        scopes::{assert_same_as_alone, tally},
        Fixture, Mtrace,
    },
};

/// Waits until `file` exists (the test's go), from a shell.
fn wait_for(file: &Path) -> String {
    format!("while [ ! -e {} ]; do sleep 0.02; done", file.display())
}

/// A member present when tracing begins runs the counts fixture twice
/// (once through a shell it starts); a process that joins the cgroup
/// after tracing began runs it once; the same fixture run outside the
/// cgroup meanwhile is not traced. Every run in the cgroup is counted
/// exactly, and the trace ends by itself when the cgroup is empty.
#[test]
fn a_cgroup_is_traced_present_and_to_come_and_nothing_outside() {
    need_bpf!();
    cgroup_present_and_to_come(&[]);
}

/// The same with `--file-wide`: the allocator files probed once, the
/// cgroup (and those below it) told from other processes in the kernel;
/// the same processes counted, exactly, each run as the program traced
/// alone (per site, and its whole stacks frame for frame).
#[test]
fn a_cgroup_traced_file_wide_counts_its_processes_and_nothing_outside() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    cgroup_present_and_to_come(&["--file-wide"]);
}

fn cgroup_present_and_to_come(extra: &[&str]) {
    let file_wide = extra.contains(&"--file-wide");
    let cg = TestCgroup::new("scope");
    let dir = tempfile::tempdir().unwrap();
    let (go, go_late) = (dir.path().join("go"), dir.path().join("go-late"));
    let counts = Fixture::Counts.path_str();
    let member = std::process::Command::new("sh")
        .args([
            "-c",
            &format!(
                "{}; {}; {counts} >/dev/null; sh -c '{counts} >/dev/null'",
                cg.join(),
                wait_for(&go)
            ),
        ])
        .spawn()
        .unwrap();
    // In the cgroup before mtrace looks.
    cg.wait_in(member.id());
    let json = dir.path().join("p.json");
    let mut args = extra.to_vec();
    args.extend([
        "--per-process",
        "--top",
        "1",
        "-o",
        json.to_str().unwrap(),
        "--cgroup",
        cg.path(),
    ]);
    let mut m = Mtrace::start(&args);
    m.wait_tracing();
    let joiner = std::process::Command::new("sh")
        .args([
            "-c",
            &format!(
                "{}; {}; exec {counts} >/dev/null",
                cg.join(),
                wait_for(&go_late)
            ),
        ])
        .spawn()
        .unwrap();
    // The joiner is in the cgroup before the member may finish: the
    // cgroup never empties, and the trace does not end, in between.
    cg.wait_in(joiner.id());
    let outside = std::process::Command::new(counts)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let outside_pid = outside.id();
    std::fs::write(&go, "").unwrap();
    // Time for mtrace (which lists the cgroup every 0.1 s) to see the
    // process that joined.
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::write(&go_late, "").unwrap();
    for mut child in [member, joiner, outside] {
        child.wait().unwrap();
    }
    let out = m.finish();
    out.assert_exit(0);
    let d = out.describe();
    assert!(
        out.stderr
            .iter()
            .any(|l| l.ends_with(": no process is left in the cgroup")),
        "{d}"
    );
    let p = crate::support::Profile::load(&json);
    let procs = p.doc["meta"]["processes"].as_array().unwrap().clone();
    let counted: Vec<u64> = procs
        .iter()
        .filter(|e| e["name"] == "counts")
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(counted.len(), 3, "{procs:?}\n{d}");
    assert!(
        !procs
            .iter()
            .any(|e| e["pid"].as_u64() == Some(outside_pid as u64)),
        "the process outside the cgroup was traced: {procs:?}"
    );
    assert_counts_sites_times(&p, 3, &d);
    p.assert_rows_hold_the_totals(&d);
    if file_wide {
        assert_eq!(p.doc["meta"]["scope"], "cgroup", "{d}");
        // The joiner's run, 1.5 s after the others, walks by the rules
        // its program's first runs taught: whole, every stack. (A first
        // run's walk that mtrace finishes after its process is gone is
        // cut, and said: `process_gone`.)
        let (out, alone) = crate::support::run_profiled(&["--", counts]);
        out.assert_exit(0);
        let alone = tally(&alone, &|_, _| true);
        for pid in counted {
            assert_same_as_alone(
                &tally(&p, &move |p, n| p == pid && n == "counts"),
                &alone,
                &d,
            );
        }
        // (A process gone before mtrace read its cgroup is not labelled.)
        return;
    }
    // Per process, each with the cgroup it ran in.
    let name = cg.dir.file_name().unwrap().to_str().unwrap();
    let report = out.report();
    let in_cgroup = report
        .by_process
        .iter()
        .filter(|l| l.starts_with("counts (pid ") && l.ends_with(&format!(", cgroup /{name}")))
        .count();
    assert_eq!(in_cgroup, 3, "{d}");
}

/// mtrace killed with SIGKILL while it traces a cgroup leaves nothing in
/// its processes.
#[test]
fn sigkilled_mtrace_leaves_no_breakpoints_in_a_cgroup() {
    need_bpf!();
    let cg = TestCgroup::new("kill");
    let path = cg.path().to_string();
    sigkilled_mtrace_leaves_no_breakpoints_in(&|pid| {
        cg.add(pid);
        vec!["--cgroup".into(), path.clone()]
    });
}

/// A directory that is not a cgroup v2 one, and an empty cgroup: one
/// line each, and the status of a target that cannot be traced.
#[test]
fn a_path_that_is_not_a_cgroup_or_an_empty_one_is_refused() {
    need_bpf!();
    let out = crate::support::run_mtrace(&["--cgroup", "/tmp"]);
    out.assert_exit(1);
    out.assert_error("/tmp: not a cgroup v2 directory");
    let cg = TestCgroup::new("empty");
    let out = crate::support::run_mtrace(&["--cgroup", cg.path()]);
    out.assert_exit(1);
    out.assert_error("has no process to trace");
}

/// A process that leaves the traced cgroup is let go within a second: its
/// probes go (its libc's first bytes are its own again) and its counting
/// stops (fewer calls counted than it made, most of its loop after it
/// left), and the profile says it left; a process that stays keeps the
/// trace going, probed to the end.
#[test]
fn a_process_that_leaves_the_cgroup_is_let_go() {
    need_bpf!();
    let cg = TestCgroup::new("leave");
    let elsewhere = TestCgroup::new("elsewhere");
    let mut leaver = Longrun::start_for("stdin");
    let mut stayer = Longrun::start_for("stdin");
    let (leaver_pid, stayer_pid) = (leaver.fx.pid(), stayer.fx.pid());
    cg.add(leaver_pid);
    cg.add(stayer_pid);
    let mut m = Mtrace::start_profiled(&["--per-process", "--cgroup", cg.path()]);
    m.mtrace.wait_tracing();
    leaver.fx.release();
    stayer.fx.release();
    std::thread::sleep(Duration::from_millis(300));
    assert!(leaver.probed() && stayer.probed(), "not probed while in");
    elsewhere.add(leaver_pid);
    let moved = Instant::now();
    while leaver.probed() && moved.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let let_go = moved.elapsed();
    assert!(
        !leaver.probed(),
        "probes left in a process out of the cgroup"
    );
    assert!(let_go < Duration::from_secs(1), "let go after {let_go:?}");
    // The leaver loops on outside the scope for as long again as it did
    // inside, untraced.
    std::thread::sleep(Duration::from_millis(600));
    assert!(stayer.probed(), "the process still in was let go");
    m.mtrace.proc.signal(libc::SIGINT);
    let (out, p) = m.finish();
    out.assert_exit(0);
    let made = leaver.finish();
    stayer.finish();
    let d = out.describe();
    assert!(
        out.stdout.contains(", 1 let go when they left the cgroup"),
        "{d}"
    );
    let counted: u64 = p
        .allocs()
        .filter(|s| s.process.as_ref().is_some_and(|r| r.pid == leaver_pid))
        .filter(|s| s.function == "malloc")
        .map(|s| s.calls)
        .sum();
    assert!(
        counted > 0 && counted * 2 < made,
        "{counted} of the leaver's {made} mallocs counted\n{d}"
    );
    let record = p.doc["meta"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["pid"] == leaver_pid)
        .unwrap_or_else(|| panic!("no record of pid {leaver_pid}\n{d}"))
        .clone();
    assert!(
        record["not_traced"]
            .as_str()
            .is_some_and(|w| w.starts_with("left the cgroup")),
        "{record}"
    );
}

/// The root of cgroup v2 holds every process of the host and has no
/// `cgroup.events` to say when it empties: `--cgroup /` (the mount, by
/// any spelling) is a one-line usage error that names `--all`, not a
/// trace that ends at once saying the cgroup is empty.
#[test]
fn the_cgroup2_root_is_a_usage_error_naming_all() {
    for root in ["/", ""] {
        let out = crate::support::run_mtrace(&["--cgroup", root, "--duration", "2"]);
        out.assert_exit(2);
        out.assert_error("is the root of cgroup v2");
        out.assert_error("trace them with --all");
    }
}
