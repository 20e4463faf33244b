//! The windows policy of `mtrace agent`: probes in for a window, out for
//! as long as keeps the traced processes' cost within a budget, counts
//! exact inside each window and scaled to the whole time when read.
//!
//! A window's cost is what its traced calls took beyond the work the
//! processes did: per call, one uprobe trap ([`TRAP_NS`], measured on this
//! kind of machine) plus what the kernel says the BPF programs ran
//! (run-time stats, on while the policy runs). Against the CPU time the
//! processes spent in the window (their threads' schedstat), that gives
//! the slowdown while probed, `r`, taken for the process that pays most
//! (of those that worked in the window and were read at both its ends)
//! and never less than for all of them together: the budget holds for
//! every process, not on average over a scope where some allocate hard
//! and others hardly at all. While the probes are in (from a
//! window's first attach to its links' closing, switches included) for
//! `t` seconds, they lose `t * r / (1 + r)` seconds of work. The next
//! pause lasts so that this is the budget's share of the whole cycle:
//! `period = t * loss / budget`. The estimate misses costs (the trap's
//! cost varies; the first calls after the probes go in cost more), so the
//! loss is taken as half as much again as the estimate, and never more
//! than the time in itself: a tight allocation loop has the probes in for
//! the budget's share of the time, which bounds its loss whatever the
//! estimate; a process whose calls
//! cost it little is probed all the time, exactly.

use std::{
    collections::BTreeMap,
    os::fd::OwnedFd,
    time::{Duration, Instant},
};

use super::Session;
use crate::profile::WindowsInfo;

/// The cost of one uprobe trap and return, in nanoseconds: a stated
/// assumption, not measured by the agent where it runs. The figure it
/// rests on, and why a fixed bound is used, are in
/// docs/design/0001-agent-trap-cost.md.
pub const TRAP_NS: u64 = 800;

/// How much more a window is taken to cost than estimated.
const LOSS_MARGIN: f64 = 1.5;

/// The longest pause, so that a process is looked at again at least this
/// often.
const MAX_PAUSE: Duration = Duration::from_secs(3600);

/// `--policy windows`: how long a window lasts, the budget, and a fixed
/// period instead of the budget's when given.
#[derive(Clone, Copy, Debug)]
pub struct Windows {
    pub window: Duration,
    /// Allowed slowdown of the traced processes, averaged (0.02: 2%).
    pub budget: f64,
    pub every: Option<Duration>,
}

/// What a window is measured by, so far: the processes' CPU time and
/// their programs' runs (one trap each) and run time.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reading {
    pub cpu_ns: u64,
    pub runs: u64,
    pub run_ns: u64,
}

impl Reading {
    /// The slowdown while probed from `self` to the later `end` (the
    /// probes' cost over the other work done), and the calls; each run
    /// taken to cost `per_run` ns of program where given, rather than
    /// the run times read.
    fn slowdown(&self, end: &Reading, per_run: Option<f64>) -> (f64, u64) {
        let calls = end.runs.saturating_sub(self.runs);
        let run_ns = match per_run {
            Some(ns) => (calls as f64 * ns) as u64,
            None => end.run_ns.saturating_sub(self.run_ns),
        };
        let cost = calls * TRAP_NS + run_ns;
        let cpu = end.cpu_ns.saturating_sub(self.cpu_ns);
        // The work besides the probes; a window in which there was none
        // (idle) costs nothing noticeable.
        let work = cpu.saturating_sub(cost).max(1);
        (cost as f64 / work as f64, calls)
    }

    fn add(&mut self, other: &Reading) {
        self.cpu_ns += other.cpu_ns;
        self.runs += other.runs;
        self.run_ns += other.run_ns;
    }
}

/// The readings of a scope: every traced process together (for the host
/// scope the host's busy CPU time), and each process apart where known.
#[derive(Clone, Debug, Default)]
pub struct Readings {
    pub all: Reading,
    pub procs: BTreeMap<u32, Reading>,
    /// The processes' programs are shared (the host scope): their run
    /// time is not known apart, each run costs the window's mean.
    pub shared_programs: bool,
}

/// A process weighs in on its own when it spent at least this share of a
/// window on a CPU: a process that woke for a call or two in a window has
/// a large slowdown over microseconds that nobody notices.
const WORKED_SHARE: f64 = 0.05;

/// The policy at work.
pub struct Duty {
    pub policy: Windows,
    /// Probes in now.
    pub on: bool,
    /// When the current window or pause began.
    since: Instant,
    /// When the next switch is due.
    pub due: Instant,
    /// Time counted, over the trace.
    probed: Duration,
    /// When the current window's probes began to go in (its first
    /// attach), and the time probes were in over the trace, each window
    /// from its first attach to its last link closed.
    in_since: Instant,
    trapped: Duration,
    windows: u64,
    /// At the window's start.
    at: Readings,
    /// The last window's measured slowdown while probed, its calls, and
    /// the share of its time in taken as lost.
    pub last_slowdown: f64,
    last_calls: u64,
    lost: f64,
    /// Keeps the kernel's BPF run-time stats on.
    _stats: Option<OwnedFd>,
}

impl Duty {
    pub fn new(policy: Windows) -> Duty {
        let stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
            .map_err(|e| log::warn!("agent: BPF run-time stats unavailable ({e}); a window's cost is taken from its calls alone"))
            .ok();
        let now = Instant::now();
        Duty {
            policy,
            on: true,
            since: now,
            due: now + policy.window,
            probed: Duration::ZERO,
            in_since: now,
            trapped: Duration::ZERO,
            windows: 1,
            at: Readings::default(),
            last_slowdown: 0.0,
            last_calls: 0,
            lost: 1.0,
            _stats: stats,
        }
    }

    /// What the profile says of the windows so far.
    pub fn info(&self) -> WindowsInfo {
        let (current, trapping) = if self.on {
            (self.since.elapsed(), self.in_since.elapsed())
        } else {
            (Duration::ZERO, Duration::ZERO)
        };
        WindowsInfo {
            probed_secs: (self.probed + current).as_secs_f64(),
            trapped_secs: (self.trapped + trapping).as_secs_f64(),
            windows: self.windows,
            window_secs: self.policy.window.as_secs_f64(),
            budget: self.policy.budget,
            last_slowdown: self.last_slowdown,
            scale: 0.0,
        }
    }
}

impl Duty {
    /// A window is due to end, and `readings` are taken at its end.
    /// Returns false when the processes pay so little that the probes stay
    /// in and the next window begins now. Returns true when counting is to
    /// stop and the probes are to go out; the caller then calls
    /// [`Duty::went_out`].
    pub fn window_ends(&mut self, readings: Readings) -> bool {
        let now = Instant::now();
        let (all, calls) = self.at.all.slowdown(&readings.all, None);
        let per_run = readings.shared_programs.then(|| {
            let runs = readings.all.runs.saturating_sub(self.at.all.runs).max(1);
            readings.all.run_ns.saturating_sub(self.at.all.run_ns) as f64 / runs as f64
        });
        let worked = (now - self.since).as_nanos() as f64 * WORKED_SHARE;
        let most = readings
            .procs
            .iter()
            .filter_map(|(pid, end)| {
                let start = self.at.procs.get(pid)?;
                let cpu = end.cpu_ns.saturating_sub(start.cpu_ns) as f64;
                (cpu >= worked).then(|| start.slowdown(end, per_run).0)
            })
            .fold(0.0, f64::max);
        self.last_slowdown = all.max(most);
        self.last_calls = calls;
        let r = self.last_slowdown;
        self.lost = (LOSS_MARGIN * r / (1.0 + r)).min(1.0);
        let wanted = match self.policy.every {
            Some(every) => every,
            None => self
                .policy
                .window
                .mul_f64((self.lost / self.policy.budget).max(1.0)),
        };
        self.probed += now - self.since;
        self.since = now;
        if wanted.saturating_sub(self.policy.window) < Duration::from_millis(10) {
            // Cheap enough to stay in: the next window begins now.
            self.windows += 1;
            self.due = now + self.policy.window;
            self.at = readings;
            return false;
        }
        self.on = false;
        true
    }

    /// Counting stopped and the links' closing began at `closing`; every
    /// link is closed now. The pause is set.
    pub fn went_out(&mut self, closing: Instant) {
        let out = Instant::now();
        // The processes pay for the probes from the window's first
        // attach until the links' closing begins: closing a uprobe link
        // takes its breakpoints out first, then waits for the kernel's
        // grace period (most of the closing's time), which costs the
        // processes nothing. The pause is sized from that time, so that
        // what the processes lose stays within the budget whatever the
        // switches take.
        let trapped = closing.saturating_duration_since(self.in_since);
        // The trace begins with a window: after it, half a period more,
        // so that the windows lie mid-period on average and a run of a few
        // periods is not probed a window more than its share.
        let first = if self.trapped.is_zero() { 1.5 } else { 1.0 };
        self.trapped += trapped;
        let period = match self.policy.every {
            Some(every) => every,
            None => trapped.mul_f64((first * self.lost / self.policy.budget).max(1.0)),
        };
        let pause = period.saturating_sub(trapped).min(MAX_PAUSE);
        self.since = out;
        self.due = out + pause;
        log::debug!(
            "windows: {} calls probed cost {:.1}% of the work; probes in {:.1} ms ({:.1} ms closing the links); out for {:.3} s",
            self.last_calls,
            self.last_slowdown * 100.0,
            trapped.as_secs_f64() * 1e3,
            (out - closing).as_secs_f64() * 1e3,
            pause.as_secs_f64()
        );
    }

    /// The pause is over: the probes begin to go in now.
    pub fn coming_in(&mut self) {
        self.in_since = Instant::now();
    }

    /// Every probe is in and counting again: a window begins, measured
    /// against `readings`.
    pub fn came_in(&mut self, readings: Readings) {
        self.windows += 1;
        log::debug!(
            "windows: probes in again in {:.1} ms",
            self.in_since.elapsed().as_secs_f64() * 1e3
        );
        self.begin(readings);
    }

    /// A window begins now, measured against `readings`.
    pub fn begin(&mut self, readings: Readings) {
        self.on = true;
        self.since = Instant::now();
        self.due = self.since + self.policy.window;
        self.at = readings;
    }
}

/// CPU time of every thread of `pid` so far (ns), from schedstat.
pub fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// CPU time the host's CPUs spent busy so far (ns), from `/proc/stat`:
/// every state but idle and waiting for I/O.
pub fn host_busy_ns() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0;
    };
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return 0;
    };
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is in
    // user's already).
    let busy: u64 = ticks
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, t)| *t)
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    busy * (1_000_000_000 / hz)
}

impl Session {
    /// Each process's CPU time, and its programs' runs and run time.
    fn duty_readings(&self) -> Readings {
        let mut out = Readings::default();
        for proc in self.procs.values() {
            let mut one = Reading {
                cpu_ns: cpu_ns(proc.pid),
                ..Reading::default()
            };
            for prog in &proc.probes.programs {
                if let Ok(info) = prog.info() {
                    one.runs += info.runs;
                    one.run_ns += info.run_time_ns;
                }
            }
            out.all.add(&one);
            out.procs.insert(proc.pid, one);
        }
        out
    }

    /// A window begins now: what it will be measured against.
    pub(super) fn begin_window(&mut self) {
        let readings = self.duty_readings();
        if let Some(duty) = self.duty.as_mut() {
            duty.begin(readings);
        }
    }

    /// Ends the window or the pause that is due.
    pub(super) fn switch_duty(&mut self) {
        let readings = self.duty_readings();
        let Some(duty) = self.duty.as_mut() else {
            return;
        };
        if duty.on {
            if !duty.window_ends(readings) {
                return;
            }
            // Counting stops for every function at once; the links, each
            // closing in a grace period of its own, go after.
            for proc in self.procs.values_mut() {
                if let Err(e) = proc.probes.set_enabled(false) {
                    log::warn!("pid {}: stopping the count: {e:#}", proc.pid);
                }
            }
            let closing = Instant::now();
            crate::probes::multi::close_all(self.take_all_links());
            if let Some(duty) = self.duty.as_mut() {
                duty.went_out(closing);
            }
        } else {
            duty.coming_in();
            // Every link in, then counting starts for all functions at once.
            for proc in self.procs.values_mut() {
                let back = proc
                    .probes
                    .resume()
                    .and_then(|()| proc.probes.set_enabled(true));
                if let Err(e) = back {
                    log::warn!("pid {}: putting the probes back: {e:#}", proc.pid);
                }
            }
            let readings = self.duty_readings();
            if let Some(duty) = self.duty.as_mut() {
                duty.came_in(readings);
            }
        }
    }

    /// During a pause: a process probed since (a new one) is paused too,
    /// its counting stopped before its probes go.
    pub(super) fn keep_paused(&mut self) {
        if self.duty.as_ref().is_some_and(|d| !d.on) {
            let mut links = Vec::new();
            for proc in self.procs.values_mut() {
                let taken = proc.probes.take_links();
                if !taken.is_empty() {
                    let _ = proc.probes.set_enabled(false);
                    links.extend(taken);
                }
            }
            if !links.is_empty() {
                std::thread::spawn(move || crate::probes::multi::close_all(links));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cpu_us` of CPU time and `runs` calls, each run 200 ns of program.
    fn reading(cpu_us: u64, runs: u64) -> Reading {
        Reading {
            cpu_ns: cpu_us * 1000,
            runs,
            run_ns: runs * 200,
        }
    }

    fn readings(procs: &[(u32, Reading)]) -> Readings {
        let mut out = Readings::default();
        for (pid, r) in procs {
            out.all.add(r);
            out.procs.insert(*pid, *r);
        }
        out
    }

    fn duty() -> Duty {
        Duty::new(Windows {
            window: Duration::from_millis(50),
            budget: 0.02,
            every: None,
        })
    }

    #[test]
    fn the_process_that_pays_most_sets_the_slowdown() {
        let mut d = duty();
        d.begin(readings(&[(1, reading(0, 0)), (2, reading(0, 0))]));
        std::thread::sleep(Duration::from_millis(20));
        // Process 1: 30,000 calls at 1 us each in 50 ms of CPU, a slowdown
        // of 30/20 = 1.5; process 2: 50 ms of work and no call. Together
        // 30 ms of 100: 0.43.
        let end = readings(&[(1, reading(50_000, 30_000)), (2, reading(50_000, 0))]);
        assert!(d.window_ends(end));
        assert!(
            (d.last_slowdown - 1.5).abs() < 1e-9,
            "slowdown {}",
            d.last_slowdown
        );
        assert_eq!(d.last_calls, 30_000);
    }

    #[test]
    fn processes_that_hardly_ran_or_came_late_weigh_in_only_together() {
        let mut d = duty();
        d.begin(readings(&[(1, reading(0, 0)), (2, reading(0, 0))]));
        std::thread::sleep(Duration::from_millis(20));
        // Process 1 woke for 10 calls in 20 us of CPU (under 5% of the
        // window); process 3 was not read at the window's start; process
        // 2 worked 40 ms without a call. Only the sum counts: 10 + 30,000
        // calls, 30.01 ms of 70.02 ms of CPU.
        let end = readings(&[
            (1, reading(20, 10)),
            (2, reading(40_000, 0)),
            (3, reading(30_000, 30_000)),
        ]);
        assert!(d.window_ends(end));
        let cost = 30_010.0 * 1000.0;
        let want = cost / (70_020_000.0 - cost);
        assert!(
            (d.last_slowdown - want).abs() < 1e-9,
            "slowdown {} want {want}",
            d.last_slowdown
        );
    }
}
