//! Running a new program to the point where its allocator is known:
//! its dynamic linker's list of objects consistent, or (a static program)
//! an object that defines `malloc` mapped executable.

use anyhow::Result;

use super::requests::{get_regs, peek, poke, ptrace, set_regs, waitpid, HeldSignals};
use crate::{
    tracee::{is_dynamic_linker, proc::read_maps, DynamicLinker, Mapping, RT_CONSISTENT},
    user_error,
};

/// How many system calls we follow, at most, waiting for the allocator to
/// be mapped.
const MAX_STARTUP_SYSCALLS: u32 = 20_000;

/// The child exited (with this code to pass through) while we waited for
/// its allocator.
#[derive(Debug)]
pub(crate) struct Exited(pub(crate) i32);

impl std::fmt::Display for Exited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the command exited before its allocator was loaded")
    }
}

impl std::error::Error for Exited {}

/// The exit code a wait status passes through, if the child is gone.
pub(crate) fn exit_code(status: i32) -> Option<i32> {
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

/// Runs the stopped child until its allocator is loaded and `attach` has
/// attached to it: for a dynamically linked program, to the moment its
/// dynamic linker has mapped every library it starts with and before any
/// of their code runs ([`run_to_consistent`]); otherwise (or if that
/// fails) from system call to system call until an object that defines
/// `malloc` is mapped executable. Signals that reach the child on the way
/// and cannot be delivered at once (it was stepping) are left in `held`,
/// for the caller to deliver when it resumes the child, error or not.
pub(crate) fn wait_for_allocator<T>(
    pid: u32,
    held: &mut HeldSignals,
    mut attach: impl FnMut(u32, &[Mapping]) -> Result<Option<T>>,
) -> Result<T> {
    let maps = read_maps(pid)?;
    if let Some(ld) = DynamicLinker::find(pid, &maps) {
        if let Some(t) = run_to_consistent(pid, &ld, held, &mut attach)? {
            return Ok(t);
        }
    }
    step_syscalls(pid, held, attach)
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
    held: &mut HeldSignals,
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
    loop {
        // A signal held since the last stop goes with this resume.
        ptrace(libc::PTRACE_CONT, pid, held.next())?;
        let status = waitpid(pid)?;
        check_alive(status)?;
        if !libc::WIFSTOPPED(status) || held.keep(status) {
            continue;
        }
        let mut regs = get_regs(pid)?;
        if regs.rip != bp + 1 || status >> 16 != 0 {
            // Another trap (the exit event): not ours.
            continue;
        }
        let consistent = ld.state(pid) == Some(RT_CONSISTENT);
        if !consistent && original & 0xff == RET {
            // Not yet: the function is a bare `ret` (glibc's), done here
            // with the breakpoint left in (one stop a call, not two).
            regs.rip = peek(pid, regs.rsp)?;
            regs.rsp += 8;
            set_regs(pid, &regs)?;
            continue;
        }
        // Ours: take the breakpoint out and run the instruction again.
        poke(pid, bp, original)?;
        regs.rip = bp;
        set_regs(pid, &regs)?;
        if consistent {
            let maps = read_maps(pid)?;
            if let Some(t) = attach(pid, &maps)? {
                return Ok(Some(t));
            }
        }
        // Not yet (or a library loaded later may bring the allocator):
        // step over the instruction and arm the breakpoint again. A signal
        // that stops the step comes before the instruction ran: it is held
        // for the next resume and the step taken again.
        loop {
            ptrace(libc::PTRACE_SINGLESTEP, pid, 0)?;
            let status = waitpid(pid)?;
            check_alive(status)?;
            if !held.keep(status) {
                break;
            }
        }
        poke(pid, bp, armed)?;
    }
}

/// `ret`: the whole of glibc's `_dl_debug_state`.
const RET: u64 = 0xc3;

/// Steps the stopped child from system call to system call until its
/// allocator is mapped executable and `attach` has attached to it.
fn step_syscalls<T>(
    pid: u32,
    held: &mut HeldSignals,
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
        // A real signal held since the last stop goes with this step.
        ptrace(libc::PTRACE_SYSCALL, pid, held.next())?;
        let status = waitpid(pid)?;
        check_alive(status)?;
        held.keep(status);
    }
    Err(user_error!(
        "no malloc found in the command or any library it maps"
    ))
}

/// The traced process stopped at an `exec` (`PTRACE_EVENT_EXEC`): runs the
/// new program to the point where its allocator is known and calls
/// `on_exec` there (the old program's probes and mappings mean nothing in
/// it). Returns the exit code to pass through when it exited meanwhile;
/// otherwise the process has been resumed, with every signal that reached
/// it meanwhile.
pub fn follow_exec(
    pid: u32,
    on_exec: &mut impl FnMut(u32, &[Mapping]) -> Result<Option<()>>,
) -> Option<i32> {
    let mut held = HeldSignals::default();
    if let Err(e) = wait_for_allocator(pid, &mut held, on_exec) {
        if let Some(Exited(code)) = e.downcast_ref::<Exited>() {
            return Some(*code);
        }
        log::warn!("pid {pid} after exec: {e:#}");
    }
    // A tracee that is gone already: its wait status says how.
    let _ = held.resume(libc::PTRACE_CONT, pid);
    None
}
