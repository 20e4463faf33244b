//! Child processes that are killed when a test fails, line readers with
//! timeouts, and running fixtures.

use std::{
    fs,
    io::{BufRead, BufReader, Read},
    os::unix::fs::FileExt,
    path::Path,
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::mpsc::{self, Receiver, RecvTimeoutError},
    time::{Duration, Instant},
};

/// How long we wait for one expected line (ready, tracing, ...).
pub const LINE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long we wait for a process that should end by itself.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(60);

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

    /// [`Proc::wait_timeout`], reaping it with `wait4`: also what it
    /// used, its peak resident set size in KiB (its `VmHWM`, read until it
    /// exits), and when it exited (to within 5 ms).
    ///
    /// The peak is not `ru_maxrss`: the kernel folds into that the peak
    /// of the address space an exec replaced, here the test binary's own
    /// (which the spawn shares until the exec), so it says whatever the
    /// tests running beside held at that moment.
    pub fn wait_rusage(&mut self, timeout: Duration) -> (ExitStatus, libc::rusage, i64, Instant) {
        use std::os::unix::process::ExitStatusExt;
        let deadline = Instant::now() + timeout;
        let pid = self.id() as i32;
        let mut peak = 0;
        loop {
            if let Some(hwm) = vm_hwm_kib(pid) {
                peak = peak.max(hwm);
            }
            let mut status = 0;
            // SAFETY: plain out-parameters.
            let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
            let got = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
            if got == pid {
                return (ExitStatus::from_raw(status), usage, peak, Instant::now());
            }
            assert_eq!(got, 0, "wait4: {}", std::io::Error::last_os_error());
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

/// A live process's peak resident set size since its exec, in KiB; none
/// once it has exited (a zombie has no address space).
fn vm_hwm_kib(pid: i32) -> Option<i64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
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
        FixtureProc::start_env(path, args, &[])
    }

    /// [`FixtureProc::start`] with `env` added to its environment.
    pub fn start_env(path: &Path, args: &[&str], env: &[(&str, &str)]) -> FixtureProc {
        let what = format!("fixture {}", path.display());
        let mut proc = Proc::spawn(
            Command::new(path)
                .args(args)
                .envs(env.iter().copied())
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
