//! Running mtrace and what it leaves.

use std::{
    ffi::OsStr,
    path::Path,
    process::{Command, ExitStatus, Stdio},
};

use super::{
    process::{Lines, Proc, EXIT_TIMEOUT, LINE_TIMEOUT},
    table::Report,
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

    /// Waits for `mtrace: tracing pid PID (...` and returns PID.
    pub fn wait_tracing(&mut self) -> u32 {
        let line = self
            .stderr
            .wait_for(|l| l.starts_with("mtrace: tracing pid "), LINE_TIMEOUT);
        let rest = &line["mtrace: tracing pid ".len()..];
        let (pid, _) = rest
            .split_once(" (")
            .unwrap_or_else(|| panic!("bad tracing line {line:?}"));
        pid.parse()
            .unwrap_or_else(|_| panic!("bad pid in tracing line {line:?}"))
    }

    /// Waits for mtrace to exit by itself and collects its output.
    pub fn finish(mut self) -> Finished {
        let status = self.proc.wait_timeout(EXIT_TIMEOUT);
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

impl Finished {
    /// The report on stdout; panics with everything mtrace printed when it
    /// cannot be parsed.
    pub fn report(&self) -> Report {
        Report::parse(&self.stdout)
            .unwrap_or_else(|e| panic!("cannot parse the report: {e}\n{}", self.describe()))
    }

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
