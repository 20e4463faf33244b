//! Launch mode: start a command with the probes attached before its first
//! instruction runs.
//!
//! The child asks to be traced (`PTRACE_TRACEME`) and execs the command, so
//! it stops right after `execve`. We then run it to the moment its dynamic
//! linker has mapped every library it starts with (a breakpoint on
//! `_dl_debug_state`, as debuggers do), before any of their code runs;
//! its link map then says which object calls to `malloc` bind to. We
//! attach the probes there and let it go. (A static program, or one whose
//! dynamic linker we do not know, is stepped from system call to system
//! call until an object that defines `malloc` is mapped executable.)
//!
//! It stays traced for a few events only ([`TreeEvent`]): at each `exec`
//! (`PTRACE_O_TRACEEXEC`) the new program is run to the same point and the
//! session probes its allocator while it waits; at its exit
//! (`PTRACE_O_TRACEEXIT`) the session reads its mappings once more so that
//! libraries it loaded late can still be symbolized after it is gone.
//! When following the process tree (the default), every child it creates
//! (`fork`, `vfork`, `clone`: `PTRACE_O_TRACEFORK` and its kin, so that
//! the child starts stopped, before its first instruction) is handed to
//! the session, which probes it before it runs, and so on to any depth;
//! threads are traced too (a thread may fork) and let run at once.
//! Signals are passed on unchanged. If mtrace dies, the kernel detaches
//! every tracee and they run on.

use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    os::unix::ffi::{OsStrExt, OsStringExt},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
};

use anyhow::Result;

use crate::{
    error::{UserError, EXIT_CMD_NOT_EXECUTABLE, EXIT_CMD_NOT_FOUND},
    user_error,
};

use super::{
    is_dynamic_linker, proc::read_maps, run_as::RunAs, DynamicLinker, Mapping, RT_CONSISTENT,
};

/// How many system calls we follow, at most, waiting for the allocator to
/// be mapped.
const MAX_STARTUP_SYSCALLS: u32 = 20_000;

/// The child exited (with this code to pass through) while we waited for
/// its allocator.
#[derive(Debug)]
struct Exited(i32);

impl std::fmt::Display for Exited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the command exited before its allocator was loaded")
    }
}

impl std::error::Error for Exited {}

/// The exit code a wait status passes through, if the child is gone.
fn exit_code(status: i32) -> Option<i32> {
    if libc::WIFEXITED(status) {
        Some(libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        Some(128 + libc::WTERMSIG(status))
    } else {
        None
    }
}

/// `Err(Exited)` when `status` says the child is gone.
fn check_alive(status: i32) -> Result<()> {
    match exit_code(status) {
        Some(code) => Err(anyhow::Error::new(Exited(code))),
        None => Ok(()),
    }
}

/// What the launch thread tells the session about the process tree. The
/// thread waits for the answer to each (the process concerned stays
/// stopped meanwhile).
#[derive(Debug)]
pub enum TreeEvent<'a> {
    /// `child`, created by `parent`, is stopped before its first
    /// instruction, with a copy of its parent's memory (`vfork`: sharing
    /// it, and calling nothing but `exec` or `_exit` until then).
    Fork {
        parent: u32,
        child: u32,
        vfork: bool,
    },
    /// `pid` exec'd and was run to the point where its new program's
    /// allocator is known; answer `Some` once it is probed, `None` to be
    /// asked again when more is mapped.
    Exec { pid: u32, maps: &'a [Mapping] },
    /// `pid`'s last thread is exiting: its memory and mappings are still
    /// there.
    Exiting { pid: u32 },
    /// `pid` is gone, with this exit code (128 + signal when killed).
    Gone { pid: u32, code: i32 },
}

pub struct Launched<T> {
    /// What the attach callback returned.
    pub attached: T,
    /// Receives the exit code to pass through (128 + signal when killed).
    pub exit: tokio::sync::oneshot::Receiver<i32>,
}

/// Finds `cmd` the way a shell does.
pub fn resolve_command(cmd: &str) -> Result<PathBuf> {
    let candidates: Vec<PathBuf> = if cmd.contains('/') {
        vec![PathBuf::from(cmd)]
    } else {
        std::env::var_os("PATH")
            .unwrap_or_default()
            .to_str()
            .unwrap_or("")
            .split(':')
            .filter(|d| !d.is_empty())
            .map(|d| Path::new(d).join(cmd))
            .collect()
    };
    let mut not_executable = None;
    for c in candidates {
        if c.is_file() {
            let cpath = CString::new(c.as_os_str().as_bytes())?;
            if unsafe { libc::access(cpath.as_ptr(), libc::X_OK) } == 0 {
                return Ok(c);
            }
            not_executable = Some(c);
        }
    }
    match not_executable {
        Some(c) => Err(anyhow::Error::new(UserError::with_code(
            format!("cannot execute {}: permission denied", c.display()),
            EXIT_CMD_NOT_EXECUTABLE,
        ))),
        None => Err(anyhow::Error::new(UserError::with_code(
            format!("command not found: {cmd}"),
            EXIT_CMD_NOT_FOUND,
        ))),
    }
}

/// Starts `argv` stopped and steps it until `attach` (called with its pid
/// and mappings each time the set of executable mappings changes) returns
/// `Some`: the allocator is mapped and the probes are in. Then lets it run,
/// telling `on_event` of what happens in it (and, with `follow`, in every
/// process it creates): each time a process calls `exec`, the new program
/// is run in the same way to the point where its allocator is known, and
/// [`TreeEvent::Exec`] asked there (answered `Some` once the session has
/// probed the new program's allocator). With `run_as`, the command runs
/// as that user (`--user`).
pub fn launch<T, F, E>(
    argv: &[String],
    follow: bool,
    run_as: Option<RunAs>,
    attach: F,
    mut on_event: E,
) -> Result<Launched<T>>
where
    T: Send + 'static,
    F: FnMut(u32, &[Mapping]) -> Result<Option<T>> + Send + 'static,
    E: FnMut(TreeEvent) -> Result<Option<()>> + Send + 'static,
{
    let path = resolve_command(&argv[0])?;
    let c_path = CString::new(path.as_os_str().as_bytes())?;
    let c_args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<_, _>>()?;
    let c_env: Vec<CString> = match &run_as {
        Some(user) => user.environment(),
        None => std::env::vars_os().collect(),
    }
    .into_iter()
    .filter_map(|(k, v)| {
        let mut kv = k.into_vec();
        kv.push(b'=');
        kv.extend(v.into_vec());
        CString::new(kv).ok()
    })
    .collect();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(u32, T)>>();
    let (exit_tx, exit_rx) = tokio::sync::oneshot::channel();

    // ptrace requests must come from the thread that forked the tracee, so
    // one thread does it all.
    std::thread::Builder::new()
        .name("mtrace-launch".into())
        .spawn(move || {
            let pid = match start_stopped(&c_path, &c_args, &c_env, run_as.as_ref(), follow) {
                Ok(pid) => pid,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let attached = wait_for_allocator(pid, attach);
            match attached {
                Ok(t) => {
                    let _ = ready_tx.send(Ok((pid, t)));
                }
                Err(e) => {
                    if e.downcast_ref::<Exited>().is_none() {
                        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                        let _ = waitpid(pid);
                    }
                    let e = match e.downcast_ref::<Exited>() {
                        Some(gone) => user_error!("{gone}"),
                        None => e,
                    };
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            }
            if let Err(e) = ptrace(libc::PTRACE_CONT, pid, 0) {
                log::warn!("resuming pid {pid}: {e}");
            }
            let group = HashMap::from([(pid, pid)]);
            let code = wait_tree(pid, group, None, &mut on_event).unwrap_or(1);
            let _ = exit_tx.send(code);
        })?;

    let (_pid, attached) = ready_rx
        .recv()
        .map_err(|_| user_error!("the launch thread died"))??;
    Ok(Launched {
        attached,
        exit: exit_rx,
    })
}

fn ptrace(req: libc::c_uint, pid: u32, data: usize) -> std::io::Result<()> {
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

fn waitpid(pid: u32) -> std::io::Result<i32> {
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

/// The limit of open files mtrace was started with (soft, hard), before
/// [`raise_file_limit`]; the command gets it back.
static FILE_LIMIT: [std::sync::atomic::AtomicU64; 2] = [
    std::sync::atomic::AtomicU64::new(u64::MAX),
    std::sync::atomic::AtomicU64::new(u64::MAX),
];

/// Raises the soft limit of open files to the hard one: every traced
/// process takes about 50 descriptors (maps, programs, probes), and a
/// shell's usual soft limit of 1,024 would stop a tree at about 20. The
/// command mtrace starts runs with the limit mtrace was given.
pub fn raise_file_limit() {
    use std::sync::atomic::Ordering;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    FILE_LIMIT[0].store(limit.rlim_cur, Ordering::Relaxed);
    FILE_LIMIT[1].store(limit.rlim_max, Ordering::Relaxed);
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            log::debug!(
                "could not raise the limit of open files: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// What the child failed at, before its exec or in it.
const FAILED_EXEC: i32 = 0;
const FAILED_CREDENTIALS: i32 = 1;

/// Forks; the child becomes traced, takes `run_as`'s credentials (if any)
/// and execs with `env`. Returns once the child is stopped right after a
/// successful exec.
fn start_stopped(
    path: &CString,
    args: &[CString],
    env: &[CString],
    run_as: Option<&RunAs>,
    follow: bool,
) -> Result<u32> {
    let pointers = |strings: &[CString]| -> Vec<*const libc::c_char> {
        strings
            .iter()
            .map(|a| a.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect()
    };
    let (argv, envp) = (pointers(args), pointers(env));
    // A close-on-exec pipe reports what failed and its errno.
    let mut fds = [0; 2];
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    if pid == 0 {
        // Child: only async-signal-safe calls from here on.
        unsafe {
            let fail = |stage: i32| -> ! {
                let report = [stage, *libc::__errno_location()];
                libc::write(fds[1], report.as_ptr().cast(), 8);
                libc::_exit(127)
            };
            libc::close(fds[0]);
            libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0);
            let (soft, hard) = (
                FILE_LIMIT[0].load(std::sync::atomic::Ordering::Relaxed),
                FILE_LIMIT[1].load(std::sync::atomic::Ordering::Relaxed),
            );
            if soft != u64::MAX || hard != u64::MAX {
                let limit = libc::rlimit {
                    rlim_cur: soft,
                    rlim_max: hard,
                };
                libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
            }
            // Groups first, the uid last: each needs root, which the
            // previous one may give up.
            if let Some(user) = run_as {
                if libc::setgroups(user.groups.len(), user.groups.as_ptr()) != 0
                    || libc::setgid(user.gid) != 0
                    || libc::setuid(user.uid) != 0
                {
                    fail(FAILED_CREDENTIALS);
                }
            }
            libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr());
            fail(FAILED_EXEC);
        }
    }
    unsafe { libc::close(fds[1]) };
    let mut report = [0i32; 2];
    let n = unsafe { libc::read(fds[0], report.as_mut_ptr().cast(), 8) };
    unsafe { libc::close(fds[0]) };
    let pid = pid as u32;
    if n == 8 {
        let _ = waitpid(pid);
        let [stage, err] = report;
        let e = std::io::Error::from_raw_os_error(err);
        if stage == FAILED_CREDENTIALS {
            let user = run_as.map_or("", |u| u.name.as_str());
            return Err(user_error!("cannot run the command as {user}: {e}"));
        }
        let code = if err == libc::ENOENT {
            EXIT_CMD_NOT_FOUND
        } else {
            EXIT_CMD_NOT_EXECUTABLE
        };
        return Err(anyhow::Error::new(UserError::with_code(
            format!("cannot execute {}: {e}", path.to_string_lossy()),
            code,
        )));
    }
    let status = waitpid(pid)?;
    if !libc::WIFSTOPPED(status) {
        return Err(user_error!("{} did not start", path.to_string_lossy()));
    }
    let mut options =
        libc::PTRACE_O_TRACESYSGOOD | libc::PTRACE_O_TRACEEXIT | libc::PTRACE_O_TRACEEXEC;
    if follow {
        options |= libc::PTRACE_O_TRACEFORK | libc::PTRACE_O_TRACEVFORK | libc::PTRACE_O_TRACECLONE;
    }
    ptrace(libc::PTRACE_SETOPTIONS, pid, options as usize)?;
    Ok(pid)
}

/// Runs the stopped child until its allocator is loaded and `attach` has
/// attached to it: for a dynamically linked program, to the moment its
/// dynamic linker has mapped every library it starts with and before any
/// of their code runs ([`run_to_consistent`]); otherwise (or if that
/// fails) from system call to system call until an object that defines
/// `malloc` is mapped executable.
fn wait_for_allocator<T>(
    pid: u32,
    mut attach: impl FnMut(u32, &[Mapping]) -> Result<Option<T>>,
) -> Result<T> {
    let maps = read_maps(pid)?;
    if let Some(ld) = DynamicLinker::find(pid, &maps) {
        if let Some(t) = run_to_consistent(pid, &ld, &mut attach)? {
            return Ok(t);
        }
    }
    step_syscalls(pid, attach)
}

/// A breakpoint on the dynamic linker's `_dl_debug_state`, which it calls
/// each time its list of objects changes (the hook debuggers use): at the
/// first call that finds the list consistent, every object the program
/// starts with is mapped and none has run code, so the link map says
/// which object calls bind to. Returns `None` (the breakpoint gone, the
/// child stopped where it was) when the breakpoint cannot be set.
fn run_to_consistent<T>(
    pid: u32,
    ld: &DynamicLinker,
    attach: &mut impl FnMut(u32, &[Mapping]) -> Result<Option<T>>,
) -> Result<Option<T>> {
    let Some(bp) = ld.debug_state else {
        return Ok(None);
    };
    let Ok(original) = peek(pid, bp) else {
        return Ok(None);
    };
    let armed = (original & !0xff) | 0xcc;
    if poke(pid, bp, armed).is_err() {
        return Ok(None);
    }
    let mut inject = 0;
    loop {
        ptrace(libc::PTRACE_CONT, pid, inject)?;
        inject = 0;
        let status = waitpid(pid)?;
        check_alive(status)?;
        if !libc::WIFSTOPPED(status) {
            continue;
        }
        let sig = libc::WSTOPSIG(status);
        if sig != libc::SIGTRAP {
            // A real signal: deliver it.
            inject = sig as usize;
            continue;
        }
        let mut regs = get_regs(pid)?;
        if regs.rip != bp + 1 || status >> 16 != 0 {
            // Another trap (the exit event): not ours.
            continue;
        }
        // Ours: take the breakpoint out and run the instruction again.
        poke(pid, bp, original)?;
        regs.rip = bp;
        set_regs(pid, &regs)?;
        if ld.state(pid) == Some(RT_CONSISTENT) {
            let maps = read_maps(pid)?;
            if let Some(t) = attach(pid, &maps)? {
                return Ok(Some(t));
            }
        }
        // Not yet (or a library loaded later may bring the allocator):
        // step over the instruction and arm the breakpoint again.
        ptrace(libc::PTRACE_SINGLESTEP, pid, 0)?;
        check_alive(waitpid(pid)?)?;
        poke(pid, bp, armed)?;
    }
}

fn peek(pid: u32, addr: u64) -> std::io::Result<u64> {
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

fn poke(pid: u32, addr: u64, word: u64) -> std::io::Result<()> {
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

fn get_regs(pid: u32) -> std::io::Result<libc::user_regs_struct> {
    // SAFETY: plain data, filled by the kernel.
    let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_GETREGS,
            pid as libc::pid_t,
            std::ptr::null_mut::<libc::c_void>(),
            &mut regs as *mut libc::user_regs_struct,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(regs)
}

fn set_regs(pid: u32, regs: &libc::user_regs_struct) -> std::io::Result<()> {
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_SETREGS,
            pid as libc::pid_t,
            std::ptr::null_mut::<libc::c_void>(),
            regs as *const libc::user_regs_struct,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Steps the stopped child from system call to system call until its
/// allocator is mapped executable and `attach` has attached to it.
fn step_syscalls<T>(
    pid: u32,
    mut attach: impl FnMut(u32, &[Mapping]) -> Result<Option<T>>,
) -> Result<T> {
    let mut seen_paths: Vec<String> = Vec::new();
    for _ in 0..MAX_STARTUP_SYSCALLS {
        let maps = read_maps(pid)?;
        let mut paths: Vec<String> = maps
            .iter()
            .filter(|m| m.is_file() && m.perms.contains('x'))
            .map(|m| m.path.clone())
            .collect();
        paths.dedup();
        if paths != seen_paths {
            if let Some(attached) = attach(pid, &maps)? {
                return Ok(attached);
            }
            // A static program without an interpreter maps nothing more.
            if !maps.iter().any(|m| is_dynamic_linker(&m.path)) {
                break;
            }
            seen_paths = paths;
        }
        ptrace(libc::PTRACE_SYSCALL, pid, 0)?;
        let status = waitpid(pid)?;
        check_alive(status)?;
        if libc::WIFSTOPPED(status) {
            let sig = libc::WSTOPSIG(status);
            if sig != (libc::SIGTRAP | 0x80) && sig != libc::SIGTRAP {
                // A real signal: deliver it on the next step.
                ptrace(libc::PTRACE_SYSCALL, pid, sig as usize)?;
                check_alive(waitpid(pid)?)?;
            }
        }
    }
    Err(user_error!(
        "no malloc found in the command or any library it maps"
    ))
}

/// The traced process stopped at an `exec` (`PTRACE_EVENT_EXEC`): runs the
/// new program to the point where its allocator is known and calls
/// `on_exec` there (the old program's probes and mappings mean nothing in
/// it). Returns the exit code to pass through when it exited meanwhile.
pub fn follow_exec(
    pid: u32,
    on_exec: &mut impl FnMut(u32, &[Mapping]) -> Result<Option<()>>,
) -> Option<i32> {
    match wait_for_allocator(pid, on_exec) {
        Ok(()) => None,
        Err(e) => match e.downcast_ref::<Exited>() {
            Some(Exited(code)) => Some(*code),
            None => {
                log::warn!("pid {pid} after exec: {e:#}");
                None
            }
        },
    }
}

/// The thread group a new tracee belongs to (`Tgid:` in its status).
fn tgid_of(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

fn event_msg(tid: u32) -> Option<u32> {
    let mut msg: libc::c_ulong = 0;
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_GETEVENTMSG,
            tid as libc::pid_t,
            std::ptr::null_mut::<libc::c_void>(),
            &mut msg as *mut libc::c_ulong,
        )
    };
    (r == 0).then_some(msg as u32)
}

/// Waits for any tracee; `None` when none is left, or (with `stop`) once
/// the flag is set.
fn wait_any(stop: Option<&AtomicBool>) -> Option<(u32, i32)> {
    let mut status = 0;
    let flags = libc::__WALL | if stop.is_some() { libc::WNOHANG } else { 0 };
    loop {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return None;
        }
        let r = unsafe { libc::waitpid(-1, &mut status, flags) };
        if r > 0 {
            return Some((r as u32, status));
        }
        if r == 0 {
            std::thread::sleep(POLL);
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

/// Follows the root process (and with `PTRACE_O_TRACEFORK` and its kin,
/// every process and thread it creates) until the root is gone, passing
/// signals on and telling `on_event` of each [`TreeEvent`]; returns the
/// root's exit code to pass through. `group` holds the thread group of
/// every thread traced already (the root's at least). With `stop` (by pid,
/// where the tracees were seized), ends when the flag is set: every tracee
/// is then detached and runs on, and `None` is returned. Otherwise,
/// tracees still running when the root is gone are detached by the kernel
/// when this thread ends.
pub fn wait_tree(
    root: u32,
    mut group: HashMap<u32, u32>,
    stop: Option<&AtomicBool>,
    on_event: &mut impl FnMut(TreeEvent) -> Result<Option<()>>,
) -> Option<i32> {
    // New tracees whose first stop came before their creator's event.
    let mut early: HashSet<u32> = HashSet::new();
    let cont = |tid: u32, sig: i32| {
        // A tracee that is gone already: its wait status says how.
        let _ = ptrace(libc::PTRACE_CONT, tid, sig as usize);
    };
    // A new tracee starts with a stop of its own: take it (now, or when
    // it came early) and let it go only when told to.
    let take_first_stop = |tid: u32, early: &mut HashSet<u32>| {
        if !early.remove(&tid) {
            let _ = waitpid(tid);
        }
    };
    loop {
        let Some((tid, status)) = wait_any(stop) else {
            if stop.is_some() {
                detach_all(group.keys().copied().chain(early.iter().copied()));
                return None;
            }
            return Some(1);
        };
        if let Some(code) = exit_code(status) {
            if let Some(tgid) = group.remove(&tid) {
                if tid == tgid {
                    let _ = on_event(TreeEvent::Gone { pid: tid, code });
                    if tid == root && stop.is_none() {
                        return Some(code);
                    }
                }
            }
            continue;
        }
        if !libc::WIFSTOPPED(status) {
            continue;
        }
        let Some(&tgid) = group.get(&tid) else {
            // The first stop of a tracee whose creator has not reported
            // it yet.
            early.insert(tid);
            continue;
        };
        let sig = libc::WSTOPSIG(status);
        match status >> 16 {
            event @ (libc::PTRACE_EVENT_FORK
            | libc::PTRACE_EVENT_VFORK
            | libc::PTRACE_EVENT_CLONE) => {
                let Some(child) = event_msg(tid) else {
                    cont(tid, 0);
                    continue;
                };
                take_first_stop(child, &mut early);
                let child_group = match event {
                    libc::PTRACE_EVENT_CLONE => tgid_of(child).unwrap_or(child),
                    _ => child,
                };
                group.insert(child, child_group);
                if child_group == child {
                    let _ = on_event(TreeEvent::Fork {
                        parent: tgid,
                        child,
                        vfork: event == libc::PTRACE_EVENT_VFORK,
                    });
                }
                cont(child, 0);
                cont(tid, 0);
            }
            libc::PTRACE_EVENT_EXEC => {
                // The thread that exec'd now has the group's id; the
                // others are gone without a word.
                let pid = tgid;
                group.retain(|t, g| *g != pid || *t == pid);
                group.insert(pid, pid);
                let mut on_exec =
                    |pid: u32, maps: &[Mapping]| on_event(TreeEvent::Exec { pid, maps });
                if let Some(code) = follow_exec(pid, &mut on_exec) {
                    group.remove(&pid);
                    let _ = on_event(TreeEvent::Gone { pid, code });
                    if pid == root && stop.is_none() {
                        return Some(code);
                    }
                    continue;
                }
                cont(pid, 0);
            }
            libc::PTRACE_EVENT_EXIT => {
                // The last thread of the group (its memory still there) or
                // the leader with threads left: either way, a last look.
                if tid == tgid {
                    let _ = on_event(TreeEvent::Exiting { pid: tid });
                }
                cont(tid, 0);
            }
            // A seized tracee's group stop (SIGSTOP and the like) stays a
            // stop; any other such stop is ours to end.
            libc::PTRACE_EVENT_STOP => {
                if matches!(
                    sig,
                    libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
                ) {
                    let _ = ptrace(libc::PTRACE_LISTEN, tid, 0);
                } else {
                    cont(tid, 0);
                }
            }
            _ if sig == libc::SIGTRAP || sig == (libc::SIGTRAP | 0x80) => cont(tid, 0),
            // A signal on its way to the tracee: deliver it.
            _ => cont(tid, sig),
        }
    }
}

/// Stops each tracee (`PTRACE_INTERRUPT`, seized tracees only) and lets it
/// go.
fn detach_all(tids: impl Iterator<Item = u32>) {
    for tid in tids {
        if ptrace(libc::PTRACE_INTERRUPT, tid, 0).is_ok() {
            let _ = waitpid(tid);
        }
        let _ = ptrace(libc::PTRACE_DETACH, tid, 0);
    }
}
