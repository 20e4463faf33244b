//! Letting go: the probes of programs that are gone wait in a graveyard
//! (taking a probe out holds up the attaching of new ones), and at the
//! end a reaper process of their own takes them out while mtrace exits.

use std::{collections::VecDeque, time::Instant};

use anyhow::Result;

use super::{tree::Tree, Session, TracedProcess};
use crate::{probes::Probes, say};

/// The probes of programs that are gone (their process exited or exec'd
/// another), not yet detached, oldest first, with the pid they were for.
#[derive(Default)]
pub struct Graveyard {
    probes: VecDeque<(u32, Probes)>,
    /// Kernel memory their maps hold, bytes.
    bytes: u64,
    /// Programs whose probes were detached while tracing (the graveyard
    /// over its budget).
    detached: u64,
}

/// Kernel memory the probes of gone programs may hold until tracing ends,
/// bytes: an eighth of the memory available when tracing starts, between
/// 256 MiB and 2 GiB.
///
/// Detaching a probe takes the kernel RCU grace periods while it holds
/// the mutex every new probe needs (`perf_uprobe_destroy` holds
/// `event_mutex` across `synchronize_rcu_tasks_trace`), so detaching while
/// tracing holds up the probes of new processes (docs/performance.md has
/// the figures). The probes of gone programs therefore wait, unable to
/// fire (their address space is gone), as long as their maps fit in this.
fn graveyard_budget() -> u64 {
    static BUDGET: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        let available = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemAvailable:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map_or(0, |kib| kib * 1024);
        (available / 8).clamp(256 << 20, 2 << 30)
    })
}

impl Graveyard {
    /// Keeps the probes of a program that is gone (its process exited or
    /// exec'd another) in the graveyard until tracing ends; while the
    /// graveyard holds more than [`graveyard_budget`] bytes of kernel
    /// memory, its oldest are detached, away from the session's thread
    /// (and holding up the probes of the processes to come meanwhile).
    pub fn bury(&mut self, pid: u32, probes: Probes) {
        self.bytes += probes.kernel_bytes;
        self.probes.push_back((pid, probes));
        while self.bytes > graveyard_budget() && self.probes.len() > 1 {
            let Some((_, oldest)) = self.probes.pop_front() else {
                break;
            };
            self.bytes -= oldest.kernel_bytes;
            self.detached += 1;
            if self.detached == 1 {
                log::info!(
                    "the probes of gone programs hold {} MiB of kernel memory: from now on the oldest are detached while tracing, which slows down attaching to new processes",
                    graveyard_budget() >> 20
                );
            }
            std::thread::spawn(move || drop(oldest));
        }
    }
}

impl Session {
    /// Ends the trace: the probes of processes that still run are taken
    /// out now (they must not go on paying for them); those of processes
    /// that are gone (the kernel waits for RCU grace periods for each,
    /// under a lock) are left to a process of their own that outlives
    /// mtrace, so that neither the user nor a CI job waits for them. Their
    /// breakpoints are in no process any more: nothing is left behind.
    /// `root_gone`: the root has exited (its exit code may be unknown).
    pub fn detach(mut self, root_gone: bool) {
        let root = self.root;
        let gone = |tree: &Tree, pid: u32| {
            (pid == root && root_gone)
                || tree
                    .processes
                    .iter()
                    .rev()
                    .find(|p| p.pid == pid)
                    .is_some_and(|p| p.exit_code.is_some())
        };
        let (dead, alive): (Vec<u32>, Vec<u32>) =
            self.procs.keys().partition(|&&pid| gone(&self.tree, pid));
        let started = Instant::now();
        let mut n = 0;
        for pid in alive {
            if let Some(proc) = self.procs.remove(&pid) {
                n += proc.probes.attached.len();
                drop(proc);
            }
        }
        if n > 0 {
            log::debug!(
                "{n} probes of running processes detached in {:.1} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
        }
        for pid in dead {
            if let Some(proc) = self.procs.remove(&pid) {
                let TracedProcess { probes, unwind, .. } = proc;
                drop(unwind);
                self.graveyard.bytes += probes.kernel_bytes;
                self.graveyard.probes.push_back((pid, probes));
            }
        }
        // The probes of a program a running process exec'd away from still
        // trap its calls (disabled): they go now, with the running ones.
        let (old_programs, dead): (Vec<_>, Vec<_>) = std::mem::take(&mut self.graveyard.probes)
            .into_iter()
            .partition(|(pid, _)| !gone(&self.tree, *pid));
        self.graveyard.probes = dead.into();
        if !old_programs.is_empty() {
            let started = Instant::now();
            let n: usize = old_programs.iter().map(|(_, p)| p.attached.len()).sum();
            drop(old_programs);
            log::debug!(
                "{n} probes of programs running processes exec'd away from detached in {:.1} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
        }
        let probes: usize = self
            .graveyard
            .probes
            .iter()
            .map(|(_, p)| p.attached.len())
            .sum();
        if probes == 0 {
            return;
        }
        match reaper() {
            Ok(true) => log::debug!(
                "the {probes} probes of {} exited processes are taken out by a process of their own",
                self.graveyard.probes.len()
            ),
            _ => say!(
                "mtrace: taking out the {probes} probes of {} exited processes (the kernel takes about 0.1 s a probe)",
                self.graveyard.probes.len()
            ),
        }
        // Here, only references go: the reaper holds the probes.
        drop(self);
    }
}

/// Forks a process that holds every descriptor mtrace has, in a session
/// of its own with standard input, output and error on /dev/null (a pipe
/// of whoever runs mtrace must see its end), and waits for mtrace to exit:
/// the last to close a probe's descriptor is the one the kernel makes
/// wait, and that is then the reaper. Only the probes of processes that are
/// gone may be open when this is called. True in the parent once forked.
fn reaper() -> Result<bool> {
    use std::os::fd::AsRawFd;
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?;
    let null = null.as_raw_fd();
    // mtrace holds the write end until it exits; the reaper reads the end
    // of file then.
    let mut pipe = [0i32; 2];
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: the child calls only async-signal-safe functions, then
    // _exit.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error().into()),
        0 => unsafe {
            libc::setsid();
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            libc::close(pipe[1]);
            let mut byte = 0u8;
            while libc::read(pipe[0], (&raw mut byte).cast(), 1) < 0 {}
            libc::_exit(0)
        },
        _ => {
            unsafe { libc::close(pipe[0]) };
            // The write end stays open until mtrace exits.
            Ok(true)
        }
    }
}
