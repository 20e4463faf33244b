//! A hostile or unlucky user: a FIFO planted at an output path or at the
//! next snapshot name, a reader gone from stdout, an output that fails
//! among others, a read-only directory, a full stderr, a closed stdout, a
//! duration too long for a clock. Nothing hangs, every output that can be
//! written is written, each failure is one line with its exit code, and
//! nothing panics.

use std::{
    ffi::CString,
    fs,
    os::unix::fs::FileTypeExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use crate::support::{
    longrun::Longrun, mtrace::mtrace_command, mtrace_path, names_in, public_tempdir, run_mtrace, s,
    Finished, Fixture, Mtrace, Proc, Profile, EXIT_TIMEOUT, LINE_TIMEOUT,
};

/// A FIFO at `path`, as another user could plant one in a shared
/// directory.
fn mkfifo(path: &Path) {
    let c = CString::new(s(path)).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0, "mkfifo");
}

/// No panic in what mtrace printed, and not a panic's exit status.
fn assert_calm(out: &Finished) {
    assert_ne!(out.status.code(), Some(101), "{}", out.describe());
    let said = format!("{}{}", out.stdout, out.stderr.join("\n"));
    assert!(!said.contains("panicked"), "{}", out.describe());
}

/// Exactly one failure said (`mtrace: cannot ...`), and it starts with
/// `prefix`.
fn assert_one_failure(out: &Finished, prefix: &str) {
    let failures: Vec<&String> = out
        .stderr
        .iter()
        .filter(|l| l.starts_with("mtrace: cannot"))
        .collect();
    assert!(
        failures.len() == 1 && failures[0].starts_with(prefix),
        "{}",
        out.describe()
    );
}

fn is_regular(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file())
}

/// The counts fixture's allocation calls (see tests/fixtures/counts.c).
const COUNTS_ALLOC_CALLS: u64 = 1000 + 250 + 10 + 5 + 7 + 3 + 4 + 2;

/// A launch-mode trace of the counts fixture with `args` before `--`.
fn trace_counts_with(args: &[&str]) -> Finished {
    let mut all = args.to_vec();
    all.extend(["--", Fixture::Counts.path_str()]);
    let out = run_mtrace(&all);
    assert_calm(&out);
    out
}

#[test]
fn a_fifo_at_an_output_path_is_replaced_never_opened() {
    need_bpf!();
    let dir = public_tempdir();
    let json = dir.path().join("run.json");
    let html = dir.path().join("run.html");
    mkfifo(&json);
    mkfifo(&html);
    let started = Instant::now();
    let out = trace_counts_with(&["-o", s(&json), "--html", s(&html)]);
    out.assert_exit(0);
    assert!(started.elapsed() < EXIT_TIMEOUT);
    assert!(is_regular(&json) && is_regular(&html), "{}", out.describe());
    let p = Profile::load(&json);
    assert_eq!(p.total().0, COUNTS_ALLOC_CALLS, "{}", out.describe());
    assert_eq!(names_in(dir.path()), ["run.html", "run.json"]);
}

/// The next snapshot's name is known to all (mtrace-PID-0001.json): a FIFO
/// there is replaced by the snapshot, the trace goes on and ends normally,
/// and the target is left unprobed.
#[test]
fn a_fifo_at_the_next_snapshot_name_is_replaced() {
    need_bpf!();
    let dir = public_tempdir();
    let target = Longrun::start();
    let pid = target.fx.pid();
    let first = dir.path().join(format!("mtrace-{pid}-0001.json"));
    mkfifo(&first);
    let pid_s = pid.to_string();
    let json = dir.path().join("run.json");
    let mut m = Mtrace::start(&[
        "--pid",
        &pid_s,
        "--interval",
        "0.3",
        "--snapshot-dir",
        s(dir.path()),
        "-o",
        s(&json),
    ]);
    m.wait_tracing();
    assert!(target.probed(), "no probe in place while tracing");
    let mut target = target;
    target.fx.release();
    let wrote = m
        .stderr
        .wait_for(|l| l.starts_with("mtrace: wrote snapshot "), LINE_TIMEOUT);
    assert_eq!(wrote, format!("mtrace: wrote snapshot to {}", s(&first)));
    m.proc.signal(libc::SIGINT);
    let out = m.finish();
    assert_calm(&out);
    out.assert_exit(0);
    assert!(is_regular(&first), "{}", out.describe());
    Profile::load(&first);
    Profile::load(&json);
    target.assert_restored();
    target.finish();
}

/// `mtrace -o run.json -- prog | head -1`: the reader of stdout is gone
/// when the report comes; the report's failure is said (exit 74) and every
/// file is still written.
#[test]
fn a_reader_gone_from_stdout_loses_no_file() {
    need_bpf!();
    let dir = public_tempdir();
    let json = dir.path().join("run.json");
    let html = dir.path().join("run.html");
    let mut cmd = mtrace_command(&[
        "-o",
        s(&json),
        "--html",
        s(&html),
        "--",
        Fixture::Counts.path_str(),
    ]);
    let mut proc = Proc::spawn(&mut cmd, "mtrace");
    // The reader is gone before mtrace says anything on stdout.
    drop(proc.child.stdout.take());
    let stderr = proc.stderr_lines();
    let status = proc.wait_timeout(EXIT_TIMEOUT);
    let out = Finished {
        status,
        stdout: String::new(),
        stderr: stderr.rest(LINE_TIMEOUT),
    };
    assert_calm(&out);
    out.assert_exit(74);
    assert_one_failure(&out, "mtrace: cannot write the report to stdout: ");
    assert_eq!(
        Profile::load(&json).total().0,
        COUNTS_ALLOC_CALLS,
        "{}",
        out.describe()
    );
    assert!(fs::read_to_string(&html).unwrap().contains("<html"));
}

/// A failing --pprof (first in the order of writing) skips no later output,
/// in a trace and in `mtrace report`.
#[test]
fn a_failed_output_does_not_skip_the_others() {
    need_bpf!();
    let dir = public_tempdir();
    let json = dir.path().join("run.json");
    let html = dir.path().join("run.html");
    let speedscope = dir.path().join("run.speedscope.json");
    let outputs = |json: &Path, html: &Path| -> Vec<String> {
        [
            "--pprof",
            "/dev/full",
            "--html",
            s(html),
            "--speedscope",
            s(&speedscope),
            "-o",
            s(json),
        ]
        .map(String::from)
        .to_vec()
    };
    let args = outputs(&json, &html);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    for out in [trace_counts_with(&args), {
        let (json2, html2) = (dir.path().join("2.json"), dir.path().join("2.html"));
        let args = outputs(&json2, &html2);
        let mut all = vec!["report".to_string(), s(&json).to_string()];
        all.extend(args);
        let out = run_mtrace(&all);
        assert!(
            is_regular(&json2) && is_regular(&html2),
            "{}",
            out.describe()
        );
        out
    }] {
        assert_calm(&out);
        out.assert_exit(74);
        assert_one_failure(&out, "mtrace: cannot write /dev/full: ");
        for what in ["HTML report", "speedscope profile", "profile"] {
            assert!(
                out.stderr
                    .iter()
                    .any(|l| l.starts_with(&format!("mtrace: wrote {what} to "))),
                "{what}\n{}",
                out.describe()
            );
        }
        assert!(!out.stderr.iter().any(|l| l.contains("pprof")));
    }
    assert!(is_regular(&html) && is_regular(&speedscope));
    assert_eq!(Profile::load(&json).total().0, COUNTS_ALLOC_CALLS);
}

/// mtrace with `args`, in a mount namespace of its own where `dir` is a
/// read-only file system (as root, a directory's mode does not stop a
/// write; a read-only mount does).
fn run_with_read_only(dir: &Path, args: &[&str]) -> Finished {
    let script = r#"mount -t tmpfs -o ro mtrace-ro "$0" && exec "$@""#;
    run_wrapped(&["unshare", "-m", "sh", "-c", script, s(dir)], args)
}

/// mtrace with `args`, started by the command `wrapper` (followed by
/// mtrace's path and `args`), to its end.
fn run_wrapped(wrapper: &[&str], args: &[&str]) -> Finished {
    let mut cmd = Command::new(wrapper[0]);
    cmd.args(&wrapper[1..])
        .arg(mtrace_path())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    Mtrace::spawn(&mut cmd).finish()
}

/// A read-only directory for an output or for snapshots: one line, exit
/// 2, at once, before anything is attached (the target is never probed).
#[test]
fn a_read_only_directory_is_refused_before_tracing() {
    need_bpf!();
    let dir = public_tempdir();
    let ro = dir.path().join("ro");
    fs::create_dir(&ro).unwrap();
    let in_ro = |name: &str| -> PathBuf { ro.join(name) };
    let (json, html) = (in_ro("run.json"), in_ro("run.html"));
    let cases: [(Vec<&str>, String); 4] = [
        (
            vec!["-o", s(&json)],
            format!(
                "cannot write {}: {}: Read-only file system",
                s(&json),
                s(&ro)
            ),
        ),
        (
            vec!["--html", s(&html)],
            format!(
                "cannot write {}: {}: Read-only file system",
                s(&html),
                s(&ro)
            ),
        ),
        (
            vec!["--snapshot-dir", s(&ro)],
            format!(
                "cannot write snapshots to {}: Read-only file system",
                s(&ro)
            ),
        ),
        (
            vec!["--interval", "1", "--snapshot-dir", s(&ro)],
            format!(
                "cannot write snapshots to {}: Read-only file system",
                s(&ro)
            ),
        ),
    ];
    for (args, message) in cases {
        let mut all = args.clone();
        all.extend(["--", Fixture::Longrun.path_str(), "2"]);
        let started = Instant::now();
        let out = run_with_read_only(&ro, &all);
        assert_calm(&out);
        out.assert_exit(2);
        out.assert_error(&message);
        assert_eq!(
            out.stderr.iter().filter(|l| !l.is_empty()).count(),
            1,
            "{}",
            out.describe()
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }
    // Outside the namespace the directory was always writable.
    assert!(names_in(&ro).is_empty());
}

/// `--duration` and `--interval` too long for a clock: a usage error (exit
/// 2, the message then the usage hint), not a panic.
#[test]
fn a_duration_too_long_is_a_usage_error() {
    for flag in ["--duration", "--interval"] {
        let out = run_mtrace(&[flag, "1e30", "--", Fixture::Counts.path_str()]);
        assert_calm(&out);
        out.assert_exit(2);
        assert_eq!(
            out.stderr[0],
            format!(
                "mtrace: invalid value '1e30' for '{flag} <SECS>': duration must be at most 1e9 seconds, not 1e30"
            ),
            "{}",
            out.describe()
        );
        assert!(out.stdout.is_empty());
    }
}

/// mtrace with stderr on /dev/full (every write to it fails) and stdout
/// collected; the exit status and stdout.
fn with_full_stderr(args: &[&str]) -> (std::process::ExitStatus, String) {
    let full = fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let mut cmd = mtrace_command(args);
    cmd.stderr(Stdio::from(full));
    let mut proc = Proc::spawn(&mut cmd, "mtrace");
    let stdout = proc.stdout_lines();
    let status = proc.wait_timeout(EXIT_TIMEOUT);
    (status, stdout.rest(LINE_TIMEOUT).join("\n"))
}

/// `2>/dev/full`: nothing can be said, yet mtrace ends as it would have
/// (usage errors included), never with a panic (exit 101).
#[test]
fn a_full_stderr_changes_nothing_but_the_words() {
    need_bpf!();
    let dir = public_tempdir();
    let json = dir.path().join("run.json");
    let missing = dir.path().join("missing.json");
    let counts = Fixture::Counts.path_str();
    let cases: [(Vec<&str>, i32); 6] = [
        (vec![], 2),
        (vec!["--no-such-flag"], 2),
        (vec!["--duration", "1e30", "--", counts], 2),
        (vec!["report", s(&missing)], 2),
        (vec!["-o", s(&json), "--", counts], 0),
        (vec!["report", s(&json), "--top", "1"], 0),
    ];
    for (args, code) in cases {
        let (status, stdout) = with_full_stderr(&args);
        assert_eq!(status.code(), Some(code), "{args:?}\n{stdout}");
        if code == 0 {
            assert!(stdout.contains("malloc"), "{args:?}\n{stdout}");
        }
    }
    assert_eq!(Profile::load(&json).total().0, COUNTS_ALLOC_CALLS);
}

/// mtrace with its stdout closed (`>&-`), through a shell.
fn with_closed_stdout(args: &[&str]) -> Finished {
    run_wrapped(&["sh", "-c", r#"exec "$@" >&-"#, "sh"], args)
}

/// `>&-`: the report has nowhere to go; that is said (exit 74, not the
/// target's status), and the files asked for are written.
#[test]
fn a_closed_stdout_is_said() {
    need_bpf!();
    let dir = public_tempdir();
    let json = dir.path().join("run.json");
    let out = with_closed_stdout(&["-o", s(&json), "--", Fixture::Counts.path_str()]);
    assert_calm(&out);
    out.assert_exit(74);
    assert_eq!(
        out.stderr.last().map(String::as_str),
        Some("mtrace: cannot write the report to stdout: it is closed"),
        "{}",
        out.describe()
    );
    assert_eq!(Profile::load(&json).total().0, COUNTS_ALLOC_CALLS);
    let out = with_closed_stdout(&["report", s(&json)]);
    assert_calm(&out);
    out.assert_exit(74);
    out.assert_error("cannot write the report to stdout: it is closed");
}

/// The same path for two outputs would keep only the last: refused before
/// tracing.
#[test]
fn one_path_for_two_outputs_is_refused() {
    let dir = public_tempdir();
    let path = dir.path().join("out");
    let out = run_mtrace(&[
        "-o",
        s(&path),
        "--html",
        s(&path),
        "--",
        Fixture::Counts.path_str(),
    ]);
    assert_calm(&out);
    out.assert_exit(2);
    out.assert_error(&format!("{} is given for two outputs", s(&path)));
    assert!(names_in(dir.path()).is_empty());
}

/// One file named by two spellings (relative and `./`, absolute, through
/// `..`, through a symbolic link to its directory) for two outputs is
/// refused as the same spelling is: the second output would replace the
/// first, and both would be said written.
#[test]
fn one_file_spelled_two_ways_for_two_outputs_is_refused() {
    let dir = public_tempdir();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::os::unix::fs::symlink(dir.path(), dir.path().join("link")).unwrap();
    let abs = dir.path().join("same.json");
    let pairs = [
        ("same.json", "./same.json"),
        ("same.json", s(&abs)),
        ("sub/../same.json", "same.json"),
        ("link/same.json", s(&abs)),
    ];
    for (first, second) in pairs {
        let mut cmd = mtrace_command(&[
            "-o",
            first,
            "--html",
            second,
            "--",
            Fixture::Counts.path_str(),
        ]);
        let out = Mtrace::spawn(cmd.current_dir(dir.path())).finish();
        assert_calm(&out);
        out.assert_exit(2);
        out.assert_error(&format!("{second} is given for two outputs (as {first})"));
        assert_eq!(names_in(dir.path()), ["link", "sub"], "{first} {second}");
    }
}

/// Every hostile case above in one place, by its exit: never "panicked",
/// never exit 101.
#[test]
fn no_hostile_case_panics() {
    need_bpf!();
    let dir = public_tempdir();
    let json = dir.path().join("run.json");
    let (fifo, fifo2) = (dir.path().join("fifo.json"), dir.path().join("fifo.html"));
    mkfifo(&fifo);
    mkfifo(&fifo2);
    let counts = Fixture::Counts.path_str();
    let cases: [Vec<&str>; 7] = [
        vec!["--duration", "1e30", "--", counts],
        vec!["--interval", "inf", "--", counts],
        vec!["--min-age", "1e300", "--live", "--", counts],
        vec![
            "--temporary-under",
            "99999999999999999999s",
            "--live",
            "--",
            counts,
        ],
        vec!["-o", s(&fifo), "--", counts],
        vec!["-o", s(&json), "--pprof", "/dev/full", "--", counts],
        vec!["report", s(&json), "--html", s(&fifo2)],
    ];
    for args in cases {
        let out = run_mtrace(&args);
        assert_calm(&out);
    }
    for args in [vec!["report", s(&json)], vec!["--bogus"]] {
        assert_calm(&with_closed_stdout(&args));
        let (status, _) = with_full_stderr(&args);
        assert!(matches!(status.code(), Some(0..=2)), "{args:?}: {status}");
    }
    // The FIFOs were replaced, never opened.
    for f in [&fifo, &fifo2] {
        assert!(!fs::symlink_metadata(f).unwrap().file_type().is_fifo());
    }
}

/// `--help` and `--version` whose output cannot be written (stdout on
/// /dev/full, or closed) are an output error (exit 74, one line), as a
/// report's would be, not a success; and the help says what `-o` writes
/// as `--version` does, not a schema version of its own.
#[test]
fn help_that_cannot_be_written_is_exit_74() {
    for args in [&["--help"][..], &["--version"], &["report", "--help"]] {
        let full = fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let mut cmd = mtrace_command(args);
        cmd.stdout(Stdio::from(full));
        let mut proc = Proc::spawn(&mut cmd, "mtrace");
        let stderr = proc.stderr_lines();
        let status = proc.wait_timeout(EXIT_TIMEOUT);
        assert_eq!(status.code(), Some(74), "{args:?} on /dev/full");
        assert_eq!(
            stderr.rest(LINE_TIMEOUT),
            ["mtrace: cannot write the help to stdout: No space left on device (os error 28)"],
            "{args:?}"
        );
        let out = with_closed_stdout(args);
        out.assert_exit(74);
        out.assert_error("cannot write the help to stdout: it is closed");
    }
    let help = run_mtrace(&["report", "--help"]);
    help.assert_exit(0);
    assert!(
        help.stdout
            .contains("an mtrace-profile file, schema version 2"),
        "{}",
        help.stdout
    );
    let version = run_mtrace(&["--version"]);
    assert!(
        version
            .stdout
            .trim()
            .ends_with("(profile schema version 2)"),
        "{}",
        version.stdout
    );
}
