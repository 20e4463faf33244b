//! The ptrace and wait requests the launch and the holds are made of:
//! the one place that calls `libc::ptrace`, besides the launched child's
//! own `PTRACE_TRACEME` (made between its fork and its exec).

use std::sync::atomic::{AtomicBool, Ordering};

/// A ptrace request on `pid` whose address is unused, with `data` (a
/// number, or a pointer to what the kernel reads or fills).
pub(crate) fn ptrace(req: libc::c_uint, pid: u32, data: usize) -> std::io::Result<()> {
    let r = unsafe {
        libc::ptrace(
            req,
            pid as libc::pid_t,
            std::ptr::null_mut::<libc::c_void>(),
            data as *mut libc::c_void,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Seizes thread `tid` (`PTRACE_SEIZE`, which does not stop it) with
/// `options`; false when it cannot be.
pub(crate) fn seize(tid: u32, options: i32) -> bool {
    ptrace(libc::PTRACE_SEIZE, tid, options as usize).is_ok()
}

pub(crate) fn waitpid(pid: u32) -> std::io::Result<i32> {
    let mut status = 0;
    loop {
        let r = unsafe { libc::waitpid(pid as i32, &mut status, libc::__WALL) };
        if r >= 0 {
            return Ok(status);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

pub(crate) fn peek(pid: u32, addr: u64) -> std::io::Result<u64> {
    // PEEKTEXT returns the word: -1 is an error only when errno says so.
    unsafe { *libc::__errno_location() = 0 };
    let word = unsafe {
        libc::ptrace(
            libc::PTRACE_PEEKTEXT,
            pid as libc::pid_t,
            addr as *mut libc::c_void,
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    let errno = unsafe { *libc::__errno_location() };
    if word == -1 && errno != 0 {
        return Err(std::io::Error::from_raw_os_error(errno));
    }
    Ok(word as u64)
}

pub(crate) fn poke(pid: u32, addr: u64, word: u64) -> std::io::Result<()> {
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_POKETEXT,
            pid as libc::pid_t,
            addr as *mut libc::c_void,
            word as *mut libc::c_void,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

pub(crate) fn get_regs(pid: u32) -> std::io::Result<libc::user_regs_struct> {
    // SAFETY: plain data, filled by the kernel.
    let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    ptrace(
        libc::PTRACE_GETREGS,
        pid,
        &mut regs as *mut libc::user_regs_struct as usize,
    )?;
    Ok(regs)
}

pub(crate) fn set_regs(pid: u32, regs: &libc::user_regs_struct) -> std::io::Result<()> {
    ptrace(
        libc::PTRACE_SETREGS,
        pid,
        regs as *const libc::user_regs_struct as usize,
    )
}

/// Signals that reached a tracee while mtrace held it for its own ends
/// (running a new program to its allocator, letting it go): none may be
/// lost, so each is delivered when the tracee is resumed.
#[derive(Default, Debug)]
pub(crate) struct HeldSignals(Vec<i32>);

impl HeldSignals {
    /// True (and the signal kept) when `status` is a signal-delivery stop:
    /// a stop for a signal on its way to the tracee, not a trap of
    /// mtrace's own (a breakpoint, a step, a system call, a ptrace event).
    pub(crate) fn keep(&mut self, status: i32) -> bool {
        if !libc::WIFSTOPPED(status) || status >> 16 != 0 {
            return false;
        }
        let sig = libc::WSTOPSIG(status);
        if sig == libc::SIGTRAP || sig == (libc::SIGTRAP | 0x80) {
            return false;
        }
        self.0.push(sig);
        true
    }

    /// The signal to deliver with the next resume (0: none).
    pub(crate) fn next(&mut self) -> usize {
        if self.0.is_empty() {
            0
        } else {
            self.0.remove(0) as usize
        }
    }

    /// Resumes `tid` (`request`: `PTRACE_CONT` or `PTRACE_DETACH`) with the
    /// first signal held; the others are sent again first, so that they
    /// come back as signals of the running tracee.
    pub(crate) fn resume(mut self, request: libc::c_uint, tid: u32) -> std::io::Result<()> {
        let first = self.next();
        for sig in self.0 {
            let tgid = tgid_of(tid).unwrap_or(tid);
            unsafe { libc::syscall(libc::SYS_tgkill, tgid as i32, tid as i32, sig) };
        }
        ptrace(request, tid, first)
    }
}

/// The thread group a new tracee belongs to (`Tgid:` in its status).
pub(crate) fn tgid_of(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

pub(crate) fn event_msg(tid: u32) -> Option<u32> {
    let mut msg: libc::c_ulong = 0;
    ptrace(
        libc::PTRACE_GETEVENTMSG,
        tid,
        &mut msg as *mut libc::c_ulong as usize,
    )
    .ok()?;
    Some(msg as u32)
}

/// Whether the signal `tid` is stopped to be delivered came from the
/// kernel itself (`SI_KERNEL`: a BPF program's, a socket's urgent data),
/// not from a process.
pub(crate) fn sent_by_kernel(tid: u32) -> bool {
    // SAFETY: plain data, all zeroes valid.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    ptrace(
        libc::PTRACE_GETSIGINFO,
        tid,
        &mut info as *mut libc::siginfo_t as usize,
    )
    .is_ok()
        && info.si_code == libc::SI_KERNEL
}

/// What [`wait_any`] saw.
pub(crate) enum Waited {
    /// A tracee's wait status.
    Tracee(u32, i32),
    /// Nothing from the tracees yet, and `asked` said there is work.
    Asked,
}

/// Waits for any tracee; `None` when none is left, or (with `stop`) once
/// the flag is set. With `stop`, `asked` is called between polls.
pub(crate) fn wait_any(stop: Option<&AtomicBool>, asked: &dyn Fn() -> bool) -> Option<Waited> {
    let mut status = 0;
    let flags = libc::__WALL | if stop.is_some() { libc::WNOHANG } else { 0 };
    let waiting = std::time::Instant::now();
    loop {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return None;
        }
        let r = unsafe { libc::waitpid(-1, &mut status, flags) };
        if r > 0 {
            return Some(Waited::Tracee(r as u32, status));
        }
        // A hold (`stop` given) with no tracee left waits on for processes
        // handed over (a cgroup that empties and fills again) until it is
        // stopped.
        let none_left = r < 0
            && stop.is_some()
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD);
        if r == 0 || none_left {
            if asked() {
                return Some(Waited::Asked);
            }
            // Busy trees are answered within POLL; a hold that has seen
            // nothing for a while (an agent on a quiet service, for weeks)
            // looks ten times less often.
            std::thread::sleep(if waiting.elapsed() < QUIET_AFTER {
                POLL
            } else {
                QUIET_POLL
            });
            continue;
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return None;
        }
    }
}

/// How often a hold (by pid) looks for a stop of its tracees and for the
/// end of the trace.
const POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// How often a hold looks once nothing has happened for [`QUIET_AFTER`].
const QUIET_POLL: std::time::Duration = std::time::Duration::from_millis(20);
const QUIET_AFTER: std::time::Duration = std::time::Duration::from_millis(200);
