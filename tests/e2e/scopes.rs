//! Scopes beyond one process: `--cgroup` (every process of a cgroup v2
//! directory, present and to come, and none outside it).

use std::{
    collections::BTreeMap,
    path::Path,
    time::{Duration, Instant},
};

use crate::{
    support::counts::assert_counts_sites_times,
    support::{
        cgroup::TestCgroup,
        longrun::{sigkilled_mtrace_leaves_no_breakpoints_in, Longrun},
        Fixture, Mtrace, LINE_TIMEOUT,
    },
};

/// Waits until process `pid` is in the cgroup.
fn wait_in(cg: &TestCgroup, pid: u32) {
    while !std::fs::read_to_string(cg.dir.join("cgroup.procs"))
        .unwrap()
        .lines()
        .any(|l| l == pid.to_string())
    {
        std::thread::sleep(Duration::from_millis(10));
    }
}

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
    wait_in(&cg, member.id());
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
    wait_in(&cg, joiner.id());
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

/// (allocator function, its whole stack: the frames' functions, files and
/// lines, innermost first, and whether it was cut short) -> calls of the
/// allocation stacks of a profile, of the processes `keep` takes (pid,
/// name).
fn tally(
    p: &crate::support::Profile,
    keep: &dyn Fn(u64, &str) -> bool,
) -> BTreeMap<(String, String), u64> {
    let mut out = BTreeMap::new();
    for s in p.allocs() {
        let (pid, name) = s
            .process
            .as_ref()
            .map_or((0, ""), |r| (r.pid as u64, r.name.as_str()));
        if keep(pid, name) {
            let frames: Vec<String> = s
                .frames
                .iter()
                .map(|f| format!("{} {:?}:{:?}", f.function, f.file, f.line))
                .collect();
            let stack = format!("{} cut:{}", frames.join(" <- "), s.truncated);
            *out.entry((s.function.clone(), stack)).or_default() += s.calls;
        }
    }
    out
}

/// `--all`: processes the test starts while mtrace runs, none of them
/// through mtrace (the counts fixture directly and from a shell that
/// forks and execs it, C++ -O2 without frame pointers) are each counted
/// under their pid exactly as a trace of that program alone counts it,
/// per function and whole stack, frame for frame to the thread's first
/// (rules by file and offset, learned in one process, serve the next),
/// and what the shell's child ran before its exec is not theirs. A static program, whose allocator no
/// process mapped before, has its probes added once seen, and stderr
/// says its calls before then are not counted.
#[test]
fn all_counts_every_process_as_a_trace_of_it_alone_would() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let counts = Fixture::Counts.path_str();
    let counts_static = Fixture::CountsStatic.path_str();
    let cxx = crate::support::unwind::CXX.objects()[0].clone();
    let cxx = cxx.to_str().unwrap();
    // The oracle: each program traced alone from its first instruction.
    let alone = |program: &str| {
        let (out, p) = crate::support::run_profiled(&["--", program]);
        out.assert_exit(0);
        tally(&p, &|_, _| true)
    };
    let (counts_alone, cxx_alone) = (alone(counts), alone(cxx));
    assert!(
        counts_alone.values().sum::<u64>() >= 1281,
        "{counts_alone:?}"
    );
    // Whole stacks, to the thread's first frame, through main.
    for alone in [&counts_alone, &cxx_alone] {
        assert!(
            alone.keys().all(|(_, s)| s.ends_with("cut:false")),
            "{alone:#?}"
        );
        assert!(alone.keys().any(|(_, s)| s.contains("main ")), "{alone:#?}");
    }

    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("p.json");
    let mut m = Mtrace::start(&["--all", "--per-process", "-o", json.to_str().unwrap()]);
    m.wait_tracing();
    let run = |argv: &[&str]| {
        let mut c = std::process::Command::new(argv[0]);
        c.args(&argv[1..]).stdout(std::process::Stdio::null());
        let mut child = c.spawn().unwrap();
        let pid = child.id();
        assert!(child.wait().unwrap().success(), "{argv:?}");
        pid
    };
    // A first run of each program: the rules its walks need, by file and
    // offset, serve every later run from its first call. (mtrace learns
    // them from the walks it finishes, within milliseconds; a walk of a
    // process gone before mtrace took it up is counted under its caller
    // and cut short, `process_gone`, as a program of a few milliseconds'
    // first run may be.)
    // Two rounds: a frame whose rule was missing is learned from a gone
    // process's file, and the frames above it may each need a run more on
    // a loaded machine.
    let mut first = Vec::new();
    for _ in 0..2 {
        first.extend([run(&[counts]), run(&[cxx])]);
        std::thread::sleep(Duration::from_millis(300));
    }
    let direct = run(&[counts]);
    run(&["sh", "-c", &format!("{counts}; exit 0")]);
    let cxx_pid = run(&[cxx]);
    let static_pid = run(&[counts_static]);
    std::thread::sleep(Duration::from_millis(600));
    m.proc.signal(libc::SIGINT);
    let out = m.finish();
    out.assert_exit(0);
    let d = out.describe();
    let p = crate::support::Profile::load(&json);
    assert_eq!(p.doc["meta"]["scope"], "host", "{d}");

    let of = |pid: u32, name: &'static str| tally(&p, &move |p, n| p == pid as u64 && n == name);
    assert_eq!(
        of(direct, "counts"),
        counts_alone,
        "counts (pid {direct})\n{d}"
    );
    // The shell's child is the counts fixture once it exec'd (its only
    // other run), and no call before that is counted as the fixture's.
    let children: Vec<u64> = p.doc["meta"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            e["name"] == "counts" && e["pid"] != direct && !first.iter().any(|&f| e["pid"] == f)
        })
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(children.len(), 1, "the shell's counts child\n{d}");
    assert_eq!(
        of(children[0] as u32, "counts"),
        counts_alone,
        "counts from a shell (pid {})\n{d}",
        children[0]
    );
    assert_eq!(
        of(cxx_pid, "cxx"),
        cxx_alone,
        "cxx (pid {cxx_pid})\n{}\n{d}",
        p.doc["meta"]["processes"]
    );
    // The static program: said, and never more than it made.
    assert!(
        out.stderr.iter().any(|l| l.contains(&format!(
            " after pid {static_pid} started it: its calls before then are not counted"
        ))),
        "{d}"
    );
    let static_calls: u64 = of(static_pid, "counts-static").values().sum();
    assert!(static_calls <= counts_alone.values().sum::<u64>(), "{d}");
}

/// `--all` keeps the stacks of processes gone only until their rows are
/// read: the kernel's stack map, far smaller here (`--stack-map-size
/// 128`: 256 stacks for the host) than the stacks of all the programs run
/// (four copies of the manystacks fixture, each its own file, 100 stacks
/// each), holds each program's stacks whole when it runs, one after the
/// other, with time between them to read the last one's rows.
#[test]
fn all_frees_the_stacks_of_processes_gone() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("p.json");
    let mut m = Mtrace::start(&[
        "--all",
        "--per-process",
        "--stack-map-size",
        "128",
        "-o",
        json.to_str().unwrap(),
    ]);
    m.wait_tracing();
    let mut pids = Vec::new();
    for i in 0..4 {
        let copy = dir.path().join(format!("manystacks-{i}"));
        std::fs::copy(Fixture::ManyStacks.path(), &copy).unwrap();
        let mut child = std::process::Command::new(&copy)
            .arg("100")
            .spawn()
            .unwrap();
        pids.push(child.id());
        assert!(child.wait().unwrap().success());
        // Read for good at the next look for processes gone, and its
        // stacks taken out at the look after (5 s apart).
        std::thread::sleep(Duration::from_secs(11));
    }
    m.proc.signal(libc::SIGINT);
    let out = m.finish();
    out.assert_exit(0);
    let d = out.describe();
    let p = crate::support::Profile::load(&json);
    for (i, pid) in pids.into_iter().enumerate() {
        let name = format!("manystacks-{i}");
        let ran = tally(&p, &|of, n| of == pid as u64 && n == name);
        let whole = ran
            .iter()
            .filter(|((_, s), _)| s.contains(" <- main ") && s.ends_with("cut:false"))
            .count();
        assert_eq!(
            (ran.values().sum::<u64>(), whole),
            (100, 100),
            "{name} (pid {pid}): {ran:#?}\n{d}"
        );
    }
}

/// mtrace --all killed with SIGKILL leaves no breakpoint in a process it
/// probed, and no program of its in the kernel.
#[test]
fn sigkilled_mtrace_leaves_nothing_on_the_host() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    sigkilled_mtrace_leaves_no_breakpoints_in(&|_| vec!["--all".into()]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let left = || {
        aya::programs::loaded_programs()
            .filter_map(Result::ok)
            .filter(|p| p.name_as_str() == Some("host_alloc"))
            .count()
    };
    while left() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(left(), 0, "host_alloc programs left in the kernel");
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

/// `--all --interval 1`: snapshots of the host while it traces
/// (`mtrace-all-NNNN.json`, as a trace by pid writes `mtrace-PID-NNNN`),
/// and one more on SIGUSR1, holding a program that ran before it with
/// its whole stacks. (The host scope wrote none, silently.)
#[test]
fn all_writes_snapshots_at_intervals_and_on_sigusr1() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let counts = Fixture::Counts.path_str();
    let dir = tempfile::tempdir().unwrap();
    let mut m = Mtrace::start(&[
        "--all",
        "--interval",
        "1",
        "--snapshot-dir",
        dir.path().to_str().unwrap(),
    ]);
    m.wait_tracing();
    let snapshot = |l: &str| l.starts_with("mtrace: wrote snapshot to ");
    // One at an interval, then one asked for once the program has run.
    m.stderr.wait_for(snapshot, LINE_TIMEOUT);
    let mut child = std::process::Command::new(counts)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    assert!(child.wait().unwrap().success());
    std::thread::sleep(Duration::from_millis(300));
    unsafe { libc::kill(m.proc.id() as i32, libc::SIGUSR1) };
    let line = m.stderr.wait_for(snapshot, LINE_TIMEOUT);
    m.proc.signal(libc::SIGINT);
    let out = m.finish();
    out.assert_exit(0);
    let path = Path::new(line.rsplit(' ').next().unwrap());
    let name = path.file_name().unwrap().to_str().unwrap();
    assert!(
        name.starts_with("mtrace-all-") && path.starts_with(dir.path()),
        "{line}"
    );
    let p = crate::support::Profile::load(path);
    let ran = tally(&p, &|of, n| of == pid as u64 && n == "counts");
    assert_eq!(
        ran.values().sum::<u64>(),
        1281,
        "{ran:#?}\n{}",
        out.describe()
    );
    assert!(
        ran.keys()
            .any(|(_, s)| s.contains("main ") && s.ends_with("cut:false")),
        "{ran:#?}"
    );
}

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

/// A run traced file-wide against the same program traced alone: the
/// same calls per function and direct caller, and every whole stack one
/// the trace alone has, frame for frame. (A first run's walk that met a
/// frame without a rule yet, its process gone before mtrace read its
/// mappings, is cut short there, and said: `process_gone`.)
fn assert_same_as_alone(
    run: &BTreeMap<(String, String), u64>,
    alone: &BTreeMap<(String, String), u64>,
    d: &str,
) {
    let sites = |t: &BTreeMap<(String, String), u64>| {
        let mut out: BTreeMap<(String, String), u64> = BTreeMap::new();
        for ((f, stack), calls) in t {
            let caller = stack.split(" <- ").next().unwrap_or("");
            let caller = caller.split(" cut:").next().unwrap_or("").to_string();
            *out.entry((f.clone(), caller)).or_default() += calls;
        }
        out
    };
    assert_eq!(sites(run), sites(alone), "{d}");
    for ((f, stack), _) in run.iter().filter(|((_, s), _)| s.ends_with("cut:false")) {
        assert!(
            alone.contains_key(&(f.clone(), stack.clone())),
            "{f} {stack}: a whole stack the trace alone has not\n{d}"
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
