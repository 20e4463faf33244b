//! A command's tree on the host engine (`--file-wide -- CMD`), held at
//! each exec: a program with an allocator of its own (a static program,
//! Rust's allocator shims, its own `operator new`) is probed before its
//! first instruction, so its first call is counted as under `--pid`.
//! Every other exec runs on at once. The files of the tree's programs
//! that no process mapped before are looked at once each.

use std::{
    collections::HashMap,
    sync::mpsc::{self, Receiver, SyncSender},
    time::Duration,
};

use super::files::{key_of_path, FileKey};

/// One executable with an allocator of its own, for the trace's loop to
/// probe while its process waits.
pub struct Ask {
    pub key: FileKey,
    pub exe: String,
    /// Answered once the probes are in.
    pub done: SyncSender<()>,
}

/// How long a process waits for its probes at most: the trace's loop
/// answers within one of its polls, unless it is ending.
const WAIT_AT_MOST: Duration = Duration::from_secs(5);

/// The trace's end of the hold (its asks), and what the thread that
/// follows the tree calls at each exec stop. `libc`: the C library a
/// program with an allocator of its own may bind to beside it.
pub fn exec_hold(libc: Option<String>) -> (Receiver<Ask>, Box<dyn FnMut(u32) + Send>) {
    let (tx, rx) = mpsc::channel();
    // Whether each executable seen has an allocator of its own.
    let mut own: HashMap<FileKey, bool> = HashMap::new();
    let on_exec = move |pid: u32| {
        let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe")) else {
            return;
        };
        let Some(key) = key_of_path(&exe) else {
            return;
        };
        if own.get(&key) == Some(&false) {
            return;
        }
        let exe = exe.to_string_lossy().into_owned();
        let has_own = *own
            .entry(key)
            .or_insert_with(|| has_own_allocator(&exe, &libc));
        if !has_own {
            return;
        }
        let (done, answered) = mpsc::sync_channel(1);
        if tx.send(Ask { key, exe, done }).is_ok() {
            // An answer that does not come (the trace ending) lets the
            // process go all the same.
            let _ = answered.recv_timeout(WAIT_AT_MOST);
        }
    };
    (rx, Box::new(on_exec))
}

/// Whether `exe` defines an allocator entry point a program calls (beside
/// the C library, which is probed from the start).
fn has_own_allocator(exe: &str, libc: &Option<String>) -> bool {
    let paths: Vec<String> = std::iter::once(exe.to_string())
        .chain(libc.clone())
        .collect();
    match crate::allocators::find_in_files(paths) {
        Ok(Some(alloc)) => alloc
            .sites
            .iter()
            .any(|s| s.role().allocates() && s.path == exe),
        Ok(None) => false,
        Err(e) => {
            log::debug!("{exe}: {e:#}");
            false
        }
    }
}

/// Whether `pid` is stopped by its tracer (`t` in `/proc/PID/stat`): in a
/// followed tree, a process held at an exec or a fork.
pub fn stopped_by_tracer(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s[s.rfind(')')? + 1..].trim_start().starts_with('t')))
        .unwrap_or(false)
}
