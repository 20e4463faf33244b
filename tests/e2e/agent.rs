//! `mtrace agent`: what real scrapers read from it. `go tool pprof`
//! (Debian's golang-go) fetches its Go heap profiles, whole and as
//! `-seconds` windows; Prometheus (Debian's prometheus) scrapes `/metrics`
//! and answers queries on it. The fixture (tests/fixtures/agent.c)
//! allocates exactly what the test tells it to, when it tells it.
//! `capacity` holds the agent's bounds against many clients, `tls` its
//! TLS and authentication, `windows` its windows policy and budget.

mod capacity;
mod tls;
mod windows;

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::TcpStream,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use crate::support::{
    self,
    agent::{agent_fixture, tell, Agent},
    cgroup::TestCgroup,
    have,
    http::http,
    pprof::{at_site, pprof_raw},
    process::FixtureProc,
    prometheus::{metric, prom_query, prom_until, start_prometheus},
};

/// What each test starts with: root (BPF), `tool` installed, a fixture
/// that has made 100 calls at agent_site_a, and an agent tracing it by
/// pid (`args` added); None when the test is skipped.
fn start(
    tool: &str,
    package: &str,
    args: &[&str],
) -> Option<(tempfile::TempDir, FixtureProc, String, Agent)> {
    if !support::require_bpf()
        || !support::require(have(tool), &format!("{tool} ({package}) is not installed"))
    {
        return None;
    }
    let mut fx = FixtureProc::start(agent_fixture(), &[]);
    fx.wait_ready();
    // Calls made before the agent: never counted.
    tell(&mut fx, "a 100");
    let pid = fx.pid().to_string();
    let mut all = args.to_vec();
    all.extend(["--pid", &pid]);
    let agent = Agent::start(&all);
    Some((tempfile::tempdir().unwrap(), fx, pid, agent))
}

#[test]
fn go_tool_pprof_reads_exact_counts_and_windows() {
    let Some((dir, mut fx, pid, agent)) =
        start("go", "Debian's golang-go", &["--policy", "always"])
    else {
        return;
    };
    tell(&mut fx, "a 1234");
    tell(&mut fx, "b 55");

    let (types, samples) = pprof_raw(dir.path(), &agent.url("/debug/pprof/allocs"), &[]);
    assert_eq!(types, ["alloc_objects/count", "alloc_space/bytes"]);
    assert_eq!(at_site(&samples, "agent_site_a"), [1234, 1_234_000]);
    assert_eq!(at_site(&samples, "agent_site_b"), [55, 55 * 24]);
    let a = samples
        .iter()
        .find(|s| s.functions[1] == "agent_site_a")
        .unwrap();
    assert_eq!(a.functions[0], "malloc");
    assert!(
        a.labels.contains("bytes:[1000 bytes]") && a.labels.contains(&format!("pid:[{pid}]")),
        "labels of agent_site_a's sample: {}",
        a.labels
    );

    // A window: exactly what was allocated during it.
    let window = {
        let (d, url) = (dir.path().to_path_buf(), agent.url("/debug/pprof/allocs"));
        std::thread::spawn(move || pprof_raw(&d, &url, &["-seconds", "6"]))
    };
    std::thread::sleep(Duration::from_millis(2500));
    tell(&mut fx, "a 500");
    tell(&mut fx, "k 7");
    let (_, samples) = window.join().unwrap();
    assert_eq!(at_site(&samples, "agent_site_a"), [500, 500_000]);
    assert_eq!(at_site(&samples, "agent_site_keep"), [7, 7 * 777]);
    assert_eq!(at_site(&samples, "agent_site_b"), Vec::<i64>::new());

    // Prometheus' view of the same counts.
    let (code, text) = agent.get("/metrics");
    assert_eq!(code, 200);
    let series = |func: &str| {
        format!("mtrace_allocation_calls_total{{pid=\"{pid}\",comm=\"agent\",function=\"{func}\"}}")
    };
    assert_eq!(
        metric(&text, &series("malloc")),
        Some((1234 + 500 + 7) as f64),
        "{text}"
    );
    assert_eq!(metric(&text, &series("calloc")), Some(55.0), "{text}");
    assert_eq!(
        metric(&text, "mtrace_lost_total{what=\"calls_map_full\"}"),
        Some(0.0)
    );

    // What it refuses, each with its own status.
    assert_eq!(agent.get("/healthz").0, 200);
    let (code, why) = agent.get("/debug/pprof/heap");
    assert_eq!(code, 501, "{why}");
    assert!(why.contains("--live"), "{why}");
    assert_eq!(http(&agent.addr, "POST", "/debug/pprof/allocs").0, 405);
    assert_eq!(agent.get("/debug/pprof/allocs?seconds=0").0, 400);
    assert_eq!(agent.get("/debug/pprof/allocs?pid=1").0, 404);
    assert_eq!(agent.get("/nothing").0, 404);
    let (code, _) = agent.get(&format!("/debug/pprof/allocs?pid={pid}"));
    assert_eq!(code, 200);

    // The target's end ends the agent, which exits 0.
    drop(fx.stdin.take());
    let finished = agent.mtrace.finish();
    finished.assert_exit(0);
}

#[test]
fn heap_profile_keeps_in_use_whole_across_windows() {
    let Some((dir, mut fx, pid, agent)) = start("go", "Debian's golang-go", &["--live"]) else {
        return;
    };
    tell(&mut fx, "k 123");
    tell(&mut fx, "a 10");
    let url = agent.url("/debug/pprof/heap");
    let (types, samples) = pprof_raw(dir.path(), &url, &[]);
    assert_eq!(
        types,
        [
            "alloc_objects/count",
            "alloc_space/bytes",
            "inuse_objects/count",
            "inuse_space/bytes"
        ]
    );
    assert_eq!(
        at_site(&samples, "agent_site_keep"),
        [123, 123 * 777, 123, 123 * 777]
    );
    assert_eq!(at_site(&samples, "agent_site_a"), [10, 10_000, 0, 0]);

    // A window with five more kept: allocations are the window's, what
    // is in use is the whole heap (Go's ?seconds= subtracts it too).
    let window = {
        let (d, url) = (dir.path().to_path_buf(), url.clone());
        std::thread::spawn(move || pprof_raw(&d, &url, &["-seconds", "5"]))
    };
    std::thread::sleep(Duration::from_millis(2000));
    tell(&mut fx, "k 5");
    let (_, samples) = window.join().unwrap();
    assert_eq!(
        at_site(&samples, "agent_site_keep"),
        [5, 5 * 777, 128, 128 * 777]
    );
    assert_eq!(at_site(&samples, "agent_site_a"), Vec::<i64>::new());
    let (_, text) = agent.get("/metrics");
    assert_eq!(
        metric(
            &text,
            &format!("mtrace_live_bytes{{pid=\"{pid}\",comm=\"agent\"}}")
        ),
        Some((128 * 777) as f64),
        "{text}"
    );
    drop(fx.stdin.take());
    agent.mtrace.finish().assert_exit(0);
}

#[test]
fn prometheus_scrapes_the_allocation_rate() {
    let Some((dir, mut fx, pid, agent)) =
        start("prometheus", "Debian's prometheus", &["--policy", "always"])
    else {
        return;
    };
    let job = format!("static_configs:\n      - targets: ['{}']\n", agent.addr);
    let (mut prom, prom_addr) = start_prometheus(dir.path(), &job);
    let up = prom_until(
        &prom_addr,
        "up{job=\"mtrace\"}",
        Duration::from_secs(30),
        |v| v == 1.0,
    );
    assert_eq!(up, Some(1.0), "Prometheus never scraped the agent");

    // 200 calls every 50 ms for 8 s: 4,000 calls a second.
    let started = Instant::now();
    let mut sent = 0u64;
    while started.elapsed() < Duration::from_secs(8) {
        let tick = Instant::now();
        tell(&mut fx, "a 200");
        sent += 200;
        std::thread::sleep(Duration::from_millis(50).saturating_sub(tick.elapsed()));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let series = format!("mtrace_allocation_calls_total{{pid=\"{pid}\",function=\"malloc\"}}");
    let rate = prom_query(&prom_addr, &format!("rate({series}[5s])"));
    let expected = sent as f64 / elapsed;
    assert!(
        rate.is_some_and(|r| (r - expected).abs() < expected * 0.25),
        "rate {rate:?}, sent {expected:.0} calls a second"
    );
    // Once a scrape follows the last call: the exact count.
    let total = prom_until(&prom_addr, &series, Duration::from_secs(10), |v| {
        v == sent as f64
    });
    assert_eq!(total, Some(sent as f64));
    let lost = prom_query(&prom_addr, "sum(mtrace_lost_total)");
    assert_eq!(lost, Some(0.0));
    let rss = prom_query(&prom_addr, "mtrace_agent_resident_bytes");
    assert!(rss.is_some_and(|r| r > 0.0), "agent RSS {rss:?}");

    prom.signal(libc::SIGTERM);
    drop(fx.stdin.take());
    agent.mtrace.finish().assert_exit(0);
}

/// A service restarted under a new pid: the agent on its cgroup counts
/// the process that exits and the one that comes after it, each under
/// its own pid, and goes on serving while the cgroup is empty between.
#[test]
fn agent_on_a_cgroup_follows_a_restarted_service() {
    need_bpf!();
    let cg = TestCgroup::new("agent");
    let mut first = FixtureProc::start(agent_fixture(), &[]);
    first.wait_ready();
    cg.add(first.pid());
    tell(&mut first, "a 100");
    let agent = Agent::start(&["--policy", "always", "--cgroup", cg.path()]);
    tell(&mut first, "a 300");
    let first_pid = first.pid();
    drop(first.stdin.take());
    first.proc.wait_timeout(Duration::from_secs(10));
    let traced = |agent: &Agent| {
        let (_, text) = agent.get("/metrics");
        metric(&text, "mtrace_processes_traced")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while traced(&agent) != Some(0.0) {
        assert!(Instant::now() < deadline, "the exited process stays traced");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        agent.get("/healthz").0,
        200,
        "the agent ended with the cgroup empty"
    );

    let mut second = FixtureProc::start(agent_fixture(), &[]);
    second.wait_ready();
    cg.add(second.pid());
    let deadline = Instant::now() + Duration::from_secs(10);
    while traced(&agent) != Some(1.0) {
        assert!(Instant::now() < deadline, "the new process is not traced");
        std::thread::sleep(Duration::from_millis(100));
    }
    tell(&mut second, "b 40");
    let (_, text) = agent.get("/metrics");
    let series = |pid: u32, func: &str| {
        format!("mtrace_allocation_calls_total{{pid=\"{pid}\",comm=\"agent\",function=\"{func}\"}}")
    };
    assert_eq!(
        metric(&text, &series(first_pid, "malloc")),
        Some(300.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, &series(second.pid(), "calloc")),
        Some(40.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, &series(second.pid(), "malloc")),
        None,
        "{text}"
    );

    drop(second.stdin.take());
    second.proc.wait_timeout(Duration::from_secs(10));
    let mut mtrace = agent.mtrace;
    mtrace.proc.signal(libc::SIGINT);
    mtrace.finish().assert_exit(0);
}

/// `mtrace agent --all`: a program started elsewhere after the agent is
/// served under its pid with exactly the calls a trace of it alone counts,
/// per function (`--policy always`), while its rows are in the kernel's
/// maps and after it has exited and they have moved out to make room
/// (every 5 s); `?pid=` selects its heap profile, which go tool pprof
/// reads with whole stacks, from the allocator to the thread's first
/// frame, frame for frame as the host walk found them.
#[test]
fn agent_all_serves_a_process_started_elsewhere_exactly() {
    if !support::require_bpf_alone() {
        return;
    }
    let counts = support::fixtures::Fixture::Counts.path_str();
    let (out, p) = support::run_profiled(&["--max-stack", "0", "--", counts]);
    out.assert_exit(0);
    let mut alone: BTreeMap<String, u64> = BTreeMap::new();
    for s in p.allocs() {
        *alone.entry(s.function.clone()).or_default() += s.calls;
    }
    assert!(alone.values().sum::<u64>() >= 1281, "{alone:?}");
    let dir = support::public_tempdir();
    let json = dir.path().join("all.json");
    let agent = Agent::start(&["--all", "--policy", "always", "-o", json.to_str().unwrap()]);
    let mut child = Command::new(counts).stdout(Stdio::null()).spawn().unwrap();
    let pid = child.id();
    assert!(child.wait().unwrap().success());
    let served = |text: &str| -> BTreeMap<String, u64> {
        let head =
            format!("mtrace_allocation_calls_total{{pid=\"{pid}\",comm=\"counts\",function=\"");
        text.lines()
            .filter_map(|l| l.strip_prefix(head.as_str()))
            .filter_map(|rest| {
                let (func, value) = rest.split_once("\"} ")?;
                Some((func.to_string(), value.trim().parse::<f64>().ok()? as u64))
            })
            .collect()
    };
    std::thread::sleep(Duration::from_millis(300));
    let (_, text) = agent.get("/metrics");
    assert_eq!(served(&text), alone, "in the maps:\n{text}");
    std::thread::sleep(Duration::from_secs(6));
    let (_, text) = agent.get("/metrics");
    assert_eq!(served(&text), alone, "moved out of the maps:\n{text}");
    let (code, body) = agent.get(&format!("/debug/pprof/allocs?pid={pid}"));
    assert_eq!(code, 200, "{body}");
    // Whole stacks, as go tool pprof reads them: every sample from the
    // allocator through main to the thread's first frame, the counts per
    // function those of the trace alone.
    let url = agent.url(&format!("/debug/pprof/allocs?pid={pid}"));
    let (_, samples) = pprof_raw(dir.path(), &url, &[]);
    let mut served: BTreeMap<String, u64> = BTreeMap::new();
    for s in &samples {
        assert!(
            s.functions.last().is_some_and(|f| f == "_start")
                && s.functions.iter().any(|f| f == "main"),
            "a stack cut short: {:?}\n{samples:#?}",
            s.functions
        );
        *served.entry(s.functions[0].clone()).or_default() += s.values[0] as u64;
    }
    assert_eq!(served, alone, "{samples:#?}");
    let small = samples
        .iter()
        .find(|s| s.functions.get(1).is_some_and(|f| f == "alloc_small"))
        .unwrap_or_else(|| panic!("no alloc_small sample: {samples:#?}"));
    assert_eq!(
        &small.functions[1..],
        [
            "alloc_small",
            "main",
            "__libc_start_call_main",
            "__libc_start_main_impl",
            "_start"
        ],
        "{samples:#?}"
    );
    let mut mtrace = agent.mtrace;
    mtrace.proc.signal(libc::SIGINT);
    let finished = mtrace.finish();
    finished.assert_exit(0);
    // The report's rows per process show the busiest few of the host; the
    // profile holds every process, this one under its pid.
    let p = support::Profile::load(&json);
    let mut at_end: BTreeMap<String, u64> = BTreeMap::new();
    for s in p
        .allocs()
        .filter(|s| s.process.as_ref().is_some_and(|r| r.pid == pid))
    {
        *at_end.entry(s.function.clone()).or_default() += s.calls;
    }
    assert_eq!(at_end, alone, "in the final profile");
}

/// What the agent refuses before anything is attached, in one line each:
/// a port in use (exit 1), windows with live mode (exit 2), a budget of
/// nothing or next to nothing (exit 2; 1e-20 overflowed the pause).
#[test]
fn agent_refusals_are_one_line() {
    need_bpf!();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let me = std::process::id().to_string();
    let out = crate::support::mtrace::run_mtrace(&["agent", "--listen", &addr, "--pid", &me]);
    out.assert_exit(1);
    out.assert_error(&format!("cannot listen on {addr}"));
    let out = crate::support::mtrace::run_mtrace(&[
        "agent", "--policy", "windows", "--live", "--pid", &me,
    ]);
    out.assert_exit(2);
    out.assert_error("--policy windows counts exact windows");
    for budget in ["0", "1e-20"] {
        let out = crate::support::mtrace::run_mtrace(&["agent", "--budget", budget, "--pid", &me]);
        out.assert_exit(2);
        out.assert_error("--budget must be at least 0.01%");
    }
}

/// A local client that opens connection after connection and sends
/// nothing, or sends a head without end, neither grows the agent nor
/// locks a scraper out: idle connections beyond 64 are closed once they
/// have sent nothing for a second, a head past 16 KiB is refused with
/// 431, and the agent keeps a few threads.
#[test]
fn agent_keeps_serving_through_a_flood_of_idle_connections() {
    need_bpf!();
    let mut fx = FixtureProc::start(agent_fixture(), &[]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let agent = Agent::start(&["--pid", &pid]);
    assert_eq!(agent.get("/healthz").0, 200);
    // `?seconds=` at its extremes: 400 at once, each (issue 41's table of
    // numbers; the options' own are in errors.rs).
    for v in [
        "0", "1e-300", "1e300", "inf", "nan", "-1", "-0", "3601", "1.5",
    ] {
        let asked = Instant::now();
        let (code, body) = agent.get(&format!("/debug/pprof/allocs?seconds={v}"));
        assert_eq!(code, 400, "seconds={v}: {body}");
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "seconds={v} waited"
        );
    }

    let idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(&agent.addr).expect("connecting"))
        .collect();
    // Each answered while 300 idle connections wait (the limit is 64).
    for _ in 0..3 {
        let (code, body) = agent.get("/healthz");
        assert_eq!(code, 200, "{body}");
    }
    let (code, body) = agent.get("/metrics");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("mtrace_up 1"), "{body}");
    let status =
        std::fs::read_to_string(format!("/proc/{}/status", agent.mtrace.proc.child.id())).unwrap();
    let threads: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|t| t.trim().parse().ok())
        .unwrap();
    assert!(threads < 40, "the agent runs {threads} threads");
    // Past 64, those silent for a second are closed.
    std::thread::sleep(Duration::from_millis(1500));
    let closed = idle
        .into_iter()
        .filter(|s| {
            let mut s = s;
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            matches!(s.read(&mut [0u8; 1]), Ok(0))
        })
        .count();
    assert!(closed >= 300 - 64, "only {closed} idle connections closed");

    // A head that never ends.
    let mut s = TcpStream::connect(&agent.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut head = String::from("GET /metrics HTTP/1.1\r\n");
    while head.len() < 20_000 {
        head.push_str("X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    let _ = s.write_all(head.as_bytes());
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 431"), "{text}");
    assert_eq!(agent.get("/healthz").0, 200);

    drop(fx.stdin.take());
    agent.mtrace.finish().assert_exit(0);
}
