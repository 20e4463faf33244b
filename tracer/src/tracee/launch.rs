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
    collections::HashMap,
    ffi::CString,
    os::unix::ffi::{OsStrExt, OsStringExt},
    path::{Path, PathBuf},
    sync::mpsc,
};

use anyhow::Result;

use super::ptrace::{
    ptrace, seize_process, wait_for_allocator, wait_tree, waitpid, AtExec, Exited, HeldSignals,
    TreeEvent,
};
use crate::{
    error::{UserError, EXIT_CMD_NOT_EXECUTABLE, EXIT_CMD_NOT_FOUND},
    tracee::{run_as::RunAs, Mapping},
    user_error,
};

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
    meanwhile: impl FnOnce(),
) -> Result<Launched<T>>
where
    T: Send + 'static,
    F: FnMut(u32, &[Mapping]) -> Result<Option<T>> + Send + 'static,
    E: FnMut(TreeEvent) -> Result<Option<()>> + Send + 'static,
{
    let (c_path, c_args, c_env) = exec_strings(argv, run_as.as_ref())?;
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
            let mut held = HeldSignals::default();
            let attached = wait_for_allocator(pid, &mut held, attach);
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
            if let Err(e) = held.resume(libc::PTRACE_CONT, pid) {
                log::warn!("resuming pid {pid}: {e}");
            }
            let group = HashMap::from([(pid, pid)]);
            // The command's status goes out when it exits; the tree is
            // followed on until every process of it is gone (the end of
            // this thread tells the session so).
            let mut exit_tx = Some(exit_tx);
            let mut on_event = |event: TreeEvent| {
                if let TreeEvent::Gone { pid: gone, code } = &event {
                    let (gone, code) = (*gone, *code);
                    if gone == pid {
                        if let Some(tx) = exit_tx.take() {
                            let _ = tx.send(code);
                        }
                    }
                }
                on_event(event)
            };
            let code =
                wait_tree(pid, group, None, None, AtExec::Allocator, &mut on_event).unwrap_or(1);
            if let Some(tx) = exit_tx.take() {
                let _ = tx.send(code);
            }
        })?;

    // The calling thread's work that needs no process, while the first
    // probes go in.
    meanwhile();
    let (_pid, attached) = ready_rx
        .recv()
        .map_err(|_| user_error!("the launch thread died"))??;
    Ok(Launched {
        attached,
        exit: exit_rx,
    })
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
    let (pid, report) = fork_command(path, args, env, run_as, None)?;
    exec_report(pid, report, path, run_as)?;
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

/// Starts `argv` (as `run_as`, if any) held before its exec: `hold` is
/// called with its pid (the probes and the scope made ready for it), then
/// it execs. Returns its pid and the receiver of its exit code (128 +
/// signal when killed). If `hold` fails, the child exits without running
/// the command. With `on_exec`, the command and every process it creates
/// are followed under ptrace (seized before the command's exec, so none
/// escapes): each exec stops the process before its new program's first
/// instruction until `on_exec` has returned, and nothing else is asked of
/// them; mtrace's end (or death) lets them go.
pub fn launch_held(
    argv: &[String],
    run_as: Option<&RunAs>,
    hold: impl FnOnce(u32) -> Result<()>,
    on_exec: Option<Holds>,
) -> Result<(u32, tokio::sync::oneshot::Receiver<i32>)> {
    let (c_path, c_args, c_env) = exec_strings(argv, run_as)?;
    let mut gate = [0; 2];
    if unsafe { libc::pipe2(gate.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let forked = fork_command(&c_path, &c_args, &c_env, run_as, Some(gate));
    unsafe { libc::close(gate[0]) };
    let (pid, report) = match forked {
        Ok(f) => f,
        Err(e) => {
            unsafe { libc::close(gate[1]) };
            return Err(e);
        }
    };
    let (exit_tx, exit_rx) = tokio::sync::oneshot::channel();
    // The child waits at the gate: seized there by the thread that waits
    // for it, or waited for by a thread of its own.
    let waiter = match on_exec {
        Some(on_exec) => follow(pid, on_exec, exit_tx),
        None => std::thread::Builder::new()
            .name("mtrace-wait".into())
            .spawn(move || {
                let code = match waitpid(pid) {
                    Ok(s) if libc::WIFSIGNALED(s) => 128 + libc::WTERMSIG(s),
                    Ok(s) => libc::WEXITSTATUS(s),
                    Err(_) => 1,
                };
                let _ = exit_tx.send(code);
            })
            .map(|_| ())
            .map_err(Into::into),
    };
    let held = waiter.and_then(|()| hold(pid));
    // One byte lets the child exec; the pipe closed without it makes the
    // child exit.
    if held.is_ok() {
        unsafe { libc::write(gate[1], [1u8].as_ptr().cast(), 1) };
    }
    unsafe { libc::close(gate[1]) };
    if let Err(e) = held {
        unsafe { libc::close(report) };
        return Err(e);
    }
    exec_report(pid, report, &c_path, run_as)?;
    Ok((pid, exit_rx))
}

/// What a followed tree is seized with: its forks, vforks, clones and
/// execs (an exit needs no stop: its status says it, unless
/// [`Holds::on_exec`] asks for it).
const FOLLOWED: i32 = libc::PTRACE_O_TRACEEXEC
    | libc::PTRACE_O_TRACEFORK
    | libc::PTRACE_O_TRACEVFORK
    | libc::PTRACE_O_TRACECLONE;

/// What the thread that follows a launched tree ([`launch_held`]) does
/// with its processes.
pub struct Holds {
    /// At each exec stop, the new program not yet run: whether to hold
    /// the process at its exit too (until `on_exit` returns).
    pub on_exec: Box<dyn FnMut(u32) -> bool + Send>,
    /// At the exit stop of a process held so, its memory still there.
    pub on_exit: Box<dyn FnMut(u32) + Send>,
    /// A thread stopped with the throttle signal from the kernel: whether
    /// the signal was the programs' (taken, once the thread may go on).
    pub on_throttle: Box<dyn FnMut(u32) -> bool + Send>,
}

/// Seizes `pid`, waiting at its gate, on a thread of its own that then
/// follows its tree ([`launch_held`]); returns once it is seized.
fn follow(pid: u32, mut holds: Holds, exit_tx: tokio::sync::oneshot::Sender<i32>) -> Result<()> {
    let (seized_tx, seized) = mpsc::channel();
    std::thread::Builder::new()
        .name("mtrace-follow".into())
        .spawn(move || {
            let mut group = HashMap::new();
            let ok = seize_process(pid, FOLLOWED, &mut group);
            let _ = seized_tx.send(ok.then_some(()).ok_or_else(std::io::Error::last_os_error));
            if !ok {
                return;
            }
            let mut exit_tx = Some(exit_tx);
            let mut on_event = |event: TreeEvent| {
                match event {
                    TreeEvent::Execd { pid } => {
                        // Its forks inherit the options, and each exec
                        // sets them again.
                        let exit = if (holds.on_exec)(pid) {
                            libc::PTRACE_O_TRACEEXIT
                        } else {
                            0
                        };
                        let _ = ptrace(libc::PTRACE_SETOPTIONS, pid, (FOLLOWED | exit) as usize);
                    }
                    TreeEvent::Exiting { pid } => (holds.on_exit)(pid),
                    TreeEvent::Throttled { tid, .. } => {
                        return Ok((holds.on_throttle)(tid).then_some(()));
                    }
                    TreeEvent::Gone { pid: gone, code } if gone == pid => {
                        if let Some(tx) = exit_tx.take() {
                            let _ = tx.send(code);
                        }
                    }
                    _ => {}
                }
                Ok(Some(()))
            };
            let code = wait_tree(pid, group, None, None, AtExec::Stop, &mut on_event).unwrap_or(1);
            if let Some(tx) = exit_tx.take() {
                let _ = tx.send(code);
            }
        })?;
    seized
        .recv()
        .map_err(|_| user_error!("the thread that follows the command died"))?
        .map_err(|e| user_error!("seizing the command (pid {pid}) before its exec: {e}"))
}

/// What `execve` is given for `argv`: the command's path (found as a
/// shell finds it), its arguments and its environment.
fn exec_strings(
    argv: &[String],
    run_as: Option<&RunAs>,
) -> Result<(CString, Vec<CString>, Vec<CString>)> {
    let path = resolve_command(&argv[0])?;
    let c_path = CString::new(path.as_os_str().as_bytes())?;
    let c_args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<_, _>>()?;
    Ok((c_path, c_args, environment(run_as)))
}

/// The command's environment: mtrace's, or `run_as`'s user's.
fn environment(run_as: Option<&RunAs>) -> Vec<CString> {
    match run_as {
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
    .collect()
}

/// Forks; the child takes `run_as`'s credentials (if any) and execs
/// with `env`: traced (`PTRACE_TRACEME`, stopped right after its exec)
/// without a `gate`, else once a byte comes through the gate's pipe.
/// Returns the child's pid and the read end of the close-on-exec pipe
/// through which it reports a failure before or in its exec.
fn fork_command(
    path: &CString,
    args: &[CString],
    env: &[CString],
    run_as: Option<&RunAs>,
    gate: Option<[i32; 2]>,
) -> Result<(u32, i32)> {
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
            match gate {
                Some([rx, tx]) => {
                    libc::close(tx);
                    let mut byte = 0u8;
                    if libc::read(rx, (&mut byte as *mut u8).cast(), 1) != 1 {
                        libc::_exit(127);
                    }
                }
                None => {
                    libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0);
                }
            }
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
    Ok((pid as u32, fds[0]))
}

/// Reads what the child `pid` reported through `report` (closed here):
/// nothing once its exec succeeded, else what failed (the child then
/// reaped).
fn exec_report(pid: u32, report: i32, path: &CString, run_as: Option<&RunAs>) -> Result<()> {
    let mut failed = [0i32; 2];
    let n = unsafe { libc::read(report, failed.as_mut_ptr().cast(), 8) };
    unsafe { libc::close(report) };
    if n == 8 {
        let _ = waitpid(pid);
        let [stage, err] = failed;
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
    Ok(())
}
