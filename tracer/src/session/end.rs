//! How a trace ends: the target's exit (a pidfd by pid), `--duration`,
//! SIGINT or SIGTERM, or `q` in the live view; and how that is said.

use std::{
    os::fd::{FromRawFd, OwnedFd},
    time::Duration,
};

use anyhow::Result;
use tokio::signal::unix::SignalKind;

use crate::user_error;

/// Why tracing stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// With the exit code to pass through (launch mode).
    TargetExited(Option<i32>),
    Duration,
    Interrupted(i32),
    /// `q` in the live view.
    Stopped,
    /// By cgroup: no process is left in it.
    CgroupEmpty,
}

impl End {
    /// Why the trace ended, for the line that says so.
    pub fn describe(&self, duration: Option<Duration>) -> String {
        match self {
            End::TargetExited(Some(0)) | End::TargetExited(None) => "the target exited".into(),
            End::TargetExited(Some(code)) if *code > 128 => format!(
                "the target was killed by signal {} ({})",
                code - 128,
                signal_name(code - 128)
            ),
            End::TargetExited(Some(code)) => format!("the target exited with status {code}"),
            End::Duration => match duration {
                Some(d) => format!("--duration {} elapsed", humantime::format_duration(d)),
                None => "the duration elapsed".into(),
            },
            End::Interrupted(sig) if *sig == libc::SIGINT => "interrupted (Ctrl-C)".into(),
            End::Interrupted(sig) => format!("{} received", signal_name(*sig)),
            End::Stopped => "stopped from the live view".into(),
            End::CgroupEmpty => "no process is left in the cgroup".into(),
        }
    }
}

fn signal_name(sig: i32) -> String {
    // SAFETY: strsignal returns a static or thread-local string.
    let name = unsafe { libc::strsignal(sig) };
    if name.is_null() {
        return format!("signal {sig}");
    }
    let abbrev = match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGBUS => "SIGBUS",
        libc::SIGPIPE => "SIGPIPE",
        _ => {
            return unsafe { std::ffi::CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        }
    };
    abbrev.to_string()
}

/// The signals that end a trace or ask for a snapshot. Installed before
/// anything else: a Ctrl-C from then on ends the trace with a report (once
/// the probes are in), never kills mtrace.
pub struct Signals {
    pub(super) int: tokio::signal::unix::Signal,
    pub(super) term: tokio::signal::unix::Signal,
    pub(super) usr1: tokio::signal::unix::Signal,
}

impl Signals {
    /// Must be called inside the runtime.
    pub fn new() -> Result<Signals> {
        use tokio::signal::unix::signal;
        Ok(Signals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            usr1: signal(SignalKind::user_defined1())?,
        })
    }

    /// The next signal: one that ends a trace (SIGINT or SIGTERM), or
    /// `None` for SIGUSR1, which asks for a snapshot.
    pub async fn next(&mut self) -> Option<i32> {
        tokio::select! {
            _ = self.int.recv() => Some(libc::SIGINT),
            _ = self.term.recv() => Some(libc::SIGTERM),
            _ = self.usr1.recv() => None,
        }
    }
}

/// The timer of `--interval` snapshots: the first one interval after the
/// start.
pub struct SnapshotTimer(Option<tokio::time::Interval>);

impl SnapshotTimer {
    /// Must be called inside the runtime.
    pub fn new(every: Option<std::time::Duration>) -> SnapshotTimer {
        SnapshotTimer(
            every.map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every)),
        )
    }

    /// Resolves when a snapshot is due (never without an interval).
    pub async fn due(&mut self) {
        match &mut self.0 {
            Some(i) => {
                i.tick().await;
            }
            None => std::future::pending().await,
        }
    }
}

/// A descriptor that becomes readable when `pid` exits. Opened before the
/// probes are attached: a target that exits during the attach is still
/// seen to exit (and a recycled pid is never watched).
pub fn pidfd_open(pid: u32) -> Result<OwnedFd> {
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(user_error!(
            "cannot watch pid {pid}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
