//! The table's tests: the whole report of a small profile, its hidden
//! rows, threads, losses, processes, the 80 columns and colour.

use super::super::test_util::{entry, on_thread, profile};
use super::super::SortKey;
use super::*;
use crate::profile::{Counts, Frame, Losses, StackQuality};
use std::sync::Arc;

const NO_LOSSES: &str = "\
lost: map full 0, stack walk failed 0, stack collisions 0, stack map full 0,
lost: caller unreadable 0, thread names 0";

fn all(per_thread: bool) -> ReportOptions {
    ReportOptions {
        top: 0,
        threshold_pct: 0.0,
        sort: SortKey::Calls,
        per_thread,
        per_process: false,
        color: false,
    }
}

fn sample() -> Profile {
    let mut leaf = entry("malloc", &[], 1000, 48000);
    leaf.frames = vec![
        Arc::new(Frame {
            function: "make_node".into(),
            file: Some("/src/list.c".into()),
            line: Some(12),
            module: Some("/tmp/fixture".into()),
            addr: 0x1234,
            inlined: true,
            ..Default::default()
        }),
        Arc::new(Frame {
            function: "main".into(),
            file: Some("/src/main.c".into()),
            line: Some(30),
            module: Some("/tmp/fixture".into()),
            addr: 0x1300,
            inlined: false,
            ..Default::default()
        }),
    ];
    let mut p = profile(vec![
        leaf,
        entry("calloc", &["zeroed", "main"], 250, 2500),
        entry("realloc", &["grow", "main"], 136, 15500),
        entry("free", &["drop_node", "main"], 1200, 0),
    ]);
    p.meta.pid = 1234;
    p.meta.command = "./fixture arg".into();
    p.meta.duration_secs = 1.234;
    p.meta.allocator_object = "/usr/lib/x86_64-linux-gnu/libc.so.6".into();
    p
}

fn lines(s: &str) -> Vec<&str> {
    s.lines().collect()
}

#[test]
fn full_report() {
    let out = render(&sample(), &all(false));
    let expected = "\
mtrace: pid 1234, 1.23 s
command: ./fixture arg
probes: /usr/lib/x86_64-linux-gnu/libc.so.6

#1  1000 calls  72.15%  46.9 KiB  avg 48 B  malloc
    make_node (list.c:12) [inlined]
    main (main.c:30)

#2  250 calls  18.04%  2.4 KiB  avg 10 B  calloc
    zeroed
    main

#3  136 calls  9.81%  15.1 KiB  avg 113 B  realloc
    grow
    main

total: 1386 allocation calls, 64.5 KiB requested, 1200 frees
by function: malloc 1000, calloc 250, realloc 136
"
    .to_string()
        + NO_LOSSES
        + "\n";
    assert_eq!(out, expected);
}

#[test]
fn hidden_rows_are_reported() {
    let mut o = all(false);
    o.threshold_pct = 10.0;
    o.top = 1;
    let out = render(&sample(), &o);
    let l = lines(&out);
    assert!(l.contains(&"1 more stack (136 calls, 15.1 KiB) hidden by --threshold"));
    assert!(l.contains(&"1 more stack (250 calls, 2.4 KiB) hidden by --top"));
    assert!(!out.contains("#2"));
}

#[test]
fn per_thread_rows_name_their_thread() {
    let p = profile(vec![
        on_thread(entry("malloc", &["a"], 3, 30), 42, "worker"),
        on_thread(entry("malloc", &["a"], 1, 10), 7, "main"),
    ]);
    let out = render(&p, &all(true));
    let l = lines(&out);
    assert!(l.contains(&"#1  3 calls  75.00%  30 B  avg 10 B  malloc  thread worker (tid 42)"));
    assert!(l.contains(&"#2  1 call  25.00%  10 B  avg 10 B  malloc  thread main (tid 7)"));

    let out = render(&p, &all(false));
    assert!(lines(&out).contains(&"#1  4 calls  100.00%  40 B  avg 10 B  malloc"));
    assert!(!out.contains("(tid "));
}

#[test]
fn truncated_rows_are_marked() {
    let mut e = entry("malloc", &["a"], 2, 20);
    e.truncated = true;
    let out = render(&profile(vec![e]), &all(false));
    assert!(
        lines(&out).contains(&"#1  2 calls  100.00%  20 B  avg 10 B  malloc  [stack truncated]")
    );
}

#[test]
fn a_scope_of_many_processes_is_named_not_pid_0() {
    for (scope, head) in [
        ("host", "mtrace: the host, 0.00 s"),
        ("cgroup", "mtrace: a cgroup, 0.00 s"),
        ("tree", "mtrace: pid 0, 0.00 s"),
    ] {
        let mut p = Profile::default();
        p.meta.scope = scope.into();
        assert_eq!(lines(&render(&p, &all(false)))[0], head);
    }
}

#[test]
fn empty_profile_says_so_and_still_prints_losses() {
    let out = render(&Profile::default(), &all(false));
    let l = lines(&out);
    assert_eq!(l[0], "mtrace: pid 0, 0.00 s");
    assert_eq!(l[1], "");
    assert!(l.contains(&"no allocations traced"));
    assert!(l.contains(&"total: 0 allocation calls, 0 B requested, 0 frees"));
    assert!(out.ends_with(&format!("{NO_LOSSES}\n")));
}

#[test]
fn losses_and_nested_are_explained() {
    let mut p = sample();
    p.totals.nested = 5;
    p.losses.map_full = 3;
    p.losses.stack_collisions = 2;
    let out = render(&p, &all(false));
    let l = lines(&out);
    assert!(l.contains(&"nested allocator calls not counted twice: 5"));
    assert!(out.contains(
        "lost: map full 3, stack walk failed 0, stack collisions 2, stack map full 0,\n\
             lost: caller unreadable 0, thread names 0\n"
    ));
    let notes: Vec<&str> = l
        .iter()
        .copied()
        .filter(|l| l.starts_with("note: "))
        .collect();
    assert_eq!(notes.len(), 2, "{out}");
    assert!(notes[0].contains("--count-map-size"));
    assert!(notes[1].contains("--stack-map-size"));
    assert!(!out.contains("caller unreadable:"));
}

#[test]
fn single_stepped_probes_that_were_hit_are_named() {
    let mut p = sample();
    let probe = |function: &str, emulated| crate::profile::Probe {
        function: function.into(),
        emulated,
        ..crate::profile::Probe::default()
    };
    p.meta.probes = vec![
        probe("malloc", false),
        probe("reallocarray", false),
        probe("calloc", true),
    ];
    p.totals.per_func.insert(
        "calloc".into(),
        Counts {
            calls: 7,
            bytes: 70,
        },
    );
    let out = render(&p, &all(false));
    let line = "single-stepped probes (20 us a call, not 1): malloc 1000";
    assert!(lines(&out).contains(&line), "{out}");
    p.meta.probes[0].emulated = true;
    assert!(!render(&p, &all(false)).contains("single-stepped"));
}

#[test]
fn no_nested_line_when_zero() {
    let out = render(&sample(), &all(false));
    assert!(!out.contains("nested"));
    assert!(!out.contains("note:"));
}

#[test]
fn zero_calls_do_not_divide_by_zero() {
    let mut p = profile(vec![entry("malloc", &["a"], 0, 0)]);
    p.totals.per_func.insert("calloc".into(), Counts::default());
    let out = render(&p, &all(false));
    assert!(lines(&out).contains(&"#1  0 calls  0.00%  0 B  avg 0 B  malloc"));
    assert!(lines(&out).contains(&"total: 0 allocation calls, 0 B requested, 0 frees"));
}

/// A live profile of a process tree, sampled, with losses: every line
/// but the frames within 80 columns.
#[test]
fn lines_fit_80_columns() {
    let mut p = sample();
    p.meta.allocator_family = "glibc".into();
    p.meta.allocator_version = "2.36".into();
    p.meta.processes = (0..3)
        .map(|i| crate::profile::ProcessMeta {
            pid: 100 + i,
            name: format!("worker{i}"),
            traced: i == 0,
            not_traced: (i > 0).then(|| "more than 1 process at once".to_string()),
            ..Default::default()
        })
        .collect();
    p.meta.sampling = Some(crate::profile::SamplingInfo {
        kind: "bytes".into(),
        rate: 512 * 1024,
        samples: 1,
    });
    for (i, name) in ["posix_memalign", "aligned_alloc", "reallocarray", "valloc"]
        .iter()
        .enumerate()
    {
        p.totals.per_func.insert(
            name.to_string(),
            Counts {
                calls: 123_456 + i as u64,
                bytes: 1,
            },
        );
    }
    p.losses = Losses {
        map_full: 123_456,
        stack_walk_failed: 123_456,
        stack_collisions: 123_456,
        stack_map_full: 123_456,
        caller_unreadable: 123_456,
        thread_names_full: 123_456,
        gone_stacks_beyond: 0,
        host: None,
    };
    p.stack_quality = Some(StackQuality {
        calls: 10,
        whole: 5,
        truncated: [
            "no_cfi",
            "max_frames",
            "bad_frame",
            "read_failed",
            "copy_lost",
        ]
        .iter()
        .map(|k| (k.to_string(), 1_000_000))
        .collect(),
        finished_by_tracer: 0,
        walked_in_kernel: 0,
        held_for_tracer: 1_000_000,
        not_held: 1_000_000,
        frame_limit: Some(126),
        python: Some(crate::profile::PythonQuality {
            with_frames: 1_000_000_000,
            no_interpreter: 1_000_000,
            no_thread_state: 1_000_000,
            no_code_running: 1_000_000,
            threads_beyond: 1_000_000,
            cut: 1_000_000,
            unreadable: 1_000_000,
            unnamed: 1_000_000,
            notices_lost: 1_000_000,
            not_known: 1_000_000,
        }),
        perf_map: Some(crate::profile::PerfMapQuality {
            lines: 1_000_000_000_000,
            kept: 1_000_000_000,
            evicted: 1_000_000_000_000,
            names_cut: 1_000_000_000,
            bad_lines: 1_000_000_000,
            unread_bytes: 123 << 30,
            rereads: 1_000_000,
        }),
        symbols: Some(crate::profile::SymbolsQuality {
            stripped_files: 1_000_000,
            local: 1_000_000,
            fetched: 1_000_000,
            not_on_servers: 1_000_000,
            not_fetched: 1_000_000,
        }),
    });
    p.live = Some(crate::profile::LiveTotals {
        peak_bytes: 123 << 30,
        untracked: 5,
        events_lost: 1_000_000,
        live_map_size: 262_144,
        old_outstanding: 1,
        old_outstanding_bytes: 16384,
        ..Default::default()
    });
    p.stacks[0].live = Some(crate::profile::LiveStats {
        allocations: 1_000_000,
        outstanding: 1_000_000,
        outstanding_bytes: 1 << 40,
        oldest_age_secs: 12345.0,
        old_outstanding: 1,
        old_outstanding_bytes: 16384,
        max_live_bytes: 1 << 40,
        live_bytes_at_peak: 1 << 40,
        temporaries: 1_000_000,
        size: Some(crate::profile::Percentiles {
            p50: 16384,
            p90: 16384,
            p99: 1 << 30,
            max: 1 << 30,
        }),
        lifetime_ns: None,
        ..Default::default()
    });
    let out = render(&p, &all(false));
    let frames = ["    make_node", "    main", "    zeroed", "    grow"];
    for line in out.lines() {
        if !frames.iter().any(|f| line.starts_with(f)) {
            assert!(line.len() <= 80, "{} columns: {line:?}\n{out}", line.len());
        }
    }
    assert!(out.contains("\n#1  1 block  16.0 KiB  oldest "), "{out}");
    assert!(out.contains("\n    size: p50 16.0 KiB, p90 16.0 KiB, p99 1.0 GiB, max 1.0 GiB\n"));
    assert!(out.contains("\nsampled: one sample per 512.0 KiB on average, 1 sample\n"));
    assert!(out.contains("\nnot traced: worker2 (pid 102): more than 1 process at once\n"));
}

/// The host scope counts every process; those whose records were not
/// kept are counted among those that allocated, never as untraced.
#[test]
fn host_scope_counts_processes_beyond_the_records_kept() {
    let mut p = sample();
    p.meta.scope = "host".into();
    p.meta.processes = (0..2)
        .map(|i| crate::profile::ProcessMeta {
            pid: 100 + i,
            name: format!("worker{i}"),
            traced: true,
            ..Default::default()
        })
        .collect();
    p.meta.processes_unlisted = 5;
    let out = render(&p, &all(false));
    assert!(
        out.contains("\nprocesses: 7 allocated (one per exec), the records of the newest 2 kept\n"),
        "{out}"
    );
    assert!(!out.contains("not traced"), "{out}");
}

#[test]
fn colour_only_when_asked() {
    let mut o = all(false);
    assert!(!render(&sample(), &o).contains('\u{1b}'));
    o.color = true;
    let out = render(&sample(), &o);
    assert!(out.contains("\u{1b}[1m#1  1000 calls  72.15%  46.9 KiB  avg 48 B  \u{1b}[0m"));
    assert!(out.contains("main\u{1b}[2m (main.c:30)\u{1b}[0m"), "{out}");
}
