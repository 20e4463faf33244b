//! Live mode's stack weights (`--weight inuse`, `--weight leaked`): folded
//! stacks, the flame graph and speedscope weighted by the bytes still
//! allocated at the end and by the leak suspects' bytes, while tracing and
//! from `mtrace report`; outside live mode a usage error.

use std::{collections::BTreeMap, fs, path::Path};

use crate::support::{
    live::{site, u},
    mtrace::report,
    run_mtrace, s, Fixture, Profile,
};

/// (allocator function, direct caller) -> summed count of a folded file;
/// every line `root;...;caller;func COUNT` with a count above 0 (an
/// inlined caller's `_[i]` dropped).
fn folded_sites(path: &Path) -> BTreeMap<(String, String), u64> {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut sites = BTreeMap::new();
    for line in text.lines() {
        let (stack, count) = line.rsplit_once(' ').expect("`stack COUNT`");
        let count: u64 = count.parse().expect("a count");
        assert!(count > 0, "a zero-weight line {line:?}");
        let mut frames = stack.rsplit(';');
        let func = frames.next().expect("the allocator").to_string();
        let caller = frames.next().unwrap_or("");
        let caller = caller.strip_suffix("_[i]").unwrap_or(caller).to_string();
        *sites.entry((func, caller)).or_insert(0) += count;
    }
    sites
}

fn key(func: &str, caller: &str) -> (String, String) {
    (func.to_string(), caller.to_string())
}

/// A live trace of the live fixture with `args`, its profile written to
/// DIR/p.json.
fn trace_live(dir: &Path, args: &[&str]) -> Profile {
    let json = dir.join("p.json");
    let mut all = vec!["--live", "--top", "0", "-o", s(&json)];
    all.extend_from_slice(args);
    all.extend(["--", Fixture::Live.path_str()]);
    let out = run_mtrace(&all);
    out.assert_exit(0);
    Profile::load(&json)
}

#[test]
fn folded_stacks_weighted_by_in_use_and_leaked_bytes() {
    let dir = bpf_tempdir!();
    let inuse = dir.path().join("inuse.folded");
    let svg = dir.path().join("inuse.svg");
    let p = trace_live(
        dir.path(),
        &[
            "--weight",
            "inuse",
            "--folded",
            s(&inuse),
            "--flamegraph",
            s(&svg),
        ],
    );
    // The fixture's blocks still allocated at the end: 100 x 64 bytes from
    // leak_site, one 16000-byte block grown by grow_site; everything else
    // it allocated is freed (churn_site, producer) or failed.
    let sites = folded_sites(&inuse);
    assert_eq!(
        sites.get(&key("malloc", "leak_site")),
        Some(&6400),
        "{sites:?}"
    );
    assert_eq!(
        sites.get(&key("realloc", "grow_site")),
        Some(&16000),
        "{sites:?}"
    );
    for (func, caller) in [("malloc", "churn_site"), ("malloc", "producer")] {
        assert_eq!(sites.get(&key(func, caller)), None, "{sites:?}");
    }
    // Every site's in-use bytes are the profile's, and so is the sum.
    for ((func, caller), bytes) in &sites {
        assert_eq!(u(&site(&p, func, caller), "outstanding_bytes"), *bytes);
    }
    let total: u64 = sites.values().sum();
    assert_eq!(total, u(&p.doc["live"], "outstanding_bytes"));
    let svg = fs::read_to_string(&svg).expect("the flame graph");
    assert!(svg.contains("in-use bytes") && svg.contains("leak_site"));

    // From the saved profile: leaked bytes (--min-age 0: every block
    // outstanding at the end is a suspect) are the same.
    let leaked = dir.path().join("leaked.folded");
    let json = dir.path().join("p.json");
    report(&[s(&json), "--weight", "leaked", "--folded", s(&leaked)]);
    assert_eq!(folded_sites(&leaked), sites);

    // speedscope opens on the leaked bytes, with the in-use ones beside.
    let ss = dir.path().join("p.speedscope.json");
    report(&[s(&json), "--weight", "leaked", "--speedscope", s(&ss)]);
    let v: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&ss).expect("speedscope")).expect("JSON");
    assert_eq!(v["activeProfileIndex"], 3);
    assert_eq!(v["profiles"][3]["endValue"], total);
    assert_eq!(v["profiles"][2]["endValue"], total);
}

#[test]
fn leaked_bytes_are_the_old_blocks_only() {
    let dir = bpf_tempdir!();
    let leaked = dir.path().join("leaked.folded");
    // No block lives an hour: no suspect, an empty file (zero weights are
    // left out); the in-use bytes stay.
    let p = trace_live(
        dir.path(),
        &[
            "--min-age",
            "3600",
            "--weight",
            "leaked",
            "--folded",
            s(&leaked),
        ],
    );
    assert_eq!(fs::read_to_string(&leaked).expect("the folded file"), "");
    assert_eq!(
        u(&site(&p, "malloc", "leak_site"), "outstanding_bytes"),
        6400
    );
}

#[test]
fn live_weights_need_a_live_profile() {
    let dir = bpf_tempdir!();
    let folded = dir.path().join("f.folded");
    let out = run_mtrace(&[
        "--weight",
        "inuse",
        "--folded",
        s(&folded),
        "--",
        Fixture::Counts.path_str(),
    ]);
    out.assert_exit(2);
    out.assert_error("--weight inuse needs a live profile (trace with --live)");
    // A count-mode profile, then `mtrace report` of it.
    let json = dir.path().join("c.json");
    run_mtrace(&["-o", s(&json), "--", Fixture::Counts.path_str()]).assert_exit(0);
    let out = run_mtrace(&[
        "report",
        s(&json),
        "--weight",
        "leaked",
        "--folded",
        s(&folded),
    ]);
    out.assert_exit(2);
    out.assert_error("--weight leaked needs a live profile (trace with --live)");
    assert!(!folded.exists());
    // diff weighs what two profiles share: calls or bytes.
    let out = run_mtrace(&["diff", s(&json), s(&json), "--weight", "inuse"]);
    out.assert_exit(2);
    out.assert_error("--weight inuse: diff compares calls or bytes");
}
