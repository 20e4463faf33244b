//! The human table on stdout: its rows, totals and losses against the JSON
//! profile of the same run, its order and cut, and the lines of live mode
//! and sampling. Every other test asserts on the JSON profile; a change to
//! the table's look should only need changes here and in
//! support/table.rs.

use crate::{
    artifacts::{report, s, trace_counts},
    counts::check_counts_profile,
    live::{run_live, u},
    support::{table::live_table, trace_fixture, validate_profile, Finished, Fixture, Profile},
};

/// (function, frame names, truncated, thread, calls, bytes) of a row.
type RowKey = (String, Vec<String>, bool, Option<(String, u32)>, u64, u64);

/// Asserts that the table of `out` shows exactly the allocation stacks,
/// totals and losses of `p` (the profile of the same run, written with
/// `--top 0`).
fn assert_table_matches(out: &Finished, p: &Profile) {
    let r = out.report();
    let d = out.describe();
    assert!(
        r.header.starts_with(&format!("mtrace: pid {} (", p.pid())),
        "{}",
        r.header
    );
    let command = p.doc["meta"]["command"].as_str().unwrap();
    assert!(r.header.contains(command), "{}\n{command:?}", r.header);

    let mut rows: Vec<RowKey> = r
        .rows
        .iter()
        .map(|row| {
            assert!(!row.frames.is_empty(), "a row without frames\n{d}");
            (
                row.func.clone(),
                row.frames.clone(),
                row.truncated,
                row.thread.clone(),
                row.calls,
                row.bytes,
            )
        })
        .collect();
    let mut stacks: Vec<RowKey> = p
        .allocs()
        .map(|s| {
            (
                s.function.clone(),
                s.names().into_iter().map(str::to_string).collect(),
                s.truncated,
                s.thread.as_ref().map(|t| (t.name.clone(), t.tid)),
                s.calls,
                s.bytes,
            )
        })
        .collect();
    rows.sort();
    stacks.sort();
    assert_eq!(rows, stacks, "table rows vs profile stacks\n{d}");

    assert_eq!((r.total_calls, r.total_bytes), p.total(), "{d}");
    assert_eq!(
        r.frees,
        p.totals.frees_counted.then_some(p.totals.frees),
        "{d}"
    );
    let per_func: Vec<(String, u64)> = p
        .totals
        .per_func
        .iter()
        .filter(|(f, c)| *f != "free" && c.calls > 0)
        .map(|(f, c)| (f.clone(), c.calls))
        .collect();
    assert_eq!(
        r.per_func.clone().into_iter().collect::<Vec<_>>(),
        per_func,
        "{d}"
    );
    assert_eq!(r.nested, p.totals.nested, "{d}");
    let lost: Vec<(String, u64)> = [
        ("map full", "map_full"),
        ("stack walk failed", "stack_walk_failed"),
        ("stack collisions", "stack_collisions"),
        ("stack map full", "stack_map_full"),
        ("caller unreadable", "caller_unreadable"),
        ("thread names", "thread_names_full"),
    ]
    .iter()
    .map(|&(label, key)| (label.to_string(), p.losses[key]))
    .collect();
    assert_eq!(r.lost, lost, "{d}");
    // The stack-quality line: the share of whole stacks and every cause.
    let q = &p.doc["stack_quality"];
    let (calls, whole) = (q["calls"].as_u64().unwrap(), q["whole"].as_u64().unwrap());
    let pct = format!("{:.2}", whole as f64 * 100.0 / calls as f64);
    assert_eq!(r.stacks_whole_pct.as_deref(), Some(pct.as_str()), "{d}");
    let cut: Vec<(String, u64)> = q["truncated"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
        .filter(|(_, n)| *n > 0)
        .collect();
    assert_eq!(r.cut_short, cut, "{d}");
}

/// Launch mode, counts fixture: the table shows what the profile holds,
/// and the profile holds the exact counts.
#[test]
fn table_shows_the_exact_counts() {
    need_bpf!();
    let (out, p) = trace_fixture(Fixture::Counts, &["--top", "0"]);
    check_counts_profile(&p);
    assert_table_matches(&out, &p);
    // glibc's reallocarray multiplies before its first branch: the one
    // probe the kernel single-steps, and the report says what it cost.
    assert_eq!(
        out.report().single_stepped.as_deref(),
        Some("reallocarray 4"),
        "{}",
        out.describe()
    );
}

/// With --per-thread, every row names its thread.
#[test]
fn table_per_thread_rows_name_their_thread() {
    need_bpf!();
    let (out, p) = trace_fixture(Fixture::Threads, &["--per-thread", "--top", "0"]);
    assert_eq!(p.site("malloc", "thread_alloc"), (1000, 32000));
    assert!(p.allocs().all(|s| s.thread.is_some()), "{}", p.dump());
    assert_table_matches(&out, &p);
}

/// `--sort bytes --top 3`: the same table from the live run and from
/// `mtrace report`, in the order of bytes.
#[test]
fn table_sort_and_top_are_the_same_from_report() {
    let dir = bpf_tempdir!();
    let h = dir.path().join("h.json");
    let live = trace_counts(
        Fixture::Counts,
        &["--sort", "bytes", "--top", "3", "-o", s(&h)],
    );
    validate_profile(&h);
    let rep = report(&[s(&h), "--sort", "bytes", "--top", "3"]);
    assert_eq!(
        rep.stdout,
        live_table(&live),
        "`mtrace report --sort bytes --top 3` differs from the live run\n--- live ---\n{}",
        live.describe()
    );
    let r = rep.report();
    let callers: Vec<&str> = r
        .rows
        .iter()
        .map(|row| row.caller().unwrap_or(""))
        .collect();
    // 62500 (alloc_zeroed), 48000 (alloc_small), 20480 (leaf_alloc).
    assert_eq!(
        callers,
        ["alloc_zeroed", "alloc_small", "leaf_alloc"],
        "\n{}",
        rep.stdout
    );
    assert!(
        rep.stdout.contains(" hidden by --top\n"),
        "no `hidden by --top` line\n{}",
        rep.stdout
    );
}

/// Live mode: the leak summary names the leak site with its exact numbers.
#[test]
fn live_summary_names_the_leak_suspects() {
    need_bpf!();
    let (_, out) = run_live(&[]);
    let suspects = out
        .stdout
        .split("leak suspects")
        .nth(1)
        .unwrap_or_else(|| panic!("no leak summary\n{}", out.describe()));
    let leak_line = suspects
        .lines()
        .position(|l| l.contains("100 blocks  6400 bytes"))
        .unwrap_or_else(|| panic!("leak site missing\n{}", out.describe()));
    let next = suspects.lines().nth(leak_line + 1).unwrap_or("");
    assert!(next.contains("leak_site"), "{}", out.describe());
}

/// Live mode: `--min-age` empties the leak suspects, and a full live map
/// is shown with its size, the untracked count and the option to raise.
#[test]
fn live_summary_min_age_and_a_full_live_map() {
    need_bpf!();
    let (p, out) = run_live(&["--min-age", "3600", "--live-map-size", "16"]);
    assert!(
        out.stdout
            .contains("leak suspects (outstanding at the end, at least 3600 s old): none"),
        "{}",
        out.describe()
    );
    let untracked = u(&p.doc["live"], "untracked");
    assert!(untracked > 0, "{}", out.describe());
    assert!(
        out.stdout
            .contains(&format!("untracked (live map of 16 full) {untracked}")),
        "{}",
        out.describe()
    );
    assert!(
        out.stdout.contains("raise --live-map-size"),
        "{}",
        out.describe()
    );
}

/// Sampling: the line under the header says how, and how many samples.
#[test]
fn sampled_header_line() {
    need_bpf!();
    let (out, p) = trace_fixture(Fixture::Sampled, &["--sample-every", "100", "--top", "0"]);
    let samples = p.doc["meta"]["sampling"]["samples"]
        .as_u64()
        .expect("meta.sampling.samples");
    let lines: Vec<&str> = out.stdout.lines().collect();
    let header = lines
        .iter()
        .position(|l| l.starts_with("mtrace: pid "))
        .unwrap_or_else(|| panic!("no header\n{}", out.describe()));
    let sampled_line = lines
        .get(header + 1)
        .unwrap_or_else(|| panic!("nothing under the header\n{}", out.describe()));
    assert!(
        sampled_line.starts_with(&format!(
            "sampled: one call in 100, {samples} samples; calls and bytes are unbiased estimates"
        )),
        "{sampled_line:?}"
    );
    // The rest is a table like any other.
    assert_table_matches(&out, &p);
}
