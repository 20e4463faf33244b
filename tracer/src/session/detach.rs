//! Letting go: a process's probes are one uprobe-multi link per program,
//! which the kernel takes out with one grace period, so they go as soon as
//! their program is done with, side by side, and the trace's end waits
//! only for the last of them.

use std::time::Instant;

use super::{Session, TracedProcess};
use crate::probes::Probes;

/// Lets go of `probes` away from the session's thread, once their links
/// are closed (their process runs another program now).
pub fn let_go(probes: Probes) {
    std::thread::spawn(move || probes.recycle());
}

/// Lets go of a gone process away from the session's thread (its
/// unwinder stopped, its object emptied, its links closed): its process
/// is reaped, so no program of its can run, and its object serves the
/// next process as soon as it is emptied (which a process that needs it
/// meanwhile waits for).
pub fn let_go_of_gone(proc: TracedProcess) {
    let coming_back = crate::probes::pool::ComingBack::new(proc.probes.made_for());
    std::thread::spawn(move || {
        let probes = proc.release();
        let (links, loaded) = probes.split();
        crate::probes::pool::give_back(loaded);
        drop(coming_back);
        crate::probes::multi::close_all(links);
    });
}

impl Session {
    /// Ends the trace: the probes of every process still traced are taken
    /// out, side by side (a grace period of the kernel's in all). Nothing
    /// is left behind: the probes of processes that are gone or exec'd
    /// went when that happened.
    pub fn detach(mut self) {
        let started = Instant::now();
        if let Some(closing) = self.letting_go.take() {
            let _ = closing.join();
        }
        let procs = std::mem::take(&mut self.procs);
        let n: usize = procs.values().map(|p| p.probes.attached.len()).sum();
        std::thread::scope(|s| {
            for (_, proc) in procs {
                let TracedProcess { probes, unwind, .. } = proc;
                s.spawn(move || {
                    drop(unwind);
                    let mut probes = probes;
                    probes.take_out();
                });
            }
        });
        if n > 0 {
            log::debug!(
                "{n} probes detached in {:.1} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
        }
    }
}
