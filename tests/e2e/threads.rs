//! The threads fixture: four named threads, 100/200/300/400 allocations.

use std::collections::{BTreeMap, BTreeSet};

use crate::support::{require_bpf, Fixture, Mtrace};

/// Thread name -> calls from thread_alloc; every call is malloc(32).
const PER_THREAD: &[(&str, u64)] = &[
    ("worker-0", 100),
    ("worker-1", 200),
    ("worker-2", 300),
    ("worker-3", 400),
];

#[test]
fn per_thread_split_by_name_and_tid() {
    if !require_bpf() {
        return;
    }
    let mut m = Mtrace::start(&[
        "--per-thread",
        "--top",
        "0",
        "--",
        Fixture::Threads.path_str(),
    ]);
    let pid = m.wait_tracing();
    let out = m.finish();
    out.assert_exit(0);
    let r = out.report();
    let dump = r.dump();

    let rows = r.rows_at("malloc", "thread_alloc");
    assert_eq!(r.site("malloc", "thread_alloc"), (1000, 32000), "\n{dump}");
    // Sum by thread; rows of one thread may come from two call sites.
    let mut by_thread: BTreeMap<(String, u32), (u64, u64)> = BTreeMap::new();
    for row in &rows {
        assert_eq!(
            row.frames.get(1).map(String::as_str),
            Some("worker"),
            "{row:?}"
        );
        let thread = row
            .thread
            .clone()
            .unwrap_or_else(|| panic!("a row without thread with --per-thread\n{dump}"));
        let e = by_thread.entry(thread).or_default();
        e.0 += row.calls;
        e.1 += row.bytes;
    }
    let mut by_name: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let mut tids = BTreeSet::new();
    for ((name, tid), counts) in &by_thread {
        assert!(
            by_name.insert(name.as_str(), *counts).is_none(),
            "thread name {name} with two tids\n{dump}"
        );
        assert!(tids.insert(*tid), "tid {tid} with two names\n{dump}");
        assert_ne!(*tid, pid, "a worker row on the main thread\n{dump}");
    }
    let expected: BTreeMap<&str, (u64, u64)> = PER_THREAD
        .iter()
        .map(|&(name, calls)| (name, (calls, calls * 32)))
        .collect();
    assert_eq!(by_name, expected, "\n{dump}");
    // Every row carries its thread.
    assert!(r.rows.iter().all(|row| row.thread.is_some()), "\n{dump}");
    r.assert_no_losses();
}

#[test]
fn threads_summed_without_per_thread() {
    if !require_bpf() {
        return;
    }
    let mut m = Mtrace::start(&["--top", "0", "--", Fixture::Threads.path_str()]);
    m.wait_tracing();
    let out = m.finish();
    out.assert_exit(0);
    let r = out.report();
    let dump = r.dump();
    assert_eq!(r.site("malloc", "thread_alloc"), (1000, 32000), "\n{dump}");
    assert!(r.rows.iter().all(|row| row.thread.is_none()), "\n{dump}");
    r.assert_no_losses();
}
