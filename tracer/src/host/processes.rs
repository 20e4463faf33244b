//! What is known of the host's processes (names, command lines), kept
//! so that a process gone before the report is still named.

use std::collections::{BTreeMap, HashSet, VecDeque};

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
    /// Ordered by process id first: a process's records (one per exec)
    /// are a range.
    metas: BTreeMap<HostProcess, ProcessMeta>,
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
        // did not exec runs its parent's program, with its command line;
        // its name is then its parent's. Its cgroup is taken as the
        // parent's (a move after the fork is not seen).
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
        let first = HostProcess {
            tgid: pid,
            _pad: 0,
            mm: 0,
        };
        let last = HostProcess {
            tgid: pid,
            _pad: u32::MAX,
            mm: u64::MAX,
        };
        self.metas
            .range(first..=last)
            .map(|(_, m)| m)
            .find(|m| m.name == name && !m.executable.is_empty())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids no process has (above the kernel's `pid_max` limit).
    const GONE: u32 = 4_000_000_000;

    fn process(tgid: u32, mm: u64) -> HostProcess {
        HostProcess { tgid, _pad: 0, mm }
    }

    #[test]
    fn a_forked_child_gone_unread_takes_its_parents_program() {
        let mut p = Processes::default();
        p.note(GONE, 1, Some("/usr/bin/tree"));
        // Its child, forked without an exec: its parent's name.
        let child = p.meta(process(GONE + 1, 2), "tree", GONE);
        assert_eq!(child.executable, "/usr/bin/tree");
        assert_eq!(child.ppid, GONE);
        // Its grandchild, read after it: the same program.
        let grandchild = p.meta(process(GONE + 2, 3), "tree", GONE + 1);
        assert_eq!(grandchild.executable, "/usr/bin/tree");
        // A child under another name exec'd something else: not known.
        let other = p.meta(process(GONE + 3, 4), "other", GONE);
        assert_eq!(other.executable, "");
        // No parent known: nothing taken.
        let orphan = p.meta(process(GONE + 4, 5), "tree", 0);
        assert_eq!(orphan.executable, "");
    }
}
