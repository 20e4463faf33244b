//! A command's tree on the host engine (`--file-wide -- CMD`), held at
//! each exec: a program with an allocator of its own (a static program,
//! Rust's allocator shims, its own `operator new`) is probed before its
//! first instruction, so its first call is counted as under `--pid`.
//! A Go program is made known before its first instruction, its heap
//! read from its start, and held at its exit to be read once more, as
//! from launch on the per-process engine. A program named like a Python
//! interpreter has its layout learned before its first instruction where
//! libpython is linked in, and is held at its exit for its interpreter's
//! state to be judged (as the per-process engine's exit hold does).
//! Every other exec runs on at once. Every process is held at its exit
//! until the walks the kernel handed over are finished in its memory.
//! The files of the tree's programs that no process mapped before are
//! looked at once each.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        mpsc::{self, Receiver, Sender, SyncSender},
        Arc, Mutex,
    },
    time::Duration,
};

use super::files::{key_of_path, FileKey};
use crate::tracee::launch::Holds;

/// What a process of the tree held by the thread that follows it waits
/// for the trace's loop to do.
pub enum Held {
    /// Probe an executable with an allocator of its own.
    Probe { key: FileKey, exe: String },
    /// Read the heap of a Go program that exec'd (from its start).
    GoStarted { pid: u32 },
    /// A Go program's heap read once more at its exit; a Python
    /// program's interpreter judged readable or not, while it still is.
    Exiting { pid: u32 },
    /// Look for the interpreter of a program that may run CPython (its
    /// layout in before its first Python frame).
    Python { pid: u32 },
}

/// One thing to do while a process waits.
pub struct Ask {
    pub what: Held,
    /// Answered once it is done.
    pub done: SyncSender<()>,
}

/// How long a process waits for its probes at most: the trace's loop
/// answers within one of its polls, unless it is ending.
const WAIT_AT_MOST: Duration = Duration::from_secs(5);

/// What an executable is, for the hold.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Kind {
    own_allocator: bool,
    go: bool,
    python: bool,
}

/// The trace's end of the hold (its asks), and what the thread that
/// follows the tree does at each exec stop and at the exit of a process
/// it holds there. `libc`: the C library a program with an allocator of
/// its own may bind to beside it. Every process is held at its exit
/// until `finish` has finished the walks the kernel handed over (a
/// short-lived process's, and those through JIT code, are walked in its
/// memory, not in what is known of it once gone); a Go program, so that
/// its heap is read with everything it allocated, and a Python one, for
/// its interpreter to be judged, until the trace's loop has done that.
pub fn exec_hold(
    libc: Option<String>,
    finish: impl Fn() + Send + 'static,
    throttled: impl Fn(u32) -> bool + Send + 'static,
) -> (Receiver<Ask>, Holds) {
    let (tx, rx) = mpsc::channel();
    let ask = |tx: &Sender<Ask>, what: Held| {
        let (done, answered) = mpsc::sync_channel(1);
        if tx.send(Ask { what, done }).is_ok() {
            // An answer that does not come (the trace ending) lets the
            // process go all the same.
            let _ = answered.recv_timeout(WAIT_AT_MOST);
        }
    };
    // What each executable seen is.
    let mut kinds: HashMap<FileKey, Kind> = HashMap::new();
    let exec_tx = tx.clone();
    // The processes whose exit the trace's loop is asked about.
    let asked = Arc::new(Mutex::new(HashSet::new()));
    let asked_at_exit = asked.clone();
    let on_exec = move |pid: u32| {
        let ask_at_exit = |yes: bool| {
            let mut asked = asked.lock().unwrap_or_else(|e| e.into_inner());
            if yes {
                asked.insert(pid);
            } else {
                asked.remove(&pid);
            }
        };
        let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe")) else {
            ask_at_exit(false);
            return true;
        };
        let Some(key) = key_of_path(&exe) else {
            ask_at_exit(false);
            return true;
        };
        let exe = exe.to_string_lossy().into_owned();
        let kind = *kinds.entry(key).or_insert_with(|| Kind {
            own_allocator: has_own_allocator(&exe, &libc),
            go: crate::golang::binary::is_go(std::path::Path::new(&exe)),
            python: crate::python::files::named_like_interpreter(&exe),
        });
        if kind.own_allocator {
            ask(&exec_tx, Held::Probe { key, exe });
        }
        if kind.go {
            ask(&exec_tx, Held::GoStarted { pid });
        }
        if kind.python {
            ask(&exec_tx, Held::Python { pid });
        }
        ask_at_exit(kind.go || kind.python);
        true
    };
    let on_exit = move |pid: u32| {
        finish();
        let asked = asked_at_exit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&pid);
        if asked {
            ask(&tx, Held::Exiting { pid });
        }
    };
    (
        rx,
        Holds {
            on_exec: Box::new(on_exec),
            on_exit: Box::new(on_exit),
            on_throttle: Box::new(throttled),
        },
    )
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
