//! `--file-wide` on a command: its process tree told from other
//! processes in the kernel, each run counted as traced alone; mtrace
//! killed leaves no breakpoint. (A cgroup traced file-wide is in
//! scopes.rs, beside the same test without `--file-wide`.)

use crate::support::{
    cgroup::TestCgroup,
    copy_executable,
    fixtures::rustjem,
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
    p.assert_rows_hold_the_totals(&d);
    for pid in runs {
        assert_same_as_alone(
            &tally(&p, &move |p, n| p == pid && n == "counts"),
            &alone,
            &d,
        );
    }
}

/// `--file-wide -- CMD`: a program of the tree with an allocator of its
/// own, in a file no process had mapped (a static C program; a Rust
/// program with jemalloc linked in under `_rjem_` names), is held at its
/// exec until its probes are in, so its first call is counted. The static
/// counts fixture is counted as a trace of it alone counts it, per
/// function and whole stack; the Rust program's three sites are exact
/// under the jemalloc entries; no probe is said to have gone in late.
#[test]
fn a_program_with_an_allocator_of_its_own_is_counted_from_its_first_call() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let dir = crate::support::public_tempdir();
    let cs = copy_executable(Fixture::CountsStatic.path(), dir.path(), "counts-static");
    let rj = copy_executable(rustjem(), dir.path(), "rustjem");
    let (cs, rj) = (cs.to_str().unwrap(), rj.to_str().unwrap());
    let (out, p) = crate::support::run_profiled(&["--", cs]);
    out.assert_exit(0);
    let alone = tally(&p, &|_, _| true);
    assert!(alone.values().sum::<u64>() >= 1281, "{alone:?}");
    let script = format!("{cs} >/dev/null; {rj} >/dev/null");
    let (out, p) =
        crate::support::run_profiled(&["--file-wide", "--per-process", "--", "sh", "-c", &script]);
    out.assert_exit(0);
    let d = out.describe();
    assert!(!out.stderr.iter().any(|l| l.contains("not counted")), "{d}");
    p.assert_rows_hold_the_totals(&d);
    assert_same_as_alone(&tally(&p, &|_, n| n == "counts-static"), &alone, &d);
    for (func, site, want) in [
        ("_rjem_malloc", "rustjem::box_site", (100, 4000)),
        ("_rjem_malloc", "rustjem::vec_site", (50, 50_000)),
        ("_rjem_calloc", "rustjem::zeroed_site", (20, 6000)),
    ] {
        let got = p
            .allocs()
            .filter(|s| s.function == func && s.names().contains(&site))
            .fold((0, 0), |(c, b), s| (c + s.calls, b + s.bytes));
        assert_eq!(got, want, "{func} through {site}\n{d}");
    }
}

/// mtrace `--file-wide` killed with SIGKILL while it follows a command's
/// tree: the tree runs on to its end, traced by no one.
#[test]
fn sigkilled_mtrace_file_wide_lets_its_tree_run_on() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let dir = crate::support::public_tempdir();
    let (go, done) = (dir.path().join("go"), dir.path().join("done"));
    let script = format!(
        "while [ ! -e {} ]; do sleep 0.01; done; ls / >/dev/null; echo $$ > {}",
        go.display(),
        done.display()
    );
    let mut m = crate::support::Mtrace::start(&["--file-wide", "--", "sh", "-c", &script]);
    let pid = m.wait_tracing();
    m.proc.signal(libc::SIGKILL);
    std::fs::write(&go, "").unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !std::fs::read_to_string(&done).is_ok_and(|s| s.trim() == pid.to_string()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the tree of pid {pid} did not run on after mtrace was killed: {:?}",
            std::fs::read_to_string(format!("/proc/{pid}/status"))
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A walk the kernel hands over whose process is gone before mtrace
/// reads its mappings is finished in the files the kernel's walks met in
/// that process (its executable and the C library): mtrace traces a
/// cgroup file-wide and is stopped (SIGSTOP) while a fresh copy of the
/// counts fixture (a file no rule is known for) runs in it and exits
/// (in a command's tree the tree would wait for mtrace at its exec);
/// once let go on, every walk of it is finished after its end, and its
/// calls are counted as a trace of it alone counts them, per function and
/// whole stack, frame for frame, none cut. Stderr says how many walks
/// were finished so, even when the trace ends at once (the cgroup found
/// empty at its first look): none is left waiting at the end.
#[test]
fn a_walk_whose_process_is_gone_is_finished_whole_in_its_files() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let dir = crate::support::public_tempdir();
    let counts = copy_executable(Fixture::Counts.path(), dir.path(), "counts");
    let counts = counts.to_str().unwrap();
    let (out, p) = crate::support::run_profiled(&["--", counts]);
    out.assert_exit(0);
    let alone = tally(&p, &|_, _| true);
    assert!(
        alone.keys().all(|(_, s)| s.ends_with("cut:false")),
        "{alone:#?}"
    );

    let cg = TestCgroup::new("gone-fw");
    let go = dir.path().join("go");
    let script = format!(
        "{}; while [ ! -e {} ]; do sleep 0.01; done; exec {counts} >/dev/null",
        cg.join(),
        go.display()
    );
    let mut member = std::process::Command::new("sh")
        .args(["-c", &script])
        .spawn()
        .unwrap();
    let pid = member.id();
    cg.wait_in(pid);
    let mut m = crate::support::Mtrace::start_profiled(&[
        "--file-wide",
        "--per-process",
        "--cgroup",
        cg.path(),
    ]);
    m.wait_tracing();
    m.proc.signal(libc::SIGSTOP);
    std::fs::write(&go, "").unwrap();
    // The fixture has run and exited.
    assert!(member.wait().unwrap().success());
    m.proc.signal(libc::SIGCONT);

    let (out, p) = m.finish();
    out.assert_exit(0);
    let d = out.describe();
    let run = tally(&p, &move |p, n| p == pid as u64 && n == "counts");
    assert_eq!(run, alone, "{d}");
    let said = out
        .stderr
        .iter()
        .find_map(|l| l.split_once("walks were finished after their process was gone"))
        .map(|(n, rest)| {
            (
                n.trim_start_matches("mtrace: ").trim().to_string(),
                rest.to_string(),
            )
        })
        .unwrap_or_else(|| panic!("no word of walks of a process gone\n{d}"));
    let n: u64 = said.0.parse().unwrap();
    let (whole, cut) = said
        .1
        .rsplit_once(": ")
        .and_then(|(_, counts)| {
            let (whole, cut) = counts.split_once(" whole, ")?;
            let cut = cut.strip_suffix(" cut (process_gone)")?;
            Some((whole.parse::<u64>().ok()?, cut.parse::<u64>().ok()?))
        })
        .unwrap_or_else(|| panic!("no whole and cut counts\n{d}"));
    assert_eq!(whole + cut, n, "{d}");
    // The fixture's calls (all whole, above) were nearly all finished
    // after it was gone (the tracer may finish a few as it stops); cut,
    // at most the calls of the shell before it exec'd the fixture and of
    // its `sleep`s: programs started before mtrace, never named to it,
    // whose walks end where the kernel's did once their process is gone.
    let shell: u64 = tally(&p, &move |p, n| p != pid as u64 || n != "counts")
        .values()
        .sum();
    assert!(whole >= 1000 && cut <= shell, "{d}");
    // No walk left unfinished at the end.
    p.assert_rows_hold_the_totals(&d);
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

/// `--file-wide -- CMD` with a process table smaller than the tree: the
/// children the tree's table had no room for are not counted, and that is
/// counted and shown (the JSON's host losses, the report's host line and
/// a line on stderr), never silently missing; with the default table the
/// same tree is counted whole and nothing is lost. A shell starts eight
/// subshells at once, each of which sleeps and then runs the counts
/// fixture: a table of 4 holds the shell and at most 3 of them.
#[test]
fn a_process_table_too_small_for_the_tree_is_counted_and_shown() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let counts = Fixture::Counts.path_str();
    let script =
        format!("for i in 1 2 3 4 5 6 7 8; do (sleep 0.3; {counts} >/dev/null) & done; wait");
    let counted = |p: &crate::support::Profile| {
        p.doc["meta"]["processes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "counts")
            .count()
    };
    let (out, p) = crate::support::run_profiled(&[
        "--file-wide",
        "--per-process",
        "--process-table-size",
        "4",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    out.assert_exit(0);
    let d = out.describe();
    let tree_full = p.losses["tree_full"];
    assert!(tree_full >= 5, "{:?}\n{d}", p.losses);
    assert!(counted(&p) <= 3, "{}\n{d}", p.doc["meta"]["processes"]);
    assert!(
        out.stdout.contains(&format!("tree full {tree_full}")),
        "{d}"
    );
    assert!(
        out.stderr
            .iter()
            .any(|l| l.contains(&format!("{tree_full} children beyond the tree's table"))),
        "{d}"
    );

    let (out, p) =
        crate::support::run_profiled(&["--file-wide", "--per-process", "--", "sh", "-c", &script]);
    out.assert_exit(0);
    let d = out.describe();
    assert_eq!(counted(&p), 8, "{}\n{d}", p.doc["meta"]["processes"]);
    for what in [
        "exec_events_lost",
        "process_names_full",
        "process_runs_full",
        "tree_full",
        "frames_untagged",
    ] {
        assert_eq!(p.losses.get(what), Some(&0), "{what}: {:?}\n{d}", p.losses);
    }
    assert!(out.stdout.contains("tree full 0"), "{d}");
}

/// The host engine's walk of a process whose mappings change as it
/// allocates (two threads map and unmap pages without end): a frame whose
/// mapping the kernel could not look up then (the process held the lock
/// to change them) is handed to the tracer, which places it and walks on,
/// so every one of the 100,000 calls of malloc from `churn_leaf` is under its whole
/// stack, to `main` and the thread's first frame. None is cut but for a
/// walk the kernel could not hand over, its ring full while a starved
/// tracer fell behind (counted as `copy_lost`, and few).
#[test]
fn a_process_changing_its_mappings_keeps_its_whole_stacks() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let churn = Fixture::MapChurn.path_str();
    let n: u64 = 100_000;
    let (out, p) = crate::support::run_profiled(&["--file-wide", "--", churn, &n.to_string()]);
    out.assert_exit(0);
    let d = out.describe();
    let q = &p.doc["stack_quality"];
    let whole: u64 = p
        .allocs()
        .filter(|s| s.function == "malloc" && !s.truncated)
        .filter(|s| s.names().contains(&"churn_leaf") && s.names().contains(&"main"))
        .map(|s| s.calls)
        .sum();
    // A cut walk may have lost its direct caller too: every malloc cut.
    let cut: u64 = p
        .allocs()
        .filter(|s| s.function == "malloc" && s.truncated)
        .map(|s| s.calls)
        .sum();
    let causes: Vec<&String> = q["truncated"]
        .as_object()
        .map(|m| m.keys().collect())
        .unwrap_or_default();
    assert!(
        causes.iter().all(|c| *c == "copy_lost"),
        "{causes:?}: {q}\n{d}"
    );
    assert_eq!(whole + cut, n, "{q}\n{d}");
    assert!(cut * 5 <= n, "{cut} cut: {q}\n{d}");
}

/// `--bpf-stats -v` on the host's engine: the kernel's time for its one
/// program, which ran at least once for each call the tree made.
#[test]
fn the_hosts_program_is_timed_with_bpf_stats() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let counts = Fixture::Counts.path_str();
    let (out, p) =
        crate::support::run_profiled(&["--file-wide", "--bpf-stats", "-v", "--", counts]);
    out.assert_exit(0);
    let d = out.describe();
    let calls = p.doc["stack_quality"]["calls"].as_u64().unwrap();
    let runs = out
        .stderr
        .iter()
        .find_map(|l| {
            let rest = l.split_once("bpf program host_alloc: ")?.1;
            rest.split_once(" runs, ")?.0.parse::<u64>().ok()
        })
        .unwrap_or_else(|| panic!("no time for the host's program\n{d}"));
    assert!(
        calls > 0 && runs >= calls,
        "{runs} runs, {calls} calls\n{d}"
    );
}

/// `--file-wide -- CMD`: a thread that outlives its process's main thread
/// (orphan.c) is counted while the main thread lives and after it ended,
/// as a trace of it alone counts it: the process leaves the tree, and its
/// incarnation ends, with its last thread.
#[test]
fn a_thread_that_outlives_its_main_thread_is_counted_to_its_end() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let orphan = crate::support::fixtures::compile_c(
        "orphan",
        "orphan",
        &["-O2", "-g", "-fno-omit-frame-pointer"],
        &["-pthread"],
    );
    let orphan = orphan.to_str().unwrap();
    for engine in [&["--file-wide", "--", orphan][..], &["--", orphan][..]] {
        let (out, p) = crate::support::run_profiled(engine);
        out.assert_exit(0);
        let d = out.describe();
        let of_size = |size: u64| -> u64 {
            p.allocs()
                .filter(|s| s.bytes == s.calls * size)
                .map(|s| s.calls)
                .sum()
        };
        assert_eq!(
            (of_size(1111), of_size(2222)),
            (100, 100),
            "{engine:?}\n{d}"
        );
    }
}
