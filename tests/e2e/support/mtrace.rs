//! Running mtrace and what it leaves; with [`run_profiled`] and
//! [`Mtrace::start_profiled`], the JSON profile it wrote (`-o`).

use std::{
    ffi::OsStr,
    ops::{Deref, DerefMut},
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
};

use super::{
    fixtures::Fixture,
    process::{FixtureProc, Lines, Proc, EXIT_TIMEOUT, LINE_TIMEOUT},
    profile::Profile,
    public_tempdir,
};

pub fn mtrace_path() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_mtrace"))
}

/// An mtrace process, stdout and stderr piped.
pub struct Mtrace {
    pub proc: Proc,
    pub stdout: Lines,
    pub stderr: Lines,
}

/// What a finished mtrace left.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: Vec<String>,
}

pub fn mtrace_command<S: AsRef<OsStr>>(args: &[S]) -> Command {
    let mut cmd = Command::new(mtrace_path());
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

impl Mtrace {
    pub fn start<S: AsRef<OsStr>>(args: &[S]) -> Mtrace {
        Mtrace::spawn(&mut mtrace_command(args))
    }

    pub fn spawn(cmd: &mut Command) -> Mtrace {
        let mut proc = Proc::spawn(cmd, "mtrace");
        let stdout = proc.stdout_lines();
        let stderr = proc.stderr_lines();
        Mtrace {
            proc,
            stdout,
            stderr,
        }
    }

    /// Waits for the line that says tracing began (`mtrace: tracing pid
    /// PID (...`) and returns PID; 0 for `--all` and a cgroup traced
    /// `--file-wide`, which name none.
    pub fn wait_tracing(&mut self) -> u32 {
        const HOST: &str = "mtrace: tracing every process on the host";
        const CGROUP: &str = "mtrace: tracing cgroup ";
        let line = self.stderr.wait_for(
            |l| {
                l.starts_with("mtrace: tracing pid ")
                    || l.starts_with(HOST)
                    || l.starts_with(CGROUP)
            },
            LINE_TIMEOUT,
        );
        if line.starts_with(HOST) || line.starts_with(CGROUP) {
            return 0;
        }
        let rest = &line["mtrace: tracing pid ".len()..];
        let (pid, _) = rest
            .split_once(" (")
            .unwrap_or_else(|| panic!("bad tracing line {line:?}"));
        pid.parse()
            .unwrap_or_else(|_| panic!("bad pid in tracing line {line:?}"))
    }

    /// Starts mtrace with `-o DIR/p.json` added to `args` (before `--`, if
    /// any), in a fresh directory.
    pub fn start_profiled(args: &[&str]) -> Profiled {
        Mtrace::profiled(args, Stdio::null())
    }

    /// [`Mtrace::start_profiled`] with mtrace's stdin piped (the command
    /// it launches reads it), and its writing end.
    pub fn start_profiled_piped(args: &[&str]) -> (Profiled, std::process::ChildStdin) {
        let mut m = Mtrace::profiled(args, Stdio::piped());
        let stdin = m.proc.take_stdin();
        (m, stdin)
    }

    fn profiled(args: &[&str], stdin: Stdio) -> Profiled {
        let dir = public_tempdir();
        let path = dir.path().join("p.json");
        let path_str = path.to_str().expect("temp path not UTF-8");
        let at = args.iter().position(|a| *a == "--").unwrap_or(args.len());
        let mut all = args[..at].to_vec();
        all.extend(["-o", path_str]);
        all.extend_from_slice(&args[at..]);
        let mtrace = Mtrace::spawn(mtrace_command(&all).stdin(stdin));
        Profiled {
            mtrace,
            path,
            _dir: dir,
        }
    }

    /// Waits for mtrace to exit by itself and collects its output.
    pub fn finish(mut self) -> Finished {
        let status = self.proc.wait_timeout(EXIT_TIMEOUT);
        self.output(status)
    }

    /// [`Mtrace::finish`], with what the run used and when it ended.
    pub fn finish_measured(mut self) -> (Finished, Measured) {
        let (status, _usage, peak_rss_kib, exited) = self.proc.wait_rusage(EXIT_TIMEOUT);
        let measured = Measured {
            peak_rss_kib,
            exited,
        };
        (self.output(status), measured)
    }

    /// What it printed, once it exited with `status`.
    fn output(self, status: ExitStatus) -> Finished {
        let stdout = self.stdout.rest(LINE_TIMEOUT);
        let stderr = self.stderr.rest(LINE_TIMEOUT);
        let mut out = String::new();
        for l in stdout {
            out.push_str(&l);
            out.push('\n');
        }
        Finished {
            status,
            stdout: out,
            stderr,
        }
    }
}

/// Runs mtrace to its end.
pub fn run_mtrace<S: AsRef<OsStr>>(args: &[S]) -> Finished {
    Mtrace::start(args).finish()
}

/// Runs mtrace to its end with `-o` added (see [`Mtrace::start_profiled`]):
/// what it printed, and the profile it wrote.
pub fn run_profiled(args: &[&str]) -> (Finished, Profile) {
    Mtrace::start_profiled(args).finish()
}

/// Traces a fixture by pid: waits for its `ready`, attaches with `args`
/// (and `-o`), lets it go, and returns once both have exited (both with
/// status 0).
pub fn trace_by_pid(fx: &mut FixtureProc, args: &[&str]) -> (Finished, Profile) {
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let mut all = vec!["--pid", pid.as_str()];
    all.extend_from_slice(args);
    let mut m = Mtrace::start_profiled(&all);
    m.wait_tracing();
    fx.release();
    let status = fx.proc.wait_timeout(EXIT_TIMEOUT);
    assert!(status.success(), "the fixture failed: {status}");
    let (out, p) = m.finish();
    out.assert_exit(0);
    (out, p)
}

/// Traces `fixture` from launch with `args` before `--` and `-o` added;
/// asserts that mtrace announces tracing, exits 0 and writes the pid it
/// traced in the profile.
pub fn trace_fixture(fixture: Fixture, args: &[&str]) -> (Finished, Profile) {
    let mut all = args.to_vec();
    all.extend(["--", fixture.path_str()]);
    let mut m = Mtrace::start_profiled(&all);
    let pid = m.wait_tracing();
    let (out, p) = m.finish();
    out.assert_exit(0);
    assert_eq!(p.pid(), pid, "meta.pid\n{}", out.describe());
    (out, p)
}

/// An mtrace writing its profile to a file of its own; derefs to the
/// [`Mtrace`].
pub struct Profiled {
    pub mtrace: Mtrace,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Deref for Profiled {
    type Target = Mtrace;
    fn deref(&self) -> &Mtrace {
        &self.mtrace
    }
}

impl DerefMut for Profiled {
    fn deref_mut(&mut self) -> &mut Mtrace {
        &mut self.mtrace
    }
}

impl Profiled {
    /// Waits for mtrace to exit by itself; its output, and the profile
    /// (validated against the schema). Panics, with everything mtrace
    /// printed, when it wrote none.
    pub fn finish(self) -> (Finished, Profile) {
        let out = self.mtrace.finish();
        let profile = written(&self.path, &out);
        (out, profile)
    }

    /// [`Profiled::finish`], with what the run used and when it ended.
    pub fn finish_measured(self) -> (Finished, Profile, Measured) {
        let (out, measured) = self.mtrace.finish_measured();
        let profile = written(&self.path, &out);
        (out, profile, measured)
    }
}

/// The profile at `path` (validated against the schema); panics, with
/// everything mtrace printed, when it wrote none.
fn written(path: &Path, out: &Finished) -> Profile {
    assert!(
        path.is_file(),
        "mtrace wrote no profile to {}\n{}",
        path.display(),
        out.describe()
    );
    Profile::load(path)
}

/// How an mtrace run went, as the kernel measured it: its peak resident
/// set size in KiB (see [`Proc::wait_rusage`] for why not `ru_maxrss`)
/// and when it exited.
pub struct Measured {
    pub peak_rss_kib: i64,
    pub exited: std::time::Instant,
}

impl Finished {
    /// For assertion messages.
    pub fn describe(&self) -> String {
        format!(
            "mtrace exited with {}\n--- stdout ---\n{}--- stderr ---\n{}",
            self.status,
            self.stdout,
            self.stderr.join("\n")
        )
    }

    pub fn assert_exit(&self, code: i32) {
        assert_eq!(
            self.status.code(),
            Some(code),
            "unexpected exit status\n{}",
            self.describe()
        );
    }

    /// An error: exactly one non-empty line on stderr, starting `mtrace: `
    /// and containing `needle`; nothing on stdout.
    pub fn assert_error(&self, needle: &str) {
        let lines: Vec<&String> = self.stderr.iter().filter(|l| !l.is_empty()).collect();
        assert_eq!(
            lines.len(),
            1,
            "expected exactly one line on stderr\n{}",
            self.describe()
        );
        assert!(
            lines[0].starts_with("mtrace: "),
            "the error does not start with `mtrace: `\n{}",
            self.describe()
        );
        assert!(
            lines[0].contains(needle),
            "the error does not contain {needle:?}\n{}",
            self.describe()
        );
        assert!(
            self.stdout.is_empty(),
            "an error printed something on stdout\n{}",
            self.describe()
        );
    }
}

/// A launch-mode trace of `fixture` (counts or counts-plus20) with `args`
/// before `--`; asserts that mtrace exits 0.
pub fn trace_counts(fixture: Fixture, args: &[&str]) -> Finished {
    let mut all: Vec<&str> = args.to_vec();
    all.push("--");
    all.push(fixture.path_str());
    let mut m = Mtrace::start(&all);
    m.wait_tracing();
    let out = m.finish();
    out.assert_exit(0);
    out
}

/// `mtrace report ARGS` (no privilege needed): exit 0, and the table.
pub fn report(args: &[&str]) -> Finished {
    let mut all = vec!["report"];
    all.extend_from_slice(args);
    let out = run_mtrace(&all);
    out.assert_exit(0);
    out
}

/// `mtrace ARGS -- env [ASSIGNMENTS] FIXTURE`.
pub fn trace_through_env(
    args: &[&str],
    assignments: &[&str],
    fixture: Fixture,
) -> (Finished, Profile) {
    let mut all = args.to_vec();
    all.extend(["--top", "0", "--", "env"]);
    all.extend(assignments);
    all.push(fixture.path_str());
    let (out, p) = run_profiled(&all);
    out.assert_exit(0);
    let exec_line = format!("exec'd {}:", fixture.path_str());
    assert!(
        out.stderr.iter().any(|l| l.contains(&exec_line)),
        "no `{exec_line}` line\n{}",
        out.describe()
    );
    (out, p)
}
