//! Trees of programs run one after the other by a shell: under a low
//! limit of open files, the BPF object loaded once and reused, the unwind
//! rules learned once and given to the next process.

use crate::support::{
    counts::assert_counts_sites_times, profile::processes, run_profiled, Fixture, Profile,
};

/// A tree of 30 programs one after the other under a soft limit of 256
/// open files (a shell's usual is 1,024): each traced program holds 20 to
/// 50 descriptors until the trace ends, so mtrace raises its own soft
/// limit to the hard one. Every program is traced and counted exactly, and the
/// command runs with the limit it was given.
#[test]
fn a_low_limit_of_open_files_does_not_stop_a_tree() {
    use std::os::unix::process::CommandExt;
    need_bpf!();
    const RUNS: u64 = 30;
    let script = format!("ulimit -n; {}", counts_runs(RUNS));
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("p.json");
    let mut cmd = crate::support::mtrace::mtrace_command(&[
        "--top",
        "0",
        "-o",
        json.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        &script,
    ]);
    unsafe {
        cmd.pre_exec(|| {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
            limit.rlim_cur = 256;
            if limit.rlim_max < 4096 {
                limit.rlim_max = 4096;
            }
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = crate::support::Mtrace::spawn(&mut cmd).finish();
    out.assert_exit(0);
    let d = out.describe();
    assert_eq!(out.stdout.lines().next(), Some("256"), "{d}");
    let p = Profile::load(&json);
    assert_runs_traced(&p, RUNS, &d);
}

/// A shell loop that runs the counts fixture `runs` times, one after the
/// other.
fn counts_runs(runs: u64) -> String {
    format!(
        "i=0; while [ $i -lt {runs} ]; do {}; i=$((i + 1)); done",
        Fixture::Counts.path_str()
    )
}

/// A shell's loop of `runs` runs of the counts fixture: the shell and
/// every run traced, every site the runs times one run's.
fn assert_runs_traced(p: &Profile, runs: u64, d: &str) {
    let procs = processes(p);
    assert_eq!(procs.len() as u64, runs + 1, "{procs:?}\n{d}");
    assert!(procs.iter().all(|e| e.3), "every program traced: {procs:?}");
    assert_counts_sites_times(p, runs, d);
}

/// A tree of programs one after the other, counted and live: the BPF
/// object loaded for the first serves the rest, emptied in between (a load
/// is the verifier's work on every program), and each program's counts are
/// its own: every run counts exactly what every other did, and the sites
/// the runs times one run's.
#[test]
fn a_tree_reuses_loaded_objects_and_counts_each_program_once() {
    need_bpf!();
    const RUNS: u64 = 12;
    let script = counts_runs(RUNS);
    for mode in [&[][..], &["--live"][..]] {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("p.json");
        let mut args = vec!["-v", "--per-process", "--top", "0"];
        args.extend(mode);
        args.extend(["-o", json.to_str().unwrap(), "--", "sh", "-c", &script]);
        let mut cmd = crate::support::mtrace::mtrace_command(&args);
        let out = crate::support::Mtrace::spawn(&mut cmd).finish();
        out.assert_exit(0);
        let d = out.describe();
        let p = Profile::load(&json);
        assert_runs_traced(&p, RUNS, &d);
        let mut per_run: std::collections::BTreeMap<u32, u64> = Default::default();
        for s in p.allocs() {
            let process = s.process.as_ref().expect("a process on every row");
            if process.name == "counts" {
                *per_run.entry(process.pid).or_default() += s.calls;
            }
        }
        assert_eq!(per_run.len() as u64, RUNS, "{per_run:?}\n{d}");
        let first = per_run.values().next().copied();
        assert!(
            per_run.values().all(|c| Some(*c) == first),
            "every run counts the same: {per_run:?}\n{d}"
        );
        let said = |how: &str| {
            out.stderr
                .iter()
                .filter(|l| l.contains(&format!("BPF object {how} and")))
                .count() as u64
        };
        // The shell's own and the first program's; the rest reuse them.
        assert!(said("loaded") <= 3, "{d}");
        assert_eq!(said("loaded") + said("reused"), RUNS + 1, "{d}");
        assert_eq!(
            p.doc["stack_quality"]["whole"], p.doc["stack_quality"]["calls"],
            "{d}"
        );
    }
}

/// The unwind rules one process of a tree learned (a walk through code
/// without a rule yet is handed to the tracer, which finishes it and adds
/// the rules it used) are given to the next process that maps the same
/// files, before its first call: every run of a program after the first
/// starts with the rules the first learned, and every stack stays whole.
#[test]
fn a_tree_learns_unwind_rules_once() {
    need_bpf!();
    const RUNS: u64 = 6;
    let script = counts_runs(RUNS);
    let (out, p) = run_profiled(&["-v", "--top", "0", "--", "sh", "-c", &script]);
    out.assert_exit(0);
    let d = out.describe();
    assert_runs_traced(&p, RUNS, &d);
    let q = &p.doc["stack_quality"];
    assert_eq!(q["whole"], q["calls"], "{d}");
    // "unwind: pid N given M rules learned before", for each process.
    let given: Vec<u64> = out
        .stderr
        .iter()
        .filter_map(|l| l.split(" given ").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    // The root learns alone; each run of the program after the first is
    // given at least the rules of the program's own code.
    let seeded = given.iter().filter(|n| **n >= 10).count() as u64;
    assert!(seeded >= RUNS - 1, "given {given:?}\n{d}");
}
