//! Helpers shared by the end-to-end tests: fixture programs compiled once
//! per test run, child processes that are killed when a test fails, line
//! readers with timeouts, and a parser for mtrace's report.

use std::{
    collections::BTreeMap,
    ffi::OsStr,
    fmt::Write as _,
    fs,
    io::{BufRead, BufReader, Read},
    os::unix::fs::{FileExt, PermissionsExt},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::{
        mpsc::{self, Receiver, RecvTimeoutError},
        OnceLock,
    },
    time::{Duration, Instant},
};

/// How long we wait for one expected line (ready, tracing, ...).
pub const LINE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long we wait for a process that should end by itself.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(60);

pub fn mtrace_path() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_mtrace"))
}

/// The BPF tests need root. Returns false (after a note on stderr) when the
/// test should be skipped; when the environment variable `CI` is set, not
/// being root fails the test instead.
#[must_use]
pub fn require_bpf() -> bool {
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("the e2e tests need root (BPF and uprobes), and CI is set: not skipping");
    }
    eprintln!("skipped: the e2e tests need root for BPF (set CI to make this a failure)");
    false
}

// ---------------------------------------------------------------------------
// Fixtures

/// The C programs in tests/fixtures.
#[derive(Clone, Copy, Debug)]
pub enum Fixture {
    Counts,
    Threads,
    Longrun,
    Exit7,
    NoMalloc,
    /// counts.c with 20% more allocations at alloc_small (1200).
    CountsPlus20,
    Live,
    Sampled,
    ManyStacks,
}

const N_FIXTURES: usize = 9;

/// `cc -O2 -fno-omit-frame-pointer -g -o OUT SRC`: frame pointers for the
/// kernel's stack walk, debug info for file:line.
const FRAME_FLAGS: &[&str] = &["-O2", "-fno-omit-frame-pointer", "-g"];

impl Fixture {
    fn name(self) -> &'static str {
        match self {
            Fixture::Counts => "counts",
            Fixture::Threads => "threads",
            Fixture::Longrun => "longrun",
            Fixture::Exit7 => "exit7",
            Fixture::NoMalloc => "nomalloc",
            Fixture::CountsPlus20 => "counts-plus20",
            Fixture::Live => "live",
            Fixture::Sampled => "sampled",
            Fixture::ManyStacks => "manystacks",
        }
    }

    /// The source file in tests/fixtures.
    fn source(self) -> &'static str {
        match self {
            Fixture::CountsPlus20 => "counts",
            other => other.name(),
        }
    }

    /// Flags before `-o OUT SRC`, and after.
    fn flags(self) -> (&'static [&'static str], &'static [&'static str]) {
        match self {
            Fixture::Threads | Fixture::Live => (FRAME_FLAGS, &["-pthread"]),
            Fixture::CountsPlus20 => (FRAME_FLAGS, &["-DSMALL_N=1200"]),
            Fixture::NoMalloc => (&["-O2", "-static", "-nostdlib"], &[]),
            _ => (FRAME_FLAGS, &[]),
        }
    }

    /// The compiled program; compiled on first use in this test run.
    pub fn path(self) -> &'static Path {
        static BUILT: [OnceLock<PathBuf>; N_FIXTURES] = [const { OnceLock::new() }; N_FIXTURES];
        BUILT[self as usize].get_or_init(|| compile(self))
    }

    pub fn path_str(self) -> &'static str {
        self.path().to_str().expect("fixture path not UTF-8")
    }
}

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn compile(fixture: Fixture) -> PathBuf {
    let name = fixture.name();
    let src = fixtures_dir().join(format!("{}.c", fixture.source()));
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-fixtures");
    fs::create_dir_all(&dir).unwrap();
    let out = dir.join(name);
    // Compile to a private name and rename: a concurrent run of the tests
    // may be executing the previous binary.
    let tmp = dir.join(format!("{name}.{}.tmp", std::process::id()));
    let (before, after) = fixture.flags();
    let output = Command::new("cc")
        .args(before)
        .arg("-o")
        .arg(&tmp)
        .arg(&src)
        .args(after)
        .output()
        .expect("running cc (a C compiler is needed for the fixtures)");
    assert!(
        output.status.success(),
        "compiling {} failed ({}):\n{}",
        src.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    fs::rename(&tmp, &out).unwrap();
    out
}

// ---------------------------------------------------------------------------
// Processes

/// A child process that is killed (and reaped) when dropped, so that a
/// failing test leaves nothing behind.
pub struct Proc {
    pub child: Child,
    what: String,
}

impl Proc {
    /// Spawns `cmd`. Retries when the executable is busy: a file we just
    /// wrote may still be open for writing in a child another test thread
    /// forked and has not yet exec'd (ETXTBSY).
    pub fn spawn(cmd: &mut Command, what: &str) -> Proc {
        let mut tries = 0;
        loop {
            match cmd.spawn() {
                Ok(child) => {
                    return Proc {
                        child,
                        what: what.to_string(),
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 100 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("cannot start {what} ({cmd:?}): {e}"),
            }
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    pub fn take_stdin(&mut self) -> ChildStdin {
        self.child.stdin.take().expect("stdin not piped")
    }

    pub fn stdout_lines(&mut self) -> Lines {
        let out = self.child.stdout.take().expect("stdout not piped");
        Lines::new(out, &format!("stdout of {}", self.what))
    }

    pub fn stderr_lines(&mut self) -> Lines {
        let err = self.child.stderr.take().expect("stderr not piped");
        Lines::new(err, &format!("stderr of {}", self.what))
    }

    /// Whether it still runs (not reaped).
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for the exit; panics (and the guard kills it) after `timeout`.
    pub fn wait_timeout(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() >= deadline {
                panic!("{} did not exit within {timeout:?}", self.what);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn signal(&mut self, sig: i32) {
        if self.running() {
            unsafe { libc::kill(self.id() as i32, sig) };
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Lines of a pipe, read by a thread, received with timeouts.
pub struct Lines {
    rx: Receiver<String>,
    /// Every line received so far.
    pub seen: Vec<String>,
    what: String,
}

impl Lines {
    pub fn new<R: Read + Send + 'static>(r: R, what: &str) -> Lines {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(r);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match r.read_until(b'\n', &mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        if buf.last() == Some(&b'\n') {
                            buf.pop();
                        }
                        if tx.send(String::from_utf8_lossy(&buf).into_owned()).is_err() {
                            break;
                        }
                    }
                }
            }
        });
        Lines {
            rx,
            seen: Vec::new(),
            what: what.to_string(),
        }
    }

    /// The next line that satisfies `pred` (earlier lines are kept in
    /// `seen`). Panics on timeout or end of file.
    pub fn wait_for(&mut self, pred: impl Fn(&str) -> bool, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout) => panic!(
                    "timed out after {timeout:?} waiting for a line on {}; got {:#?}",
                    self.what, self.seen
                ),
                Err(RecvTimeoutError::Disconnected) => panic!(
                    "{} ended before the line we wait for; got {:#?}",
                    self.what, self.seen
                ),
            }
        }
    }

    /// The next line.
    pub fn next_line(&mut self, timeout: Duration) -> String {
        self.wait_for(|_| true, timeout)
    }

    /// Everything up to end of file (including lines seen before).
    pub fn rest(mut self, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(RecvTimeoutError::Disconnected) => return self.seen,
                Err(RecvTimeoutError::Timeout) => panic!(
                    "{} did not end within {timeout:?}; got {:#?}",
                    self.what, self.seen
                ),
            }
        }
    }
}

/// A running fixture with piped stdin and stdout, stdout read by lines.
pub struct FixtureProc {
    pub proc: Proc,
    pub stdin: Option<ChildStdin>,
    pub stdout: Lines,
}

impl FixtureProc {
    /// Starts `path args` with stdin and stdout piped (stderr inherited).
    pub fn start(path: &Path, args: &[&str]) -> FixtureProc {
        let what = format!("fixture {}", path.display());
        let mut proc = Proc::spawn(
            Command::new(path)
                .args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped()),
            &what,
        );
        let stdin = Some(proc.take_stdin());
        let stdout = proc.stdout_lines();
        FixtureProc {
            proc,
            stdin,
            stdout,
        }
    }

    pub fn pid(&self) -> u32 {
        self.proc.id()
    }

    /// Waits for the line `ready`.
    pub fn wait_ready(&mut self) {
        self.stdout.wait_for(|l| l == "ready", LINE_TIMEOUT);
    }

    /// Writes the byte the fixture waits for.
    pub fn release(&mut self) {
        use std::io::Write;
        let stdin = self.stdin.as_mut().expect("stdin already closed");
        stdin.write_all(b"g").unwrap();
        stdin.flush().unwrap();
    }
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

// ---------------------------------------------------------------------------
// The report

/// One row of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub func: String,
    pub calls: u64,
    pub bytes: u64,
    /// (name, tid) with --per-thread.
    pub thread: Option<(String, u32)>,
    pub truncated: bool,
    /// Function names, innermost (the allocator's direct caller) first.
    pub frames: Vec<String>,
}

impl Row {
    pub fn caller(&self) -> Option<&str> {
        self.frames.first().map(String::as_str)
    }
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub header: String,
    pub rows: Vec<Row>,
    pub total_calls: u64,
    pub total_bytes: u64,
    pub frees: u64,
    /// `(malloc 1005, calloc 250, ...)` of the totals line.
    pub per_func: BTreeMap<String, u64>,
    pub nested: u64,
    /// `lost: ...` as (what, count).
    pub lost: Vec<(String, u64)>,
}

fn num(s: &str, what: &str) -> Result<u64, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("{what}: {s:?} is not a number"))
}

/// `function (file:line)`, `function [inlined]`, `lib+0x12 [lib]` or
/// `function` -> `function`.
fn frame_name(line: &str) -> String {
    let mut s = line.trim();
    if let Some(rest) = s.strip_suffix(" [inlined]") {
        s = rest;
    }
    if s.ends_with(')') {
        if let Some(i) = s.rfind(" (") {
            s = &s[..i];
        }
    } else if s.ends_with(']') && !s.starts_with('[') {
        if let Some(i) = s.rfind(" [") {
            s = &s[..i];
        }
    }
    s.to_string()
}

/// `#K  CALLS calls  PCT%  BYTES bytes  avg AVG  FUNC[  thread NAME (tid N)][  [stack truncated]]`
fn parse_row_header(line: &str) -> Result<Row, String> {
    let bad = || format!("bad row header {line:?}");
    let parts: Vec<&str> = line.split("  ").collect();
    if parts.len() < 6 || !parts[0].starts_with('#') {
        return Err(bad());
    }
    let calls = num(parts[1].strip_suffix(" calls").ok_or_else(bad)?, line)?;
    parts[2].strip_suffix('%').ok_or_else(bad)?;
    let bytes = num(parts[3].strip_suffix(" bytes").ok_or_else(bad)?, line)?;
    let avg = num(parts[4].strip_prefix("avg ").ok_or_else(bad)?, line)?;
    if calls > 0 && avg != bytes / calls {
        return Err(format!("wrong average in {line:?}"));
    }
    let mut row = Row {
        func: parts[5].to_string(),
        calls,
        bytes,
        thread: None,
        truncated: false,
        frames: Vec::new(),
    };
    for part in &parts[6..] {
        if let Some(t) = part.strip_prefix("thread ") {
            let (name, tid) = t.rsplit_once(" (tid ").ok_or_else(bad)?;
            let tid = num(tid.strip_suffix(')').ok_or_else(bad)?, line)?;
            row.thread = Some((name.to_string(), tid as u32));
        } else if *part == "[stack truncated]" {
            row.truncated = true;
        } else {
            return Err(bad());
        }
    }
    Ok(row)
}

impl Report {
    /// Parses mtrace's stdout. Lines before the `mtrace: pid` header (a
    /// launched command's own output) are skipped.
    pub fn parse(text: &str) -> Result<Report, String> {
        let mut lines = text.lines().skip_while(|l| !l.starts_with("mtrace: pid "));
        let mut r = Report {
            header: lines.next().ok_or("no `mtrace: pid` header")?.to_string(),
            ..Report::default()
        };
        let mut seen_total = false;
        let mut seen_lost = false;
        for line in lines {
            if line.is_empty() {
                continue;
            }
            // Live mode: the heap summary and the leak suspects follow the
            // table (tests/e2e/live.rs reads them from the JSON profile).
            if line.starts_with("live: ") {
                break;
            }
            // Live mode: statistics under a row.
            if line.starts_with("    live: ") || line.starts_with("    size ") {
                continue;
            }
            if line.starts_with('#') {
                r.rows.push(parse_row_header(line)?);
            } else if let Some(frame) = line.strip_prefix("    ") {
                let row = r.rows.last_mut().ok_or("a frame before any row")?;
                if frame != "[no frames]" {
                    row.frames.push(frame_name(frame));
                }
            } else if let Some(t) = line.strip_prefix("total: ") {
                let bad = || format!("bad totals line {line:?}");
                let (calls, rest) = t.split_once(" allocation calls, ").ok_or_else(bad)?;
                let (bytes, rest) = rest.split_once(" bytes requested, ").ok_or_else(bad)?;
                let (frees, rest) = rest.split_once(" frees").ok_or_else(bad)?;
                r.total_calls = num(calls, line)?;
                r.total_bytes = num(bytes, line)?;
                r.frees = num(frees, line)?;
                if let Some(list) = rest.trim().strip_prefix('(') {
                    for item in list.strip_suffix(')').ok_or_else(bad)?.split(", ") {
                        let (f, n) = item.rsplit_once(' ').ok_or_else(bad)?;
                        r.per_func.insert(f.to_string(), num(n, line)?);
                    }
                }
                seen_total = true;
            } else if let Some(n) = line.strip_prefix("nested allocator calls not counted twice: ")
            {
                r.nested = num(n, line)?;
            } else if let Some(l) = line.strip_prefix("lost: ") {
                for item in l.split(", ") {
                    let (what, n) = item
                        .rsplit_once(' ')
                        .ok_or_else(|| format!("bad lost line {line:?}"))?;
                    r.lost.push((what.to_string(), num(n, line)?));
                }
                seen_lost = true;
            } else if line.contains(" hidden by --")
                || line == "no allocations traced"
                || line.starts_with("note: ")
                || line.starts_with("sampled: ")
            {
            } else {
                return Err(format!("unexpected line {line:?}"));
            }
        }
        if !seen_total || !seen_lost {
            return Err("no totals or no lost line".into());
        }
        Ok(r)
    }

    /// Rows of `func` whose direct caller is `caller`.
    pub fn rows_at(&self, func: &str, caller: &str) -> Vec<&Row> {
        self.rows
            .iter()
            .filter(|r| r.func == func && r.caller() == Some(caller))
            .collect()
    }

    /// Summed (calls, bytes) of `func` called from `caller` (a compiler may
    /// have made one source loop into several call sites).
    pub fn site(&self, func: &str, caller: &str) -> (u64, u64) {
        self.rows_at(func, caller)
            .iter()
            .fold((0, 0), |(c, b), r| (c + r.calls, b + r.bytes))
    }

    /// Every distinct (func, direct caller).
    pub fn sites(&self) -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = self
            .rows
            .iter()
            .map(|r| (r.func.clone(), r.caller().unwrap_or("").to_string()))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    pub fn assert_no_losses(&self) {
        assert!(!self.lost.is_empty());
        assert!(
            self.lost.iter().all(|(_, n)| *n == 0),
            "losses: {:?}",
            self.lost
        );
    }

    /// For assertion messages.
    pub fn dump(&self) -> String {
        let mut s = String::new();
        for r in &self.rows {
            let _ = writeln!(
                s,
                "{} calls {} bytes {} {:?} {:?}{}",
                r.calls,
                r.bytes,
                r.func,
                r.thread,
                r.frames,
                if r.truncated { " [truncated]" } else { "" }
            );
        }
        s
    }
}

// ---------------------------------------------------------------------------
// Misc

/// A fresh directory under /tmp that every user can enter (tempfile makes
/// them 0700).
pub fn public_tempdir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("mtrace-e2e-")
        .tempdir_in("/tmp")
        .unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// Copies `src` into `dir` as an executable file.
pub fn copy_executable(src: &Path, dir: &Path, name: &str) -> PathBuf {
    let dst = dir.join(name);
    fs::copy(src, &dst).unwrap();
    fs::set_permissions(&dst, fs::Permissions::from_mode(0o755)).unwrap();
    dst
}

/// `len` bytes of the memory of `pid` at `addr`.
pub fn read_mem(pid: u32, addr: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let f = fs::File::open(format!("/proc/{pid}/mem"))?;
    let mut buf = vec![0; len];
    f.read_exact_at(&mut buf, addr)?;
    Ok(buf)
}

/// The pid of a process that has exited and been reaped.
pub fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().expect("running true");
    let pid = child.id();
    child.wait().unwrap();
    pid
}
