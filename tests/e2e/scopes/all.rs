//! `--all`: every process on the host, each counted as a trace of it
//! alone counts it; the stacks of processes gone freed; snapshots; mtrace
//! killed leaves nothing on the host. These tests run alone
//! (`support::require_bpf_alone`).

use std::{path::Path, time::Duration};

use crate::support::{
    longrun::sigkilled_mtrace_leaves_no_breakpoints_in,
    scopes::{assert_tally_eq, tally},
    Fixture, Mtrace, LINE_TIMEOUT,
};

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
    assert_tally_eq(
        &of(direct, "counts"),
        &counts_alone,
        &format!("counts (pid {direct})\n{d}"),
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
    assert_tally_eq(
        &of(children[0] as u32, "counts"),
        &counts_alone,
        &format!("counts from a shell (pid {})\n{d}", children[0]),
    );
    assert_tally_eq(
        &of(cxx_pid, "cxx"),
        &cxx_alone,
        &format!("cxx (pid {cxx_pid})\n{}\n{d}", p.doc["meta"]["processes"]),
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
/// read: the kernel's stack map, smaller here (`--stack-map-size 600`:
/// 1,200 stacks for the host) than the stacks of all the programs run (14
/// copies of the manystacks fixture, each its own file, 100 stacks each),
/// holds each program's stacks whole when it runs, three at a time, with
/// time between them to read the last ones' rows. (The room beyond the
/// programs' 300 is for the other processes on the host, which keep
/// theirs while they live: a CI run's shells and test binary filled 280
/// in one run, over 500 in another.)
#[test]
fn all_frees_the_stacks_of_processes_gone() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("p.json");
    // Built before the trace: the compiler's own stacks would fill the
    // small map.
    let fixture = Fixture::ManyStacks.path();
    let mut m = Mtrace::start(&[
        "--all",
        "--per-process",
        "--stack-map-size",
        "600",
        "-o",
        json.to_str().unwrap(),
    ]);
    m.wait_tracing();
    let mut pids = Vec::new();
    for i in 0..14 {
        let copy = dir.path().join(format!("manystacks-{i}"));
        std::fs::copy(fixture, &copy).unwrap();
        let mut child = std::process::Command::new(&copy)
            .arg("100")
            .spawn()
            .unwrap();
        pids.push(child.id());
        assert!(child.wait().unwrap().success());
        if i % 3 == 2 {
            // Read for good at the next look for processes gone, and
            // their stacks taken out at the look after (5 s apart).
            std::thread::sleep(Duration::from_secs(11));
        }
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
