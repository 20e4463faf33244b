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
    let dir = host_tempdir!();
    let node = "/usr/bin/node";
    if !require(Path::new(node).exists(), "node is missing") {
        return;
    }
    let path = dir.path().join("alloc.js");
    fs::write(&path, SCRIPT).unwrap();
    let script = path.to_str().unwrap();
    let log = format!("--logfile={}", dir.path().join("v8.log").display());
    // Both engines: the process's own probes, and the host engine's
    // (its perf map read from its first walk through JIT code).
    for engine in [&[][..], &["--file-wide"][..]] {
        let mut args = engine.to_vec();
        args.extend([
            "--",
            node,
            "--perf-basic-prof",
            "--interpreted-frames-native-stack",
            // (Its log, which the perf map turns on, goes with the script.)
            "--no-logfile-per-isolate",
            &log,
            script,
        ]);
        let (out, p) = run_profiled(&args);
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

/// tests/fixtures/jvm/Zip.java, compiled once: the directory of its class.
fn zip_class() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-fixtures/jvm");
        fs::create_dir_all(&dir).unwrap();
        let src = crate::support::fixtures::fixtures_dir().join("jvm/Zip.java");
        crate::support::fixtures::build_fixture(
            std::process::Command::new("javac")
                .arg("-d")
                .arg(&dir)
                .arg(&src),
            "tests/fixtures/jvm/Zip.java",
        );
        dir
    })
}

/// `Zip.work` calls made: the first few hundred run interpreted, the rest
/// compiled (C1, then C2).
const ZIP_CALLS: u64 = 20_000;

/// zlib's `deflateInit2_` calls malloc five times per `Deflater`.
const DEFLATE_MALLOCS: u64 = 5;

/// Traces the Zip fixture by pid under the JVM options `jvm`, its perf map
/// written by `jcmd PID Compiler.perfmap` once it has allocated.
/// `None` when the JDK is missing (a failure under `CI`).
fn trace_zip(jvm: &[&str]) -> Option<(crate::support::Finished, crate::support::Profile)> {
    let have = |p: &str| crate::support::have(p);
    if !require(
        have("java") && have("javac") && have("jcmd"),
        "java, javac or jcmd is missing (openjdk-17-jdk-headless)",
    ) {
        return None;
    }
    let calls = ZIP_CALLS.to_string();
    let class_dir = zip_class().to_str().unwrap();
    let mut args = jvm.to_vec();
    args.extend(["-cp", class_dir, "Zip", calls.as_str()]);
    let mut fx = FixtureProc::start(Path::new("java"), &args);
    let _map = Removed(format!("/tmp/perf-{}.map", fx.pid()));
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let mut m = Mtrace::start_profiled(&["--pid", pid.as_str()]);
    m.wait_tracing();
    fx.release();
    fx.stdout.wait_for(|l| l == "allocated", EXIT_TIMEOUT);
    let jcmd = std::process::Command::new("jcmd")
        .args([pid.as_str(), "Compiler.perfmap"])
        .output()
        .expect("running jcmd");
    assert!(
        jcmd.status.success(),
        "jcmd failed: {}",
        String::from_utf8_lossy(&jcmd.stderr)
    );
    fx.release();
    let status = fx.proc.wait_timeout(EXIT_TIMEOUT);
    assert!(status.success(), "the JVM failed: {status}");
    let (out, p) = m.finish();
    out.assert_exit(0);
    Some((out, p))
}

/// zlib's mallocs under `Zip.work`, by stack.
fn deflate_stacks(p: &crate::support::Profile) -> Vec<&crate::support::profile::Stack> {
    p.stacks_at("malloc", "deflateInit2_")
}

/// A JVM run with -XX:+PreserveFramePointer allocating through
/// java.util.zip, traced by pid: every stack of zlib's mallocs is whole,
/// from the Java methods (compiled and interpreted, named from the perf
/// map) through the VM's entry into Java to the thread's first frame, and
/// the counts are exact. Nothing says its stacks are cut.
#[test]
fn a_jvm_keeping_frame_pointers_is_walked_to_the_threads_start() {
    need_bpf!();
    let Some((out, p)) = trace_zip(&["-XX:+PreserveFramePointer"]) else {
        return;
    };
    let d = format!("{}\n{}", out.describe(), p.dump());
    let stacks = deflate_stacks(&p);
    let calls: u64 = stacks.iter().map(|s| s.calls).sum();
    assert_eq!(calls, DEFLATE_MALLOCS * ZIP_CALLS, "{d}");
    let mut named = 0;
    for s in &stacks {
        let names = s.names();
        assert!(!s.truncated, "a stack cut short: {names:?}\n{d}");
        // The main thread's start, below the launcher's JavaMain.
        assert_eq!(
            names[names.len().saturating_sub(4)..],
            ["JavaMain", "ThreadJavaMain", "start_thread", "clone3"],
            "{d}"
        );
        assert!(
            names
                .iter()
                .any(|n| n.starts_with("JavaCalls::call_helper(")),
            "no VM frame below Java: {names:?}\n{d}"
        );
        assert!(
            !names.iter().any(|n| n.starts_with("[anonymous code")),
            "an unnamed Java frame: {names:?}\n{d}"
        );
        if names.contains(&"byte[] Zip.work(int)") {
            named += s.calls;
        }
    }
    // The calls made once work() is compiled (the interpreter's frame is
    // named "Interpreter", not by method).
    assert!(
        named * 10 >= calls * 9,
        "{named} of {calls} under Zip.work\n{d}"
    );
    assert!(
        !p.doc["unseen"]
            .as_array()
            .is_some_and(|u| u.iter().any(|u| u["heap"] == "java stacks")),
        "{d}"
    );
}

/// HotSpot's default: its compiled code keeps no frame pointer, so the
/// walk stops at the first Java frame (counted, never a wrong frame), and
/// the report says which option would make the stacks whole.
#[test]
fn a_jvm_without_frame_pointers_is_told_the_option_that_makes_stacks_whole() {
    need_bpf!();
    let Some((out, p)) = trace_zip(&[]) else {
        return;
    };
    let d = format!("{}\n{}", out.describe(), p.dump());
    let stacks = deflate_stacks(&p);
    let calls: u64 = stacks.iter().map(|s| s.calls).sum();
    assert_eq!(calls, DEFLATE_MALLOCS * ZIP_CALLS, "{d}");
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("not seen: ") && l.contains("java stacks"))
        .unwrap_or_else(|| panic!("no `java stacks` line\n{d}"));
    assert!(line.contains("-XX:+PreserveFramePointer"), "{line}");
    let unseen = p.doc["unseen"].as_array().cloned().unwrap_or_default();
    assert!(unseen.iter().any(|u| u["heap"] == "java stacks"), "{d}");
    // Cut short where the walk could not go on, and said so.
    let cut: u64 = stacks.iter().filter(|s| s.truncated).map(|s| s.calls).sum();
    assert!(cut * 2 >= calls, "{cut} of {calls} cut\n{d}");
}
