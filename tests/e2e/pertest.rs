//! Allocations per test (`--per-test`) and per group (`--group`): a Rust
//! test binary (`tests/fixtures/rusttests`) and pytest under Debian's
//! python3.11, each test's figures exact, and `mtrace diff --per-test`
//! gating each test on its own.

use std::{collections::BTreeMap, path::Path, process::Command};

use crate::support::{
    fixtures::fixtures_dir, mtrace::mtrace_command, require, run_mtrace, validate_against,
    Finished, Mtrace, Profile,
};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// tests/fixtures/rusttests's test binary, built once with `cargo test
/// --no-run` (the test profile: debug information, nothing inlined).
fn rusttests() -> &'static Path {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("rusttests");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = crate::support::fixtures::build_fixture(
            Command::new(cargo)
                .args([
                    "test",
                    "--no-run",
                    "--locked",
                    "--message-format",
                    "json",
                    "--manifest-path",
                ])
                .arg(fixtures_dir().join("rusttests/Cargo.toml"))
                .arg("--target-dir")
                .arg(&target),
            "tests/fixtures/rusttests",
        );
        // The test binary's path is in cargo's message about it.
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|m| m["profile"]["test"] == true)
            .find_map(|m| m["executable"].as_str().map(std::path::PathBuf::from))
            .expect("cargo names the test binary")
    })
}

/// Runs mtrace with `args`, the traced command's environment with `env`
/// added; what it printed and the profile it wrote to `profile`.
fn trace(args: &[&str], env: &[(&str, &str)], profile: &Path) -> (Finished, Profile) {
    let mut all = vec!["-o", s(profile)];
    all.extend_from_slice(args);
    let mut cmd = mtrace_command(&all);
    cmd.envs(env.iter().copied());
    let out = Mtrace::spawn(&mut cmd).finish();
    out.assert_exit(0);
    let p = Profile::load(profile);
    (out, p)
}

/// The `regression:` lines `mtrace diff` printed.
fn regressions(out: &Finished) -> Vec<&str> {
    out.stdout
        .lines()
        .filter(|l| l.starts_with("regression: "))
        .collect()
}

/// The profile's `tests` (or `groups`): name -> (calls, bytes).
fn figures(p: &Profile, key: &str) -> BTreeMap<String, (u64, u64)> {
    p.doc[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in the profile"))
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                (t["calls"].as_u64().unwrap(), t["bytes"].as_u64().unwrap()),
            )
        })
        .collect()
}

fn expected(list: &[(&str, u64, u64)]) -> BTreeMap<String, (u64, u64)> {
    list.iter()
        .map(|&(n, c, b)| (n.to_string(), (c, b)))
        .collect()
}

/// N boxes of a u64 and a Vec with room for N: N + 1 calls, 16 N bytes.
fn boxes(name: &str, n: u64) -> (String, (u64, u64)) {
    (format!("tests::{name}"), (n + 1, 16 * n))
}

/// Each test of a Rust test binary gets exactly its own boxes and Vec,
/// named as libtest names it (not the 15 characters of its thread's
/// name), whether the tests run on threads of their own or, with
/// `--test-threads=1`, on the main thread; the table says them. `mtrace
/// diff --per-test` passes two identical runs and fails the one test that
/// allocates twice as much, alone, in its text and as its own JUnit test
/// case.
#[test]
fn rust_tests_are_counted_exactly_and_gated_one_by_one() {
    let dir = bpf_tempdir!();
    let bin = s(rusttests());
    let base_tests: BTreeMap<_, _> = [
        boxes("allocates_one_thousand_boxes", 1000),
        boxes("allocates_five_thousand_boxes", 5000),
        boxes("allocates_twenty_thousand_boxes", 20000),
    ]
    .into_iter()
    .collect();
    let a = dir.path().join("a.json");
    let (out, p) = trace(&["--per-test", "--top", "0", "--", bin], &[], &a);
    assert_eq!(figures(&p, "tests"), base_tests, "{}", out.describe());
    assert!(
        out.stdout
            .contains("\n      20001 calls  312.5 KiB  tests::allocates_twenty_thousand_boxes\n"),
        "{}",
        out.describe()
    );

    let b = dir.path().join("b.json");
    let (out, p) = trace(&["--per-test", "--", bin, "--test-threads=1"], &[], &b);
    assert_eq!(
        figures(&p, "tests"),
        base_tests,
        "one thread\n{}",
        out.describe()
    );

    // The five-thousand test allocates 10,000 boxes, and one more call
    // (the variable's value, 1 byte).
    let c = dir.path().join("c.json");
    let (out, p) = trace(&["--per-test", "--", bin], &[("RUSTTESTS_GROW", "1")], &c);
    let mut grown = base_tests.clone();
    grown.insert(
        "tests::allocates_five_thousand_boxes".into(),
        (10_002, 160_001),
    );
    assert_eq!(figures(&p, "tests"), grown, "{}", out.describe());

    let gate = [
        "--per-test",
        "--fail-if",
        "calls>+1%",
        "--fail-if",
        "bytes>+1%",
    ];
    let mut args = vec!["diff", s(&a), s(&b)];
    args.extend(gate);
    let out = run_mtrace(&args);
    out.assert_exit(0);
    assert!(
        out.stdout.contains("\nok: no regression"),
        "{}",
        out.describe()
    );

    let junit = dir.path().join("junit.xml");
    let json = dir.path().join("diff.json");
    for (format, file) in [("junit", &junit), ("json", &json)] {
        let mut args = vec!["diff", s(&a), s(&c), "--format", format, "-o", s(file)];
        args.extend(gate);
        let out = run_mtrace(&args);
        out.assert_exit(1);
        let regressions = regressions(&out);
        assert_eq!(
            regressions,
            [
                "regression: calls>+1%: test tests::allocates_five_thousand_boxes: 5001 -> 10002 (+5001, +100.00%)",
                "regression: bytes>+1%: test tests::allocates_five_thousand_boxes: 78.1 KiB -> 156.3 KiB (+78.1 KiB, +100.00%)",
            ],
            "{}",
            out.describe()
        );
    }
    let (cases, failures) =
        crate::support::diff::junit_cases(&std::fs::read_to_string(&junit).unwrap());
    assert_eq!(cases.len(), 6, "a case per test and condition: {cases:?}");
    assert!(cases.contains(&"tests::allocates_twenty_thousand_boxes (bytes>+1%)".to_string()));
    assert_eq!(failures.len(), 2, "{failures:?}");
    assert!(
        failures
            .iter()
            .all(|f| f.contains("test tests::allocates_five_thousand_boxes: ")),
        "{failures:?}"
    );
    let doc = validate_against(&json, "diff.schema.json");
    assert_eq!(doc["tests"].as_array().unwrap().len(), 3, "{doc}");
    assert_eq!(doc["gate"]["conditions"][0]["scope"], "tests");
    assert_eq!(
        doc["gate"]["conditions"][0]["violations"][0]["test"],
        "tests::allocates_five_thousand_boxes"
    );
}

/// `--group` sums every stack through a matching frame, from a trace and
/// from `mtrace report` of the saved profile alike, and `mtrace diff
/// --per-group` gates each group.
#[test]
fn groups_sum_what_their_frames_call_and_are_gated() {
    let dir = bpf_tempdir!();
    let bin = s(rusttests());
    let a = dir.path().join("a.json");
    let group = [
        "--group",
        "boxes=rusttests::tests::boxes",
        "--group",
        "big=*twenty_thousand*",
        "--group",
        "none=no::such::function",
    ];
    let mut args = group.to_vec();
    args.extend(["--", bin]);
    let (out, p) = trace(&args, &[], &a);
    let want = expected(&[
        ("boxes", 26_003, 416_000),
        ("big", 20_001, 320_000),
        ("none", 0, 0),
    ]);
    assert_eq!(figures(&p, "groups"), want, "{}", out.describe());
    assert_eq!(p.doc["groups"][0]["name"], "boxes", "in the order named");

    // Read back, grouped anew, without a trace.
    let r = dir.path().join("r.json");
    let mut args = vec!["report", s(&a), "-o", s(&r)];
    args.extend(group);
    run_mtrace(&args).assert_exit(0);
    assert_eq!(figures(&Profile::load(&r), "groups"), want);

    let c = dir.path().join("c.json");
    let mut args = group.to_vec();
    args.extend(["--", bin]);
    trace(&args, &[("RUSTTESTS_GROW", "1")], &c);
    // The groups the profiles were saved with, without --group again.
    let out = run_mtrace(&[
        "diff",
        s(&a),
        s(&c),
        "--per-group",
        "--fail-if",
        "calls>+10%",
    ]);
    out.assert_exit(1);
    let regressions = regressions(&out);
    assert_eq!(
        regressions,
        ["regression: calls>+10%: group boxes: 26003 -> 31003 (+5000, +19.23%)"],
        "{}",
        out.describe()
    );
    let out = run_mtrace(&["diff", s(&a), s(&a), "--per-group", "--fail-if", "calls>+0"]);
    out.assert_exit(0);
}

/// pytest under Debian's python3.11: each test (a function, a method of
/// a class) is found by the Python frame pytest_pyfunc_call calls, named
/// as pytest names it, and holds exactly its bytearrays and its list;
/// the gate fails the one test that grew.
#[test]
fn pytest_tests_are_counted_exactly_and_gated() {
    let dir = bpf_tempdir!();
    let python = Path::new("/usr/bin/python3.11");
    let has_pytest = Command::new(python)
        .args(["-c", "import pytest"])
        .status()
        .is_ok_and(|s| s.success());
    if !require(
        has_pytest,
        "pytest for /usr/bin/python3.11 (cargo xtask setup installs python3-pytest)",
    ) {
        return;
    }
    let tests = dir.path().join("test_alloc.py");
    std::fs::write(
        &tests,
        "import os\n\n\
         def keep(n, size):\n    kept = [None] * n\n    for i in range(n):\n        kept[i] = bytearray(size)\n    return kept\n\n\
         def test_one_thousand():\n    assert len(keep(1000, 100_000)) == 1000\n\n\
         def test_three_thousand():\n    n = 6000 if os.environ.get('PERTEST_GROW') else 3000\n    assert len(keep(n, 100_000)) == n\n\n\
         class TestInClass:\n    def test_two_hundred(self):\n        assert len(keep(200, 100_000)) == 200\n",
    )
    .unwrap();
    let run = |env: &[(&str, &str)], out: &Path| {
        trace(
            &[
                "--per-test",
                "--",
                s(python),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                s(&tests),
            ],
            env,
            out,
        )
    };
    // N bytearrays of 100,000 bytes (a block of 100,001 each, past
    // pymalloc's small blocks) and a list of N pointers.
    let kept = |n: u64| (n + 1, n * 100_001 + n * 8);
    let a = dir.path().join("a.json");
    let (out, p) = run(&[], &a);
    let base: BTreeMap<_, _> = [
        ("test_alloc.py::test_one_thousand", kept(1000)),
        ("test_alloc.py::test_three_thousand", kept(3000)),
        ("test_alloc.py::TestInClass::test_two_hundred", kept(200)),
    ]
    .into_iter()
    .map(|(n, f)| (n.to_string(), f))
    .collect();
    assert_eq!(figures(&p, "tests"), base, "{}", out.describe());

    let c = dir.path().join("c.json");
    let (out, p) = run(&[("PERTEST_GROW", "1")], &c);
    assert_eq!(
        figures(&p, "tests")["test_alloc.py::test_three_thousand"],
        kept(6000),
        "{}",
        out.describe()
    );
    let out = run_mtrace(&["diff", s(&a), s(&c), "--per-test", "--fail-if", "bytes>+5%"]);
    out.assert_exit(1);
    let regressions = regressions(&out);
    assert_eq!(regressions.len(), 1, "{}", out.describe());
    assert!(
        regressions[0]
            .starts_with("regression: bytes>+5%: test test_alloc.py::test_three_thousand: "),
        "{}",
        out.describe()
    );
}

/// `--per-thread` prints each thread's totals, and with `--tree` a call
/// tree per thread under a line naming it: the threads fixture's workers,
/// 100/200/300/400 calls of malloc(32), exactly.
#[test]
fn per_thread_totals_and_a_tree_per_thread() {
    need_bpf!();
    let (out, p) = crate::support::trace_fixture(
        crate::support::Fixture::Threads,
        &["--per-thread", "--tree", "--top", "0"],
    );
    let tid = |name: &str| {
        p.allocs()
            .filter_map(|s| s.thread.as_ref())
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no thread {name}\n{}", out.describe()))
            .tid
    };
    for (n, calls) in [(0, 100u64), (1, 200), (2, 300), (3, 400)] {
        let name = format!("worker-{n}");
        let tid = tid(&name);
        let size = format!("{:.1} KiB", (calls * 32) as f64 / 1024.0);
        let total = format!("\n{calls:>11} calls {size:>10}  {name} ({tid})\n");
        assert!(out.stdout.contains(&total), "{total:?}\n{}", out.describe());
        let tree = format!("\nthread {name} ({tid}): {calls} calls, {size}\ncall tree, top-down");
        assert!(out.stdout.contains(&tree), "{tree:?}\n{}", out.describe());
    }
    assert!(
        out.stdout.contains("\nby thread (5 threads):\n"),
        "{}",
        out.describe()
    );
}

/// Snapshots (`--interval`) carry the tests (`--per-test`) and groups
/// (`--group`) of the final profile: the last one, taken after the test
/// binary ended (the shell around it sleeps on), holds its figures
/// exactly, so that `mtrace diff --per-test` and `--per-group` (by the
/// groups saved, no `--group` again) gate a snapshot against a profile
/// test by test.
#[test]
fn snapshots_carry_tests_and_groups() {
    let dir = bpf_tempdir!();
    let snaps = dir.path().join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    let bin = s(rusttests());
    let script = format!("'{bin}' && sleep 2");
    let a = dir.path().join("a.json");
    let (out, p) = trace(
        &[
            "--per-test",
            "--group",
            "boxes=rusttests::tests::boxes",
            "--interval",
            "0.4",
            "--snapshot-dir",
            s(&snaps),
            "--",
            "sh",
            "-c",
            &script,
        ],
        &[],
        &a,
    );
    let tests: BTreeMap<_, _> = [
        boxes("allocates_one_thousand_boxes", 1000),
        boxes("allocates_five_thousand_boxes", 5000),
        boxes("allocates_twenty_thousand_boxes", 20000),
    ]
    .into_iter()
    .collect();
    assert_eq!(figures(&p, "tests"), tests, "{}", out.describe());
    let groups = expected(&[("boxes", 26_003, 416_000)]);
    assert_eq!(figures(&p, "groups"), groups, "{}", out.describe());

    let mut files: Vec<_> = std::fs::read_dir(&snaps)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let last = files
        .last()
        .unwrap_or_else(|| panic!("no snapshot\n{}", out.describe()))
        .clone();
    let snap = Profile::load(&last);
    assert_eq!(
        figures(&snap, "tests"),
        tests,
        "{}\n{}",
        last.display(),
        out.describe()
    );
    assert_eq!(figures(&snap, "groups"), groups, "{}", last.display());
    // Every earlier snapshot has the lists too, each test at most its
    // final figures.
    for f in &files {
        let sp = Profile::load(f);
        for key in ["tests", "groups"] {
            assert!(sp.doc[key].is_array(), "no {key} in {}", f.display());
        }
    }

    // Gated against the final profile, test by test and by the groups
    // saved: nothing moved.
    for scope in ["--per-test", "--per-group"] {
        let out = run_mtrace(&["diff", s(&last), s(&a), scope, "--fail-if", "calls>+0"]);
        out.assert_exit(0);
        assert!(
            out.stdout.contains("\nok: no regression"),
            "{}",
            out.describe()
        );
    }
    // And against a run where one test grew: that test, and the group.
    let c = dir.path().join("c.json");
    trace(
        &[
            "--per-test",
            "--group",
            "boxes=rusttests::tests::boxes",
            "--",
            bin,
        ],
        &[("RUSTTESTS_GROW", "1")],
        &c,
    );
    let out = run_mtrace(&[
        "diff",
        s(&last),
        s(&c),
        "--per-test",
        "--per-group",
        "--fail-if",
        "calls>+10%",
    ]);
    out.assert_exit(1);
    assert_eq!(
        regressions(&out),
        [
            "regression: calls>+10%: test tests::allocates_five_thousand_boxes: 5001 -> 10002 (+5001, +100.00%)",
            "regression: calls>+10%: group boxes: 26003 -> 31003 (+5000, +19.23%)",
        ],
        "{}",
        out.describe()
    );
}
