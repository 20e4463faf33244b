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
