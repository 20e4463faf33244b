//! JIT frames named from the runtime's perf map: node with
//! `--perf-basic-prof` writes /tmp/perf-PID.map, and the JavaScript
//! functions on an allocation's stack are named from it instead of
//! `[anonymous code 0x...]`. A map that is huge and grows
//! (tests/fixtures/perfmap.c) is read off the loop, what was appended
//! only, within a ceiling: `--duration` and SIGTERM end the trace on
//! time, and the names are right.

use std::{
    fs,
    path::{Path, PathBuf},
    sync::OnceLock,
    time::{Duration, Instant},
};

use crate::support::{
    fixtures::compile_c, require, run_profiled, FixtureProc, Mtrace, EXIT_TIMEOUT, LINE_TIMEOUT,
};

/// 5000 buffers of 100000 or 100001 bytes (one malloc each), from
/// `leafAlloc` called by `midAlloc`.
const SCRIPT: &str = "\
function leafAlloc(i) {
  return Buffer.allocUnsafeSlow(100000 + (i & 1));
}
function midAlloc(i) {
  return leafAlloc(i);
}
const keep = [];
for (let i = 0; i < 5000; i++) {
  keep.push(midAlloc(i));
  if (keep.length > 10) keep.shift();
}
";

#[test]
fn node_jit_frames_are_named_from_its_perf_map() {
    let dir = bpf_tempdir!();
    let node = "/usr/bin/node";
    if !require(Path::new(node).exists(), "node is missing") {
        return;
    }
    let path = dir.path().join("alloc.js");
    fs::write(&path, SCRIPT).unwrap();
    let script = path.to_str().unwrap();
    let log = format!("--logfile={}", dir.path().join("v8.log").display());
    let (out, p) = run_profiled(&[
        "--",
        node,
        "--perf-basic-prof",
        "--interpreted-frames-native-stack",
        // (Its log, which the perf map turns on, goes with the script.)
        "--no-logfile-per-isolate",
        &log,
        script,
    ]);
    // node leaves its map in /tmp.
    let _map = Removed(format!("/tmp/perf-{}.map", p.pid()));
    out.assert_exit(0);
    let buffers: Vec<_> = p
        .allocs()
        .filter(|s| s.calls * 100_000 <= s.bytes && s.bytes <= s.calls * 100_001)
        .collect();
    let calls: u64 = buffers.iter().map(|s| s.calls).sum();
    assert_eq!(calls, 5000, "{}", out.describe());
    // Every JIT frame on their stacks has its name (the walk may stop
    // short at V8's interpreter trampoline before the script's code is
    // compiled, how often depending on when V8 tiers up: it compiles on
    // another thread).
    for s in &buffers {
        let names = s.names();
        assert!(
            !names.iter().any(|n| n.starts_with("[anonymous code")),
            "an unnamed JIT frame: {names:?}"
        );
    }
    let named: u64 = buffers
        .iter()
        .filter(|s| {
            s.names()
                .iter()
                .any(|n| n.starts_with("JS:") && n.contains(script))
        })
        .map(|s| s.calls)
        .sum();
    assert!(
        named * 10 >= calls,
        "{named} of {calls} buffers under a named script frame\n{}",
        out.describe()
    );
}

/// tests/fixtures/perfmap.c, compiled once.
fn perfmap() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        compile_c(
            "perfmap",
            "perfmap",
            &["-O2", "-fno-omit-frame-pointer", "-g"],
            &[],
        )
    })
}

/// The fixture's perf map, in MiB.
const MAP_MIB: &str = "250";

/// How long a trace of it runs: time enough for the reading thread to
/// read it all on a busy machine (it takes a fraction of a second of CPU).
const TRACING: Duration = Duration::from_secs(6);

/// How late mtrace may exit after its `--duration` or a SIGTERM: the
/// promise is 100 ms; this leaves a busy machine room, and is far below
/// the seconds that reading such a map on the loop took.
const LATE: Duration = Duration::from_millis(2000);

/// mtrace's maximum resident set size tracing the fixture, in KiB: the
/// bound docs/python.md states (the names at their ceiling, the reading's
/// buffers, and mtrace's own 75 MiB or so).
const MAX_RSS_KIB: i64 = 200 << 10;

/// The ceiling of pieces of code named per process.
const MAX_ENTRIES: u64 = 1 << 20;

/// Removes the fixture's perf map whatever happens to the test.
struct Removed(String);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// The fixture writes a 250 MiB perf map (four million lines, junk and
/// overlong names among them), then allocates through its JIT code and
/// appends a line a second; traced by pid until `--duration` or a
/// SIGTERM. mtrace ends on time and within its memory bound, the counts
/// are exact, the code named by the map's last line and by a line
/// appended later is named, the oldest names were evicted (their code
/// reads as anonymous code), and every line is accounted for.
fn a_huge_growing_perf_map(sigterm: bool) {
    need_bpf!();
    let mut fx = FixtureProc::start(perfmap(), &[MAP_MIB]);
    let _map = Removed(format!("/tmp/perf-{}.map", fx.pid()));
    let fillers: u64 = fx
        .stdout
        .next_line(LINE_TIMEOUT)
        .strip_prefix("fillers ")
        .and_then(|n| n.parse().ok())
        .expect("fillers N");
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let seconds = TRACING.as_secs().to_string();
    let mut args = vec!["--pid", pid.as_str()];
    if !sigterm {
        args.extend(["--duration", seconds.as_str()]);
    }
    let mut m = Mtrace::start_profiled(&args);
    m.wait_tracing();
    let began = Instant::now();
    fx.release();
    fx.stdout.wait_for(|l| l == "allocated", LINE_TIMEOUT);
    // By `--duration`, the end is reckoned from when the test saw tracing
    // begin, milliseconds after mtrace did.
    let mut end = began + TRACING;
    if sigterm {
        std::thread::sleep(end.saturating_duration_since(Instant::now()));
        m.proc.signal(libc::SIGTERM);
        end = Instant::now();
    }
    let (out, p, run) = m.finish_measured();
    let late = run.exited.saturating_duration_since(end);
    let d = format!("{}\n{}", out.describe(), p.dump());
    out.assert_exit(0);
    drop(fx.stdin.take());
    let status = fx.proc.wait_timeout(EXIT_TIMEOUT);
    assert!(status.success(), "the fixture failed: {status}");

    let rss = run.peak_rss_kib;
    eprintln!(
        "mtrace exited {:.0} ms after its end, at most {} MiB resident",
        late.as_secs_f64() * 1e3,
        rss >> 10
    );
    assert!(late < LATE, "mtrace exited {late:?} after its end\n{d}");
    assert!(
        rss < MAX_RSS_KIB,
        "mtrace's maximum RSS was {} MiB\n{d}",
        rss >> 10
    );
    for (leaf, code, calls, size) in [
        ("leaf_old", None, 100, 16),
        ("leaf_alpha", Some("jit_alpha"), 1000, 24),
        ("leaf_beta", Some("jit_beta"), 2000, 40),
    ] {
        assert_eq!(p.site("malloc", leaf), (calls, calls * size), "{d}");
        for st in p.stacks_at("malloc", leaf) {
            let names = st.names();
            let jit = names.get(1).copied().unwrap_or_default();
            match code {
                Some(code) => assert_eq!(jit, code, "{d}"),
                // Its line was the map's first: evicted.
                None => assert!(jit.starts_with("[anonymous code 0x"), "{d}"),
            }
            assert_eq!(names.get(2).copied(), Some("main"), "{d}");
        }
    }
    assert_eq!(p.total().0, 3100, "{d}");
    let q = &p.doc["stack_quality"]["perf_map"];
    let n = |k: &str| {
        q[k].as_u64()
            .unwrap_or_else(|| panic!("no perf_map.{k}\n{d}"))
    };
    let junk = (0..fillers).filter(|i| i % 64 == 63).count() as u64;
    let long = (0..fillers)
        .filter(|i| i % 64 != 63 && i % 4096 == 4094)
        .count() as u64;
    assert_eq!(n("bad_lines"), junk, "{d}");
    assert_eq!(n("names_cut"), long, "{d}");
    // The map's lines (the fillers that are not junk, OLD's, ALPHA's,
    // BETA's) and one appended a second since: every one named code at
    // its own address, kept or evicted.
    let lines = n("lines");
    let at_least = fillers - junk + 3;
    let appended = lines - at_least;
    assert!(
        lines >= at_least && appended <= TRACING.as_secs() + 2,
        "{lines} lines read, {at_least} written before the trace\n{d}"
    );
    assert_eq!(n("kept") + n("evicted"), lines, "{d}");
    assert!(n("kept") <= MAX_ENTRIES, "{d}");
    assert!(n("evicted") >= lines - MAX_ENTRIES, "{d}");
    // Read to the end but for a line appended as the trace ended.
    assert!(n("unread_bytes") < 200, "{d}");
    assert_eq!(n("rereads"), 0, "{d}");
}

#[test]
fn a_huge_growing_perf_map_keeps_the_duration_memory_and_names() {
    a_huge_growing_perf_map(false);
}

#[test]
fn a_huge_growing_perf_map_keeps_sigterm_memory_and_names() {
    a_huge_growing_perf_map(true);
}
