//! The windows policy over the host (`mtrace agent --all`): what a
//! window is measured by, and the switch in and out.

use std::collections::HashMap;

use super::probes::HostProbes;
use crate::session::duty::{cpu_ns, host_busy_ns, Duty, Reading, Readings};

/// Processes read apart in a window of the windows policy: those that made
/// the most calls in the window before (reading every allocating
/// process's threads each window would cost a busy host more than the
/// one that pays most needs).
const HOT_PROCESSES: usize = 16;

/// The windows policy over the host: what a window is measured by.
#[derive(Default)]
pub(super) struct HostWindows {
    /// Each process's program runs at the window's start.
    runs_at: HashMap<u32, u64>,
    /// The processes read apart in this window.
    hot: Vec<u32>,
}

impl HostWindows {
    /// The host's busy CPU time and the host program's runs and run time,
    /// and each hot process's CPU time and runs; `runs` each process's
    /// runs now.
    fn readings(&self, probes: &HostProbes, runs: &HashMap<u32, u64>) -> Readings {
        let (all_runs, run_ns) = probes.program_stats();
        Readings {
            all: Reading {
                cpu_ns: host_busy_ns(),
                runs: all_runs,
                run_ns,
            },
            procs: self
                .hot
                .iter()
                .filter_map(|t| {
                    let runs = *runs.get(t)?;
                    Some((
                        *t,
                        Reading {
                            cpu_ns: cpu_ns(*t),
                            runs,
                            run_ns: 0,
                        },
                    ))
                })
                .collect(),
            shared_programs: true,
        }
    }

    /// A window begins: its readings.
    pub(super) fn begin(&mut self, probes: &HostProbes) -> Readings {
        self.runs_at = probes.process_runs();
        self.readings(probes, &self.runs_at)
    }

    /// A window ends: its readings; the processes with the most calls in
    /// it are read apart in the next, which may begin now (the probes
    /// staying in) from these runs.
    fn end(&mut self, probes: &HostProbes) -> Readings {
        let runs = probes.process_runs();
        let readings = self.readings(probes, &runs);
        let mut made: Vec<(u64, u32)> = runs
            .iter()
            .map(|(t, n)| (n.saturating_sub(*self.runs_at.get(t).unwrap_or(&0)), *t))
            .filter(|(n, _)| *n > 0)
            .collect();
        made.sort_unstable_by(|a, b| b.cmp(a));
        self.hot = made.iter().take(HOT_PROCESSES).map(|(_, t)| *t).collect();
        self.runs_at = runs;
        readings
    }
}

/// Ends the window or the pause that is due (the windows policy).
pub(super) fn switch(probes: &mut HostProbes, duty: &mut Duty, windows: &mut HostWindows) {
    if duty.on {
        if !duty.window_ends(windows.end(probes)) {
            return;
        }
        match probes.pause() {
            Ok(closing) => duty.went_out(closing),
            Err(e) => log::warn!("taking the probes out for a pause: {e:#}"),
        }
    } else {
        duty.coming_in();
        if let Err(e) = probes.resume() {
            log::warn!("{e:#}");
        }
        duty.came_in(windows.begin(probes));
    }
}
