//! The process tree: every process seen, and what the session does when
//! one forks, exec's or exits (the launch thread or the exit hold tells it).

use std::{
    sync::{Arc, Mutex},
    time::Instant,
};

use anyhow::Result;

use super::{detach, Session, TracedProcess};
use crate::{
    profile::{Meta, ProcessMeta},
    render::text::printable,
    say,
    tracee::{
        self, perf_map,
        ptrace::{Handover, TreeEvent},
        AddressSpace, Mapping,
    },
};

/// The process tree as traced: every process seen, in order.
#[derive(Debug, Default)]
pub struct Tree {
    pub processes: Vec<ProcessMeta>,
    /// Processes neither traced nor listed (beyond
    /// [`Meta::MAX_PROCESS_RECORDS`]).
    pub unlisted: u64,
}

impl Tree {
    fn get(&mut self, pid: u32) -> Option<&mut ProcessMeta> {
        // The newest entry of a pid: pids are reused.
        self.processes.iter_mut().rev().find(|p| p.pid == pid)
    }

    /// `proc` is probed (again, after an exec): its entry says what runs.
    pub fn probed(&mut self, proc: &TracedProcess) {
        if let Some(p) = self.get(proc.pid) {
            p.traced = true;
            p.not_traced = None;
            p.name = proc.name.clone();
            p.command = proc.meta.command.clone();
            p.executable = proc.meta.executable.clone();
            p.cgroup = crate::tracee::cgroup::of(proc.pid);
            p.allocator_object = proc.meta.allocator_object.clone();
        }
    }

    fn not_traced(&mut self, pid: u32, why: String) {
        if let Some(p) = self.get(pid) {
            p.traced = false;
            p.not_traced = Some(why);
        }
    }
}

/// A [`TreeEvent`] sent to the session, with where to answer.
pub struct TreeRequest {
    pub event: OwnedTreeEvent,
    pub reply: Option<std::sync::mpsc::Sender<Result<bool, String>>>,
}

/// [`TreeEvent`], owning its mappings.
pub enum OwnedTreeEvent {
    Fork {
        parent: u32,
        child: u32,
        vfork: bool,
    },
    Exec {
        pid: u32,
        maps: Vec<Mapping>,
    },
    Exiting {
        pid: u32,
    },
    Gone {
        pid: u32,
        code: i32,
    },
    Throttled {
        pid: u32,
        tid: u32,
    },
}

impl OwnedTreeEvent {
    pub(super) fn describe(&self) -> String {
        match self {
            OwnedTreeEvent::Fork {
                parent,
                child,
                vfork,
            } => {
                format!(
                    "pid {parent} {} {child}",
                    if *vfork { "vforked" } else { "forked" }
                )
            }
            OwnedTreeEvent::Exec { pid, .. } => format!("pid {pid} exec'd"),
            OwnedTreeEvent::Exiting { pid } => format!("pid {pid} exiting"),
            OwnedTreeEvent::Gone { pid, code } => format!("pid {pid} gone ({code})"),
            OwnedTreeEvent::Throttled { pid, tid } => {
                format!("pid {pid} thread {tid} stopped with the throttle signal")
            }
        }
    }
}

impl From<TreeEvent<'_>> for OwnedTreeEvent {
    fn from(e: TreeEvent<'_>) -> OwnedTreeEvent {
        match e {
            TreeEvent::Fork {
                parent,
                child,
                vfork,
            } => OwnedTreeEvent::Fork {
                parent,
                child,
                vfork,
            },
            TreeEvent::Exec { pid, maps } => OwnedTreeEvent::Exec {
                pid,
                maps: maps.to_vec(),
            },
            // The session follows to the allocator (`AtExec::Allocator`):
            // an exec stop reaches it with nothing mapped to look at.
            TreeEvent::Execd { pid } => OwnedTreeEvent::Exec {
                pid,
                maps: Vec::new(),
            },
            TreeEvent::Exiting { pid } => OwnedTreeEvent::Exiting { pid },
            TreeEvent::Gone { pid, code } => OwnedTreeEvent::Gone { pid, code },
            TreeEvent::Throttled { pid, tid } => OwnedTreeEvent::Throttled { pid, tid },
        }
    }
}

impl Session {
    /// Probes a new process (if the limit allows): `false` when no
    /// allocator is mapped in it yet.
    fn start_proc(&mut self, pid: u32, maps: &[Mapping]) -> Result<bool> {
        if self.procs.len() >= self.options.max_processes {
            let why = format!(
                "more than {} {} at once",
                self.options.max_processes,
                if self.options.max_processes == 1 {
                    "process"
                } else {
                    "processes"
                }
            );
            self.tree.not_traced(pid, why);
            return Ok(true);
        }
        let space = Arc::new(Mutex::new(AddressSpace::new()));
        let settings = self.options.settings;
        match TracedProcess::attach(pid, maps, &settings, space, &self.meta) {
            Ok(Some(proc)) => {
                self.tree.probed(&proc);
                log::debug!(
                    "pid {pid} ({}): {}",
                    printable(&proc.name),
                    proc.probes.placement()
                );
                self.procs.insert(pid, proc);
                Ok(true)
            }
            // A Go program with no malloc (a static one): its own heap is
            // read all the same, and it is done with.
            Ok(None) => match crate::golang::detect(pid, maps) {
                crate::golang::Found::Go(go) => {
                    if let Some(p) = self.tree.get(pid) {
                        p.traced = true;
                        p.not_traced = None;
                        p.allocator_object = crate::profile::GO_HEAP_FUNC.into();
                    }
                    log::debug!("pid {pid}: {}, its own heap read", go.version());
                    self.go_only.insert(pid, go);
                    Ok(true)
                }
                crate::golang::Found::Unreadable(u) => {
                    self.tree.not_traced(pid, format!("no malloc; {}", u.why));
                    Ok(true)
                }
                crate::golang::Found::None => Ok(false),
            },
            Err(e) => {
                log::warn!("pid {pid} not traced: {e:#}");
                self.tree.not_traced(pid, format!("{e:#}"));
                Ok(true)
            }
        }
    }

    /// By pid with `--children`: a process the target had created before
    /// mtrace came, running, is probed.
    pub fn adopt(&mut self, parent: u32, child: u32) {
        let adopted = self.on_tree_event(OwnedTreeEvent::Fork {
            parent,
            child,
            vfork: false,
        });
        if let Err(e) = adopted {
            log::warn!("pid {child} not traced: {e:#}");
            self.tree.not_traced(child, format!("{e:#}"));
        }
    }

    /// What the launch thread (or the exit hold) tells of the tree.
    pub(super) fn on_tree_event(&mut self, event: OwnedTreeEvent) -> Result<bool> {
        // A program exec replaced is read before anything else of its
        // process happens.
        self.read_exec_replaced();
        // A new process takes the object a gone one leaves.
        if matches!(event, OwnedTreeEvent::Exec { .. })
            || matches!(event, OwnedTreeEvent::Fork { vfork: false, .. })
        {
            self.settle();
        }
        match event {
            OwnedTreeEvent::Fork {
                parent,
                child,
                vfork,
            } => {
                // A fork bomb: what cannot be traced is counted, not kept.
                if self.tree.processes.len() >= Meta::MAX_PROCESS_RECORDS
                    && self.procs.len() >= self.options.max_processes
                {
                    self.tree.unlisted += 1;
                    return Ok(true);
                }
                self.tree.processes.push(ProcessMeta {
                    pid: child,
                    ppid: parent,
                    name: tracee::comm(child),
                    command: tracee::cmdline(child),
                    executable: tracee::executable(child),
                    cgroup: tracee::cgroup::of(child),
                    ..Default::default()
                });
                // A process that left the cgroup before it forked (and
                // is still to be let go) makes a child outside it too.
                if let Some(scope) = &self.cgroup {
                    if !tracee::cgroup::contains(&scope.dir, child) {
                        let _ = scope.handover.send(Handover::Release(child));
                        self.tree
                            .not_traced(child, "created outside the cgroup".into());
                        return Ok(true);
                    }
                }
                // A vfork child shares its parent's memory, and its probes,
                // until it execs (and may call nothing but exec or _exit).
                if vfork {
                    self.tree
                        .not_traced(child, "vfork child that did not exec".into());
                    return Ok(true);
                }
                let maps = tracee::read_maps(child)?;
                self.start_proc(child, &maps)
            }
            OwnedTreeEvent::Exec { pid, maps } => {
                // The Go program it ran is gone with the exec.
                self.go_only.remove(&pid);
                let settings = self.options.settings;
                let mut replaced = None;
                let done = match self.procs.get_mut(&pid) {
                    Some(proc) => {
                        replaced = proc.on_exec(&maps, &settings)?;
                        let done = replaced.is_some();
                        if done {
                            let meta = &proc.meta;
                            let said = format!(
                                "pid {pid} exec'd {}: {} ({})",
                                printable(&meta.executable),
                                proc.probes.placement(),
                                meta.allocator_family
                            );
                            // The root's program is the trace's; the
                            // rest of a tree's execs are for -v.
                            if pid == self.root {
                                say!("mtrace: {said}");
                            } else {
                                log::debug!("{said}");
                            }
                            self.tree.probed(proc);
                            if pid == self.root {
                                // The command as given stays the trace's.
                                self.meta = Meta {
                                    command: std::mem::take(&mut self.meta.command),
                                    ..proc.meta.clone()
                                };
                            }
                        }
                        done
                    }
                    None => self.start_proc(pid, &maps)?,
                };
                if let Some(old) = replaced {
                    // The old program (its counting stopped) is read once
                    // the new one has its answer; its probes go then, and
                    // their object serves again once they are out.
                    self.exec_replaced.push(old);
                }
                Ok(done)
            }
            OwnedTreeEvent::Exiting { pid } => {
                // A Go heap is read while its memory is still there.
                if let Some(go) = self.go_only.get_mut(&pid) {
                    go.keep_exit_reading();
                }
                if let Some(proc) = self.procs.get_mut(&pid) {
                    if let Some(go) = proc.go.as_mut() {
                        go.keep_exit_reading();
                    }
                    proc.unseen = proc.unseen_now();
                }
                if let Some(proc) = self.procs.get(&pid) {
                    proc.space.lock().unwrap().refresh(pid);
                    // Its memory is still there: the walks waiting in the
                    // ring are finished now (one that passes code without
                    // call-frame information reads the call before its
                    // return address from that memory).
                    let mut walks = proc.unwind.walks();
                    // Its interpreter's state judged while it can be read,
                    // if it never was.
                    if let Some(names) = walks.python.as_mut() {
                        names.judge();
                    }
                }
                Ok(true)
            }
            OwnedTreeEvent::Throttled { pid, tid } => {
                // The thread goes on once the walks its process's ring
                // holds are finished; a signal the programs did not send
                // is the program's (false: delivered).
                let Some(proc) = self.procs.get_mut(&pid) else {
                    return Ok(false);
                };
                if !proc.probes.take_throttled(tid) {
                    return Ok(false);
                }
                drop(proc.unwind.walks());
                Ok(true)
            }
            OwnedTreeEvent::Gone { pid, code } => {
                if let Some(p) = self.tree.get(pid) {
                    p.exit_code = Some(code);
                }
                // The root's counts are read when the trace ends.
                if pid == self.root {
                    return Ok(true);
                }
                // Read and let go once the next process of the tree is
                // under way (see `settle`).
                if self.procs.contains_key(&pid) && !self.gone.contains(&pid) {
                    self.gone.push(pid);
                    self.gone_since.get_or_insert_with(std::time::Instant::now);
                }
                Ok(true)
            }
        }
    }

    /// The processes that are gone are read, joined into what ended, and
    /// their objects emptied for the next. Until then a gone process
    /// stays among the traced ones, its counts whole in any profile taken
    /// meanwhile: its reading is put off so that it overlaps the start of
    /// the process the tree runs next, rather than hold up its answer.
    pub(super) fn settle(&mut self) {
        self.read_exec_replaced();
        self.gone_since = None;
        let mut catch_up = None;
        for pid in std::mem::take(&mut self.gone) {
            let Some(mut proc) = self.procs.remove(&pid) else {
                continue;
            };
            proc.probes.last_read = true;
            // Its perf map is read to its end (from the file held open),
            // the processes gone together waiting at most that long.
            let perf_map = proc.space.lock().unwrap().perf_map();
            perf_map.ask();
            perf_map.wait(*catch_up.get_or_insert_with(|| Instant::now() + perf_map::CATCH_UP));
            let read = proc.finish().and_then(|()| self.proc_profile(&proc));
            match read {
                Ok(profile) => self.ended.add(profile),
                Err(e) => log::warn!("pid {pid}: counts unread: {e:#}"),
            }
            if self.options.bounded {
                self.bound_gone();
            }
            detach::let_go_of_gone(proc);
        }
    }
}

impl Session {
    /// By cgroup, every scan: the processes that joined it are handed to
    /// the hold to be seized (and told of as forks); those that left it
    /// are let go ([`Session::let_go_of_leaver`]). False when no process
    /// of the cgroup (or of one below it) runs.
    pub(super) fn scan_cgroup(&mut self) -> bool {
        let Some(scope) = &self.cgroup else {
            return true;
        };
        let dir = scope.dir.clone();
        let members = tracee::cgroup::members_below(&dir);
        for &pid in &members {
            let known = self
                .tree
                .processes
                .iter()
                .any(|p| p.pid == pid && p.exit_code.is_none());
            if !known {
                let _ = scope.handover.send(Handover::Adopt(pid));
            }
        }
        // A process that moves between two cgroups of the scope while they
        // are listed can be in neither list: its own path says.
        let left: Vec<u32> = self
            .procs
            .keys()
            .copied()
            .filter(|pid| members.binary_search(pid).is_err() && !self.gone.contains(pid))
            .filter(|&pid| tracee::cgroup::is_alive(pid) && !tracee::cgroup::contains(&dir, pid))
            .collect();
        for pid in left {
            self.let_go_of_leaver(pid);
        }
        !members.is_empty() || tracee::cgroup::populated(&dir)
    }

    /// A process that left the traced cgroup: its counting stops, what it
    /// counted while in the cgroup joins what ended, its probes go, and
    /// the hold lets go of it (what it creates from then on is outside the
    /// scope too).
    fn let_go_of_leaver(&mut self, pid: u32) {
        self.read_exec_replaced();
        if let Some(mut proc) = self.procs.remove(&pid) {
            let read = proc.finish().and_then(|()| self.proc_profile(&proc));
            match read {
                Ok(profile) => self.ended.add(profile),
                Err(e) => log::warn!("pid {pid}: counts unread: {e:#}"),
            }
            detach::let_go(proc.release());
        }
        let after = self.clock.started.elapsed().as_secs_f64();
        if let Some(p) = self.tree.get(pid) {
            p.not_traced = Some(format!(
                "left the cgroup {after:.1} s into the trace, counted until then"
            ));
        }
        if let Some(scope) = &self.cgroup {
            let _ = scope.handover.send(Handover::Release(pid));
        }
        log::debug!("pid {pid} left the cgroup: let go");
    }

    /// Reads the programs exec replaced into their processes' new ones.
    pub(super) fn read_exec_replaced(&mut self) {
        let per_thread = self.options.settings.mode.per_thread;
        for old in std::mem::take(&mut self.exec_replaced) {
            let pid = old.pid;
            let new = self.procs.get_mut(&pid);
            match TracedProcess::exec_replaced(old, new, &self.clock, per_thread) {
                Ok(Some(profile)) => self.ended.add(profile),
                Ok(None) => {}
                Err(e) => log::warn!("pid {pid}: the program before exec unread: {e:#}"),
            }
        }
    }

    /// `Options::bounded`, after a process is gone: past
    /// [`super::GONE_WITH_PID`] gone processes their rows are joined per
    /// command (pid 0), and past [`super::AGENT_RECORDS`] records the
    /// oldest of a gone process is dropped (counted as unlisted).
    fn bound_gone(&mut self) {
        self.gone_with_pid += 1;
        if self.gone_with_pid > super::GONE_WITH_PID {
            self.ended.forget_pids();
            self.gone_with_pid = 0;
        }
        while self.tree.processes.len() > super::AGENT_RECORDS {
            let Some(i) = self
                .tree
                .processes
                .iter()
                .position(|p| p.exit_code.is_some() && p.pid != self.root)
            else {
                break;
            };
            self.tree.processes.remove(i);
            self.tree.unlisted += 1;
        }
    }
}
