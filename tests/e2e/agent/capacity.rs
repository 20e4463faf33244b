//! The agent's capacity against many clients: a window whose client has
//! gone gives its slot back at once, health and metrics are answered
//! beside any number of profile requests, concurrent profiles share
//! their renders and give the memory back, and a storm of reconnecting
//! idle clients fails no scrape.

use std::{
    io::{Read, Write},
    net::TcpStream,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use crate::support::{
    agent::{agent_fixture, tell, Agent},
    http::{http, try_http},
    process::FixtureProc,
};

/// A fixture and an agent tracing it exactly (`--policy always`).
fn traced() -> (FixtureProc, Agent) {
    let mut fx = FixtureProc::start(agent_fixture(), &[]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let agent = Agent::start(&["--policy", "always", "--pid", &pid]);
    (fx, agent)
}

/// Ends the fixture, and with it the agent (exit 0).
fn finish(mut fx: FixtureProc, agent: Agent) {
    drop(fx.stdin.take());
    agent.mtrace.finish().assert_exit(0);
}

/// A connection that has asked `GET path`, its answer not read.
fn ask(addr: &str, path: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    s
}

/// Whether the agent has answered on `s` (or closed it), within 50 ms.
fn answered(s: &TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut s = s;
    !matches!(s.read(&mut [0u8; 1]), Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

/// Sixteen connections that have asked for an hour's window, each taken
/// (a refusal would be answered at once).
fn sixteen_windows(agent: &Agent, which: &str) -> Vec<TcpStream> {
    let asked: Vec<TcpStream> = (0..16)
        .map(|_| ask(&agent.addr, "/debug/pprof/allocs?seconds=3600"))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !asked.iter().any(answered),
        "one of sixteen {which} windows of an hour was answered (refused)"
    );
    asked
}

/// Sixteen clients that ask for an hour's window and go away lock
/// nothing: their slots and descriptors are given back at once, health
/// and metrics answer, sixteen new windows are taken; a window of a pid
/// the agent does not trace is refused at once, not at its end.
#[test]
fn abandoned_windows_give_their_slots_back_at_once() {
    need_bpf!();
    let (fx, agent) = traced();
    assert_eq!(agent.get("/healthz").0, 200);
    let before = agent.descriptors();
    drop(sixteen_windows(&agent, "abandoned"));
    let deadline = Instant::now() + Duration::from_secs(2);
    while agent.descriptors() > before + 2 {
        assert!(
            Instant::now() < deadline,
            "the agent holds {} descriptors, {before} before the windows",
            agent.descriptors()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(agent.get("/healthz").0, 200);
    let (code, body) = agent.get("/metrics");
    assert_eq!(code, 200, "{body}");

    drop(sixteen_windows(&agent, "new"));

    let asked = Instant::now();
    let (code, why) = agent.get("/debug/pprof/allocs?seconds=2&pid=1");
    assert_eq!(code, 404, "{why}");
    assert!(
        asked.elapsed() < Duration::from_millis(1500),
        "the 404 took {:?}",
        asked.elapsed()
    );
    finish(fx, agent);
}

/// Sixteen profiles of a trace of 8,192 stacks asked at once: /metrics
/// is answered meanwhile, the agent's peak memory stays within twice
/// what one profile takes, and what they took is given back.
#[test]
fn concurrent_profiles_share_renders_and_give_the_memory_back() {
    need_bpf!();
    let (mut fx, agent) = traced();
    tell(&mut fx, "s 13");
    // The first profile fills the symbolizer's caches, which stay.
    assert_eq!(agent.get("/debug/pprof/allocs").0, 200);
    let (base, _) = agent.memory();
    assert_eq!(agent.get("/debug/pprof/allocs").0, 200);
    let (_, peak) = agent.memory();
    let one = peak.saturating_sub(base);

    let profiles: Vec<_> = (0..16)
        .map(|_| {
            let addr = agent.addr.clone();
            std::thread::spawn(move || http(&addr, "GET", "/debug/pprof/allocs"))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let (code, body) = agent.get("/metrics");
    assert_eq!(code, 200, "/metrics beside 16 profiles: {body}");
    for p in profiles {
        let (code, body) = p.join().unwrap();
        assert_eq!(code, 200, "{body}");
    }
    let (after, peak) = agent.memory();
    const MIB: u64 = 1 << 20;
    assert!(
        peak.saturating_sub(base) <= 2 * one + 32 * MIB,
        "16 profiles at once took {} MiB, one {} MiB (resident before: {} MiB)",
        peak.saturating_sub(base) / MIB,
        one / MIB,
        base / MIB
    );
    assert!(
        after <= base + one / 4 + 16 * MIB,
        "{} MiB resident after the profiles, {} MiB before (one took {} MiB)",
        after / MIB,
        base / MIB,
        one / MIB
    );
    finish(fx, agent);
}

/// 400 idle clients that reconnect as soon as the agent closes them (it
/// closes one for each new connection past 64): every request made
/// meanwhile by a client that sends it at once (/metrics, /healthz) is
/// answered.
#[test]
fn a_reconnect_storm_fails_no_scrape() {
    need_bpf!();
    let (fx, agent) = traced();
    let stop = Arc::new(AtomicBool::new(false));
    let storm: Vec<_> = (0..4)
        .map(|_| {
            let (addr, stop) = (agent.addr.clone(), stop.clone());
            std::thread::spawn(move || {
                let open = || {
                    let s = TcpStream::connect(&addr).unwrap();
                    s.set_nonblocking(true).unwrap();
                    s
                };
                let mut conns: Vec<TcpStream> = (0..100).map(|_| open()).collect();
                let mut reopened = 0u64;
                let mut buf = [0u8; 256];
                while !stop.load(Ordering::Relaxed) {
                    for c in conns.iter_mut() {
                        let closed = match c.read(&mut buf) {
                            Ok(0) => true,
                            Ok(_) => false,
                            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                        };
                        if closed {
                            *c = open();
                            reopened += 1;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                reopened
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let mut failed = Vec::new();
    // Scrapes of /metrics, and of /healthz between them (quicker: more
    // connections made while the storm goes on).
    // At least 300, and for 3.5 s: idle connections are closed once
    // they have been silent for a second, and the storm goes on.
    let mut i = 0;
    while i < 300 || started.elapsed() < Duration::from_millis(3500) {
        i += 1;
        let (path, expected) = match i % 3 {
            0 => ("/metrics", "mtrace_up"),
            _ => ("/healthz", "ok: tracing"),
        };
        match try_http(&agent.addr, "GET", path) {
            Ok((200, body)) if body.contains(expected) => {}
            other => failed.push(format!("{path}: {other:?}")),
        }
    }
    let secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let reopened: u64 = storm.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(
        failed.is_empty(),
        "{} of {i} requests failed among {reopened} reconnections in {secs:.1} s: {failed:?}",
        failed.len()
    );
    assert!(
        reopened >= 300,
        "the storm reconnected only {reopened} times in {secs:.1} s"
    );
    finish(fx, agent);
}
