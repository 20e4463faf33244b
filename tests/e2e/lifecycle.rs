//! The target's and mtrace's lives: exit status pass-through, a target
//! whose binary is gone before the report, and mtrace killed mid-trace.

use std::{
    fs,
    os::unix::process::ExitStatusExt,
    time::{Duration, Instant},
};

use crate::{
    support::counts::check_counts_profile,
    support::{
        copy_executable,
        longrun::{sigkilled_mtrace_leaves_no_breakpoints_in, Longrun},
        profile::Frame,
        Fixture, FixtureProc, Mtrace, EXIT_TIMEOUT,
    },
};

#[test]
fn launch_mode_passes_exit_status_through() {
    need_bpf!();
    let mut m = Mtrace::start_profiled(&["--top", "0", "--", Fixture::Exit7.path_str()]);
    m.wait_tracing();
    let (out, p) = m.finish();
    out.assert_exit(7);
    assert!(
        out.stderr
            .iter()
            .any(|l| l.starts_with("mtrace: tracing ended after ")
                && l.ends_with(": the target exited with status 7")),
        "the end is not explained\n{}",
        out.describe()
    );
    // The report is still printed, and the profile written.
    assert_eq!(out.report().total_calls, 1, "no report\n{}", out.describe());
    assert_eq!(p.site("malloc", "main"), (1, 64), "\n{}", p.dump());
    assert_eq!(p.total(), (1, 64));
}

#[test]
fn deleted_binary_of_exited_target_is_still_symbolized() {
    let dir = bpf_tempdir!();
    let bin = copy_executable(Fixture::Counts.path(), dir.path(), "counts-copy");
    let mut fx = FixtureProc::start(&bin, &["--wait"]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let mut m = Mtrace::start_profiled(&["--top", "0", "--pid", &pid]);
    m.wait_tracing();
    fs::remove_file(&bin).unwrap();
    fx.release();
    assert_eq!(fx.proc.wait_timeout(EXIT_TIMEOUT).code(), Some(0));
    let (out, p) = m.finish();
    out.assert_exit(0);
    // Names, not addresses, and still the exact numbers.
    assert_eq!(
        p.site("malloc", "alloc_small"),
        (1000, 48000),
        "\n{}",
        p.dump()
    );
    check_counts_profile(&p);
    // An unresolved frame would be named `counts-copy (deleted)+0x...` or
    // `[unknown 0x...]` in module `.../counts-copy (deleted)`.
    let unresolved: Vec<&Frame> = p
        .stacks
        .iter()
        .flat_map(|s| &s.frames)
        .filter(|f| {
            let in_copy = f
                .module
                .as_deref()
                .is_some_and(|m| m.contains("counts-copy"));
            let unnamed = f.function.starts_with('[') || f.function.contains("+0x");
            f.function.contains("counts-copy") || (in_copy && unnamed)
        })
        .collect();
    assert!(unresolved.is_empty(), "unresolved frames {unresolved:?}");
}

/// What tests/fixtures/longrun.c sums over `n` iterations.
#[test]
fn sigkilled_mtrace_leaves_no_breakpoints() {
    need_bpf!();
    sigkilled_mtrace_leaves_no_breakpoints_in(&|pid| vec!["--pid".into(), pid.to_string()]);
}

/// mtrace ended by `--duration`, SIGTERM or SIGINT while the target
/// allocates: a report of what was seen, exit 0, the probes gone, and the
/// target runs on to its correct end.
fn ends_cleanly(end: &str) {
    need_bpf!();
    let target = Longrun::start();
    let pid = target.fx.pid().to_string();
    let mut args = vec!["--pid", pid.as_str()];
    if end == "duration" {
        args.extend(["--duration", "0.7"]);
    }
    let mut m = Mtrace::start_profiled(&args);
    m.wait_tracing();
    assert!(target.probed(), "no probe in place while tracing");
    let mut target = target;
    target.fx.release();
    std::thread::sleep(Duration::from_millis(500));
    match end {
        "SIGTERM" => m.proc.signal(libc::SIGTERM),
        "SIGINT" => m.proc.signal(libc::SIGINT),
        _ => {}
    }
    let (out, p) = m.finish();
    out.assert_exit(0);
    let why = match end {
        "SIGTERM" => "SIGTERM received",
        "SIGINT" => "interrupted (Ctrl-C)",
        _ => "--duration 700ms elapsed",
    };
    assert!(
        out.stderr
            .iter()
            .any(|l| l.starts_with("mtrace: tracing ended after ") && l.ends_with(why)),
        "the end is not explained as {why:?}\n{}",
        out.describe()
    );
    // Every iteration calls malloc, realloc and calloc once each (and
    // free twice, not probed in count mode): the window mtrace saw holds
    // the same number of each, give or take the iteration in flight at
    // either end, and fewer than the fixture made in all.
    let (calls, _) = p.site("malloc", "main");
    let d = out.describe();
    assert!(calls > 0, "no malloc seen before the {end}\n{d}");
    for f in ["realloc", "calloc"] {
        let (n, _) = p.site(f, "main");
        assert!(calls.abs_diff(n) <= 1, "malloc {calls}, {f} {n}\n{d}");
    }
    assert_eq!(p.calls_of("free"), None, "free is not probed\n{d}");
    assert!(
        target.fx.proc.running(),
        "the target did not outlive the trace"
    );
    target.assert_restored();
    let iterations = target.finish();
    assert!(
        calls < iterations,
        "{calls} mallocs traced, {iterations} made\n{d}"
    );
}

#[test]
fn duration_ends_with_a_report_and_a_clean_detach() {
    ends_cleanly("duration");
}

#[test]
fn sigterm_ends_with_a_report_and_a_clean_detach() {
    ends_cleanly("SIGTERM");
}

#[test]
fn sigint_ends_with_a_report_and_a_clean_detach() {
    ends_cleanly("SIGINT");
}

/// By pid, attached while the target loops (each iteration: malloc,
/// realloc, calloc, then two frees): the probes go in one after the other
/// while it runs, yet every function's count starts and stops at the same
/// moment, so the counts agree to within the one iteration in flight.
/// (The target loops until told to stop, after mtrace ended: in CI on 2
/// CPUs, attaching once took longer than a 5-second loop.)
#[test]
fn counting_starts_and_stops_together_by_pid() {
    need_bpf!();
    let mut target = Longrun::start_for("stdin");
    target.fx.release();
    let pid = target.fx.pid().to_string();
    let mut m = Mtrace::start_profiled(&["--pid", &pid, "--count-frees", "--duration", "0.5"]);
    m.wait_tracing();
    let (out, p) = m.finish();
    out.assert_exit(0);
    let d = out.describe();
    let calls = |f: &str| p.calls_of(f).unwrap_or_else(|| panic!("no {f}\n{d}"));
    let (malloc, realloc, calloc, free) = (
        calls("malloc"),
        calls("realloc"),
        calls("calloc"),
        calls("free"),
    );
    assert!(malloc > 1000, "{d}");
    assert!(
        malloc.abs_diff(realloc) <= 1,
        "malloc {malloc}, realloc {realloc}\n{d}"
    );
    assert!(
        malloc.abs_diff(calloc) <= 1,
        "malloc {malloc}, calloc {calloc}\n{d}"
    );
    assert!(
        free.abs_diff(2 * malloc) <= 2,
        "malloc {malloc}, free {free}\n{d}"
    );
    target.assert_restored();
    target.finish();
}

/// By pid, a target killed by a signal: the end says so, with the
/// signal, and mtrace exits 0 (the target's end is how a trace by pid
/// normally ends).
#[test]
fn by_pid_a_target_killed_by_a_signal_is_said() {
    need_bpf!();
    let mut target = Longrun::start_for("30");
    let pid = target.fx.pid();
    let mut m = Mtrace::start(&["--top", "0", "--pid", &pid.to_string()]);
    m.wait_tracing();
    target.fx.release();
    std::thread::sleep(Duration::from_millis(200));
    target.fx.proc.signal(libc::SIGKILL);
    let out = m.finish();
    out.assert_exit(0);
    assert!(
        out.stderr
            .iter()
            .any(|l| l.starts_with("mtrace: tracing ended after ")
                && l.ends_with(": the target was killed by signal 9 (SIGKILL)")),
        "{}",
        out.describe()
    );
}

/// The target and mtrace signalled at the same moment (a process group
/// killed, a container stopped with its sidecar): the target's SIGTERM
/// reaches it every time, whatever mtrace held it with as it let go. 20
/// rounds by pid and 20 under `mtrace agent`, side by side; the order of
/// the two signals alternates, so do mtrace's signal (SIGTERM, SIGINT,
/// SIGKILL) and the target's state (allocating, or blocked in a read).
#[test]
fn a_signal_to_the_target_as_mtrace_stops_reaches_it() {
    need_bpf!();
    let by_pid = std::thread::spawn(|| signalled_together(&[]));
    let agent = std::thread::spawn(|| signalled_together(&["agent", "--listen", "127.0.0.1:0"]));
    let mut failures = by_pid.join().unwrap();
    failures.extend(agent.join().unwrap());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// 20 rounds of mtrace (`mode` and `--pid`) and its target signalled
/// together; what went wrong in each round.
fn signalled_together(mode: &[&str]) -> Vec<String> {
    let mut failures = Vec::new();
    for round in 0..20 {
        let mut target = Longrun::start_for("stdin");
        let pid = target.fx.pid();
        if round % 2 == 0 {
            target.fx.release();
        }
        let pid_arg = pid.to_string();
        let mut args = mode.to_vec();
        args.extend(["--top", "0", "--pid", &pid_arg]);
        let mut m = Mtrace::start(&args);
        m.wait_tracing();
        let mtrace = m.proc.id() as i32;
        let stop = [libc::SIGTERM, libc::SIGINT, libc::SIGKILL][round % 3];
        let both = if round % 4 < 2 {
            [(mtrace, stop), (pid as i32, libc::SIGTERM)]
        } else {
            [(pid as i32, libc::SIGTERM), (mtrace, stop)]
        };
        for (p, sig) in both {
            unsafe { libc::kill(p, sig) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while target.fx.proc.running() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let what = format!(
            "{} round {round} (mtrace sent signal {stop})",
            mode.first().unwrap_or(&"by pid")
        );
        if target.fx.proc.running() {
            failures.push(format!("{what}: the target outlived its SIGTERM"));
            target.fx.proc.signal(libc::SIGKILL);
        } else {
            let status = target.fx.proc.wait_timeout(EXIT_TIMEOUT);
            if status.signal() != Some(libc::SIGTERM) {
                failures.push(format!("{what}: the target ended with {status:?}"));
            }
        }
        let out = m.finish();
        let expected = if stop == libc::SIGKILL {
            out.status.signal() == Some(libc::SIGKILL)
        } else {
            out.status.code() == Some(0)
        };
        if !expected {
            failures.push(format!("{what}: mtrace\n{}", out.describe()));
        }
    }
    failures
}

/// A program's own SIGURG from the kernel (urgent data on a socket it
/// owns, tests/fixtures/urgent.c) under launch mode, whose BPF programs
/// stop a thread that fills the buffer of walks with the same signal from
/// the kernel: each of the program's 50 reaches its handler, on both
/// engines, and its 500 calls are counted.
#[test]
fn a_programs_own_urgent_signals_reach_it_under_launch_mode() {
    need_bpf!();
    let urgent = crate::support::fixtures::compile_c("urgent", "urgent", &["-O2", "-g"], &[]);
    for engine in [&[][..], &["--file-wide"][..]] {
        let mut args = engine.to_vec();
        args.extend(["--top", "0", "--", urgent.to_str().unwrap(), "50"]);
        let (out, p) = crate::support::run_profiled(&args);
        let d = format!("{engine:?}\n{}", out.describe());
        out.assert_exit(0);
        assert!(out.stdout.contains("urgent=50\n"), "{d}");
        let calls: u64 = p.stacks_at("malloc", "main").iter().map(|s| s.calls).sum();
        assert_eq!(calls, 500, "{d}\n{}", p.dump());
    }
}
