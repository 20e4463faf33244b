//! Round trip: live run -> profile -> `mtrace report`.

use std::fs;

use serde_json::Value;

use crate::{
    support::counts::{check_counts_profile, COUNTS_TOTAL_BYTES, COUNTS_TOTAL_CALLS},
    support::{
        gunzip,
        mtrace::{report, trace_counts},
        s,
        table::live_table,
        validate_profile, Fixture, Profile,
    },
};

#[test]
fn report_reproduces_the_live_run() {
    let dir = bpf_tempdir!();
    let p = |name: &str| dir.path().join(name);
    // Every output format, each file named PREFIX.EXTENSION.
    let outputs = |prefix: &str, formats: &[(&str, &str)]| -> Vec<String> {
        let mut args = vec!["--top".to_string(), "0".to_string()];
        for (flag, ext) in formats {
            args.push(flag.to_string());
            args.push(s(&p(&format!("{prefix}.{ext}"))).to_string());
        }
        args
    };
    let live_args = outputs(
        "live",
        &[
            ("--folded", "folded"),
            ("--pprof", "pb.gz"),
            ("--speedscope", "speedscope.json"),
        ],
    );
    let mut live_args: Vec<&str> = live_args.iter().map(String::as_str).collect();
    let f_json = p("f.json");
    live_args.extend(["--output", s(&f_json)]);
    let live = trace_counts(Fixture::Counts, &live_args);
    let f = Profile::load(&p("f.json"));
    check_counts_profile(&f);
    let f = f.doc;
    assert_eq!(f["meta"]["mode"], "count");
    assert_eq!(f["totals"]["allocs"]["calls"], COUNTS_TOTAL_CALLS);
    assert_eq!(f["totals"]["allocs"]["bytes"], COUNTS_TOTAL_BYTES);

    let rep_args = outputs(
        "rep",
        &[
            ("--folded", "folded"),
            ("--flamegraph", "svg"),
            ("--pprof", "pb.gz"),
            ("--speedscope", "speedscope.json"),
        ],
    );
    let g_json = p("g.json");
    let mut args = vec![s(&f_json), "-o", s(&g_json)];
    args.extend(rep_args.iter().map(String::as_str));
    let rep = report(&args);
    assert_eq!(
        rep.stdout,
        live_table(&live),
        "`mtrace report` prints another table than the live run\n--- live ---\n{}",
        live.describe()
    );
    for what in [
        "profile",
        "folded stacks",
        "flamegraph",
        "pprof profile",
        "speedscope profile",
    ] {
        assert!(
            rep.stderr
                .iter()
                .any(|l| l.starts_with(&format!("mtrace: wrote {what} to "))),
            "report did not say it wrote the {what}\n{}",
            rep.describe()
        );
    }

    // Re-written, the profile is the same document.
    let g = validate_profile(&p("g.json"));
    assert_eq!(g, f, "report -o does not write back the profile it read");

    // Every file made from the saved profile equals the live run's.
    let folded = fs::read_to_string(p("rep.folded")).expect("no folded file from report");
    assert_eq!(
        folded,
        fs::read_to_string(p("live.folded")).unwrap(),
        "folded stacks differ between live run and report"
    );
    let folded_calls: u64 = folded
        .lines()
        .map(|l| {
            l.rsplit_once(' ')
                .and_then(|(_, n)| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("bad folded line {l:?}"))
        })
        .sum();
    assert_eq!(folded_calls, COUNTS_TOTAL_CALLS, "{folded}");
    assert!(
        folded
            .lines()
            .any(|l| l.ends_with(";alloc_small;malloc 1000")),
        "{folded}"
    );
    assert_eq!(
        gunzip(&p("rep.pb.gz")),
        gunzip(&p("live.pb.gz")),
        "pprof profiles differ between live run and report"
    );
    let ss = |name: &str| -> Value {
        serde_json::from_str(&fs::read_to_string(p(name)).unwrap())
            .unwrap_or_else(|e| panic!("{name} is not JSON: {e}"))
    };
    assert_eq!(
        ss("rep.speedscope.json"),
        ss("live.speedscope.json"),
        "speedscope profiles differ between live run and report"
    );
    let svg = fs::read_to_string(p("rep.svg")).expect("no flamegraph from report");
    assert!(svg.contains("<svg"), "not an SVG");
    assert!(svg.contains("alloc_small"), "alloc_small not in the SVG");
    // Another order and cut of the table: tests/e2e/table.rs.
}
