//! What is known of the host's processes (names, command lines), kept
//! so that a process gone before the report is still named.

use std::collections::{HashMap, HashSet, VecDeque};

use tracer_common::HostProcess;

use crate::{profile::ProcessMeta, tracee};

/// Most processes whose names and command lines are kept (the first
/// seen give way first).
const PROCESSES_KEPT: usize = 65536;

/// What is known of the host's processes, by process and address space
/// (one per exec): read from `/proc` when first seen (at the start, with
/// address space 0, or at an exec), so that one gone before the report
/// still has its name and command line.
#[derive(Default)]
pub struct Processes {
    metas: HashMap<HostProcess, ProcessMeta>,
    order: VecDeque<HostProcess>,
}

impl Processes {
    /// Reads what `/proc` says of `pid` now (`exe`: the path it exec'd,
    /// which outlives it; `mm`: its address space since, 0 at the start).
    pub(super) fn note(&mut self, pid: u32, mm: u64, exe: Option<&str>) {
        let mut meta = proc_meta(pid);
        if let Some(exe) = exe {
            if meta.executable.is_empty() {
                meta.executable = exe.to_string();
            }
            if meta.name.is_empty() {
                meta.name = exe.rsplit('/').next().unwrap_or(exe).to_string();
            }
        }
        let key = HostProcess {
            tgid: pid,
            _pad: 0,
            mm,
        };
        self.keep(key, meta);
    }

    /// The record of process `p`, whose name was `comm` when it first
    /// allocated: from its exec, else from the start's scan or from `/proc`
    /// now when the name there is the same (it has not exec'd since),
    /// else the name alone.
    /// What is found is kept: a view redrawn every second reads `/proc`
    /// once per process.
    /// `ppid`: its parent's id then (0: not known).
    pub(super) fn meta(&mut self, p: HostProcess, comm: &str, ppid: u32) -> ProcessMeta {
        let mut m = self.meta_of(p, comm);
        let mut changed = false;
        if m.ppid == 0 && ppid != 0 {
            m.ppid = ppid;
            changed = true;
        }
        // Gone before anything but its name was read: a child forked that
        // did not exec runs its parent's program, with its command line
        // and (unless moved) its cgroup; its name is then its parent's.
        if m.executable.is_empty() && m.ppid != 0 {
            if let Some(parent) = self.running_as(m.ppid, &m.name) {
                m.executable = parent.executable.clone();
                m.command = parent.command.clone();
                m.cgroup = parent.cgroup.clone();
                changed = true;
            }
        }
        if changed {
            self.keep(p, m.clone());
        }
        m
    }

    /// A record of process `pid` under the name `name` with its
    /// executable known.
    fn running_as(&self, pid: u32, name: &str) -> Option<&ProcessMeta> {
        self.metas
            .iter()
            .find(|(k, m)| k.tgid == pid && m.name == name && !m.executable.is_empty())
            .map(|(_, m)| m)
    }

    fn meta_of(&mut self, p: HostProcess, comm: &str) -> ProcessMeta {
        let same = |m: &ProcessMeta| comm.is_empty() || m.name == comm;
        if let Some(m) = self.metas.get_mut(&p) {
            if !comm.is_empty() {
                // The name it had when it allocated (the exec's path
                // named it only when it was already gone).
                m.name = comm.to_string();
            }
            return m.clone();
        }
        let at_start = HostProcess { mm: 0, ..p };
        let found = match self.metas.get(&at_start).filter(|m| same(m)) {
            Some(m) => m.clone(),
            None => {
                let now = proc_meta(p.tgid);
                if !now.name.is_empty() && same(&now) {
                    now
                } else {
                    ProcessMeta {
                        pid: p.tgid,
                        name: comm.to_string(),
                        traced: true,
                        ..ProcessMeta::default()
                    }
                }
            }
        };
        self.keep(p, found.clone());
        found
    }

    /// Forgets processes `gone` (by tgid): their rows and records have
    /// been read out for good.
    pub(super) fn forget(&mut self, gone: &HashSet<u32>) {
        self.metas.retain(|p, _| !gone.contains(&p.tgid));
        self.order.retain(|p| !gone.contains(&p.tgid));
    }

    /// The processes recorded that are gone from `/proc` and have nothing
    /// left in the maps (`counted`: the processes with keys there).
    pub(super) fn gone_uncounted(&self, counted: &HashSet<u32>) -> HashSet<u32> {
        self.metas
            .keys()
            .map(|p| p.tgid)
            .filter(|t| !counted.contains(t) && !crate::tracee::cgroup::is_alive(*t))
            .collect()
    }

    fn keep(&mut self, p: HostProcess, meta: ProcessMeta) {
        if self.metas.insert(p, meta).is_none() {
            self.order.push_back(p);
        }
        while self.order.len() > PROCESSES_KEPT {
            if let Some(old) = self.order.pop_front() {
                self.metas.remove(&old);
            }
        }
    }
}

/// What `/proc` says of `pid` now (empty fields when it is gone).
fn proc_meta(pid: u32) -> ProcessMeta {
    let known = |s: String| if s == "?" { String::new() } else { s };
    ProcessMeta {
        pid,
        ppid: tracee::ppid(pid).unwrap_or(0),
        name: known(tracee::comm(pid)),
        command: known(tracee::cmdline(pid)),
        executable: tracee::executable(pid),
        cgroup: tracee::cgroup::of(pid),
        traced: true,
        ..ProcessMeta::default()
    }
}
