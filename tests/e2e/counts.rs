//! The counts fixture: exact calls and bytes per allocation site, traced
//! from launch and attached by pid.

use std::fs;

use crate::support::{trace_fixture, Fixture, FixtureProc, Mtrace, Profile, EXIT_TIMEOUT};

/// (allocator function, direct caller, calls, bytes) of tests/fixtures/counts.c.
pub const COUNTS_SITES: &[(&str, &str, u64, u64)] = &[
    ("malloc", "alloc_small", 1000, 48000),
    ("calloc", "alloc_zeroed", 250, 62500),
    // realloc(NULL, 100), then 200, ... 1000.
    ("realloc", "grow_buffer", 10, 5500),
    ("malloc", "leaf_alloc", 5, 20480),
    ("posix_memalign", "aligned_allocs", 7, 700),
    ("aligned_alloc/memalign", "aligned_allocs", 3, 384),
    // 8 * 16, 8 * 32, 8 * 48, 8 * 64.
    ("reallocarray", "array_allocs", 4, 1280),
    ("valloc", "page_allocs", 2, 2000),
];
pub const COUNTS_TOTAL_CALLS: u64 = 1281;
pub const COUNTS_TOTAL_BYTES: u64 = 140844;
/// 1000 + 250 + 1 + 5 + 7 + 3 + 1 + 2.
pub const COUNTS_FREES: u64 = 1269;
/// recurse(20) between main and leaf_alloc.
pub const RECURSE_DEPTH: usize = 20;

/// Everything the counts fixture must produce, whatever the mode.
/// Every site of the counts fixture with its exact calls and bytes, under
/// any allocator: glibc's `aligned_alloc/memalign` (one function) may be
/// two in another allocator.
pub fn assert_counts_sites(p: &Profile, d: &str) {
    assert_counts_sites_times(p, 1, d);
}

/// As [`assert_counts_sites`], for `times` runs of the fixture.
pub fn assert_counts_sites_times(p: &Profile, times: u64, d: &str) {
    for &(func, caller, calls, bytes) in COUNTS_SITES {
        let (mut got_calls, mut got_bytes) = p.site(func, caller);
        if func.contains('/') && got_calls == 0 {
            for name in func.split('/') {
                let (c, b) = p.site(name, caller);
                (got_calls, got_bytes) = (got_calls + c, got_bytes + b);
            }
        }
        assert_eq!(
            (got_calls, got_bytes),
            (calls * times, bytes * times),
            "{func} from {caller}\n{d}"
        );
    }
}

pub fn check_counts_profile(p: &Profile) {
    let dump = p.dump();
    for &(func, caller, calls, bytes) in COUNTS_SITES {
        assert_eq!(
            p.site(func, caller),
            (calls, bytes),
            "{func} from {caller}: (calls, bytes)\n{dump}"
        );
        for stack in p.stacks_at(func, caller) {
            assert!(!stack.truncated, "truncated stack\n{dump}");
            let f = stack.names();
            if caller == "leaf_alloc" {
                assert!(f.len() > RECURSE_DEPTH + 1, "short stack {f:?}");
                assert!(
                    f[1..=RECURSE_DEPTH].iter().all(|n| *n == "recurse"),
                    "expected {RECURSE_DEPTH} recurse frames under leaf_alloc: {f:?}"
                );
                assert_eq!(f[RECURSE_DEPTH + 1], "main", "{f:?}");
            } else {
                assert_eq!(f.get(1).copied(), Some("main"), "{stack:?}");
            }
        }
    }
    // The allocator's calls to itself, each counted once under the outer
    // call and counted here: glibc's reallocarray calls realloc (4 times),
    // and a realloc of NULL calls malloc (grow_buffer's first realloc and
    // array_allocs' first reallocarray).
    assert_eq!(p.totals.nested, 4 + 2, "nested calls\n{dump}");
    // No other allocation site.
    let mut expected: Vec<(String, String)> = COUNTS_SITES
        .iter()
        .map(|&(f, c, _, _)| (f.to_string(), c.to_string()))
        .collect();
    expected.sort();
    expected.dedup();
    assert_eq!(p.sites(), expected, "unexpected allocation sites\n{dump}");

    assert_eq!(
        p.total(),
        (COUNTS_TOTAL_CALLS, COUNTS_TOTAL_BYTES),
        "totals\n{dump}"
    );
    // Count mode probes `free` only with --count-frees (live mode always).
    let free_probed = p.doc["meta"]["probes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|pr| pr["function"] == "free");
    assert_eq!(p.totals.frees_counted, free_probed, "{dump}");
    if p.totals.frees_counted {
        assert_eq!(p.totals.frees, COUNTS_FREES, "frees");
    } else {
        assert_eq!(p.totals.frees, 0, "frees");
    }
    assert_eq!(
        p.per_func_alloc_calls(),
        COUNTS_TOTAL_CALLS,
        "{:?}",
        p.totals.per_func
    );
    assert_eq!(p.calls_of("malloc"), Some(1005));
    p.assert_no_losses();
    // The timeline holds every call, byte and (when counted) free.
    let points = p.doc["timeline"]["points"]
        .as_array()
        .unwrap_or_else(|| panic!("no timeline\n{dump}"));
    assert!(!points.is_empty(), "an empty timeline");
    let sum = |field: &str| -> u64 {
        points
            .iter()
            .map(|pt| pt[field].as_u64().unwrap_or(0))
            .sum()
    };
    assert_eq!(
        (sum("calls"), sum("bytes")),
        (COUNTS_TOTAL_CALLS, COUNTS_TOTAL_BYTES),
        "timeline {points:?}"
    );
    if p.totals.frees_counted {
        assert_eq!(sum("frees"), COUNTS_FREES, "timeline {points:?}");
    } else {
        assert!(
            points.iter().all(|pt| pt.get("frees").is_none()),
            "{points:?}"
        );
    }
}

/// A launch-mode run of the counts fixture with `args` before `--`.
fn check_launch_run(args: &[&str]) {
    let (out, p) = trace_fixture(Fixture::Counts, args);
    // The fixture's own output comes first on the shared stdout.
    assert!(
        out.stdout.lines().any(|l| l == "done"),
        "the fixture did not finish\n{}",
        out.describe()
    );
    let command = p.doc["meta"]["command"].as_str().expect("meta.command");
    assert!(command.contains(Fixture::Counts.path_str()), "{command:?}");
    check_counts_profile(&p);
}

#[test]
fn launch_mode_exact_counts() {
    need_bpf!();
    check_launch_run(&["--top", "0", "--count-frees"]);
}

/// Count mode needs one probe per allocating call: `free` is not probed
/// (and the report says frees were not counted) unless asked for.
#[test]
fn count_mode_probes_no_free_by_default() {
    need_bpf!();
    let (out, p) = trace_fixture(Fixture::Counts, &["--top", "0"]);
    out.assert_exit(0);
    check_counts_profile(&p);
    assert!(!p.totals.frees_counted);
    let probed: Vec<&str> = p.doc["meta"]["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pr| pr["function"].as_str().unwrap())
        .collect();
    assert!(!probed.contains(&"free"), "{probed:?}");
    assert!(probed.contains(&"malloc"), "{probed:?}");
    assert_eq!(out.report().frees, None, "{}", out.describe());
}

#[test]
fn launch_mode_folded_and_flamegraph() {
    let dir = bpf_tempdir!();
    let folded = dir.path().join("counts.folded");
    let svg = dir.path().join("counts.svg");
    check_launch_run(&[
        "--top",
        "0",
        "--folded",
        folded.to_str().unwrap(),
        "--weight",
        "bytes",
        "--flamegraph",
        svg.to_str().unwrap(),
    ]);

    let text = fs::read_to_string(&folded).expect("no folded file written");
    let mut total = 0;
    let mut small = 0;
    let mut leaf = 0;
    for line in text.lines() {
        let (stack, n) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad folded line {line:?}"));
        let n: u64 = n
            .parse()
            .unwrap_or_else(|_| panic!("bad count in {line:?}"));
        total += n;
        let frames: Vec<&str> = stack.split(';').collect();
        let func = *frames.last().unwrap();
        assert!(
            COUNTS_SITES.iter().any(|&(f, ..)| f == func),
            "folded line does not end in an allocator: {line:?}"
        );
        if stack.ends_with(";alloc_small;malloc") {
            small += n;
        }
        if stack.ends_with(";leaf_alloc;malloc") {
            leaf += n;
            // Root first: ...;main;recurse x 20;leaf_alloc;malloc.
            let k = frames.len();
            assert!(k >= RECURSE_DEPTH + 3, "{line:?}");
            assert!(
                frames[k - 2 - RECURSE_DEPTH..k - 2]
                    .iter()
                    .all(|f| *f == "recurse"),
                "{line:?}"
            );
            assert_eq!(frames[k - 3 - RECURSE_DEPTH], "main", "{line:?}");
        }
    }
    assert_eq!(small, 48000, "bytes of alloc_small in\n{text}");
    assert_eq!(leaf, 20480, "bytes of leaf_alloc in\n{text}");
    assert_eq!(total, COUNTS_TOTAL_BYTES, "all bytes in\n{text}");

    let svg_text = fs::read_to_string(&svg).expect("no flamegraph written");
    assert!(svg_text.contains("<svg"), "not an SVG");
    assert!(
        svg_text.contains("alloc_small"),
        "alloc_small not in the SVG"
    );
}

#[test]
fn pid_mode_exact_counts() {
    need_bpf!();
    let mut fx = FixtureProc::start(Fixture::Counts.path(), &["--wait"]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let mut m = Mtrace::start_profiled(&["--top", "0", "--pid", &pid]);
    assert_eq!(m.wait_tracing(), fx.pid());
    fx.release();
    let status = fx.proc.wait_timeout(EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(0), "fixture status");
    fx.stdout.wait_for(|l| l == "done", EXIT_TIMEOUT);

    // mtrace notices the exit by itself.
    let (out, p) = m.finish();
    out.assert_exit(0);
    assert_eq!(p.pid(), fx.pid(), "meta.pid");
    let command = p.doc["meta"]["command"].as_str().expect("meta.command");
    assert!(command.contains(Fixture::Counts.path_str()), "{command:?}");
    check_counts_profile(&p);
}
