//! By pid: the target (and with `--children` its descendants) held at the
//! events a trace needs, as launch mode does. At its exit the session reads
//! its mappings once more: without it, a library the target loads and
//! uses just before exiting is gone before the tracer has seen it mapped,
//! and its frames can be neither unwound nor named. At an `exec` it waits
//! until the new program's allocator is probed. With `--children`, each
//! process it creates is stopped before its first instruction until the
//! session has probed it, and the processes it had created before mtrace
//! came are probed as they run.
//!
//! Every thread is seized (`PTRACE_SEIZE`, which does not stop it) with
//! `PTRACE_O_TRACEEXIT` and `PTRACE_O_TRACEEXEC` (and `PTRACE_O_TRACEFORK`
//! and its kin with `--children`); signals are passed on, a group stop is
//! kept (`PTRACE_LISTEN`). When the trace ends first, every tracee is
//! detached. A target that another tracer (a debugger) holds is traced
//! without the hold. If mtrace dies, the kernel detaches them all.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
};

use super::ptrace::{
    seize_descendants, seize_process, seize_tree, wait_tree, AtExec, Handover, TreeEvent,
    WITH_CHILDREN,
};

pub struct ExitHold {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    go: Option<std::sync::mpsc::Sender<()>>,
}

impl ExitHold {
    /// Holds `pid` (and with `children` its descendants, present and to
    /// come), telling `on_event` what happens in the tree once [`go`] is
    /// called. Returns with the descendants it seized, as (parent, child):
    /// they run on meanwhile, and are the caller's to probe.
    ///
    /// [`go`]: ExitHold::go
    pub fn start<E>(pid: u32, children: bool, on_event: E) -> (ExitHold, Vec<(u32, u32)>)
    where
        E: FnMut(TreeEvent) -> anyhow::Result<Option<()>> + Send + 'static,
    {
        ExitHold::start_with(pid, Vec::new(), children, None, on_event)
    }

    /// As [`ExitHold::start`] with children, for `pid` and `others` (the
    /// processes of a cgroup): the others and their descendants are among
    /// the descendants returned, each as a child of its parent. What is
    /// sent to `handover` is done while the tree runs: a process adopted is
    /// seized (with what it created) and told to `on_event` as forks; a
    /// process released is detached.
    pub fn start_with<E>(
        pid: u32,
        others: Vec<u32>,
        children: bool,
        handover: Option<std::sync::mpsc::Receiver<Handover>>,
        mut on_event: E,
    ) -> (ExitHold, Vec<(u32, u32)>)
    where
        E: FnMut(TreeEvent) -> anyhow::Result<Option<()>> + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let (found_tx, found) = std::sync::mpsc::channel();
        let (go, wait_go) = std::sync::mpsc::channel::<()>();
        // ptrace requests come from the thread that seized the tracees.
        let thread = std::thread::Builder::new()
            .name("mtrace-hold".into())
            .spawn(move || {
                let options = if children {
                    WITH_CHILDREN
                } else {
                    libc::PTRACE_O_TRACEEXIT | libc::PTRACE_O_TRACEEXEC
                };
                let mut group = HashMap::new();
                if !seize_process(pid, options, &mut group) {
                    log::debug!(
                        "pid {pid} not held at its exit: {}",
                        std::io::Error::last_os_error()
                    );
                    let _ = found_tx.send(Vec::new());
                    return;
                }
                let mut descendants = if children {
                    seize_descendants(pid, options, &mut group)
                } else {
                    Vec::new()
                };
                for other in others {
                    descendants.extend(seize_tree(other, &mut group));
                }
                let _ = found_tx.send(descendants);
                // Until the session can hear of the tree; an end of the
                // trace before then detaches at once.
                let _ = wait_go.recv();
                wait_tree(
                    pid,
                    group,
                    Some(&flag),
                    handover.as_ref(),
                    AtExec::Allocator,
                    &mut on_event,
                );
            })
            .ok();
        let descendants = found.recv().unwrap_or_default();
        let hold = ExitHold {
            stop,
            thread,
            go: Some(go),
        };
        (hold, descendants)
    }

    /// From now on, events go to the session.
    pub fn go(&mut self) {
        self.go.take();
    }
}

impl Drop for ExitHold {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.go.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
