//! The live fixture (tests/fixtures/live.c) in live mode: its run, what
//! it must show, and live statistics by site.

use serde_json::Value;

use super::{run_profiled, Finished, Fixture, Profile};

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
