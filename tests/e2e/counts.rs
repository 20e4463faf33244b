//! The counts fixture: exact calls and bytes per allocation site, traced
//! from launch and attached by pid.

use std::fs;

use crate::support::{
    counts::{check_counts_profile, COUNTS_SITES, COUNTS_TOTAL_BYTES, RECURSE_DEPTH},
    trace_fixture, Fixture, FixtureProc, Mtrace, EXIT_TIMEOUT,
};

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

/// The host engine (`--file-wide -- CMD`) counts the fixture as the
/// per-process engine does: every site exact, no loss, and a timeline
/// that holds every call and byte (it had none); its report parses, the
/// losses one list whose lines join (the host's were a second list under
/// the same label), every line but the paths and frames within 80
/// columns (the scope line was 200 wide).
#[test]
fn file_wide_counts_are_exact_with_a_timeline_and_a_report_that_parses() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let (out, p) = trace_fixture(Fixture::Counts, &["--file-wide", "--top", "0"]);
    out.assert_exit(0);
    check_counts_profile(&p);
    let r = out.report();
    assert_eq!(r.lost.len(), 13, "{:?}\n{}", r.lost, out.describe());
    assert!(r.lost.iter().all(|(_, n)| *n == 0), "{:?}", r.lost);
    for line in out
        .stdout
        .lines()
        .filter(|l| l.starts_with("scope: ") || l.starts_with("lost: "))
    {
        assert!(line.chars().count() <= 80, "{line:?}");
    }
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
