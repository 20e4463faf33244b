//! Following a process tree under ptrace: forks, execs and exits, told
//! to the session as [`TreeEvent`]s.

use std::{
    collections::{HashMap, HashSet},
    sync::atomic::AtomicBool,
};

use anyhow::Result;

use super::{
    requests::{
        event_msg, ptrace, sent_by_kernel, tgid_of, wait_any, waitpid, HeldSignals, Waited,
    },
    startup::{exit_code, follow_exec},
};
use crate::tracee::Mapping;

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
    /// `pid` exec'd and is stopped there ([`AtExec::Stop`]): its new
    /// program has run no instruction yet. It runs on once answered.
    Execd { pid: u32 },
    /// `pid`'s last thread is exiting: its memory and mappings are still
    /// there.
    Exiting { pid: u32 },
    /// `pid` is gone, with this exit code (128 + signal when killed).
    Gone { pid: u32, code: i32 },
    /// Thread `tid` of `pid` is stopped with the throttle signal from the
    /// kernel (`tracer_common::Config::throttle`). Answer `Some` when the
    /// signal was the programs' (it is taken, and the thread goes on
    /// once answered: the walks it waited for are finished), `None` when
    /// it is not known to be (it is delivered).
    Throttled { pid: u32, tid: u32 },
}

/// What the session hands the thread that follows a tree by pid (a
/// cgroup's): a process to seize (it joined the cgroup), or one to let go
/// (it left it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handover {
    /// Seized with what it created, each told as a fork of its parent.
    Adopt(u32),
    /// Every thread of the process detached (signals on their way to it
    /// delivered); what it creates from then on is not traced.
    Release(u32),
}

/// Where a traced process's `exec` is told to the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtExec {
    /// Run on to where the new program's allocator is known
    /// ([`TreeEvent::Exec`]).
    Allocator,
    /// At the exec stop itself ([`TreeEvent::Execd`]).
    Stop,
}

/// Follows the root process (and with `PTRACE_O_TRACEFORK` and its kin,
/// every process and thread it creates, daemons that fork away from it
/// included) until every one is gone, passing signals on and telling
/// `on_event` of each [`TreeEvent`]; returns the root's exit code to pass
/// through. `group` holds the thread group of
/// every thread traced already (the root's at least). With `stop` (by pid,
/// where the tracees were seized), ends when the flag is set: every tracee
/// is then detached and runs on, and `None` is returned. Otherwise,
/// tracees still running when the trace ends are detached by the kernel
/// when this thread ends. `handover` (by pid) hands over processes to
/// seize or to let go while the tree runs ([`Handover`]). `at_exec` says
/// where each exec is told.
pub fn wait_tree(
    root: u32,
    mut group: HashMap<u32, u32>,
    stop: Option<&AtomicBool>,
    handover: Option<&std::sync::mpsc::Receiver<Handover>>,
    at_exec: AtExec,
    on_event: &mut impl FnMut(TreeEvent) -> Result<Option<()>>,
) -> Option<i32> {
    // New tracees whose first stop came before their creator's event.
    let mut early: HashSet<u32> = HashSet::new();
    // Launch mode: the root's exit code, once it is gone.
    let mut root_code = None;
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
    // Handed over processes wait here until seized or let go.
    let pending: std::cell::RefCell<Vec<Handover>> = Default::default();
    let asked = || {
        if let Some(rx) = handover {
            pending.borrow_mut().extend(rx.try_iter());
        }
        !pending.borrow().is_empty()
    };
    loop {
        let (tid, status) = match wait_any(stop, &asked) {
            Some(Waited::Tracee(tid, status)) => (tid, status),
            Some(Waited::Asked) => {
                for asked in pending.take() {
                    match asked {
                        Handover::Adopt(pid) => {
                            let seized = super::seize::seize_tree(pid, &mut group);
                            for (parent, child) in seized {
                                let _ = on_event(TreeEvent::Fork {
                                    parent,
                                    child,
                                    vfork: false,
                                });
                            }
                        }
                        Handover::Release(pid) => {
                            let threads: Vec<u32> = group
                                .iter()
                                .filter(|&(_, &g)| g == pid)
                                .map(|(&t, _)| t)
                                .collect();
                            group.retain(|_, g| *g != pid);
                            detach_all(threads.into_iter());
                        }
                    }
                }
                continue;
            }
            None => {
                if stop.is_some() {
                    detach_all(group.keys().copied().chain(early.iter().copied()));
                    return None;
                }
                return Some(root_code.unwrap_or(1));
            }
        };
        if let Some(code) = exit_code(status) {
            if let Some(tgid) = group.remove(&tid) {
                if tid == tgid {
                    let _ = on_event(TreeEvent::Gone { pid: tid, code });
                    if tid == root && stop.is_none() {
                        root_code = Some(code);
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
                if at_exec == AtExec::Stop {
                    let _ = on_event(TreeEvent::Execd { pid });
                    cont(pid, 0);
                    continue;
                }
                let mut on_exec =
                    |pid: u32, maps: &[Mapping]| on_event(TreeEvent::Exec { pid, maps });
                if let Some(code) = follow_exec(pid, &mut on_exec) {
                    group.remove(&pid);
                    let _ = on_event(TreeEvent::Gone { pid, code });
                    if pid == root && stop.is_none() {
                        root_code = Some(code);
                    }
                }
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
            // The programs' throttle signal is taken once the session has
            // finished the walks the thread waited for.
            0 if sig == tracer_common::THROTTLE_SIGNAL as i32 && sent_by_kernel(tid) => {
                let ours = matches!(
                    on_event(TreeEvent::Throttled { pid: tgid, tid }),
                    Ok(Some(()))
                );
                cont(tid, if ours { 0 } else { sig });
            }
            // No system call is traced here and every ptrace event is
            // matched above: a SIGTRAP stop is a real signal (the program's
            // own breakpoint, `kill -TRAP`) and is delivered as any other.
            _ => cont(tid, sig),
        }
    }
}

/// Stops each tracee (`PTRACE_INTERRUPT`, seized tracees only) and lets it
/// go. The stop it reports may be a signal on its way to it (sent as the
/// trace ended, not yet seen by the loop): that signal goes with the
/// detach, or it would be lost.
fn detach_all(tids: impl Iterator<Item = u32>) {
    for tid in tids {
        let mut held = HeldSignals::default();
        if ptrace(libc::PTRACE_INTERRUPT, tid, 0).is_ok() {
            if let Ok(status) = waitpid(tid) {
                held.keep(status);
            }
        }
        let _ = held.resume(libc::PTRACE_DETACH, tid);
    }
}
