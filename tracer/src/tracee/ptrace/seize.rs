//! Seizing running processes (by pid): every thread of a process, and
//! with children what it created before mtrace came, to any depth.

use std::collections::HashMap;

use super::requests::seize;

/// Seized with children: exits, execs, and every fork, vfork and clone.
pub(crate) const WITH_CHILDREN: i32 = libc::PTRACE_O_TRACEEXIT
    | libc::PTRACE_O_TRACEEXEC
    | libc::PTRACE_O_TRACEFORK
    | libc::PTRACE_O_TRACEVFORK
    | libc::PTRACE_O_TRACECLONE;

/// Seizes running process `pid` (unless held already) and what it created,
/// to any depth, with children; returns them as (parent, child), `pid`
/// first (its parent as /proc says).
pub(crate) fn seize_tree(pid: u32, group: &mut HashMap<u32, u32>) -> Vec<(u32, u32)> {
    if group.contains_key(&pid) || !seize_process(pid, WITH_CHILDREN, group) {
        return Vec::new();
    }
    let parent = crate::tracee::ppid(pid).unwrap_or(0);
    let mut found = vec![(parent, pid)];
    found.extend(seize_descendants(pid, WITH_CHILDREN, group));
    found
}

/// The threads of `pid` now.
fn threads(pid: u32) -> Vec<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Seizes every thread of `pid` (again, until no new one appears: a
/// thread seized before it created another reports the new one itself).
/// False when not even the first could be seized.
pub(crate) fn seize_process(pid: u32, options: i32, group: &mut HashMap<u32, u32>) -> bool {
    loop {
        let new: Vec<u32> = threads(pid)
            .into_iter()
            .filter(|t| !group.contains_key(t))
            .collect();
        if new.is_empty() {
            return group.contains_key(&pid);
        }
        let mut any = false;
        for tid in new {
            if seize(tid, options) {
                group.insert(tid, pid);
                any = true;
            }
        }
        if !any {
            return group.contains_key(&pid);
        }
    }
}

/// The children of every thread of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for tid in threads(pid) {
        if let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
        }
    }
    out
}

/// Seizes the processes `root` created before mtrace came, to any depth;
/// returns them as (parent, child). A process seized before it forks
/// reports its children itself; the children it had are read after it is
/// seized, so none falls between.
pub(crate) fn seize_descendants(
    root: u32,
    options: i32,
    group: &mut HashMap<u32, u32>,
) -> Vec<(u32, u32)> {
    let mut found = Vec::new();
    let mut parents = vec![root];
    while let Some(parent) = parents.pop() {
        for child in children(parent) {
            if group.contains_key(&child) || !seize_process(child, options, group) {
                continue;
            }
            found.push((parent, child));
            parents.push(child);
        }
    }
    found
}
