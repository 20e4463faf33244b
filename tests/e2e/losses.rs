//! Full kernel maps: what does not fit is counted and shown, and the
//! totals stay exact. tests/fixtures/manystacks.c makes 40 calls of 10
//! bytes, each under its own stack (1 to 40 frames of `rec` below main).

use crate::support::{
    process::{FixtureProc, EXIT_TIMEOUT, LINE_TIMEOUT},
    run_profiled, Fixture, Mtrace, Profile,
};

const CALLS: u64 = 40;

fn traced(extra: &[&str]) -> Profile {
    let mut args = extra.to_vec();
    args.extend(["--top", "0", "--", Fixture::ManyStacks.path_str()]);
    let (out, p) = run_profiled(&args);
    out.assert_exit(0);
    p
}

#[test]
fn a_full_aggregation_map_is_counted_and_the_totals_stay_exact() {
    need_bpf!();
    let p = traced(&["--count-map-size", "16"]);
    let d = p.dump();
    assert_eq!(p.total(), (CALLS, CALLS * 10), "{d}");
    let in_stacks: u64 = p.stacks.iter().map(|s| s.calls).sum();
    // The kernel's map holds 16 stacks; walks the tracer finished (the
    // first through code without unwind rules yet) are counted by the
    // tracer, outside the map.
    let by_tracer = p.doc["stack_quality"]["finished_by_tracer"]
        .as_u64()
        .unwrap();
    assert!(p.stacks.len() >= 16, "{d}");
    assert!(p.stacks.len() as u64 <= 16 + by_tracer, "{d}");
    // Every call not in a stack is a loss, and only those.
    assert_eq!(p.losses["map_full"], CALLS - in_stacks, "{d}");
    assert!(
        p.losses["map_full"] >= CALLS.saturating_sub(16 + by_tracer),
        "{d}"
    );
}

#[test]
fn a_full_stack_map_keeps_the_direct_caller_and_is_counted() {
    need_bpf!();
    let p = traced(&["--stack-map-size", "16"]);
    let d = p.dump();
    assert_eq!(p.total().0, CALLS, "{d}");
    assert_eq!(p.stacks.len() as u64, CALLS, "one stack per depth: {d}");
    let (truncated, whole): (Vec<_>, Vec<_>) = p.stacks.iter().partition(|s| s.truncated);
    // 16 stacks fit the kernel's map; walks the tracer finished keep their
    // stacks outside it.
    let by_tracer = p.doc["stack_quality"]["finished_by_tracer"]
        .as_u64()
        .unwrap();
    assert_eq!(truncated.len() as u64, p.losses["stack_map_full"], "{d}");
    // The stack-quality line names the cause.
    assert_eq!(
        p.doc["stack_quality"]["truncated"]["stack_map_full"].as_u64(),
        Some(p.losses["stack_map_full"]),
        "{d}"
    );
    assert!(
        p.losses["stack_map_full"] >= CALLS.saturating_sub(16 + by_tracer),
        "{d}"
    );
    assert!(p.losses["stack_map_full"] > 0, "{d}");
    for s in truncated {
        // The direct caller, from [rsp], is never lost.
        assert_eq!(s.caller(), Some("rec"), "{s:?}");
    }
    // The stored stacks are whole: caller, then depth-1 more rec frames,
    // main and libc's start.
    for s in whole {
        let names = s.names();
        let recs = names.iter().filter(|f| **f == "rec").count();
        assert_eq!(names[recs], "main", "{s:?}");
    }
}

/// Live mode under a storm (tests/fixtures/storm.c: 8 threads on this
/// machine's CPUs freeing each other's blocks, with rings of one page):
/// events are lost, yet no freed block is ever reported outstanding and no
/// block goes unfollowed. A free or an allocation whose event found its
/// ring full is kept aside in the kernel and applied in its order; only the
/// fixture's 10 leaked blocks stay outstanding.
#[test]
fn a_storm_of_cross_thread_frees_leaves_no_freed_block_outstanding() {
    need_bpf!();
    let storm = storm();
    let iter: u64 = 50_000;
    let (out, p) = run_profiled(&[
        "--live",
        "--top",
        "0",
        "--event-buffer-size",
        "4096",
        "--",
        storm.to_str().unwrap(),
        &iter.to_string(),
    ]);
    out.assert_exit(0);
    let d = p.dump();
    assert!(
        out.stdout.contains(&format!("passed={}", 8 * iter)),
        "{}",
        out.describe()
    );
    let live = &p.doc["live"];
    let n = |k: &str| live[k].as_u64().unwrap_or_else(|| panic!("live.{k}\n{d}"));
    eprintln!(
        "storm: events lost {}, frees kept aside {}, frees lost {}, \
         allocations kept aside {}, allocations lost {}, untracked {}, stale {}",
        n("events_lost"),
        n("frees_kept"),
        n("frees_lost"),
        n("allocs_kept"),
        n("allocs_lost"),
        n("untracked"),
        n("stale")
    );
    // The storm did overflow the rings (else this test proves nothing).
    assert!(n("events_lost") > 0, "no event was lost\n{d}");
    assert!(n("frees_kept") > 0, "no free was kept aside\n{d}");
    assert!(n("allocs_kept") > 0, "no allocation was kept aside\n{d}");
    assert_eq!((n("frees_lost"), n("allocs_lost")), (0, 0), "{d}");
    assert_every_allocation_accounted(&p, &d);
    // Every storm_pass block was freed: none outstanding.
    for st in p.stacks_at("malloc", "storm_pass") {
        let l = st.live.as_ref().expect("live stats");
        assert_eq!(l["outstanding"], 0, "a freed block is outstanding\n{d}");
    }
    // The leaks, made before the storm, are exact.
    let leaks: Vec<_> = p.stacks_at("malloc", "storm_leak");
    let sum = |k: &str| -> u64 {
        leaks
            .iter()
            .map(|s| s.live.as_ref().unwrap()[k].as_u64().unwrap())
            .sum()
    };
    assert_eq!(
        (sum("outstanding"), sum("outstanding_bytes")),
        (10, 10_000),
        "{d}"
    );
    // The report states the suspects as facts, and says what was lost.
    let r = out.report();
    assert!(
        r.leak_suspects.is_some() && r.uncertain.is_none(),
        "{}",
        out.stdout
    );
}

/// tests/fixtures/NAME.c, a threaded fixture, built once into `built`
/// (the tests run in parallel).
fn threaded(
    name: &str,
    built: &'static std::sync::OnceLock<std::path::PathBuf>,
) -> &'static std::path::Path {
    built.get_or_init(|| {
        crate::support::fixtures::compile_c(
            name,
            name,
            &["-O2", "-fno-omit-frame-pointer", "-g"],
            &["-pthread"],
        )
    })
}

fn storm() -> &'static std::path::Path {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    threaded("storm", &BUILT)
}

/// The stress test of live mode: 8 threads passing blocks to each other
/// for a minute under mtrace's default buffers. Every call is counted,
/// every passed block is freed and none is outstanding, and the 10 leaks
/// are outstanding to the byte.
#[test]
fn a_minute_of_cross_thread_frees_in_live_mode_is_exact() {
    need_bpf!();
    let mut m = crate::support::Mtrace::start_profiled(&[
        "--live",
        "--top",
        "0",
        "--",
        storm().to_str().unwrap(),
        "0",
        "60",
    ]);
    // Longer than the usual wait for an exit: the minute, then the report.
    m.proc.wait_timeout(std::time::Duration::from_secs(180));
    let (out, p) = m.finish();
    out.assert_exit(0);
    let d = p.dump();
    let passed: u64 = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("passed="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no passed=N\n{}", out.describe()));
    let live = &p.doc["live"];
    let n = |k: &str| live[k].as_u64().unwrap_or_else(|| panic!("live.{k}\n{d}"));
    eprintln!(
        "a minute of storm: {passed} blocks passed; events lost {}, frees kept aside {}, \
         frees lost {}, allocations kept aside {}, allocations lost {}, untracked {}",
        n("events_lost"),
        n("frees_kept"),
        n("frees_lost"),
        n("allocs_kept"),
        n("allocs_lost"),
        n("untracked")
    );
    assert!(passed > 100_000, "{passed} blocks passed in a minute\n{d}");
    assert_eq!(p.site("malloc", "storm_pass").0, passed, "{d}");
    assert_eq!((n("frees_lost"), n("allocs_lost")), (0, 0), "{d}");
    assert_every_allocation_accounted(&p, &d);
    assert_eq!(n("untracked"), 0, "{d}");
    // Outstanding per site: none of the passed blocks, the 10 leaks to
    // the byte (the rest is the C library's own: stdio's buffer, the
    // threads' structures).
    let outstanding = |caller: &str| -> (u64, u64) {
        p.stacks_at("malloc", caller)
            .iter()
            .map(|s| {
                let l = s.live.as_ref().unwrap();
                let n = |k: &str| l[k].as_u64().unwrap();
                (n("outstanding"), n("outstanding_bytes"))
            })
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    };
    assert_eq!(outstanding("storm_pass"), (0, 0), "{d}");
    assert_eq!(outstanding("storm_leak"), (10, 10_000), "{d}");
}

fn burst() -> &'static std::path::Path {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    threaded("burst", &BUILT)
}

/// Every allocation the trace saw made is accounted for in live mode:
/// followed, not followed for a full table, or lost (said with a bound).
fn assert_every_allocation_accounted(p: &Profile, d: &str) {
    let live = &p.doc["live"];
    let n = |k: &str| live[k].as_u64().unwrap_or_else(|| panic!("live.{k}\n{d}"));
    assert_eq!(
        p.total().0,
        n("tracked_allocations")
            + n("untracked")
            + n("allocs_lost")
            + n("pending_full")
            + n("failed"),
        "an allocation is neither followed nor counted\n{d}"
    );
}

/// The leaks of tests/fixtures/burst.c outstanding: (blocks, bytes).
fn burst_leaks(p: &Profile) -> (u64, u64) {
    let leaks = p.stacks_at("malloc", "burst_leak");
    let sum = |k: &str| -> u64 {
        leaks
            .iter()
            .map(|s| s.live.as_ref().unwrap()[k].as_u64().unwrap())
            .sum()
    };
    (sum("outstanding"), sum("outstanding_bytes"))
}

/// Live mode under a burst (tests/fixtures/burst.c): 1.6 million blocks
/// over 8 threads, all freed at once by other threads, and 1,234 leaked
/// amid the frees, when the rings are at their fullest. With the default
/// block table and with one of 4M entries (the size the report suggests
/// when the table fills), default event buffers: no freed block is
/// reported outstanding, and the 1,234 leaks exactly are. The frees and
/// the allocations the rings have no room for are kept aside in the
/// kernel, as many of each as the table holds blocks. A stress test: it
/// runs alone (`cargo xtask test`).
#[test]
fn a_burst_at_any_table_size_reports_every_leak_and_no_freed_block() {
    need_bpf!();
    let burst = burst();
    let per: u64 = 200_000;
    for table in [None, Some("4194304")] {
        let mut args = vec!["--live", "--top", "0"];
        if let Some(t) = table {
            args.extend(["--live-map-size", t]);
        }
        let per_s = per.to_string();
        args.extend(["--", burst.to_str().unwrap(), &per_s]);
        let mut m = Mtrace::start_profiled(&args);
        // Longer than the usual wait for an exit: a storm on 2 CPUs.
        m.proc.wait_timeout(std::time::Duration::from_secs(180));
        let (out, p) = m.finish();
        out.assert_exit(0);
        let d = format!("table {table:?}\n{}", p.dump());
        assert!(
            out.stdout.contains(&format!("freed={}", 8 * per)),
            "{}",
            out.describe()
        );
        let live = &p.doc["live"];
        let n = |k: &str| live[k].as_u64().unwrap_or_else(|| panic!("live.{k}\n{d}"));
        eprintln!(
            "burst, table {table:?}: events lost {}, frees kept aside {}, frees lost {}, \
             allocations kept aside {}, allocations lost {}, untracked {}",
            n("events_lost"),
            n("frees_kept"),
            n("frees_lost"),
            n("allocs_kept"),
            n("allocs_lost"),
            n("untracked"),
        );
        assert_eq!(n("allocs_lost"), 0, "{d}");
        if table.is_some() {
            // Every block is in the table: every free of one is kept.
            assert_eq!(n("frees_lost"), 0, "{d}");
            assert_eq!(n("untracked"), 0, "{d}");
        }
        assert_every_allocation_accounted(&p, &d);
        for st in p.stacks_at("malloc", "burst_alloc") {
            let l = st.live.as_ref().expect("live stats");
            assert_eq!(l["outstanding"], 0, "a freed block is outstanding\n{d}");
        }
        assert_eq!(burst_leaks(&p), (1234, 123_400), "{d}");
        // No line says that an allocation was lost. The default table
        // says that it could not follow every block, and that frees (of
        // those blocks, the queue holding as many as the table) were lost.
        let uncertain: Vec<_> = out
            .stdout
            .lines()
            .filter(|l| l.starts_with("uncertain: "))
            .collect();
        assert!(table.is_none() || uncertain.is_empty(), "{}", out.stdout);
        assert!(
            uncertain.iter().all(|l| !l.contains("allocations lost")),
            "{}",
            out.stdout
        );
    }
}

/// When even the queues kept aside are full, the report says how many
/// allocations it could not follow, hence at most how many leaks are
/// missing. mtrace is stopped (SIGSTOP) while the burst runs with rings of
/// one page and queues of 32,768 entries, so that 400,000 allocations
/// cannot all be kept: those lost are counted, in the JSON profile and in
/// an `uncertain:` line, and the leaks missing from the suspects are
/// within the bound.
#[test]
fn allocations_lost_when_the_queue_is_full_bound_the_missing_leaks() {
    need_bpf!();
    let per: u64 = 50_000;
    let per_s = per.to_string();
    let mut fx = FixtureProc::start(burst(), &[&per_s, "wait"]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let mut m = Mtrace::start_profiled(&[
        "--live",
        "--top",
        "0",
        "--event-buffer-size",
        "4096",
        "--live-map-size",
        "32768",
        "--pid",
        &pid,
    ]);
    m.wait_tracing();
    m.proc.signal(libc::SIGSTOP);
    fx.release();
    let freed = fx.stdout.next_line(LINE_TIMEOUT);
    m.proc.signal(libc::SIGCONT);
    assert_eq!(freed, format!("freed={}", 8 * per));
    fx.release();
    assert!(fx.proc.wait_timeout(EXIT_TIMEOUT).success());
    let (out, p) = m.finish();
    out.assert_exit(0);
    let d = p.dump();
    let live = &p.doc["live"];
    let n = |k: &str| live[k].as_u64().unwrap_or_else(|| panic!("live.{k}\n{d}"));
    let lost = n("allocs_lost");
    let (leaks, _) = burst_leaks(&p);
    eprintln!(
        "burst, mtrace stopped: allocations kept aside {}, lost {lost}; leaks reported {leaks} of 1234",
        n("allocs_kept")
    );
    // Far more allocations than the queue holds were made while nothing
    // drained it.
    assert!(n("allocs_kept") <= 32_768, "{d}");
    assert!(lost >= 8 * per - 32_768 - 8 * 64, "{d}");
    assert_every_allocation_accounted(&p, &d);
    // The leaks missing from the suspects are within the bound.
    assert!(leaks <= 1234 && 1234 - leaks <= lost, "{d}");
    assert!(
        out.stdout.contains(&format!(
            "uncertain: {lost} allocations lost (their ring and the queue kept aside full),\n\
             uncertain: at most {lost} leaks missing from these\n"
        )),
        "{}",
        out.stdout
    );
}

/// The states of the threads of `pid` (`R`, `S`, `T` stopped, `t`
/// stopped by its tracer, ...), by thread id.
fn thread_states(pid: u32) -> Vec<(u32, char)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| {
            let t = t.ok()?;
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            // The state follows the name's closing parenthesis.
            let state = stat.rsplit_once(") ")?.1.chars().next()?;
            Some((t.file_name().to_str()?.parse().ok()?, state))
        })
        .collect()
}

/// Waits until `done` holds for the states of `pid`'s threads.
fn wait_for_states(pid: u32, what: &str, done: impl Fn(&[(u32, char)]) -> bool) {
    let deadline = std::time::Instant::now() + LINE_TIMEOUT;
    loop {
        let states = thread_states(pid);
        if done(&states) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: {states:?}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Stops mtrace (SIGSTOP) and waits until every thread of it is.
fn stop_fully(m: &mut Mtrace) {
    m.proc.signal(libc::SIGSTOP);
    wait_for_states(m.proc.id(), "mtrace did not stop", |s| {
        s.iter().all(|&(_, state)| state == 'T')
    });
}

/// tests/fixtures/burst.c (8 threads, 200 blocks each, and the leaks)
/// traced by pid with `--unwind-buffer-size size`, mtrace stopped
/// (SIGSTOP) while the fixture allocates: no walk is finished and no
/// rule learned meanwhile, so each call's walk is handed over with a
/// copy of its stack, and those the buffer has no room for are cut
/// short. Returns them (`copy_lost`), the line that says so, and a
/// description.
fn copy_lost_while_stopped(size: &str) -> (u64, Option<String>, String) {
    let mut fx = FixtureProc::start(burst(), &["200", "wait"]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let mut m = Mtrace::start_profiled(&[
        "--pid",
        pid.as_str(),
        "--unwind-buffer-size",
        size,
        "--top",
        "0",
    ]);
    m.wait_tracing();
    stop_fully(&mut m);
    fx.release();
    fx.stdout
        .wait_for(|l| l.starts_with("freed="), LINE_TIMEOUT);
    m.proc.signal(libc::SIGCONT);
    drop(fx.stdin.take());
    let status = fx.proc.wait_timeout(EXIT_TIMEOUT);
    assert!(status.success(), "the fixture failed: {status}");
    let (out, p) = m.finish();
    out.assert_exit(0);
    let d = format!("{}\n{}", out.describe(), p.dump());
    // (and the C library's few as it starts the threads)
    assert!(p.total().0 >= 8 * 200 + 1234, "{d}");
    let lost = p.doc["stack_quality"]["truncated"]["copy_lost"]
        .as_u64()
        .unwrap_or(0);
    let said = out
        .stderr
        .iter()
        .find(|l| l.contains("(copy_lost)"))
        .cloned();
    (lost, said, d)
}

/// `--unwind-buffer-size`: some 2,850 walks handed over while mtrace
/// cannot take them, each with a copy of its thread's stack (4 to 256
/// KiB). A buffer of 1 MiB holds at most a few hundred: the rest are cut
/// short (`copy_lost`), every call still counted, and a line says how
/// many, the buffer's size and the option that doubles it. One of 128
/// MiB holds at least 500 copies: hundreds fewer are cut, said so.
#[test]
fn a_full_buffer_of_stack_copies_is_counted_and_its_option_said() {
    need_bpf!();
    let (small, said, d) = copy_lost_while_stopped("1048576");
    assert!(small > 1000, "{d}");
    assert_eq!(
        said.as_deref(),
        Some(
            format!(
                "mtrace: {small} stacks cut short: the buffer of stack copies for mtrace to finish was full (copy_lost); --unwind-buffer-size 2097152 gives it twice the room (1 MiB now)"
            )
            .as_str()
        ),
        "{d}"
    );
    let (large, said, d) = copy_lost_while_stopped("134217728");
    assert!(large + 300 <= small, "{small} cut with 1 MiB\n{d}");
    let said = said.unwrap_or_default();
    assert!(
        said.starts_with(&format!("mtrace: {large} stacks cut short")) == (large > 0)
            && said.ends_with("(128 MiB now)") == (large > 0),
        "{d}"
    );
}

/// The burst fixture in `mode` ("held" or "blocked") launched under
/// mtrace on `engine` with a buffer of stack copies of 4 MiB (16 of
/// their copies of up to 256 KiB fill it), its threads let go with
/// mtrace stopped (SIGSTOP), so that no walk is finished and no rule
/// learned until mtrace goes on. Returns mtrace, the fixture's pid and
/// its stdin (a byte or its end lets it exit).
fn burst_let_go_stopped(
    engine: &[&str],
    mode: &str,
) -> (
    crate::support::mtrace::Profiled,
    u32,
    std::process::ChildStdin,
) {
    let burst = burst().to_str().unwrap();
    let mut args = engine.to_vec();
    args.extend([
        "--unwind-buffer-size",
        "4194304",
        "--top",
        "0",
        "--",
        burst,
        "200",
        mode,
    ]);
    let (mut m, mut stdin) = Mtrace::start_profiled_piped(&args);
    let pid = m.wait_tracing();
    m.stdout.wait_for(|l| l == "ready", LINE_TIMEOUT);
    stop_fully(&mut m);
    use std::io::Write as _;
    stdin.write_all(b"g").unwrap();
    stdin.flush().unwrap();
    (m, pid, stdin)
}

/// Launch mode (`--`): the burst's 8 threads started, then let go with
/// mtrace stopped and its buffer of stack copies at 4 MiB (16 of their
/// copies of up to 256 KiB fill it), so that no walk is finished and no
/// rule learned until mtrace goes on. Each thread whose walk's copy finds
/// the buffer a quarter full is held (stopped for its tracer) until
/// mtrace has finished the walks the buffer holds; the rest of it holds
/// the one copy each thread makes past the mark. So threads are held,
/// no walk is cut (where by pid the same burst cuts over a thousand with
/// 1 MiB, above), each stack is whole to the thread's start, each call
/// counted, and the holds are counted and said. The same on the host
/// engine (`--file-wide`), whose one buffer serves the whole tree.
#[test]
fn a_launched_programs_threads_wait_for_room_rather_than_lose_stacks() {
    need_bpf!();
    launched_threads_wait_for_room(&[]);
    launched_threads_wait_for_room(&["--file-wide"]);
}

fn launched_threads_wait_for_room(engine: &[&str]) {
    let (mut m, pid, stdin) = burst_let_go_stopped(engine, "held");
    // At most 4 of the 8 make their copies before the mark (mtrace
    // finishes none meanwhile): the others are held by mtrace.
    wait_for_states(pid, "the burst's threads were not held", |s| {
        s.iter()
            .filter(|&&(tid, state)| tid != pid && state == 't')
            .count()
            >= 4
    });
    m.proc.signal(libc::SIGCONT);
    m.stdout.wait_for(|l| l.starts_with("freed="), LINE_TIMEOUT);
    drop(stdin);
    let (out, p) = m.finish();
    out.assert_exit(0);
    let d = format!("{engine:?}\n{}\n{}", out.describe(), p.dump());
    let q = &p.doc["stack_quality"];
    assert_eq!(q["truncated"], serde_json::json!({}), "{d}");
    assert_eq!(q["whole"], q["calls"], "{d}");
    let held = q["held_for_tracer"].as_u64().unwrap_or(0);
    assert!(held >= 4, "{d}");
    assert!(
        out.stdout.contains(&format!(
            "stacks: threads held {held} times for mtrace to finish their walks (none lost)\n"
        )),
        "{d}"
    );
    // Each call under its whole stack, through the thread's routine.
    for (caller, calls) in [("burst_alloc", 8 * 200), ("burst_leak", 1234)] {
        let stacks = p.stacks_at("malloc", caller);
        assert!(
            stacks
                .iter()
                .all(|s| !s.truncated && s.names().contains(&"run")),
            "{caller}\n{d}"
        );
        assert_eq!(
            stacks.iter().map(|s| s.calls).sum::<u64>(),
            calls,
            "{caller}\n{d}"
        );
    }
}

/// Launch mode, threads that block SIGURG, the signal that holds a thread
/// (as a program that takes its signals with sigwait or a signalfd does):
/// the burst of the test above with each thread blocking it and, its work
/// done, taking one pending for it. mtrace sends them none: no thread
/// takes a SIGURG and none is held; the walks not held for are counted
/// and said, the copies that then found the buffer full are counted and
/// said as cut short, and every call is counted. Both engines.
#[test]
fn threads_that_block_the_hold_signal_are_sent_none() {
    need_bpf!();
    threads_blocking_the_signal(&[]);
    threads_blocking_the_signal(&["--file-wide"]);
}

fn threads_blocking_the_signal(engine: &[&str]) {
    let (mut m, pid, stdin) = burst_let_go_stopped(engine, "blocked");
    // Each thread runs its burst through, and stops at its exit for its
    // tracer or waits there to be reaped (or, wrongly held, stops
    // before): then mtrace goes on.
    wait_for_states(pid, "the burst's threads did not finish", |s| {
        s.iter()
            .all(|&(tid, state)| tid == pid || state == 't' || state == 'Z')
    });
    m.proc.signal(libc::SIGCONT);
    m.stdout.wait_for(|l| l.starts_with("freed="), LINE_TIMEOUT);
    let urgent = m
        .stdout
        .wait_for(|l| l.starts_with("urgent="), LINE_TIMEOUT);
    drop(stdin);
    let (out, p) = m.finish();
    out.assert_exit(0);
    let d = format!("{engine:?}\n{}\n{}", out.describe(), p.dump());
    assert_eq!(urgent, "urgent=0", "a thread took mtrace's SIGURG\n{d}");
    let q = &p.doc["stack_quality"];
    assert_eq!(q.get("held_for_tracer"), None, "{d}");
    let not_held = q["not_held"].as_u64().unwrap_or(0);
    let lost = q["truncated"]["copy_lost"].as_u64().unwrap_or(0);
    assert!(not_held >= 1 && lost >= 1, "{d}");
    let r = out.report();
    assert_eq!(r.held, None, "{d}");
    let said = if not_held == 1 {
        "a thread blocking SIGURG not held once (its copies may be lost)".to_string()
    } else {
        format!("threads blocking SIGURG not held {not_held} times (copies may be lost)")
    };
    assert_eq!(r.not_held, Some(said), "{d}");
    assert!(out.stdout.contains(&format!("copy_lost {lost}")), "{d}");
    // Every call counted, under its direct caller at least.
    for (caller, calls) in [("burst_alloc", 8 * 200), ("burst_leak", 1234)] {
        let stacks = p.stacks_at("malloc", caller);
        assert_eq!(
            stacks.iter().map(|s| s.calls).sum::<u64>(),
            calls,
            "{caller}\n{d}"
        );
    }
}
