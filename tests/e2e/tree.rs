//! Process trees. Launch mode follows every process the command starts
//! (fork, vfork through posix_spawn, exec of another program, a static
//! one included), to any depth, counted exactly from its first
//! instruction, each symbolized with its own mappings.
//! `runs` holds trees of programs run one after the other.

mod runs;

use std::collections::BTreeSet;

use crate::{
    support::counts::{assert_counts_sites, COUNTS_SITES},
    support::{
        diff::DiffOut, profile::processes, run_profiled, table::Processes, trace_by_pid, Finished,
        Fixture, FixtureProc, Profile,
    },
};

/// tree.c's own sites: (function, caller, calls, bytes).
const TREE_SITES: &[(&str, &str, u64, u64)] = &[
    ("malloc", "root_work", 100, 1100),
    ("malloc", "child_work", 1000, 22000),
    ("malloc", "grandchild_work", 10, 330),
];

/// `mtrace ARGS --top 0 -o P -- tree counts counts-static`, exit 0.
fn trace_tree(args: &[&str]) -> (Finished, Profile) {
    let mut all = args.to_vec();
    all.extend([
        "--top",
        "0",
        "--",
        Fixture::Tree.path_str(),
        Fixture::Counts.path_str(),
        Fixture::CountsStatic.path_str(),
    ]);
    let (out, p) = run_profiled(&all);
    out.assert_exit(0);
    (out, p)
}

/// Every site of tree.c exact, and every site of the counts fixture
/// `times` times over (it runs spawned, and exec'd statically linked).
fn assert_tree_sites(p: &Profile, d: &str, times: u64) {
    for &(func, caller, calls, bytes) in TREE_SITES {
        assert_eq!(p.site(func, caller), (calls, bytes), "{caller}\n{d}");
    }
    for &(func, caller, calls, bytes) in COUNTS_SITES {
        // glibc's `aligned_alloc/memalign` (one function) is two in a
        // static glibc without the alias.
        let mut names = vec![func];
        if func.contains('/') {
            names.extend(func.split('/'));
        }
        let got = names
            .iter()
            .map(|f| p.site(f, caller))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        assert_eq!(
            got,
            (calls * times, bytes * times),
            "{func} from {caller}\n{d}"
        );
    }
}

/// `--file-wide`: every process of the tree is named with its parent,
/// those gone before mtrace read `/proc` too (the kernel names the parent
/// with the process's first row), and every site is exact.
#[test]
fn a_tree_traced_file_wide_names_each_process_and_its_parent() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let (out, p) = trace_tree(&["--file-wide"]);
    let d = out.describe();
    assert_tree_sites(&p, &d, 2);
    let procs = processes(&p);
    let root = p.pid() as u64;
    assert_eq!(procs[0].0, root, "{procs:?}\n{d}");
    assert!(procs.iter().all(|e| e.1 != 0), "{procs:?}\n{d}");
    let parents: BTreeSet<u64> = procs.iter().map(|e| e.1).collect();
    assert!(
        procs.iter().any(|e| e.1 == root && parents.contains(&e.0)),
        "three generations: {procs:?}\n{d}"
    );
}

#[test]
fn every_process_of_the_tree_is_counted_exactly() {
    need_bpf!();
    let (out, p) = trace_tree(&[]);
    let d = out.describe();
    assert_tree_sites(&p, &d, 2);
    let procs = processes(&p);
    // The root, the child that exits at once, child A and its child, the
    // spawned program and the forked child that execs.
    assert_eq!(procs.len(), 6, "{procs:?}\n{d}");
    let root = p.pid() as u64;
    assert_eq!(procs[0].0, root, "{procs:?}");
    assert!(procs.iter().all(|e| e.3), "every process traced: {procs:?}");
    assert!(
        procs[1..].iter().all(|e| e.4 == Some(0)),
        "every child exited 0 during the trace: {procs:?}"
    );
    let names: BTreeSet<&str> = procs.iter().map(|e| e.2.as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from(["tree", "counts", "counts-static"]),
        "{procs:?}"
    );
    // The grandchild's parent is a child of the root.
    let parents: BTreeSet<u64> = procs.iter().map(|e| e.1).collect();
    assert!(
        procs.iter().any(|e| e.1 == root && parents.contains(&e.0)),
        "three generations: {procs:?}"
    );
    assert_eq!(
        out.report().processes,
        Some(Processes {
            traced: 6,
            exited: 6,
            not_traced: 0,
            allocated: None,
        }),
        "{d}"
    );
    // Each process's stacks reach its first frame, symbolized with its
    // own mappings.
    for caller in ["child_work", "grandchild_work", "alloc_small"] {
        for st in p.stacks_at("malloc", caller) {
            assert_eq!(st.names().last().copied(), Some("_start"), "{st:?}\n{d}");
        }
    }
}

#[test]
fn per_process_rows_name_their_process() {
    need_bpf!();
    rows_name_their_process(&[]);
}

/// The same on the host's engine (`--file-wide`, alone): a forked child
/// gone before mtrace read `/proc` is named with its parent's program,
/// command line and cgroup.
#[test]
fn per_process_rows_name_their_process_file_wide() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    rows_name_their_process(&["--file-wide"]);
}

/// Each row of the tree under its process, by `engine`.
fn rows_name_their_process(engine: &[&str]) {
    let mut args = engine.to_vec();
    args.push("--per-process");
    let (out, p) = trace_tree(&args);
    let d = format!("{engine:?}\n{}", out.describe());
    assert_tree_sites(&p, &d, 2);
    let procs = processes(&p);
    let root = p.pid();
    let process_of = |caller: &str| {
        let rows = p.stacks_at("malloc", caller);
        assert_eq!(rows.len(), 1, "{caller}: one row\n{d}");
        rows[0].process.clone().expect("a process on every row")
    };
    let r = process_of("root_work");
    assert_eq!((r.pid, r.name.as_str()), (root, "tree"), "{d}");
    let a = process_of("child_work");
    let g = process_of("grandchild_work");
    assert!(a.pid != root && g.pid != root && a.pid != g.pid, "{d}");
    assert!(
        procs
            .iter()
            .any(|e| e.0 == a.pid as u64 && e.1 == root as u64),
        "child_work runs in a child of the root: {procs:?}"
    );
    assert!(
        procs
            .iter()
            .any(|e| e.0 == g.pid as u64 && e.1 == a.pid as u64),
        "grandchild_work runs in a child of child_work's process: {procs:?}"
    );
    // The processes that allocated, by calls, each with its executable and
    // cgroup (this test's own).
    let report = out.report();
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let cgroup = cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_default();
    let line_of = |pid: u32| {
        report
            .by_process
            .iter()
            .find(|l| l.contains(&format!(" (pid {pid}): ")))
            .unwrap_or_else(|| panic!("no by-process line of pid {pid}\n{d}"))
    };
    for pid in [root, a.pid, g.pid] {
        let l = line_of(pid);
        assert!(l.starts_with("tree (pid "), "{l}\n{d}");
        assert!(l.contains(Fixture::Tree.path_str()), "{l}\n{d}");
        if !cgroup.is_empty() {
            assert!(l.ends_with(&format!(", cgroup {cgroup}")), "{l}\n{d}");
        }
    }
    // The counts fixture ran twice, as two programs: two rows.
    let names: BTreeSet<String> = p
        .stacks_at("malloc", "alloc_small")
        .iter()
        .map(|s| s.process.as_ref().unwrap().name.clone())
        .collect();
    assert_eq!(
        names,
        BTreeSet::from(["counts".to_string(), "counts-static".to_string()]),
        "{d}"
    );
    assert!(
        out.report()
            .rows
            .iter()
            .any(|r| r.process == Some(("tree".to_string(), a.pid))),
        "{d}"
    );
}

#[test]
fn no_follow_traces_the_command_alone() {
    need_bpf!();
    let (out, p) = trace_tree(&["--no-follow"]);
    let d = out.describe();
    assert_eq!(p.site("malloc", "root_work"), (100, 1100), "{d}");
    for caller in ["child_work", "grandchild_work", "alloc_small"] {
        assert_eq!(p.site("malloc", caller), (0, 0), "{caller}\n{d}");
    }
    assert!(processes(&p).is_empty(), "{d}");
}

#[test]
fn live_mode_keeps_each_process_blocks_apart() {
    need_bpf!();
    let (out, p) = trace_tree(&["--live"]);
    let d = out.describe();
    assert_tree_sites(&p, &d, 2);
    // (caller, blocks left, bytes left): child_work leaks 5 blocks of 22
    // bytes; the others free all. A fork copies the heap, so parent and
    // child hand out the same addresses: kept apart, no block is lost or
    // freed twice.
    for (caller, left, left_bytes) in [
        ("root_work", 0, 0),
        ("child_work", 5, 110),
        ("grandchild_work", 0, 0),
    ] {
        let rows = p.stacks_at("malloc", caller);
        let live = rows[0].live.as_ref().expect("live stats");
        assert_eq!(
            (
                live["outstanding"].as_u64(),
                live["outstanding_bytes"].as_u64()
            ),
            (Some(left), Some(left_bytes)),
            "{caller}\n{d}"
        );
    }
}

#[test]
fn a_pipeline_in_a_shell_is_followed() {
    need_bpf!();
    let script = format!("{} | cat >/dev/null", Fixture::Counts.path_str());
    let (out, p) = run_profiled(&["--top", "0", "--", "sh", "-c", &script]);
    out.assert_exit(0);
    let d = out.describe();
    assert_counts_sites(&p, &d);
}

#[test]
fn processes_beyond_the_limit_are_named_not_dropped_silently() {
    need_bpf!();
    let (out, p) = trace_tree(&["--max-processes", "1"]);
    let d = out.describe();
    // The root alone is probed: its calls exact, nobody else's.
    assert_eq!(p.site("malloc", "root_work"), (100, 1100), "{d}");
    assert_eq!(p.site("malloc", "child_work"), (0, 0), "{d}");
    let procs = processes(&p);
    assert_eq!(procs.len(), 6, "{procs:?}");
    assert!(procs[0].3 && procs[1..].iter().all(|e| !e.3), "{procs:?}");
    let r = out.report();
    assert_eq!(
        r.processes.map(|p| (p.traced, p.not_traced)),
        Some((1, 5)),
        "{d}"
    );
    assert!(
        r.not_traced
            .iter()
            .any(|l| l.contains("more than 1 process at once")),
        "{d}"
    );
}

/// A burst of 5,000 processes that cannot be traced (tests/fixtures/
/// forkmany.c, `--max-processes 1`): mtrace keeps 4,096 records of the
/// tree and counts the rest, and the root's count stays exact.
#[test]
fn a_burst_of_processes_is_counted_within_bounded_records() {
    need_bpf!();
    let forkmany = crate::support::fixtures::compile_c(
        "forkmany",
        "forkmany",
        &["-O2", "-fno-omit-frame-pointer", "-g"],
        &[],
    );
    let n = 5000;
    let (out, p) = run_profiled(&[
        "--max-processes",
        "1",
        "--top",
        "0",
        "--",
        forkmany.to_str().unwrap(),
        &n.to_string(),
    ]);
    out.assert_exit(0);
    let d = out.describe();
    assert!(out.stdout.contains(&format!("forked={n}")), "{d}");
    assert_eq!(p.site("malloc", "forkmany_site"), (1, 64), "{d}");
    let listed = p.doc["meta"]["processes"].as_array().unwrap().len() as u64;
    let unlisted = p.doc["meta"]["processes_unlisted"].as_u64().unwrap_or(0);
    assert_eq!(listed, 4096, "{d}");
    assert_eq!(listed + unlisted, n + 1, "every process counted");
    // The report names a few of the untraced and counts them all.
    let r = out.report();
    assert_eq!(
        r.processes,
        Some(Processes {
            traced: 1,
            exited: 1,
            not_traced: n,
            allocated: None,
        }),
        "{d}"
    );
    let named = r
        .not_traced
        .iter()
        .filter(|l| l.starts_with("forkmany"))
        .count();
    assert_eq!(named, 10, "{d}");
    let more = format!(
        "{} more ({} listed in the JSON profile)",
        n - 10,
        listed - 1 - 10
    );
    assert!(r.not_traced.contains(&more), "{d}");
}

/// workers.c's sites: (caller, calls, bytes), the parent's first.
const WORKER_SITES: &[(&str, u64, u64)] = &[
    ("parent_work", 50, 3300),
    ("existing_work", 300, 13200),
    ("existing_grandchild_work", 7, 539),
    ("new_work", 200, 11000),
];

#[test]
fn by_pid_children_present_and_to_come_are_traced() {
    need_bpf!();
    let mut fx = FixtureProc::start(Fixture::Workers.path(), &[]);
    let (out, p) = trace_by_pid(&mut fx, &["--children", "--top", "0"]);
    let d = out.describe();
    for &(caller, calls, bytes) in WORKER_SITES {
        assert_eq!(p.site("malloc", caller), (calls, bytes), "{caller}\n{d}");
    }
    let procs = processes(&p);
    // The target, its worker and the worker's child from before mtrace,
    // and the worker it forks while traced.
    assert_eq!(procs.len(), 4, "{procs:?}\n{d}");
    assert!(procs.iter().all(|e| e.3), "every process traced: {procs:?}");
}

#[test]
fn by_pid_without_children_traces_the_target_alone() {
    need_bpf!();
    let mut fx = FixtureProc::start(Fixture::Workers.path(), &[]);
    let (out, p) = trace_by_pid(&mut fx, &["--top", "0"]);
    let d = out.describe();
    assert_eq!(p.site("malloc", "parent_work"), (50, 3300), "{d}");
    for &(caller, _, _) in &WORKER_SITES[1..] {
        assert_eq!(p.site("malloc", caller), (0, 0), "{caller}\n{d}");
    }
    assert!(processes(&p).is_empty(), "{d}");
}

/// Split per process, the folded stacks are rooted at each process (name
/// and pid), and two runs of the same tree (other pids) diff as equal: the
/// gate matches processes by name, not pid.
#[test]
fn per_process_folded_roots_and_a_diff_across_pids() {
    let dir = bpf_tempdir!();
    let mut runs = Vec::new();
    for name in ["a", "b"] {
        let json = dir.path().join(format!("{name}.json"));
        let folded = dir.path().join(format!("{name}.folded"));
        let mut args = vec!["--per-process", "--folded", folded.to_str().unwrap()];
        args.extend(["-o", json.to_str().unwrap(), "--top", "0", "--"]);
        args.extend([
            Fixture::Tree.path_str(),
            Fixture::Counts.path_str(),
            Fixture::CountsStatic.path_str(),
        ]);
        let out = crate::support::run_mtrace(&args);
        out.assert_exit(0);
        let p = Profile::load(&json);
        let text = std::fs::read_to_string(&folded).unwrap();
        // Every line starts at its process; child_work's 1000 calls under
        // the child's pid.
        let child = p.stacks_at("malloc", "child_work")[0]
            .process
            .clone()
            .unwrap();
        let root = format!("{}-{};", child.name, child.pid);
        let child_calls: u64 = text
            .lines()
            .filter(|l| l.starts_with(&root) && l.contains(";child_work;"))
            .map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap())
            .sum();
        assert_eq!(child_calls, 1000, "{text}");
        assert!(
            text.lines()
                .all(|l| l.starts_with("tree-") || l.starts_with("counts-")),
            "{text}"
        );
        runs.push((json, child.pid));
    }
    assert_ne!(runs[0].1, runs[1].1, "the two runs' children share a pid");
    let out = crate::support::run_mtrace(&[
        "diff",
        runs[0].0.to_str().unwrap(),
        runs[1].0.to_str().unwrap(),
        "--per-stack",
        "--fail-if",
        "calls>+0%",
    ]);
    out.assert_exit(0);
    assert!(
        DiffOut::parse(&out.stdout).no_stack_changed,
        "{}",
        out.describe()
    );
}

/// A daemon that forks away (a double fork: the command's child starts
/// a grandchild in the background and exits, and so does the command)
/// is traced until it exits, from its first instruction; mtrace says
/// why it goes on after the command, and exits with the command's status.
#[test]
fn a_daemon_that_forks_away_is_traced_until_it_is_gone() {
    need_bpf!();
    daemon_traced_until_gone(&[]);
}

/// The same on the host engine (`--file-wide -- CMD`).
#[test]
fn a_daemon_that_forks_away_is_traced_file_wide_until_it_is_gone() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    daemon_traced_until_gone(&["--file-wide"]);
}

fn daemon_traced_until_gone(engine: &[&str]) {
    let script = format!(
        "( (sleep 0.3; exec {} >/dev/null) & ); exit 3",
        Fixture::Counts.path_str()
    );
    let mut args = engine.to_vec();
    args.extend(["--top", "0", "--", "sh", "-c", &script]);
    let (out, p) = run_profiled(&args);
    out.assert_exit(3);
    let d = out.describe();
    assert!(
        out.stderr
            .iter()
            .any(|l| l.starts_with("mtrace: the command exited with status 3; tracing the ")),
        "{d}"
    );
    assert!(
        out.stderr
            .iter()
            .any(|l| l.ends_with(": the target exited with status 3")),
        "{d}"
    );
    assert_counts_sites(&p, &d);
    let procs = processes(&p);
    assert!(
        procs.iter().any(|e| e.2 == "counts" && e.3),
        "the daemon traced: {procs:?}"
    );
}

/// A short program's burst of new code on the host engine (sqlite3, 3,000
/// inserts in about 20 ms, 9,578 calls): every walk the kernel hands over
/// finds room in the ring, so every stack is whole, run after run, as on
/// the per-process engine (a ring of 16 MiB lost 4-26% of them in four
/// runs of five).
#[test]
fn a_burst_of_new_code_keeps_whole_stacks_file_wide() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let sql = "create table t(a integer primary key, b text); with recursive c(x) as \
               (select 1 union all select x + 1 from c where x < 3000) \
               insert into t select x, hex(randomblob(20)) from c;";
    for run in 0..3 {
        let (out, p) = run_profiled(&["--file-wide", "--", "sqlite3", ":memory:", sql]);
        out.assert_exit(0);
        let q = &p.doc["stack_quality"];
        assert!(
            q["calls"].as_u64().is_some_and(|n| n > 9000) && q["whole"] == q["calls"],
            "run {run}: {q}\n{}",
            out.describe()
        );
    }
}
