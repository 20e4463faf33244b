//! The thread that finishes the host scope's walks as the kernel hands
//! them over ([`HostWalks`]), woken by their ring.

use std::{
    os::fd::AsRawFd,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard,
    },
    thread::JoinHandle,
};

use anyhow::{Context, Result};
use aya::Ebpf;

use super::walks::{lock_paths, HostWalks, Paths};

/// Executables' paths kept.
const PATHS_KEPT: usize = 4096;

/// The thread that finishes the walks as they come (a walk waits in a
/// ring that a burst of new code fills: the sooner the rules are in, the
/// fewer walks are handed over).
pub struct HostWalker {
    walks: Arc<Mutex<HostWalks>>,
    paths: Paths,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HostWalker {
    /// Starts the thread on the ring and maps of `ebpf` (loaded).
    pub fn start(ebpf: &Ebpf, max_frames: u32) -> Result<HostWalker> {
        let paths = Paths::default();
        let walks = HostWalks::new(ebpf, max_frames, paths.clone())?;
        let fd = walks
            .ring
            .as_ref()
            .map(|r| r.as_raw_fd())
            .context("the ring of walks")?;
        let walks = Arc::new(Mutex::new(walks));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (walks, stop) = (walks.clone(), stop.clone());
            std::thread::Builder::new()
                .name("mtrace-walks".into())
                .spawn(move || {
                    crate::unwind::service::realtime_priority();
                    // `fd` stays open: `walks` owns the ring.
                    while !stop.load(Ordering::Relaxed) {
                        let mut pfd = libc::pollfd {
                            fd,
                            events: libc::POLLIN,
                            revents: 0,
                        };
                        let ready = unsafe { libc::poll(&mut pfd, 1, POLL_MS) } > 0;
                        let mut walks = lock(&walks);
                        if ready || !walks.deferred.is_empty() {
                            walks.finish_all();
                        }
                    }
                })?
        };
        Ok(HostWalker {
            walks,
            paths,
            stop,
            thread: Some(thread),
        })
    }

    /// Notes that file `key` is at `path` (an executable as exec'd): a
    /// walk of a process gone learns its rules there.
    pub fn note_path(&self, key: (u32, u64), path: &str) {
        let mut paths = lock_paths(&self.paths);
        if paths.len() >= PATHS_KEPT {
            paths.clear();
        }
        paths.insert(key, PathBuf::from(path));
    }

    /// The walks as they are (the Python processes' table, say), without
    /// finishing those waiting.
    pub fn lock(&self) -> MutexGuard<'_, HostWalks> {
        lock(&self.walks)
    }

    /// What finishes the walks waiting, from another thread (the one
    /// that holds a process of the tree at its exit, while its memory is
    /// there to finish them in).
    pub fn finisher(&self) -> impl Fn() + Send + 'static {
        let walks = self.walks.clone();
        move || lock(&walks).finish_all()
    }

    /// What lets a thread of the tree stopped with the throttle signal go
    /// on (true: the signal was the programs', taken), once the walks
    /// waiting in the ring are finished.
    pub fn throttle_taker(&self) -> impl Fn(u32) -> bool + Send + 'static {
        let walks = self.walks.clone();
        move |tid| {
            let mut walks = lock(&walks);
            let ours = walks.take_throttled(tid);
            if ours {
                walks.finish_all();
            }
            ours
        }
    }

    /// Finishes every walk still waiting, those waiting for their
    /// process's files to be named too: the end of the trace, once the
    /// last execs were read.
    pub fn finish_at_end(&self) {
        lock(&self.walks).finish_at_end();
    }

    /// The walks finished so far, after finishing those still waiting.
    pub fn walks(&self) -> MutexGuard<'_, HostWalks> {
        let mut w = lock(&self.walks);
        w.finish_all();
        w
    }
}

/// How long the thread sleeps between looks at its stop flag.
const POLL_MS: i32 = 50;

fn lock(walks: &Mutex<HostWalks>) -> MutexGuard<'_, HostWalks> {
    walks.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for HostWalker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
