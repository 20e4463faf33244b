//! The human table on stdout: its rows, totals and losses against the JSON
//! profile of the same run, its order and cut, and the lines of live mode
//! and sampling. Every other test asserts on the JSON profile; a change to
//! the table's look should only need changes here and in
//! support/table.rs.

use tracer_offline::render::text::bytes;

use crate::{
    support::counts::check_counts_profile,
    support::live::{run_live, u},
    support::mtrace::{report, trace_counts},
    support::s,
    support::{table::live_table, trace_fixture, validate_profile, Finished, Fixture, Profile},
};

/// (function, frame names, truncated, thread, calls, bytes, average) of a
/// row, sizes as shown.
type RowKey = (
    String,
    Vec<String>,
    bool,
    Option<(String, u32)>,
    u64,
    String,
    String,
);

/// Asserts that the table of `out` shows exactly the allocation stacks,
/// totals and losses of `p` (the profile of the same run, written with
/// `--top 0`).
fn assert_table_matches(out: &Finished, p: &Profile) {
    let r = out.report();
    let d = out.describe();
    assert!(
        r.header.starts_with(&format!("mtrace: pid {}, ", p.pid())),
        "{}",
        r.header
    );
    let command = p.doc["meta"]["command"].as_str().unwrap();
    assert_eq!(r.command.as_deref(), Some(command), "{d}");
    // Every line but the frames (and the fixture's paths) within 80
    // columns.
    for line in out.stdout.lines() {
        let long_path = ["command: ", "probes: ", "by process: "]
            .iter()
            .any(|p| line.starts_with(p));
        if !line.starts_with("    ") && !long_path {
            assert!(line.chars().count() <= 80, "{line:?}\n{d}");
        }
    }

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
                row.bytes.clone(),
                row.avg.clone(),
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
                bytes(s.bytes),
                bytes(s.bytes.checked_div(s.calls).unwrap_or(0)),
            )
        })
        .collect();
    rows.sort();
    stacks.sort();
    assert_eq!(rows, stacks, "table rows vs profile stacks\n{d}");

    let (calls, total_bytes) = p.total();
    assert_eq!(
        (r.total_calls, r.total_bytes.clone()),
        (calls, bytes(total_bytes)),
        "{d}"
    );
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
    // The host engine's follow in the same list.
    let host: &[&str] = match p.losses.contains_key("exec_events_lost") {
        true => &[
            "exec_events_lost",
            "process_names_full",
            "process_runs_full",
            "tree_full",
            "frames_untagged",
            "processes_unnumbered",
            "python_full",
        ],
        false => &[],
    };
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
    .chain(host.iter().map(|k| (k.replace('_', " "), p.losses[*k])))
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
    // glibc's reallocarray multiplies before its first branch: probed at
    // that branch, past the multiply, its 4 calls and 1,280 bytes are
    // exact (above) and no probe is single-stepped.
    assert_eq!(
        out.report().single_stepped.as_deref(),
        None,
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
    // Each thread's totals, as the profile's stacks sum them.
    let mut want: std::collections::BTreeMap<String, u64> = Default::default();
    for s in p.allocs() {
        let t = s.thread.as_ref().unwrap();
        *want.entry(format!("{} ({})", t.name, t.tid)).or_default() += s.calls;
    }
    let got: std::collections::BTreeMap<String, u64> = out
        .report()
        .group_rows
        .into_iter()
        .map(|(noun, calls, name)| {
            assert_eq!(noun, "thread");
            (name, calls)
        })
        .collect();
    assert_eq!(got, want, "{}", out.describe());
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
    let (p, out) = run_live(&[]);
    // The exact largest size (not the histogram's 2 digits: 16000 is
    // 16063 there), in the profile and under the row.
    let max = p
        .stacks_at("realloc", "grow_site")
        .iter()
        .filter_map(|s| s.live.as_ref()?["size"]["max"].as_u64())
        .max();
    assert_eq!(max, Some(16000), "{}", out.describe());
    assert!(
        out.stdout.contains(&format!(", max {}\n", bytes(16000))),
        "{}",
        out.describe()
    );
    let suspects = out
        .stdout
        .split("leak suspects")
        .nth(1)
        .unwrap_or_else(|| panic!("no leak summary\n{}", out.describe()));
    let leak_line = suspects
        .lines()
        .position(|l| {
            l.starts_with('#') && l.contains(&format!("  100 blocks  {}  oldest ", bytes(6400)))
        })
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
    // Under the header: the command, the probes, then how it was sampled.
    let sampled: Vec<&str> = lines[header..]
        .iter()
        .take_while(|l| !l.is_empty())
        .filter(|l| l.starts_with("sampled: "))
        .copied()
        .collect();
    assert_eq!(
        sampled,
        [
            format!("sampled: one call in 100, {samples} samples"),
            "sampled: calls and bytes are unbiased estimates, frees are not counted".into()
        ],
        "{}",
        out.describe()
    );
    // The rest is a table like any other.
    assert_table_matches(&out, &p);
}

/// Colour on a terminal (a pseudo-terminal from util-linux's `script`),
/// none with `NO_COLOR` set, none in a pipe.
#[test]
fn colour_on_a_terminal_only() {
    let dir = bpf_tempdir!();
    let h = dir.path().join("h.json");
    let piped = trace_counts(Fixture::Counts, &["--top", "1", "-o", s(&h)]);
    assert!(!piped.stdout.contains('\u{1b}'), "{}", piped.describe());
    let on_tty = |no_color: bool| {
        let cmd = format!(
            "{} report {} --top 1",
            crate::support::mtrace_path().display(),
            s(&h)
        );
        let mut script = std::process::Command::new("script");
        script.args(["-qec", &cmd, "/dev/null"]);
        script.env_remove("NO_COLOR").env_remove("CLICOLOR_FORCE");
        script.env("TERM", "xterm");
        if no_color {
            script.env("NO_COLOR", "1");
        }
        let out = script.output().expect("util-linux's script");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).expect("UTF-8")
    };
    let coloured = on_tty(false);
    assert!(coloured.contains("\u{1b}[1m#1  "), "{coloured}");
    let plain = on_tty(true);
    assert!(!plain.contains('\u{1b}'), "{plain}");
    assert_eq!(plain.replace("\r\n", "\n"), piped_table(&piped));
}

/// The table of a piped run, from its header on.
fn piped_table(out: &Finished) -> String {
    let at = out.stdout.find("mtrace: pid ").expect("a header");
    out.stdout[at..].to_string()
}

/// Three malloc calls in one function without line information
/// (`samesite.c`, built without `-g`): three rows that would print the
/// same frames show the return address's offset in that function where
/// they differ, as the JSON gives it; the frames they share are printed
/// as they are.
#[test]
fn rows_alike_but_for_the_call_site_show_its_offset() {
    need_bpf!();
    let fixture = crate::support::fixtures::compile_c("samesite", "samesite", &["-O1"], &[]);
    let (out, p) = crate::support::run_profiled(&["--", fixture.to_str().unwrap()]);
    out.assert_exit(0);
    let d = format!("{}\n{}", out.describe(), p.dump());
    let stacks = p.stacks_at("malloc", "sites");
    assert_eq!(stacks.len(), 3, "{d}");
    let mut offsets: Vec<u64> = stacks
        .iter()
        .map(|s| {
            assert_eq!(s.calls, 1000, "{d}");
            s.frames[0].symbol_offset.expect("no symbol offset")
        })
        .collect();
    offsets.sort_unstable();
    offsets.dedup();
    assert_eq!(offsets.len(), 3, "{d}");
    let rows: Vec<_> = out
        .report()
        .rows
        .into_iter()
        .filter(|r| r.func == "malloc" && r.calls == 1000)
        .collect();
    assert_eq!(rows.len(), 3, "{d}");
    let mut shown: Vec<String> = rows.iter().map(|r| r.frames[0].clone()).collect();
    shown.sort();
    let mut want: Vec<String> = offsets.iter().map(|o| format!("sites+{o:#x}")).collect();
    want.sort();
    assert_eq!(shown, want, "{d}");
    for r in &rows {
        assert_eq!(r.frames[1], "main", "{d}");
    }
}

/// Live mode, `samesite.c` leaking one block at each of its three call
/// sites: three leak suspects of one block each, whose frames would print
/// the same, told apart as the table's rows are: each shows its call
/// site's offset in `sites`, as the JSON gives it.
#[test]
fn leak_suspects_alike_but_for_the_call_site_show_its_offset() {
    need_bpf!();
    let fixture = crate::support::fixtures::compile_c("samesite", "samesite", &["-O1"], &[]);
    let (out, p) = crate::support::run_profiled(&[
        "--live",
        "--top",
        "0",
        "--",
        fixture.to_str().unwrap(),
        "0",
    ]);
    out.assert_exit(0);
    let d = format!("{}\n{}", out.describe(), p.dump());
    let mut want: Vec<String> = p
        .stacks_at("malloc", "sites")
        .iter()
        .map(|s| {
            let o = s.frames[0].symbol_offset.expect("no symbol offset");
            format!("sites+{o:#x}")
        })
        .collect();
    want.sort();
    want.dedup();
    assert_eq!(want.len(), 3, "{d}");
    let suspects: Vec<&str> = out
        .stdout
        .split("leak suspects")
        .nth(1)
        .unwrap_or_else(|| panic!("no leak summary\n{d}"))
        .lines()
        .collect();
    let mut shown: Vec<String> = suspects
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with('#') && l.contains(&format!("  1 block  {}  ", bytes(64))))
        .map(|(i, _)| {
            let frame = suspects.get(i + 1).copied().unwrap_or_default();
            frame
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    shown.sort();
    assert_eq!(shown, want, "{d}");
}
