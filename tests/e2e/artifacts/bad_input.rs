//! Unreadable input: exit 2, one line on stderr.

use std::fs;

use crate::support::{
    mtrace::{report, trace_counts},
    run_mtrace, s, validate_profile, Fixture,
};

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
    assert!(text.contains("\"schema_version\": 2,"));
    let v99 = text.replacen("\"schema_version\": 2,", "\"schema_version\": 99,", 1);
    fs::write(p("v99.json"), v99).unwrap();
    let v_text = text.replacen("\"schema_version\": 2,", "\"schema_version\": \"2\",", 1);
    fs::write(p("v-text.json"), v_text).unwrap();
    // Values no trace produces.
    let duration = text.find("\"duration_secs\": ").unwrap();
    let end = duration + text[duration..].find(',').unwrap();
    let negative = format!(
        "{}\"duration_secs\": -5.0{}",
        &text[..duration],
        &text[end..]
    );
    fs::write(p("negative.json"), negative).unwrap();
    // What `report` must not read: a sparse file over the size limit, a
    // FIFO nobody writes to, a device that never ends.
    fs::File::create(p("huge.json"))
        .unwrap()
        .set_len((1 << 30) + 1)
        .unwrap();
    let fifo = std::ffi::CString::new(s(&p("fifo.json"))).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);

    let cases: &[(&str, &str)] = &[
        ("truncated.json", "truncated"),
        ("garbage.json", ""),
        ("garbage-text.json", "not a JSON profile"),
        ("v99.json", "version 99"),
        (
            "v-text.json",
            "schema_version must be a number, found \"2\"",
        ),
        ("negative.json", "corrupt profile: duration_secs is -5"),
        ("huge.json", "over the 1024 MiB"),
        ("fifo.json", "not a regular file"),
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
    let started = std::time::Instant::now();
    run_mtrace(&["report", "/dev/zero"]).assert_error("/dev/zero: not a regular file");
    assert!(
        started.elapsed().as_secs() < 5,
        "report /dev/zero took {:?}",
        started.elapsed()
    );
    // The good file still works.
    report(&[s(&good)]);

    let out = run_mtrace(&["diff", s(&good), s(&good), "--fail-if", "calls>>5"]);
    out.assert_exit(2);
    out.assert_error("bad --fail-if 'calls>>5'");
}
