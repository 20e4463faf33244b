//! The loop of a trace under way: drains live mode's event rings,
//! refreshes the mappings, feeds the timeline and the watchers every
//! second, writes snapshots, follows the process tree, until the trace
//! ends.

use std::{
    os::fd::OwnedFd,
    time::{Duration, Instant},
};

use anyhow::Result;
use tokio::{io::unix::AsyncFd, sync::oneshot};

use super::{
    end::{End, Signals},
    tree::TreeRequest,
    Session,
};
use crate::{say, sinks::Sink, watch::Watcher};

/// What a running trace listens to.
pub struct Inputs {
    /// Launch mode: the command's exit code.
    pub exit_rx: Option<oneshot::Receiver<i32>>,
    /// By pid: readable when the target exits (opened before the probes
    /// went in: [`super::pidfd_open`]).
    pub pidfd: Option<OwnedFd>,
    /// What happens in the process tree.
    pub tree_events: Option<tokio::sync::mpsc::UnboundedReceiver<TreeRequest>>,
    pub signals: Signals,
    /// The live view's `q`.
    pub stop: Option<oneshot::Receiver<()>>,
    /// By cgroup: its directory, and where to send the processes that
    /// join it (the hold seizes them and tells of them as forks) and those
    /// that leave it (the hold lets them go).
    pub cgroup: Option<super::Scope>,
    /// A watcher wants the trace now, not at the next second.
    pub wake: Option<std::sync::Arc<tokio::sync::Notify>>,
}

/// How often the timeline, the status line and the live view are fed.
const TICK_EVERY: Duration = Duration::from_secs(1);

/// Live mode: how often the event rings are drained.
const DRAIN_EVERY: Duration = Duration::from_millis(10);

/// How often the target's mappings are re-read (new libraries).
const REFRESH_EVERY: Duration = Duration::from_millis(500);

/// By pid: how long the end of the trace waits for the hold's word of
/// how the target ended, once its pidfd said it had.
const ROOT_GONE_WAIT: Duration = Duration::from_millis(50);

/// By cgroup: how often its processes are listed.
const CGROUP_SCAN_EVERY: Duration = Duration::from_millis(100);

/// How long a gone process waits to be read when no other process of the
/// tree is answered meanwhile.
const SETTLE_AFTER: Duration = Duration::from_millis(2);

/// When the loop ends and when it writes snapshots.
pub struct Schedule {
    pub duration: Option<Duration>,
    pub interval: Option<Duration>,
    /// `mtrace agent`: a cgroup that empties is waited on (a service that
    /// restarts comes back into it) until the trace is stopped.
    pub until_stopped: bool,
}

impl Session {
    /// Runs until the trace ends; returns why, and in launch mode the
    /// receiver of the command's exit code when it still runs.
    pub async fn run(
        &mut self,
        schedule: &Schedule,
        sinks: &mut [Box<dyn Sink>],
        inputs: Inputs,
        watchers: &mut [Box<dyn Watcher>],
    ) -> Result<(End, Option<oneshot::Receiver<i32>>)> {
        let Inputs {
            exit_rx,
            pidfd,
            mut tree_events,
            signals,
            stop,
            cgroup,
            wake,
        } = inputs;
        let woken = async || match &wake {
            Some(n) => n.notified().await,
            None => std::future::pending().await,
        };
        // Live mode: each process's event rings, one per CPU. The BPF
        // programs do not wake us per event; we drain them on a timer,
        // often enough that they cannot fill at any allocation rate a
        // uprobe allows (about a million events a second per CPU at most;
        // 4 MiB hold some 70,000).
        let next_event =
            async |rx: &mut Option<tokio::sync::mpsc::UnboundedReceiver<TreeRequest>>| match rx {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            };
        let mut drain_tick = tokio::time::interval(DRAIN_EVERY);
        drain_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let live = self.options.settings.mode.live;
        let drain_due = async |tick: &mut tokio::time::Interval| {
            if !live {
                std::future::pending().await
            } else {
                tick.tick().await;
            }
        };
        let Signals {
            int: mut sigint,
            term: mut sigterm,
            usr1: mut sigusr1,
        } = signals;
        let sleep = async {
            match schedule.duration {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(sleep);
        let mut refresh = tokio::time::interval(REFRESH_EVERY);
        // By cgroup: how soon a process that joins it is traced, and the
        // cgroup's end seen.
        let mut cgroup_scan = tokio::time::interval(CGROUP_SCAN_EVERY);
        let scanning = cgroup.is_some();
        self.cgroup = cgroup;
        let cgroup_due = async |tick: &mut tokio::time::Interval| {
            if scanning {
                tick.tick().await;
            } else {
                std::future::pending().await
            }
        };
        let mut interval = super::SnapshotTimer::new(schedule.interval);

        // Launch mode learns of the exit from the launch thread; by pid, a
        // pidfd becomes readable.
        let exited_fd = match pidfd {
            // SAFETY: the descriptor is ours and lives as long as the AsyncFd.
            Some(fd) => Some(unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?),
            None => None,
        };
        let mut exit_rx = exit_rx;
        let target_exit = async |rx: &mut Option<oneshot::Receiver<i32>>| -> Option<i32> {
            match (rx, &exited_fd) {
                (Some(rx), _) => rx.await.ok(),
                (None, Some(fd)) => {
                    let _ = fd.readable().await;
                    None
                }
                (None, None) => std::future::pending().await,
            }
        };

        let mut second =
            tokio::time::interval_at(tokio::time::Instant::now() + TICK_EVERY, TICK_EVERY);
        second.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let stop = async {
            match stop {
                Some(rx) => {
                    if rx.await.is_err() {
                        std::future::pending::<()>().await
                    }
                }
                None => std::future::pending().await,
            }
        };
        tokio::pin!(stop);

        let duty_due = |due: Option<Instant>| async move {
            match due {
                Some(due) => tokio::time::sleep_until(due.into()).await,
                None => std::future::pending().await,
            }
        };

        let end = loop {
            let next_switch = self.duty.as_ref().map(|d| d.due);
            let settle_at = self.gone_since.map(|t| t + SETTLE_AFTER);
            tokio::select! {
                _ = duty_due(next_switch) => self.switch_duty(),
                _ = duty_due(settle_at) => self.settle(),
                _ = &mut stop => break (End::Stopped, exit_rx),
                _ = woken() => {
                    let tick = self.tick();
                    for w in watchers.iter_mut() {
                        w.woken(&tick, &|| self.profile())?;
                    }
                }
                _ = second.tick() => {
                    let tick = self.tick();
                    self.timeline.record(tick.elapsed, tick.running, tick.live_bytes, false);
                    for w in watchers.iter_mut() {
                        w.tick(&tick, &|| self.profile())?;
                    }
                }
                code = target_exit(&mut exit_rx) => {
                    // By pid the pidfd says the target is gone, not how:
                    // the hold's word of its exit comes at about the same
                    // time (a last look, briefly).
                    let code = match (code, &mut tree_events) {
                        (None, Some(rx)) => {
                            let deadline = tokio::time::Instant::now() + ROOT_GONE_WAIT;
                            while self.root_exit_code().is_none() {
                                match tokio::time::timeout_at(deadline, rx.recv()).await {
                                    Ok(Some(req)) => self.handle(req),
                                    _ => break,
                                }
                            }
                            self.root_exit_code()
                        }
                        (code, _) => code,
                    };
                    // Launch mode: processes the command started that
                    // still run (a daemon that forked away) are traced
                    // until they are gone too: the launch thread ends then.
                    let running = self.running_besides_root();
                    match (code, &tree_events) {
                        (Some(code), Some(_)) if running > 0 => {
                            exit_rx = None;
                            self.root_code = Some(code);
                            say!(
                                "mtrace: the command exited{}; tracing the {running} {} it started that still {} until {} gone, Ctrl-C to stop",
                                if code == 0 { String::new() } else { format!(" with status {code}") },
                                if running == 1 { "process" } else { "processes" },
                                if running == 1 { "runs" } else { "run" },
                                if running == 1 { "it is" } else { "they are" },
                            );
                        }
                        _ => break (End::TargetExited(code), None),
                    }
                }
                _ = &mut sleep => break (End::Duration, exit_rx),
                _ = sigint.recv() => break (End::Interrupted(libc::SIGINT), exit_rx),
                _ = sigterm.recv() => break (End::Interrupted(libc::SIGTERM), exit_rx),
                _ = drain_due(&mut drain_tick) => self.drain_all(),
                _ = sigusr1.recv() => {
                    self.drain_all();
                    self.snapshot(sinks)?;
                }
                _ = interval.due() => {
                    self.drain_all();
                    self.snapshot(sinks)?;
                }
                _ = refresh.tick() => {
                    self.keep_paused();
                    for proc in self.procs.values() {
                        proc.space.lock().unwrap().refresh(proc.pid);
                    }
                }
                _ = cgroup_due(&mut cgroup_scan) => {
                    if !self.scan_cgroup() && !schedule.until_stopped {
                        break (End::CgroupEmpty, exit_rx);
                    }
                }
                req = next_event(&mut tree_events) => match req {
                    Some(req) => self.handle(req),
                    // The launch thread is gone: no more events, and in
                    // launch mode no process of the tree is left.
                    None => {
                        tree_events = None;
                        if let Some(code) = self.root_code {
                            break (End::TargetExited(Some(code)), None);
                        }
                    }
                },
            }
        };
        self.settle();
        self.drain_all();
        Ok(end)
    }

    /// One word from the thread that follows the tree, answered.
    fn handle(&mut self, req: TreeRequest) {
        let t = Instant::now();
        let what = req.event.describe();
        let done = self.on_tree_event(req.event);
        log::debug!("{what}: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
        if let Some(reply) = req.reply {
            let _ = reply.send(done.map_err(|e| format!("{e:#}")));
            // The process answered runs on meanwhile.
            self.settle();
        } else {
            if let Err(e) = done {
                log::warn!("{e:#}");
            }
            self.read_exec_replaced();
        }
    }
}
