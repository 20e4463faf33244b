//! Errors: one line on stderr starting `mtrace: `, a fixed exit code, no
//! report.

use std::{
    fs,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    process::{Command, Stdio},
};

use crate::support::{
    copy_executable, dead_pid, mtrace_path, public_tempdir, require, run_mtrace, Fixture, Mtrace,
    Proc,
};

#[test]
fn no_such_process() {
    need_bpf!();
    let pid = dead_pid().to_string();
    let out = run_mtrace(&["--pid", &pid]);
    out.assert_exit(1);
    out.assert_error("no such process");
}

#[test]
fn kernel_thread() {
    need_bpf!();
    let comm = fs::read_to_string("/proc/2/comm").unwrap_or_default();
    if !require(
        comm.trim() == "kthreadd",
        "this test needs pid 2 to be kthreadd (not so in a pid namespace)",
    ) {
        return;
    }
    let out = run_mtrace(&["--pid", "2"]);
    out.assert_exit(1);
    out.assert_error("kernel thread");
}

#[test]
fn not_enough_privilege() {
    // A copy of mtrace that user nobody can reach and execute.
    let dir = public_tempdir();
    let bin = copy_executable(mtrace_path(), dir.path(), "mtrace");
    let me = std::process::id().to_string();
    let mut cmd = Command::new(&bin);
    cmd.args(["--pid", &me])
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if unsafe { libc::geteuid() } == 0 {
        // std drops the supplementary groups too.
        cmd.uid(65534).gid(65534);
    }
    let out = Mtrace::spawn(&mut cmd).finish();
    out.assert_exit(1);
    out.assert_error("not enough privilege");
}

#[test]
fn no_malloc_found() {
    need_bpf!();
    let path = Fixture::NoMalloc.path();
    let fixture = Proc::spawn(&mut Command::new(path), "nomalloc");
    let pid = fixture.id().to_string();
    let out = run_mtrace(&["--pid", &pid]);
    out.assert_exit(1);
    out.assert_error("no malloc found");
    // The fixture is killed when dropped.
}

#[test]
fn command_not_found() {
    need_bpf!();
    let out = run_mtrace(&["--", "/nonexistent/cmd"]);
    out.assert_exit(127);
    let line = out.stderr.join("\n");
    assert!(
        line.contains("command not found") || line.contains("cannot execute"),
        "{}",
        out.describe()
    );
    out.assert_error("/nonexistent/cmd");
}

#[test]
fn command_not_executable() {
    let dir = bpf_tempdir!();
    let file = dir.path().join("not-executable");
    fs::write(&file, "#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
    let out = run_mtrace(&["--", file.to_str().unwrap()]);
    out.assert_exit(126);
    out.assert_error("cannot execute");
}

/// Usage errors: one line `mtrace: ...`, then at most a usage hint, exit 2;
/// `mtrace` alone included.
#[test]
fn usage_errors_are_one_line_and_exit_2() {
    let cases: [&[&str]; 5] = [
        &[],
        &["--bogus"],
        &["--pid", "abc"],
        &["report"],
        &["diff", "a.json"],
    ];
    for args in cases {
        let out = run_mtrace(args);
        out.assert_exit(2);
        let lines: Vec<&String> = out.stderr.iter().filter(|l| !l.is_empty()).collect();
        assert!(
            (1..=2).contains(&lines.len()) && lines[0].starts_with("mtrace: "),
            "{args:?}\n{}",
            out.describe()
        );
        if let Some(hint) = lines.get(1) {
            assert!(
                hint.starts_with("usage: mtrace"),
                "{args:?}\n{}",
                out.describe()
            );
        }
    }
    assert_eq!(run_mtrace(&["--version"]).status.code(), Some(0));
}

/// A command without `--` before it: one line saying how to trace it.
#[test]
fn a_command_without_dashes_is_suggested_with_them() {
    let out = run_mtrace(&["--top", "5", "ls", "-l"]);
    out.assert_exit(2);
    assert_eq!(
        out.stderr,
        ["mtrace: unknown command 'ls'; to trace it: mtrace --top 5 -- ls -l"],
        "{}",
        out.describe()
    );
    assert_eq!(out.stdout, "");
}

/// Every numeric option tried with the values that break arithmetic
/// (0, 1e-300, 1e300, inf, nan, negatives): each is a one-line usage error
/// (exit 2), or is accepted with the meaning docs/usage.md gives it (the
/// cases listed in `accepted`, which must then trace to a clean end); none
/// panics. The command traced lives a third of a second, long enough for
/// the agent's windows policy to open and close a window.
#[test]
fn numeric_options_at_their_extremes_are_refused_or_meant() {
    need_bpf!();
    const VALUES: [&str; 7] = ["0", "1e-300", "1e300", "inf", "nan", "-1", "-0"];
    let profile = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/offline/tests/data/render/profile.json"
    );
    // (the words before the option, the option, the words after its value)
    let trace_cmd: &[&str] = &["--", "/bin/sh", "-c", "sleep 0.3"];
    let live: &[&str] = &["--live"];
    let agent: &[&str] = &["agent", "--listen", "127.0.0.1:0"];
    let report: &[&str] = &["report", profile];
    let diff: &[&str] = &["diff", profile, profile];
    let options: [(&[&str], &str); 23] = [
        (&[], "--duration"),
        (&[], "--interval"),
        (live, "--min-age"),
        (live, "--temporary-under"),
        (live, "--live-map-size"),
        (live, "--event-buffer-size"),
        (&[], "--sample-bytes"),
        (&[], "--sample-every"),
        (&[], "--max-stack"),
        (&[], "--max-processes"),
        (&[], "--count-map-size"),
        (&[], "--stack-map-size"),
        (&[], "--unwind-rules-size"),
        (&[], "--unwind-buffer-size"),
        (&[], "--top"),
        (&[], "--threshold"),
        (agent, "--window"),
        (agent, "--every"),
        (agent, "--budget"),
        (report, "--top"),
        (report, "--threshold"),
        (diff, "--top"),
        (diff, "--fail-if"),
    ];
    // What docs/usage.md says these mean: no minimum age (or one beyond
    // any trace), no temporaries, no stack, no row cut, every row.
    let accepted = |option: &str, value: &str| {
        matches!(
            (option, value),
            ("--min-age", "0" | "1e-300" | "1e300" | "-0")
                | ("--temporary-under", "0")
                | ("--max-stack", "0" | "-0")
                | ("--top", "0")
                | ("--threshold", "0" | "1e-300" | "-0")
        )
    };
    let mut cases = Vec::new();
    for (before, option) in options {
        for value in VALUES {
            let mut args: Vec<String> = before.iter().map(|a| a.to_string()).collect();
            if option == "--fail-if" {
                args.extend(["--fail-if".into(), format!("calls>+{value}%")]);
            } else {
                args.push(format!("{option}={value}"));
            }
            if before != report && before != diff {
                args.extend(trace_cmd.iter().map(|a| a.to_string()));
            }
            let expect_ok = accepted(option, value) || (option == "--fail-if" && value == "0");
            cases.push((args, expect_ok));
        }
    }
    let cases = std::sync::Mutex::new(cases);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..3 {
            scope.spawn(|| loop {
                let Some((args, expect_ok)) = cases.lock().unwrap().pop() else {
                    return;
                };
                let out = run_mtrace(&args);
                let code = out.status.code();
                let said: Vec<&String> = out.stderr.iter().filter(|l| !l.is_empty()).collect();
                let panicked = out.stderr.iter().any(|l| l.contains("panicked"));
                let one_line = !said.is_empty()
                    && said[0].starts_with("mtrace: ")
                    && said[1..].iter().all(|l| l.starts_with("usage: mtrace"))
                    && said.len() <= 2;
                let fine = !panicked
                    && match code {
                        Some(0) => expect_ok,
                        Some(2) => !expect_ok && one_line,
                        _ => false,
                    };
                if !fine {
                    failures
                        .lock()
                        .unwrap()
                        .push(format!("{args:?}\n{}", out.describe()));
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
