//! Go programs' own heap, read from their memory (tracer/src/golang/):
//! tests/fixtures/goheap, built static (CGO_ENABLED=0), stripped
//! (`-ldflags=-s`) and with cgo (which also calls C's malloc 1000 times),
//! keeps 32 MiB in 512-byte objects (main.keepSmall) and 32 MiB in 1 MiB
//! objects (main.keepLarge); traced, it allocates 64 MiB in 4 KiB objects
//! and keeps half (main.afterAttach); it writes its own heap profile
//! (`pprof.WriteHeapProfile`) and `runtime.ReadMemStats`' figures.
//!
//! At `runtime.MemProfileRate` 1 (set by the fixture's own code) every
//! allocation is recorded: the rows are the fixture's shapes exactly.
//! At Go's default rate the rows name those functions with Go file and
//! line, their bytes in use are the program's own profile's to the byte
//! (the same sampled records, scaled the same way), and against the
//! shapes and `ReadMemStats` they are within Go's sampling error
//! ([`sampling_bound`]).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

use crate::support::{
    self, agent::Agent, fixtures::fixtures_dir, have, pprof::pprof_raw, profile::Profile,
    run_profiled, trace_by_pid, FixtureProc,
};

/// How the fixture is built.
#[derive(Clone, Copy, Debug)]
enum Build {
    Static,
    Stripped,
    Cgo,
}

/// The fixture built so, once per test run; `None` (the test skipped)
/// without Go. The build needs no network: the standard library only,
/// GOPATH mode, no proxy; its cache is the tests' own.
fn goheap(build: Build) -> Option<&'static Path> {
    static BUILT: [OnceLock<PathBuf>; 3] = [const { OnceLock::new() }; 3];
    if !support::require(have("go"), "go (Debian's golang-go) is not installed") {
        return None;
    }
    Some(BUILT[build as usize].get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("goheap");
        let (name, cgo, ldflags) = match build {
            Build::Static => ("static", "0", ""),
            Build::Stripped => ("stripped", "0", "-s"),
            Build::Cgo => ("cgo", "1", ""),
        };
        let out = dir.join(name);
        let tmp = dir.join(format!("{name}.{}.tmp", std::process::id()));
        let status = Command::new("go")
            .args(["build", "-ldflags", ldflags, "-o"])
            .arg(&tmp)
            .arg(".")
            .current_dir(fixtures_dir().join("goheap"))
            .env("CGO_ENABLED", cgo)
            .env("GO111MODULE", "off")
            .env("GOPROXY", "off")
            .env("GOFLAGS", "")
            .env("GOCACHE", dir.join("cache"))
            .env("GOPATH", dir.join("gopath"))
            .env("HOME", &dir)
            .output()
            .expect("running go build");
        assert!(
            status.status.success(),
            "go build of tests/fixtures/goheap failed:\n{}",
            String::from_utf8_lossy(&status.stderr)
        );
        std::fs::rename(&tmp, &out).unwrap();
        out
    }))
}

/// Bytes in use per leaf function, summed over samples, of a profile
/// `go tool pprof -raw` reads (a file or a URL), and its period.
fn in_use_by_function(dir: &Path, source: &str) -> BTreeMap<String, i64> {
    let (types, samples) = pprof_raw(dir, source, &[]);
    let at = types
        .iter()
        .position(|t| t == "inuse_space/bytes")
        .unwrap_or_else(|| panic!("no inuse_space in {types:?}"));
    let mut sum = BTreeMap::new();
    for s in samples {
        *sum.entry(s.functions[0].clone()).or_default() += s.values[at];
    }
    sum
}

/// Bytes in use per leaf function of the profile's Go heap rows.
fn rows_in_use(p: &Profile) -> BTreeMap<String, i64> {
    let mut sum = BTreeMap::new();
    for s in p.stacks.iter().filter(|s| s.function == "go heap") {
        let bytes = s.in_use.map_or(0, |u| u.bytes);
        *sum.entry(s.frames[0].function.clone()).or_default() += bytes as i64;
    }
    sum
}

/// Go's sampling error on `n` objects of `size` bytes at one sample per
/// `rate` bytes: each object is sampled with probability
/// p = 1 - exp(-size/rate) and stands for 1/p objects when it is, so the
/// estimate of their bytes has variance n·size²·(1-p)/p. The bound is
/// five standard deviations: a correct reading falls outside it less
/// than once in a million runs.
fn sampling_bound(n: f64, size: f64, rate: f64) -> f64 {
    let p = 1.0 - (-size / rate).exp();
    5.0 * size * (n * (1.0 - p) / p).sqrt()
}

/// The fixture's shapes: (function, its line, objects allocated, object
/// size, objects kept).
const SHAPES: [(&str, u64, u64, u64, u64); 3] = [
    ("main.keepSmall", 44, 65536, 512, 65536),
    ("main.keepLarge", 51, 32, 1 << 20, 32),
    ("main.afterAttach", 58, 16384, 4096, 8192),
];

/// What the fixture's own oracle said: bytes in use per function, and
/// its `ReadMemStats` heap.
struct Oracle {
    in_use: BTreeMap<String, i64>,
    heap_alloc: f64,
    rate: u64,
}

fn oracle(dir: &Path, path: &Path) -> Oracle {
    let stats = std::fs::read_to_string(format!("{}.memstats", path.display())).unwrap();
    let field = |name: &str| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {stats}"))
    };
    Oracle {
        in_use: in_use_by_function(dir, path.to_str().unwrap()),
        heap_alloc: field("HeapAlloc") as f64,
        rate: field("MemProfileRate"),
    }
}

/// The Go heap row of `p` at `func` of `size`-byte objects (the row of
/// the `make`, not of a slice's growth on the same line).
fn row<'a>(p: &'a Profile, func: &str, size: u64, describe: &str) -> &'a support::profile::Stack {
    p.stacks
        .iter()
        .find(|s| {
            s.function == "go heap" && s.frames[0].function == func && s.object_size == Some(size)
        })
        .unwrap_or_else(|| panic!("no go heap row at {func} of {size}-byte objects\n{describe}"))
}

/// What every reading of the fixture shows: one Go heap, its rate the
/// program's, nothing lost; the shapes' functions named with Go file and
/// line, called from main.main; bytes in use per function the program's
/// own profile's exactly.
fn check_common(p: &Profile, o: &Oracle, describe: &str) {
    let heaps = p.doc["go_heaps"].as_array().expect("go_heaps");
    assert_eq!(heaps.len(), 1, "{describe}");
    let heap = &heaps[0];
    assert!(heap["version"].as_str().unwrap().starts_with("go1."));
    assert_eq!(heap["rate"].as_u64(), Some(o.rate), "{describe}");
    for lost in ["unreadable", "inconsistent"] {
        assert_eq!(heap[lost].as_u64(), Some(0), "{lost}\n{describe}");
    }
    assert_eq!(heap["cut"], false, "{describe}");
    let mine = rows_in_use(p);
    for (func, line, _, size, _) in SHAPES {
        let f = &row(p, func, size, describe).frames;
        assert!(
            f[0].file
                .as_deref()
                .is_some_and(|f| f.ends_with("goheap/main.go")),
            "{:?}",
            f[0]
        );
        assert_eq!(f[0].line, Some(line), "{:?}", f[0]);
        assert_eq!(f[1].function, "main.main", "{f:?}");
        assert_eq!(
            mine.get(func),
            o.in_use.get(func),
            "{func}: in use as read, and as the program's pprof.WriteHeapProfile says\n{describe}"
        );
    }
}

/// At rate 1: every shape exactly, allocations counted from `since`
/// (`attach`: main.afterAttach's only).
fn check_exact(p: &Profile, since: &str, describe: &str) {
    for (func, _, n, size, kept) in SHAPES {
        let r = row(p, func, size, describe);
        let allocated = if since == "attach" && func != "main.afterAttach" {
            0
        } else {
            n
        };
        assert_eq!(
            (r.calls, r.bytes),
            (allocated, allocated * size),
            "{func}: allocated\n{describe}"
        );
        let u = r.in_use.unwrap();
        assert_eq!(
            (u.calls, u.bytes),
            (kept, kept * size),
            "{func}: in use\n{describe}"
        );
    }
}

/// At Go's default rate: the shapes within Go's sampling error of what
/// the fixture allocated and kept, and the whole heap of what
/// `ReadMemStats` says.
fn check_sampled(p: &Profile, o: &Oracle, describe: &str) {
    let rate = o.rate as f64;
    let mine = rows_in_use(p);
    let mut variance = 0.0;
    for (func, _, n, size, kept) in SHAPES {
        let bound = sampling_bound(kept as f64, size as f64, rate);
        variance += bound * bound;
        let got = mine[func] as f64;
        let truth = (kept * size) as f64;
        assert!(
            (got - truth).abs() <= bound + 4096.0,
            "{func}: {got} bytes in use, {truth} kept: more than {bound} apart\n{describe}"
        );
        if func == "main.afterAttach" {
            let r = row(p, func, size, describe);
            let truth = (n * size) as f64;
            let bound = sampling_bound(n as f64, size as f64, rate);
            assert!(
                (r.bytes as f64 - truth).abs() <= bound,
                "{func}: {} bytes allocated since attach, {truth} allocated: more than {bound} apart\n{describe}",
                r.bytes
            );
        }
    }
    // The whole heap against ReadMemStats: the shapes' sampling error, and
    // 4 MiB for the rest of the program (its runtime, the profile's own
    // writing).
    let total: i64 = mine.values().sum();
    let bound = variance.sqrt() + 4.0 * 1048576.0;
    assert!(
        (total as f64 - o.heap_alloc).abs() <= bound,
        "{total} bytes in use over the rows, ReadMemStats says {}: more than {bound} apart\n{describe}",
        o.heap_alloc
    );
}

/// By pid, each build at rate 1 and at Go's default: attached, then the
/// fixture allocates in main.afterAttach and exits; its rows are read at
/// its exit, allocations counted from the attach.
#[test]
fn go_heap_by_pid_static_stripped_and_cgo() {
    let dir = bpf_tempdir!();
    for build in [Build::Static, Build::Stripped, Build::Cgo] {
        let Some(exe) = goheap(build) else {
            return;
        };
        for rate in [Some("1"), None] {
            let oracle_path = dir.path().join(format!("{build:?}.{rate:?}.pb.gz"));
            let mut args = vec!["known", oracle_path.to_str().unwrap()];
            args.extend(rate);
            let mut fx = FixtureProc::start(exe, &args);
            let (out, p) = trace_by_pid(&mut fx, &[]);
            let describe = format!("{build:?} at rate {rate:?}\n{}", out.describe());
            assert!(!out.stdout.contains("no allocations traced"), "{describe}");
            assert!(out.stdout.contains("go heap: pid "), "{describe}");
            let heap = &p.doc["go_heaps"][0];
            assert_eq!(heap["since"], "attach", "{describe}");
            assert_eq!(heap["read_at"], "exit", "{describe}");
            let o = oracle(dir.path(), &oracle_path);
            check_common(&p, &o, &describe);
            match rate {
                Some(_) => check_exact(&p, "attach", &describe),
                None => check_sampled(&p, &o, &describe),
            }
        }
    }
}

/// From launch, at rate 1, on either engine (`--file-wide`: the host
/// engine over the command's tree): read at the program's exit (held
/// there), counted from its start, exactly; with cgo, its malloc calls
/// exact beside its Go heap.
#[test]
fn go_heap_from_launch_static_and_cgo() {
    let dir = host_tempdir!();
    for build in [Build::Static, Build::Cgo] {
        let Some(exe) = goheap(build) else {
            return;
        };
        for engine in [None, Some("--file-wide")] {
            let oracle_path = dir
                .path()
                .join(format!("{build:?}.{engine:?}.launch.pb.gz"));
            // Its stdin is mtrace's, at its end: it does not wait.
            let saved = dir.path().join(format!("{build:?}.{engine:?}.json"));
            let mut args: Vec<&str> = engine.into_iter().collect();
            args.extend([
                "-o",
                saved.to_str().unwrap(),
                "--",
                exe.to_str().unwrap(),
                "known",
                oracle_path.to_str().unwrap(),
                "1",
            ]);
            let out = support::run_mtrace(&args);
            out.assert_exit(0);
            let p = Profile::load(&saved);
            let describe = format!("{build:?} {engine:?}\n{}", out.describe());
            let heap = &p.doc["go_heaps"][0];
            assert_eq!(heap["since"], "start", "{describe}");
            assert_eq!(heap["read_at"], "exit", "{describe}");
            check_common(&p, &oracle(dir.path(), &oracle_path), &describe);
            check_exact(&p, "start", &describe);
            // The saved profile reads back: `mtrace report` shows its Go
            // heap.
            let report = support::run_mtrace(&["report", saved.to_str().unwrap()]);
            report.assert_exit(0);
            assert!(
                report.stdout.contains("go heap: pid ")
                    && report.stdout.contains("main.afterAttach"),
                "{}",
                report.describe()
            );
            if let Build::Cgo = build {
                let (calls, bytes) = p.site("malloc", "c_alloc");
                assert_eq!((calls, bytes), (1000, 100_000), "{describe}");
            }
        }
    }
}

/// `mtrace agent` on a Go program (count mode), by pid and over the
/// whole host (`--all`, which finds it among every process; `?pid=` its
/// samples): `go tool pprof` reads its Go heap profile, whose bytes in
/// use are the program's own.
#[test]
fn go_tool_pprof_reads_the_agents_go_heap() {
    let dir = bpf_tempdir!();
    let Some(exe) = goheap(Build::Static) else {
        return;
    };
    for scope in ["--pid", "--all"] {
        let oracle_path = dir.path().join(format!("agent{scope}.pb.gz"));
        let mut fx = FixtureProc::start(exe, &["churn", oracle_path.to_str().unwrap(), "0"]);
        fx.wait_ready();
        let pid = fx.pid().to_string();
        let (agent, query) = match scope {
            "--pid" => (Agent::start(&["--pid", &pid]), String::new()),
            _ => (Agent::start(&["--all"]), format!("?pid={pid}")),
        };
        let served =
            in_use_by_function(dir.path(), &agent.url(&format!("/debug/pprof/heap{query}")));
        // Each sample is one record of the runtime, labelled with its
        // objects' size once, as Go's own heap profile labels it:
        // main.churn's 4 KiB blocks, once a collection has published some
        // (within 30 s).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let churn = loop {
            let allocs = agent.url(&format!("/debug/pprof/allocs{query}"));
            let (_, samples) = pprof_raw(dir.path(), &allocs, &[]);
            let churn = samples
                .into_iter()
                .find(|s| s.functions[0] == "main.churn" && s.values[0] > 0);
            match churn {
                Some(s) => break s,
                None if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(500))
                }
                None => panic!("{scope}: no allocation at main.churn served within 30 s"),
            }
        };
        assert!(churn.labels.contains("bytes:[4096]"), "{scope}: {churn:?}");
        let o = oracle(dir.path(), &oracle_path);
        for func in ["main.keepSmall", "main.keepLarge"] {
            assert_eq!(
                served.get(func),
                o.in_use.get(func),
                "{scope}: {func}: {served:?}"
            );
        }
        drop(agent);
    }
}

/// `--all`: a Go program that ends while the host is traced keeps its
/// rows as last read (mtrace reads each Go heap every 5 s), said so; at
/// rate 1, what it keeps is every object of its shapes, exactly.
#[test]
fn a_go_program_gone_during_a_host_trace_keeps_its_last_reading() {
    let dir = bpf_tempdir!();
    let Some(exe) = goheap(Build::Static) else {
        return;
    };
    let oracle_path = dir.path().join("gone.pb.gz");
    let mut fx = FixtureProc::start(exe, &["churn", oracle_path.to_str().unwrap(), "0", "1"]);
    fx.wait_ready();
    let pid = fx.pid();
    let json = dir.path().join("all.json");
    let mut m = support::mtrace::Mtrace::start(&["--all", "-o", json.to_str().unwrap()]);
    m.wait_tracing();
    // A look at the host for processes gone (every 5 s) reads it; the
    // next finds it gone.
    std::thread::sleep(std::time::Duration::from_secs(6));
    fx.proc.signal(libc::SIGKILL);
    fx.proc.wait_timeout(std::time::Duration::from_secs(10));
    std::thread::sleep(std::time::Duration::from_secs(6));
    m.proc.signal(libc::SIGINT);
    let out = m.finish();
    out.assert_exit(0);
    let describe = out.describe();
    let p = Profile::load(&json);
    let heap = p.doc["go_heaps"]
        .as_array()
        .and_then(|h| h.iter().find(|h| h["pid"] == pid))
        .unwrap_or_else(|| panic!("no go heap of pid {pid}\n{describe}"));
    assert_eq!(heap["since"], "attach", "{describe}");
    assert_eq!(heap["read_at"], "last", "{describe}");
    assert!(
        out.stdout.contains("(read last before it ended)"),
        "{describe}"
    );
    for (func, _, _, size, kept) in &SHAPES[..2] {
        let in_use: Vec<(u64, u64)> = p.doc["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["process"]["pid"] == pid && s["object_size"] == *size)
            .filter(|s| s["frames"][0]["function"] == *func)
            .map(|s| {
                (
                    s["in_use"]["calls"].as_u64().unwrap(),
                    s["in_use"]["bytes"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(in_use, [(*kept, kept * size)], "{func}\n{describe}");
    }
}

/// A Go program whose runtime samples nothing (`MemProfileRate` 0, set
/// by its own code) is one line saying so, not "no allocations traced",
/// and mtrace does not write into it.
#[test]
fn a_go_program_that_samples_nothing_is_said() {
    let dir = bpf_tempdir!();
    let Some(exe) = goheap(Build::Static) else {
        return;
    };
    let oracle_path = dir.path().join("zero.pb.gz");
    let mut fx = FixtureProc::start(exe, &["churn", oracle_path.to_str().unwrap(), "0", "0"]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let (out, p) = run_profiled(&["--pid", &pid, "--duration", "1"]);
    out.assert_exit(0);
    assert!(
        !out.stdout.contains("no allocations traced"),
        "{}",
        out.describe()
    );
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("not seen: "))
        .unwrap_or_else(|| panic!("no `not seen:` line\n{}", out.describe()));
    assert!(
        line.contains("go heap") && line.contains("MemProfileRate is 0"),
        "{line}"
    );
    assert_eq!(p.doc["unseen"][0]["heap"], "go heap");
    assert!(p.doc["go_heaps"].as_array().is_none_or(|h| h.is_empty()));
    // Still 0 once mtrace is gone: read, never written (the static build
    // is not position-independent: the symbol's address is where it is).
    let nm = Command::new("go")
        .args(["tool", "nm"])
        .arg(exe)
        .output()
        .unwrap();
    let nm = String::from_utf8_lossy(&nm.stdout);
    let addr = nm
        .lines()
        .find(|l| l.ends_with(" runtime.MemProfileRate"))
        .and_then(|l| u64::from_str_radix(l.split_whitespace().next()?, 16).ok())
        .unwrap_or_else(|| panic!("no runtime.MemProfileRate in go tool nm's output"));
    let now = support::process::read_mem(fx.pid(), addr, 8).unwrap();
    assert_eq!(now, [0; 8], "runtime.MemProfileRate");
}

/// `command` traced from launch on both engines (the process's own
/// probes, and the host engine's): its one `not seen:` line says `heap`,
/// and its malloc calls are counted all the same.
fn says_heap_not_seen(command: &[&str], heap: &str) {
    for engine in [&[][..], &["--file-wide"][..]] {
        let mut args = engine.to_vec();
        args.push("--");
        args.extend(command);
        let (out, p) = run_profiled(&args);
        out.assert_exit(0);
        let line = out
            .stdout
            .lines()
            .find(|l| l.starts_with("not seen: "))
            .unwrap_or_else(|| panic!("{engine:?}: no `not seen:` line\n{}", out.describe()));
        assert!(line.contains(heap), "{engine:?}: {line}");
        assert_eq!(p.doc["unseen"][0]["heap"], heap, "{engine:?}");
        assert!(p.totals.allocs.calls > 0, "{}", out.describe());
    }
}

/// node keeps JavaScript objects in V8's heap: said in one line, its
/// malloc calls counted all the same, on both engines.
#[test]
fn node_says_its_v8_heap_is_not_seen() {
    let _dir = host_tempdir!();
    let node = "/usr/bin/node";
    if !support::require(Path::new(node).exists(), "node is missing") {
        return;
    }
    let script = "const a = []; for (let i = 0; i < 1000; i++) a.push({i});";
    says_heap_not_seen(&[node, "-e", script], "v8 heap");
}

/// A JVM keeps Java objects in its own heap (libjvm.so, loaded after the
/// probes are in): said in one line, its malloc calls counted, on both
/// engines.
#[test]
fn a_jvm_says_its_java_heap_is_not_seen() {
    let _dir = host_tempdir!();
    if !support::require(have("java"), "java is missing") {
        return;
    }
    says_heap_not_seen(&["java", "-Xshare:auto", "-version"], "java heap");
}
