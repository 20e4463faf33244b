//! Unreadable input: exit 2, one line on stderr.

use std::fs;

use super::{report, s, trace_counts};
use crate::support::{run_mtrace, validate_profile, Fixture};

#[test]
fn bad_profiles_exit_2() {
    let dir = bpf_tempdir!();
    let p = |name: &str| dir.path().join(name);
    let good = p("a.json");
    trace_counts(Fixture::Counts, &["-o", s(&good)]);
    validate_profile(&good);
    let text = fs::read(&good).unwrap();

    fs::write(p("truncated.json"), &text[..text.len() / 2]).unwrap();
    // Not UTF-8, and UTF-8 that is not JSON.
    let garbage: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    fs::write(p("garbage.json"), &garbage).unwrap();
    fs::write(
        p("garbage-text.json"),
        "{\"format\": \"mtrace-profile\", ][ garbage",
    )
    .unwrap();
    let text = String::from_utf8(text).unwrap();
    assert!(text.contains("\"schema_version\": 1,"));
    let v99 = text.replacen("\"schema_version\": 1,", "\"schema_version\": 99,", 1);
    fs::write(p("v99.json"), v99).unwrap();

    let cases: &[(&str, &str)] = &[
        ("truncated.json", "truncated"),
        ("garbage.json", ""),
        ("garbage-text.json", "not a JSON profile"),
        ("v99.json", "version 99"),
        ("does-not-exist.json", ""),
    ];
    for &(name, needle) in cases {
        let bad = p(name);
        let runs: [Vec<&str>; 3] = [
            vec!["report", s(&bad)],
            vec!["diff", s(&good), s(&bad)],
            vec!["diff", s(&bad), s(&good)],
        ];
        for args in &runs {
            let out = run_mtrace(args);
            out.assert_exit(2);
            // One line, naming the file and what is wrong.
            out.assert_error(s(&bad));
            out.assert_error(needle);
        }
    }
    // The good file still works.
    report(&[s(&good)]);

    let out = run_mtrace(&["diff", s(&good), s(&good), "--fail-if", "calls>>5"]);
    out.assert_exit(2);
    out.assert_error("bad --fail-if 'calls>>5'");
}
