//! The host scope narrowed in the kernel (`--file-wide` with a command
//! or `--cgroup`): which processes the host programs count. A tree
//! scope keeps its processes in `HOST_SCOPE_PIDS`: a forked child of a
//! process in it joins it, and a process leaves it when its last thread
//! ends. A cgroup scope keeps its cgroups in `HOST_SCOPE_CGROUPS`, with
//! the levels they lie at under key 0.

use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid, bpf_probe_read_kernel,
        generated::bpf_get_current_ancestor_cgroup_id,
    },
    programs::RawTracePointContext,
};
use tracer_common::{counter, HostMark, SCOPE_CGROUP, SCOPE_CGROUP_LEVELS, SCOPE_TREE};

use crate::{
    aggregate::bump_counter,
    incarnation::ends_count,
    maps::{config_u32, CONFIG, HOST_MARKS, HOST_SCOPE_CGROUPS, HOST_SCOPE_PIDS},
};

/// Whether process `tgid` (the current task's) is in the scope the host
/// programs count: every process, those of the tree, or those of the
/// scope's cgroups and their descendants.
#[inline(always)]
pub(crate) fn in_scope(tgid: u32) -> bool {
    match config_u32(&CONFIG.host_scope) {
        SCOPE_TREE => HOST_SCOPE_PIDS.get_ptr(&tgid).is_some(),
        SCOPE_CGROUP => in_scope_cgroups(),
        _ => true,
    }
}

/// The calling thread's mark (`HOST_MARKS`, made now if it has none;
/// null where task storage has no room) if process `tgid` is in the
/// scope, else `None`. In a tree scope the mark remembers that the
/// process is in the tree ([`HostMark::in_tree`]); the count of ends is
/// read before the tree is looked up.
#[inline(always)]
pub(crate) fn scope_mark(tgid: u32) -> Option<*mut HostMark> {
    let mine = || {
        HOST_MARKS
            .current(true)
            .map_or(core::ptr::null_mut(), |m| m as *mut HostMark)
    };
    if config_u32(&CONFIG.host_scope) != SCOPE_TREE {
        return in_scope(tgid).then(mine);
    }
    let ends = ends_count();
    if let Some(m) = HOST_MARKS.current(false) {
        if ends != u64::MAX && m.in_tree == ends + 1 {
            return Some(m as *mut HostMark);
        }
    }
    core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
    // Not in the tree: no mark made.
    HOST_SCOPE_PIDS.get_ptr(&tgid)?;
    let m = mine();
    if let Some(m) = unsafe { m.as_mut() } {
        m.in_tree = ends.wrapping_add(1);
    }
    Some(m)
}

/// Whether the current task's cgroup is one of the scope's or lies below
/// one: its ancestor at each level a scope cgroup lies at is looked up.
#[inline(always)]
fn in_scope_cgroups() -> bool {
    let Some(levels) = (unsafe { HOST_SCOPE_CGROUPS.get(&0) }) else {
        return false;
    };
    let levels = *levels;
    let mut level = 0;
    while level < SCOPE_CGROUP_LEVELS {
        if levels & (1 << level) != 0 {
            let id = unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
            if id != 0 && HOST_SCOPE_CGROUPS.get_ptr(&id).is_some() {
                return true;
            }
        }
        level += 1;
    }
    false
}

/// A task forked (the `sched_process_fork` raw tracepoint, in the
/// parent): in a tree scope, a child of a process in the tree joins it
/// (a thread joins its own process: no change).
#[inline(always)]
pub(crate) fn fork(ctx: &RawTracePointContext) -> i32 {
    if config_u32(&CONFIG.host_scope) != SCOPE_TREE {
        return 0;
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if HOST_SCOPE_PIDS.get_ptr(&tgid).is_none() {
        return 0;
    }
    let at = config_u32(&CONFIG.vma.task_tgid) as u64;
    // `sched_process_fork(parent, child)`.
    let child: u64 = ctx.arg(1);
    if at == 0 || child == 0 {
        bump_counter(counter::SCOPE_FULL, 1);
        return 0;
    }
    let Ok(child_tgid) = (unsafe { bpf_probe_read_kernel((child + at) as *const i32) }) else {
        bump_counter(counter::SCOPE_FULL, 1);
        return 0;
    };
    let child_tgid = child_tgid as u32;
    if child_tgid != tgid && HOST_SCOPE_PIDS.insert(&child_tgid, &1, 0).is_err() {
        bump_counter(counter::SCOPE_FULL, 1);
    }
    0
}

/// Process `tgid` ended (its last thread): in a tree scope it leaves the
/// tree (a process that reuses its id is not the tree's).
#[inline(always)]
pub(crate) fn leave(tgid: u32) {
    if config_u32(&CONFIG.host_scope) == SCOPE_TREE {
        let _ = HOST_SCOPE_PIDS.remove(&tgid);
    }
}
