//! Go programs' own heap, read from their memory (tracer/src/golang/):
//! tests/fixtures/goheap, built static (CGO_ENABLED=0), stripped
//! (`-ldflags=-s`) and with cgo (which also calls C's malloc 1000 times),
//! keeps 32 MiB in 512-byte objects (main.keepSmall) and 32 MiB in 1 MiB
//! objects (main.keepLarge), writes its own heap profile
//! (`pprof.WriteHeapProfile`) and `runtime.ReadMemStats`' figures, then
//! makes garbage at about 40 MB/s (main.churn). The rows mtrace reads
//! name those functions with Go file and line, and their bytes in use are
//! the program's own profile's to the byte: both are the same sampled
//! records, scaled the same way. Against the truth (the shapes the
//! fixture allocates) and against `ReadMemStats`, they are within Go's
//! sampling error ([`sampling_bound`]).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

use crate::{
    agent::{have, pprof_raw, Agent},
    support::{
        self, fixtures::fixtures_dir, profile::Profile, run_profiled, FixtureProc, LINE_TIMEOUT,
    },
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

/// 65536 objects of 512 bytes, and the slice that holds them (its last
/// backing array: 65536 slice headers of 24 bytes).
const SMALL: (f64, f64) = (65536.0, 512.0);
const SMALL_TRUE: f64 = 65536.0 * 512.0 + 65536.0 * 24.0;
/// 32 objects of 1 MiB.
const LARGE: (f64, f64) = (32.0, 1048576.0);

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

/// The rows of `p` against the fixture's own profile and the truth.
fn check_rows(p: &Profile, o: &Oracle, describe: &str) {
    let heaps = p.doc["go_heaps"].as_array().expect("go_heaps");
    assert_eq!(heaps.len(), 1, "{describe}");
    let heap = &heaps[0];
    assert!(heap["version"].as_str().unwrap().starts_with("go1."));
    assert_eq!(heap["rate"].as_u64(), Some(o.rate), "{describe}");
    assert_eq!(heap["unreadable"].as_u64(), Some(0), "{describe}");
    // The functions that keep most, named with Go file and line.
    for (func, line) in [("main.keepSmall", 32), ("main.keepLarge", 39)] {
        let row = p
            .stacks
            .iter()
            .find(|s| s.function == "go heap" && s.frames[0].function == func)
            .unwrap_or_else(|| panic!("no go heap row at {func}\n{describe}"));
        let f = &row.frames[0];
        assert!(
            f.file
                .as_deref()
                .is_some_and(|f| f.ends_with("goheap/main.go")),
            "{f:?}"
        );
        assert_eq!(f.line, Some(line), "{f:?}");
        assert_eq!(row.frames[1].function, "main.main", "{:?}", row.frames);
    }
    let mine = rows_in_use(p);
    let rate = o.rate as f64;
    for (func, (n, size), truth) in [
        ("main.keepSmall", SMALL, SMALL_TRUE),
        ("main.keepLarge", LARGE, LARGE.0 * LARGE.1),
    ] {
        // The program's own profile: the same records, the same scaling.
        assert_eq!(
            mine.get(func),
            o.in_use.get(func),
            "{func}: in use as read, and as the program's pprof.WriteHeapProfile says\n{describe}"
        );
        let got = mine[func] as f64;
        let bound = sampling_bound(n, size, rate);
        assert!(
            (got - truth).abs() <= bound,
            "{func}: {got} bytes in use, {truth} allocated: more than {bound} apart\n{describe}"
        );
    }
    // The whole heap against ReadMemStats: the sampling error of both
    // shapes, and 4 MiB for the rest of the program (its runtime, the
    // profile's own writing).
    let total: i64 = mine.values().sum();
    let bound = (sampling_bound(SMALL.0, SMALL.1, rate).powi(2)
        + sampling_bound(LARGE.0, LARGE.1, rate).powi(2))
    .sqrt()
        + 4.0 * 1048576.0;
    assert!(
        (total as f64 - o.heap_alloc).abs() <= bound,
        "{total} bytes in use over the rows, ReadMemStats says {}: more than {bound} apart\n{describe}",
        o.heap_alloc
    );
}

/// By pid: each build's rows, read while it runs.
#[test]
fn go_heap_by_pid_static_stripped_and_cgo() {
    let dir = bpf_tempdir!();
    for build in [Build::Static, Build::Stripped, Build::Cgo] {
        let Some(exe) = goheap(build) else {
            return;
        };
        let oracle_path = dir.path().join(format!("{build:?}.pb.gz"));
        let mut fx = FixtureProc::start(exe, &[oracle_path.to_str().unwrap(), "0"]);
        fx.stdout.wait_for(|l| l == "ready", LINE_TIMEOUT);
        let pid = fx.pid().to_string();
        let (out, p) = run_profiled(&["--pid", &pid, "--duration", "2"]);
        out.assert_exit(0);
        let describe = format!("{build:?}\n{}", out.describe());
        assert!(!out.stdout.contains("no allocations traced"), "{describe}");
        assert!(out.stdout.contains("go heap: pid "), "{describe}");
        let heap = &p.doc["go_heaps"][0];
        assert_eq!(heap["since"], "attach", "{describe}");
        assert_eq!(heap["read_at"], "running", "{describe}");
        // It makes garbage at about 40 MB/s while traced: what it
        // allocated since mtrace came is counted, at churn.
        let churned: u64 = p
            .stacks
            .iter()
            .filter(|s| s.function == "go heap" && s.frames[0].function == "main.churn")
            .map(|s| s.bytes)
            .sum();
        assert!(
            churned > 10 << 20,
            "{churned} bytes at main.churn\n{describe}"
        );
        check_rows(&p, &oracle(dir.path(), &oracle_path), &describe);
    }
}

/// From launch: read at the program's exit (held there), counted from
/// its start; with cgo, its malloc calls exact beside its Go heap.
#[test]
fn go_heap_from_launch_static_and_cgo() {
    let dir = bpf_tempdir!();
    for build in [Build::Static, Build::Cgo] {
        let Some(exe) = goheap(build) else {
            return;
        };
        let oracle_path = dir.path().join(format!("{build:?}.launch.pb.gz"));
        let (out, p) = run_profiled(&[
            "--",
            exe.to_str().unwrap(),
            oracle_path.to_str().unwrap(),
            "1",
        ]);
        out.assert_exit(0);
        let describe = format!("{build:?}\n{}", out.describe());
        let heap = &p.doc["go_heaps"][0];
        assert_eq!(heap["since"], "start", "{describe}");
        assert_eq!(heap["read_at"], "exit", "{describe}");
        check_rows(&p, &oracle(dir.path(), &oracle_path), &describe);
        if let Build::Cgo = build {
            let (calls, bytes) = p.site("malloc", "c_alloc");
            assert_eq!((calls, bytes), (1000, 100_000), "{describe}");
        }
    }
}

/// `mtrace agent` on a Go program: `go tool pprof` reads its Go heap
/// profile, whose bytes in use are the program's own.
#[test]
fn go_tool_pprof_reads_the_agents_go_heap() {
    let dir = bpf_tempdir!();
    let Some(exe) = goheap(Build::Static) else {
        return;
    };
    let oracle_path = dir.path().join("agent.pb.gz");
    let mut fx = FixtureProc::start(exe, &[oracle_path.to_str().unwrap(), "0"]);
    fx.stdout.wait_for(|l| l == "ready", LINE_TIMEOUT);
    let pid = fx.pid().to_string();
    let agent = Agent::start(&["--pid", &pid]);
    let served = in_use_by_function(dir.path(), &agent.url("/debug/pprof/heap"));
    let o = oracle(dir.path(), &oracle_path);
    for func in ["main.keepSmall", "main.keepLarge"] {
        assert_eq!(served.get(func), o.in_use.get(func), "{func}: {served:?}");
    }
    drop(agent);
}

/// A Go program whose runtime samples nothing (`MemProfileRate` 0, here
/// by GODEBUG) is one line saying so, not "no allocations traced", and
/// mtrace does not write into it.
#[test]
fn a_go_program_that_samples_nothing_is_said() {
    let dir = bpf_tempdir!();
    let Some(exe) = goheap(Build::Static) else {
        return;
    };
    let oracle_path = dir.path().join("zero.pb.gz");
    let mut fx = FixtureProc::start_env(
        exe,
        &[oracle_path.to_str().unwrap(), "0"],
        &[("GODEBUG", "memprofilerate=0")],
    );
    fx.stdout.wait_for(|l| l == "ready", LINE_TIMEOUT);
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
    // Still 0: read, never written.
    let o = std::fs::read_to_string(format!("{}.memstats", oracle_path.display())).unwrap();
    assert!(o.contains("MemProfileRate 0"), "{o}");
}

/// node keeps JavaScript objects in V8's heap: said in one line, its
/// malloc calls counted all the same.
#[test]
fn node_says_its_v8_heap_is_not_seen() {
    let _dir = bpf_tempdir!();
    let node = "/usr/bin/node";
    if !support::require(Path::new(node).exists(), "node is missing") {
        return;
    }
    let (out, p) = run_profiled(&[
        "--",
        node,
        "-e",
        "const a = []; for (let i = 0; i < 1000; i++) a.push({i});",
    ]);
    out.assert_exit(0);
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("not seen: "))
        .unwrap_or_else(|| panic!("no `not seen:` line\n{}", out.describe()));
    assert!(line.contains("v8 heap"), "{line}");
    assert_eq!(p.doc["unseen"][0]["heap"], "v8 heap");
    assert!(p.totals.allocs.calls > 0, "{}", out.describe());
}

/// A JVM keeps Java objects in its own heap (libjvm.so, loaded after the
/// probes are in): said in one line, its malloc calls counted.
#[test]
fn a_jvm_says_its_java_heap_is_not_seen() {
    let _dir = bpf_tempdir!();
    if !support::require(have("java"), "java is missing") {
        return;
    }
    let (out, p) = run_profiled(&["--", "java", "-Xshare:auto", "-version"]);
    out.assert_exit(0);
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("not seen: "))
        .unwrap_or_else(|| panic!("no `not seen:` line\n{}", out.describe()));
    assert!(line.contains("java heap"), "{line}");
    assert!(p.totals.allocs.calls > 0, "{}", out.describe());
}
