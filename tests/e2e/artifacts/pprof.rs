//! pprof, decoded by protoc with the official profile.proto.

use std::collections::BTreeMap;

use crate::{
    support::counts::{expected_sites, COUNTS_TOTAL_BYTES, COUNTS_TOTAL_CALLS, RECURSE_DEPTH},
    support::{
        mtrace::trace_counts,
        protoc::{unquote, Pprof, TextMsg},
        s, validate_profile, Fixture,
    },
};

#[test]
fn protoc_text_format_is_read() {
    // No BPF needed: the reader of protoc's output on its own.
    assert_eq!(unquote(r#""a\"b\\c\303\251\n""#), "a\"b\\c\u{e9}\n");
    assert_eq!(unquote("42"), "42");
    let msg = TextMsg::parse("a: 1\nm {\n  s: \"x {\"\n  n {\n  }\n}\na: 2\n");
    assert_eq!(msg.ints("a"), [1, 2]);
    let m = &msg.msgs("m")[0];
    assert_eq!(m.scalars("s"), ["x {"]);
    assert_eq!(m.msgs("n").len(), 1);
}

#[test]
fn pprof_has_the_exact_counts() {
    let dir = bpf_tempdir!();
    let pb = dir.path().join("counts.pb.gz");
    trace_counts(Fixture::Counts, &["--top", "0", "--pprof", s(&pb)]);
    let p = Pprof::decode(&pb);
    assert_eq!(
        p.sample_type_names(),
        ["alloc_objects/count", "alloc_space/bytes"]
    );
    for (locs, values) in &p.samples {
        assert_eq!(values.len(), 2, "sample {locs:?} has values {values:?}");
    }
    let by_site = p.by_site();
    let got: BTreeMap<(String, String), [i64; 2]> = by_site
        .iter()
        .map(|(k, v)| (k.clone(), [v[0], v[1]]))
        .collect();
    assert_eq!(
        got,
        expected_sites(),
        "pprof (allocator, caller) -> [alloc_objects, alloc_space]"
    );

    // By direct caller alone (aligned_allocs has two allocators).
    let mut by_caller: BTreeMap<&str, [i64; 2]> = BTreeMap::new();
    for ((_, caller), v) in &got {
        let e = by_caller.entry(caller.as_str()).or_default();
        e[0] += v[0];
        e[1] += v[1];
    }
    assert_eq!(by_caller["alloc_small"], [1000, 48000]);
    assert_eq!(by_caller["alloc_zeroed"], [250, 62500]);
    assert_eq!(by_caller["grow_buffer"], [10, 5500]);
    assert_eq!(by_caller["leaf_alloc"], [5, 20480]);
    assert_eq!(by_caller["aligned_allocs"], [10, 1084]);
    assert_eq!(by_caller["array_allocs"], [4, 1280]);
    assert_eq!(by_caller["page_allocs"], [2, 2000]);
    let total: [i64; 2] = got.values().fold([0, 0], |a, v| [a[0] + v[0], a[1] + v[1]]);
    assert_eq!(
        total,
        [COUNTS_TOTAL_CALLS as i64, COUNTS_TOTAL_BYTES as i64]
    );

    // The deep stack: malloc, leaf_alloc, recurse x 20, main.
    for (locs, _) in &p.samples {
        let names = p.stack_names(locs);
        if names[1] == "leaf_alloc" {
            assert!(names.len() > RECURSE_DEPTH + 2, "{names:?}");
            assert!(
                names[2..2 + RECURSE_DEPTH].iter().all(|n| *n == "recurse"),
                "{names:?}"
            );
            assert_eq!(names[2 + RECURSE_DEPTH], "main", "{names:?}");
        }
    }
    assert!(
        p.strings.iter().any(|s| s.starts_with("mtrace ")),
        "no comment"
    );
}

#[test]
fn pprof_of_live_mode_has_inuse_values() {
    let dir = bpf_tempdir!();
    let pb = dir.path().join("live.pb.gz");
    let json = dir.path().join("live.json");
    trace_counts(
        Fixture::Counts,
        &["--live", "--pprof", s(&pb), "-o", s(&json)],
    );
    let doc = validate_profile(&json);
    assert_eq!(doc["meta"]["mode"], "live");
    let p = Pprof::decode(&pb);
    assert_eq!(
        p.sample_type_names(),
        [
            "alloc_objects/count",
            "alloc_space/bytes",
            "inuse_objects/count",
            "inuse_space/bytes"
        ]
    );
    // counts.c frees every block: nothing in use at the end.
    let got: BTreeMap<(String, String), Vec<i64>> = p.by_site();
    let expected: BTreeMap<(String, String), Vec<i64>> = expected_sites()
        .into_iter()
        .map(|(k, [c, b])| (k, vec![c, b, 0, 0]))
        .collect();
    assert_eq!(got, expected);

    // live.c leaks 100 blocks of 64 bytes and keeps the 16,000-byte
    // buffer it grew by 1,000 reallocs; its churn and the blocks another
    // thread freed are not in use.
    let pb = dir.path().join("leaks.pb.gz");
    trace_counts(Fixture::Live, &["--live", "--pprof", s(&pb)]);
    let got = Pprof::decode(&pb).by_site();
    let site = |f: &str, caller: &str| {
        got.get(&(f.to_string(), caller.to_string()))
            .cloned()
            .unwrap_or_else(|| panic!("no {f} from {caller}: {got:?}"))
    };
    assert_eq!(site("malloc", "leak_site"), [100, 6400, 100, 6400]);
    assert_eq!(site("realloc", "grow_site"), [1000, 8_008_000, 1, 16000]);
    assert_eq!(site("malloc", "churn_site"), [10000, 320_000, 0, 0]);
    assert_eq!(site("malloc", "producer"), [500, 64000, 0, 0]);
}
