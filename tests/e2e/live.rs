//! Live mode (--live): outstanding blocks and leaks, temporaries, the peak,
//! realloc chains, cross-thread frees, failed allocations, a full live map
//! and frees of blocks allocated before attach. Numbers come from the JSON
//! profile (-o), which carries the same data as the table.

use crate::support::counts::check_counts_profile;
use crate::support::{
    live::{check_live_fixture, run_live, site, u},
    run_profiled, Fixture, FixtureProc, Mtrace, EXIT_TIMEOUT,
};

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
