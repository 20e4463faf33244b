//! The threads fixture: four named threads, 100/200/300/400 allocations.

use std::collections::{BTreeMap, BTreeSet};

use crate::support::{trace_by_pid, trace_fixture, Fixture, FixtureProc, Profile};

/// Thread name -> calls from thread_alloc; every call is malloc(32).
const PER_THREAD: &[(&str, u64)] = &[
    ("worker-0", 100),
    ("worker-1", 200),
    ("worker-2", 300),
    ("worker-3", 400),
];

#[test]
fn per_thread_split_by_name_and_tid() {
    need_bpf!();
    let (_, p) = trace_fixture(Fixture::Threads, &["--per-thread", "--top", "0"]);
    check_per_thread(&p);
}

/// By pid, the threads are named as they named themselves too.
#[test]
fn per_thread_by_pid() {
    need_bpf!();
    let mut fx = FixtureProc::start(Fixture::Threads.path(), &["--wait"]);
    let (_, p) = trace_by_pid(&mut fx, &["--per-thread", "--top", "0"]);
    check_per_thread(&p);
}

/// The host engine (`--file-wide`: the command's tree, probes file-wide)
/// splits by thread as the per-process one does: each worker under its
/// name and tid, exactly. (Its stacks are checked elsewhere: a worker's
/// first walk, handed to the tracer, can find the process gone and its
/// caller's mapping not looked up, as the host engine says.)
#[test]
fn per_thread_on_the_host_engine() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let (_, p) = trace_fixture(
        Fixture::Threads,
        &["--file-wide", "--per-thread", "--top", "0"],
    );
    check_per_thread_counts(&p);
}

/// thread_alloc's calls split by thread: each worker under its own name
/// and tid, with its exact count.
fn check_per_thread(p: &Profile) {
    let pid = p.pid();
    let dump = p.dump();

    let stacks = p.stacks_at("malloc", "thread_alloc");
    assert_eq!(p.site("malloc", "thread_alloc"), (1000, 32000), "\n{dump}");
    // Sum by thread; stacks of one thread may come from two call sites.
    let mut by_thread: BTreeMap<(String, u32), (u64, u64)> = BTreeMap::new();
    for stack in &stacks {
        assert_eq!(stack.names().get(1).copied(), Some("worker"), "{stack:?}");
        let thread = stack
            .thread
            .clone()
            .unwrap_or_else(|| panic!("a stack without thread with --per-thread\n{dump}"));
        let e = by_thread.entry((thread.name, thread.tid)).or_default();
        e.0 += stack.calls;
        e.1 += stack.bytes;
    }
    let mut by_name: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let mut tids = BTreeSet::new();
    for ((name, tid), counts) in &by_thread {
        assert!(
            by_name.insert(name.as_str(), *counts).is_none(),
            "thread name {name} with two tids\n{dump}"
        );
        assert!(tids.insert(*tid), "tid {tid} with two names\n{dump}");
        assert_ne!(*tid, pid, "a worker stack on the main thread\n{dump}");
    }
    let expected: BTreeMap<&str, (u64, u64)> = PER_THREAD
        .iter()
        .map(|&(name, calls)| (name, (calls, calls * 32)))
        .collect();
    assert_eq!(by_name, expected, "\n{dump}");
    // Every stack carries its thread.
    assert!(p.allocs().all(|s| s.thread.is_some()), "\n{dump}");
    p.assert_no_losses();
}

#[test]
fn threads_summed_without_per_thread() {
    need_bpf!();
    let (_, p) = trace_fixture(Fixture::Threads, &["--top", "0"]);
    let dump = p.dump();
    assert_eq!(p.site("malloc", "thread_alloc"), (1000, 32000), "\n{dump}");
    assert!(p.allocs().all(|s| s.thread.is_none()), "\n{dump}");
    p.assert_no_losses();
}

/// Each worker's malloc calls under its own name and tid, exactly, none on
/// the main thread; every row carries its thread.
fn check_per_thread_counts(p: &Profile) {
    let pid = p.pid();
    let dump = p.dump();
    let mut by_thread: BTreeMap<String, (BTreeSet<u32>, u64, u64)> = BTreeMap::new();
    for stack in p.allocs() {
        let thread = stack
            .thread
            .clone()
            .unwrap_or_else(|| panic!("a stack without thread with --per-thread\n{dump}"));
        if stack.function != "malloc" || !thread.name.starts_with("worker-") {
            continue;
        }
        assert_ne!(
            thread.tid, pid,
            "a worker's name on the main thread\n{dump}"
        );
        let e = by_thread.entry(thread.name).or_default();
        e.0.insert(thread.tid);
        e.1 += stack.calls;
        e.2 += stack.bytes;
    }
    let got: BTreeMap<&str, (usize, u64, u64)> = by_thread
        .iter()
        .map(|(name, (tids, calls, bytes))| (name.as_str(), (tids.len(), *calls, *bytes)))
        .collect();
    let expected: BTreeMap<&str, (usize, u64, u64)> = PER_THREAD
        .iter()
        .map(|&(name, calls)| (name, (1, calls, calls * 32)))
        .collect();
    assert_eq!(got, expected, "\n{dump}");
    let tids: BTreeSet<u32> = by_thread
        .values()
        .flat_map(|(t, _, _)| t.iter().copied())
        .collect();
    assert_eq!(tids.len(), PER_THREAD.len(), "\n{dump}");
}
