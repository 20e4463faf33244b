//! The agent's windows policy: probes in for part of the time and out
//! for the rest, said in what it serves; a budget bounds the time they
//! are in, for the process that pays most too, and under `--all` the
//! windows take the probes out of every process.

use std::{
    os::unix::process::CommandExt,
    process::Command,
    time::{Duration, Instant},
};

use crate::support::{self, agent::Agent, longrun::Longrun, prometheus::metric};

/// Over 6 s, every `every`: how many times longrun's allocator code had
/// a breakpoint in it, and how many times not.
fn watch_breakpoints(target: &Longrun, every: Duration) -> (u32, u32) {
    let (mut seen_in, mut seen_out) = (0, 0);
    let watching = Instant::now();
    while watching.elapsed() < Duration::from_secs(6) {
        if target.probed() {
            seen_in += 1;
        } else {
            seen_out += 1;
        }
        std::thread::sleep(every);
    }
    (seen_in, seen_out)
}

/// Stops a windows policy's agent: it exits 0, its report says how its
/// counts came about, and longrun's code is as its file has it and the
/// program runs on to its correct end.
fn stop_windows_agent(agent: Agent, target: Longrun) {
    let mut mtrace = agent.mtrace;
    mtrace.proc.signal(libc::SIGINT);
    let finished = mtrace.finish();
    finished.assert_exit(0);
    assert!(
        finished.stdout.contains("windows: probes in "),
        "{}",
        finished.stdout
    );
    target.assert_restored();
    assert!(target.finish() > 0);
}

/// The windows policy's figures in /metrics: the trace's seconds, those
/// counted, those with probes in, and the windows.
fn windows_figures(text: &str) -> (f64, f64, f64, f64) {
    let of = |name: &str| metric(text, name).unwrap_or_else(|| panic!("no {name} in {text}"));
    (
        of("mtrace_trace_seconds"),
        of("mtrace_probed_seconds_total"),
        of("mtrace_probes_in_seconds_total"),
        of("mtrace_windows_total"),
    )
}

/// The windows policy on a process that allocates in a tight loop
/// (longrun.c: one malloc, realloc and calloc per iteration), probes in
/// for 0.5 s every 2 s: the breakpoints are seen in the code and out of it
/// in turn, what is served says so, the estimates of the three functions
/// agree (each is called once per iteration), and the process runs on to
/// its correct end with no probe left once the agent stops.
#[test]
fn windows_policy_probes_part_of_the_time_and_says_so() {
    need_bpf!();
    let target = Longrun::start_for("8");
    let pid = target.fx.pid().to_string();
    let agent = Agent::start(&["--window", "0.5", "--every", "2", "--pid", &pid]);
    let mut target = target;
    target.fx.release();
    let (seen_in, seen_out) = watch_breakpoints(&target, Duration::from_millis(20));
    assert!(
        seen_in > 5 && seen_out > 5,
        "probes seen in {seen_in} times, out {seen_out} times"
    );
    let (_, text) = agent.get("/metrics");
    let (secs, probed, probes_in, windows) = windows_figures(&text);
    assert!(windows >= 3.0, "{windows} windows in {secs} s");
    // The probes are in a little longer than counted: the attaches of
    // each window before its count starts.
    assert!(
        probes_in >= probed && probes_in <= probed + 0.1 * windows,
        "probes in {probes_in} s, counted {probed} s, {windows} windows"
    );
    let share = probed / secs;
    assert!(
        (0.15..0.45).contains(&share),
        "probed {probed} s of {secs} s"
    );
    let calls = |func: &str| {
        metric(
            &text,
            &format!(
                "mtrace_allocation_calls_total{{pid=\"{pid}\",comm=\"longrun\",function=\"{func}\"}}"
            ),
        )
        .unwrap_or_else(|| panic!("no {func} row in {text}"))
    };
    let (m, r, c) = (calls("malloc"), calls("realloc"), calls("calloc"));
    for other in [r, c] {
        assert!(
            (other - m).abs() <= m * 0.01 + 2.0,
            "malloc {m}, realloc {r}, calloc {c}"
        );
    }
    assert!(text.contains("sampling=\"windows\""), "{text}");
    stop_windows_agent(agent, target);
}

/// The budget bounds the time a tight allocation loop has probes in:
/// `--budget 10` on longrun.c (every call's trap costs it many times the
/// call) keeps the probes in for about a tenth of the time, switches
/// included.
#[test]
fn windows_budget_bounds_the_time_probes_are_in() {
    need_bpf!();
    let target = Longrun::start_for("9");
    let pid = target.fx.pid().to_string();
    let agent = Agent::start(&["--window", "0.1", "--budget", "10", "--pid", &pid]);
    let mut target = target;
    target.fx.release();
    std::thread::sleep(Duration::from_secs(7));
    let (_, text) = agent.get("/metrics");
    let (secs, _, probes_in, windows) = windows_figures(&text);
    let share = probes_in / secs;
    assert!(
        (0.06..0.15).contains(&share) && windows >= 4.0,
        "probes in {probes_in} s of {secs} s, {windows} windows"
    );
    let mut mtrace = agent.mtrace;
    mtrace.proc.signal(libc::SIGINT);
    mtrace.finish().assert_exit(0);
    target.assert_restored();
    assert!(target.finish() > 0);
}

/// The windows policy sizes its pauses by the process that pays most, not
/// by the scope's average: a tight allocation loop (longrun.c) launched
/// beside a shell that keeps the other CPU busy without allocating, both
/// in the agent's scope, makes the last window's slowdown the loop's own
/// (its calls cost it 1.6-6 times its work here), where the two together
/// would average it down to about a half.
#[test]
fn windows_budget_holds_for_the_process_that_pays_most() {
    need_bpf!();
    let agent = Agent::start(&[
        "--window",
        "0.05",
        "--budget",
        "10",
        "--",
        "sh",
        "-c",
        &loop_beside_burner(40),
    ]);
    // Past the tree's start (a BPF object loaded for each new program) and
    // the first windows: the first has the tree's start in it, and the
    // pause after it is sized from it (up to 15 times its length).
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&agent.get("/metrics").1, "mtrace_windows_total").unwrap_or(0.0) < 3.0 {
        assert!(Instant::now() < deadline, "no third window in 20 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    // (The loop runs 40 s: 20 s to the third window, 18 to look at.)
    assert_paid_by_the_loop(&agent, 3, 18);
    // The loop ends, then the shell and the agent with it.
    agent.mtrace.finish().assert_exit(0);
}

/// As [`windows_budget_holds_for_the_process_that_pays_most`], on the
/// whole host (`--all`): the busy CPUs of the host, the shell's among
/// them, would average the loop's slowdown down; the processes with the
/// most calls are read apart.
#[test]
fn agent_all_windows_budget_holds_for_the_process_that_pays_most() {
    if !support::require_bpf_alone() {
        return;
    }
    let agent = Agent::start(&["--all", "--window", "0.05", "--budget", "10"]);
    let mut run = Command::new("sh")
        .args(["-c", &loop_beside_burner(30)])
        .process_group(0)
        .spawn()
        .unwrap();
    // Past the first window (the attach to every file is in it, and the
    // pause after it is sized from it) and the one after.
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&agent.get("/metrics").1, "mtrace_windows_total").unwrap_or(0.0) < 3.0 {
        assert!(Instant::now() < deadline, "no third window in 20 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_paid_by_the_loop(&agent, 3, 25);
    unsafe { libc::kill(-(run.id() as i32), libc::SIGKILL) };
    let _ = run.wait();
    let mut mtrace = agent.mtrace;
    mtrace.proc.signal(libc::SIGINT);
    mtrace.finish().assert_exit(0);
}

/// A shell script: longrun.c looping for `secs` s beside a shell loop that
/// keeps a CPU busy without allocating, stopped after it.
fn loop_beside_burner(secs: u32) -> String {
    let longrun = support::fixtures::Fixture::Longrun.path_str();
    format!("sh -c 'while :; do :; done' & echo x | {longrun} {secs} >/dev/null; kill $!")
}

/// Over at least `secs` s of the agent's windows, and at least three of
/// them (on a loaded machine a window's probes can take long to go in,
/// and the pause after it is as much longer: at most `most` s): the highest
/// slowdown is the loop's own (over 1.5), and the probes are in for at
/// most about the budget's share of the time (10%; windows of 50 ms over
/// 3 s: one window more or less is 2%). Less is allowed: on a loaded
/// machine the switches take long, and the pauses sized from them leave
/// the probes in for less than the budget.
fn assert_paid_by_the_loop(agent: &Agent, secs: u32, most: u64) {
    let (_, before) = agent.get("/metrics");
    let (_, _, _, w0) = windows_figures(&before);
    let started = Instant::now();
    let mut slowdown = 0.0f64;
    let mut text;
    loop {
        std::thread::sleep(Duration::from_millis(500));
        text = agent.get("/metrics").1;
        slowdown = slowdown.max(metric(&text, "mtrace_window_slowdown_ratio").expect("slowdown"));
        let windows = windows_figures(&text).3 - w0;
        if started.elapsed() >= Duration::from_secs(secs.into()) && windows >= 3.0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(most),
            "{windows} windows in {most} s\n{text}"
        );
    }
    assert!(
        slowdown > 1.5,
        "the windows' slowdown, {slowdown} at most: the loop's own is 1.6-6 times its work\n{text}"
    );
    let (s0, _, in0, w0) = windows_figures(&before);
    let (s1, _, in1, w1) = windows_figures(&text);
    let share = (in1 - in0) / (s1 - s0);
    assert!(
        (0.01..0.16).contains(&share) && w1 - w0 >= 3.0,
        "probes in {} s of {} s, {} windows",
        in1 - in0,
        s1 - s0,
        w1 - w0
    );
}

/// `mtrace agent --all` under the windows policy: the file-wide probes
/// go in and out of a process the agent did not start (longrun.c, a tight
/// loop: the breakpoints are seen in its code and out of it in turn), for
/// about the budget's share of the time, and none is left at the end.
#[test]
fn agent_all_windows_take_the_probes_out_of_every_process() {
    if !support::require_bpf_alone() {
        return;
    }
    let target = Longrun::start_for("9");
    let agent = Agent::start(&["--all", "--window", "0.1", "--budget", "10"]);
    let mut target = target;
    target.fx.release();
    let (seen_in, seen_out) = watch_breakpoints(&target, Duration::from_millis(10));
    let (_, text) = agent.get("/metrics");
    let (secs, _, probes_in, windows) = windows_figures(&text);
    assert!(
        seen_in >= 3 && seen_out > seen_in,
        "probes seen in {seen_in} times, out {seen_out} times"
    );
    assert!(
        (0.04..0.2).contains(&(probes_in / secs)) && windows >= 3.0,
        "probes in {probes_in} s of {secs} s, {windows} windows"
    );
    stop_windows_agent(agent, target);
}
