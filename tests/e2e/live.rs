//! Live mode (--live): outstanding blocks and leaks, temporaries, the peak,
//! realloc chains, cross-thread frees, failed allocations, a full live map
//! and frees of blocks allocated before attach. Numbers come from the JSON
//! profile (-o), which carries the same data as the table.

use serde_json::Value;

use crate::support::counts::check_counts_profile;
use crate::support::{run_profiled, Finished, Fixture, FixtureProc, Mtrace, Profile, EXIT_TIMEOUT};

/// Live statistics summed over the stacks of `func` whose direct caller is
/// `caller` (a compiler may split one site into several call instructions).
pub fn site(p: &Profile, func: &str, caller: &str) -> Value {
    let keys = [
        "allocations",
        "allocated_bytes",
        "frees",
        "outstanding",
        "outstanding_bytes",
        "old_outstanding",
        "old_outstanding_bytes",
        "live_bytes_at_peak",
        "temporaries",
    ];
    let mut sum = serde_json::Map::new();
    let stacks = p.stacks_at(func, caller);
    assert!(!stacks.is_empty(), "no stack {func} <- {caller}");
    for s in &stacks {
        let live = s
            .live
            .as_ref()
            .unwrap_or_else(|| panic!("no live data at {func} <- {caller}: {s:?}"));
        for k in keys {
            let v = sum.get(k).and_then(Value::as_u64).unwrap_or(0) + live[k].as_u64().unwrap();
            sum.insert(k.into(), v.into());
        }
    }
    sum.insert("calls".into(), p.site(func, caller).0.into());
    Value::Object(sum)
}

/// A live statistic summed over every stack.
fn sum_live(p: &Profile, key: &str) -> u64 {
    p.stacks
        .iter()
        .filter_map(|s| s.live.as_ref()?[key].as_u64())
        .sum()
}

pub fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

/// Everything the live fixture must show, however it was traced.
pub fn check_live_fixture(p: &Profile, out: &Finished) {
    let d = out.describe();
    // (function, caller, [(field, expected)]) for each site of the fixture.
    type Site<'a> = (&'a str, &'a str, &'a [(&'a str, u64)]);
    let expected: [Site; 5] = [
        // 100 x malloc(64), never freed.
        (
            "malloc",
            "leak_site",
            &[
                ("allocations", 100),
                ("outstanding", 100),
                ("outstanding_bytes", 6400),
                ("temporaries", 0),
                ("live_bytes_at_peak", 6400),
            ],
        ),
        // 10000 x malloc(32) + free: nothing left, all temporary.
        (
            "malloc",
            "churn_site",
            &[
                ("allocations", 10000),
                ("frees", 10000),
                ("outstanding", 0),
                ("temporaries", 10000),
            ],
        ),
        // realloc 1000 times: one block of the final size.
        (
            "realloc",
            "grow_site",
            &[
                ("calls", 1000),
                ("allocations", 1000),
                ("frees", 999),
                ("outstanding", 1),
                ("outstanding_bytes", 16000),
                ("live_bytes_at_peak", 16000),
            ],
        ),
        // Allocated in a thread, freed by main; the 500 blocks, the leaks
        // and the grown buffer were all live at the peak.
        (
            "malloc",
            "producer",
            &[
                ("allocations", 500),
                ("frees", 500),
                ("outstanding", 0),
                ("live_bytes_at_peak", 64000),
            ],
        ),
        // Failed calls are calls, not allocations (also for malloc, below).
        (
            "posix_memalign",
            "failing_allocs",
            &[("calls", 1), ("allocations", 0), ("outstanding", 0)],
        ),
    ];
    for (func, caller, fields) in expected {
        let got = site(p, func, caller);
        for (field, want) in fields {
            assert_eq!(u(&got, field), *want, "{func} from {caller}: {field}\n{d}");
        }
    }
    let failed = site(p, "malloc", "failing_allocs");
    let failed = ["calls", "allocations", "outstanding"].map(|k| u(&failed, k));
    assert_eq!(failed, [1, 0, 0], "malloc from failing_allocs\n{d}");
    let live = &p.doc["live"];
    assert_eq!(u(live, "failed"), 2, "{d}");
    assert_eq!(u(live, "untracked"), 0, "{d}");
    assert_eq!(u(live, "events_lost"), 0, "{d}");
    assert_eq!(u(live, "stale"), 0, "{d}");
    // Each stack's share of the peak adds up to it.
    let shares = sum_live(p, "live_bytes_at_peak");
    assert_eq!(u(live, "peak_bytes"), shares, "{d}");
    assert!(u(live, "peak_bytes") >= 86400, "{d}");
    // Totals match the stacks.
    let outstanding = sum_live(p, "outstanding_bytes");
    assert_eq!(u(live, "outstanding_bytes"), outstanding, "{d}");
}

/// A live-mode run of the live fixture, with `extra` options.
pub fn run_live(extra: &[&str]) -> (Profile, Finished) {
    let mut args = vec!["--live", "--top", "0", "--temporary-under", "100ms"];
    args.extend_from_slice(extra);
    args.push("--");
    args.push(Fixture::Live.path_str());
    let (out, p) = run_profiled(&args);
    out.assert_exit(0);
    (p, out)
}

#[test]
fn leaks_churn_realloc_threads_and_failures() {
    need_bpf!();
    let (p, out) = run_live(&[]);
    assert_eq!(p.mode(), "live");
    check_live_fixture(&p, &out);
    // The leak suspects in the table: tests/e2e/table.rs.
}

#[test]
fn counts_stay_exact_with_return_probes() {
    need_bpf!();
    // Nested calls (realloc -> malloc, reallocarray -> realloc, ...) are
    // recognised without the entry marks in live mode: the same exact
    // counts as count mode.
    let (out, p) = run_profiled(&["--live", "--top", "0", "--", Fixture::Counts.path_str()]);
    out.assert_exit(0);
    assert_eq!(p.mode(), "live");
    check_counts_profile(&p);
}

#[test]
fn min_age_filters_leak_suspects() {
    need_bpf!();
    let (p, out) = run_live(&["--min-age", "3600"]);
    let leak = site(&p, "malloc", "leak_site");
    assert_eq!(u(&leak, "outstanding"), 100);
    assert_eq!(u(&leak, "old_outstanding"), 0, "{}", out.describe());
    assert_eq!(
        u(&p.doc["live"], "old_outstanding"),
        0,
        "{}",
        out.describe()
    );
    // `leak suspects (...): none` in the table: tests/e2e/table.rs.
}

#[test]
fn a_full_live_map_counts_untracked_allocations() {
    need_bpf!();
    let (p, out) = run_live(&["--live-map-size", "16"]);
    let d = out.describe();
    // live.c's first blocks are leak_site's 100, never freed: the first 16
    // fill the map, and every later allocation finds it full: the other 84,
    // churn_site's 10,000, grow_site's 1,000 reallocs, the producer's 500
    // and the calloc of the second thread's creation.
    let untracked = u(&p.doc["live"], "untracked");
    assert_eq!(untracked, 84 + 10_000 + 1000 + 500 + 1, "{d}");
    assert_eq!(u(&p.doc["live"], "live_map_size"), 16, "{}", out.describe());
    // Calls are still counted exactly.
    let leak: u64 = p
        .allocs()
        .filter(|s| s.caller() == Some("leak_site"))
        .map(|s| s.calls)
        .sum();
    assert_eq!(leak, 100, "{}", out.describe());
    assert_eq!(u(&p.doc["live"], "outstanding"), 16, "{d}");
    assert_eq!(u(&p.doc["live"], "outstanding_bytes"), 16 * 64, "{d}");
    let leak = site(&p, "malloc", "leak_site");
    assert_eq!(u(&leak, "outstanding"), 16, "{d}");
    // The 84 leaks the map had no room for are not named, and the
    // suspects say so rather than stand as the whole story.
    assert!(
        out.stdout.contains(&format!(
            "\nuncertain: {untracked} allocations not followed (the live map was full),\n\
             uncertain: at least "
        )),
        "{d}"
    );
    // The untracked line and its hint in the table: tests/e2e/table.rs.
}

#[test]
fn frees_of_blocks_allocated_before_attach_are_counted_apart() {
    need_bpf!();
    // Launch mode first, for what the program frees that it did not
    // allocate through the probed functions (the dynamic linker's blocks).
    let (launched, _) = run_live(&[]);
    let baseline = u(&launched.doc["live"], "frees_unknown");

    let mut fx = FixtureProc::start(Fixture::Live.path(), &["--wait"]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let mut m = Mtrace::start_profiled(&[
        "--live",
        "--top",
        "0",
        "--temporary-under",
        "100ms",
        "--pid",
        &pid,
    ]);
    m.wait_tracing();
    fx.release();
    assert_eq!(fx.proc.wait_timeout(EXIT_TIMEOUT).code(), Some(0));
    let (out, p) = m.finish();
    out.assert_exit(0);
    // The 50 blocks allocated before attach and freed after it.
    assert_eq!(
        u(&p.doc["live"], "frees_unknown"),
        baseline + 50,
        "{}",
        out.describe()
    );
    // ... and nothing else is disturbed by them.
    check_live_fixture(&p, &out);
}
