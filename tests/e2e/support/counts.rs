//! The counts fixture's (tests/fixtures/counts.c) exact figures, and the
//! checks of a profile against them that several test files share.

use std::collections::BTreeMap;

use super::Profile;

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

/// (allocator function, direct caller) -> [calls, bytes] of the counts
/// fixture.
pub fn expected_sites() -> BTreeMap<(String, String), [i64; 2]> {
    COUNTS_SITES
        .iter()
        .map(|&(f, c, calls, bytes)| ((f.to_string(), c.to_string()), [calls as i64, bytes as i64]))
        .collect()
}
