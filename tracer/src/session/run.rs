//! A trace by pid, command or cgroup under [`drive`]'s loop: drains live
//! mode's event rings, refreshes the mappings, follows the process tree
//! and the cgroup, until the target is gone.

use std::{
    os::fd::OwnedFd,
    time::{Duration, Instant},
};

use anyhow::Result;
use tokio::{io::unix::AsyncFd, sync::oneshot};

use super::{
    drive::{drive, Controls, Engine},
    end::{End, Signals},
    tree::TreeRequest,
    Session,
};
use crate::{
    profile::Profile,
    sinks::Sink,
    watch::{Tick, Watcher},
};

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

/// A trace by pid, command or cgroup as the loop's engine: its processes,
/// and what tells of them.
struct Traced<'a> {
    session: &'a mut Session,
    sinks: &'a mut [Box<dyn Sink>],
    /// Launch mode: the command's exit code.
    exit_rx: Option<oneshot::Receiver<i32>>,
    /// By pid: readable when the target exits.
    exited_fd: Option<AsyncFd<OwnedFd>>,
    tree_events: Option<tokio::sync::mpsc::UnboundedReceiver<TreeRequest>>,
    /// Live mode's event rings, one per CPU, drained on this timer: the
    /// BPF programs do not wake us per event. Often enough that they
    /// cannot fill at any allocation rate a uprobe allows (about a
    /// million events a second per CPU at most; 4 MiB hold some 70,000).
    drain: Option<tokio::time::Interval>,
    refresh: tokio::time::Interval,
    /// By cgroup: how soon a process that joins it is traced, and the
    /// cgroup's end seen.
    cgroup_scan: Option<tokio::time::Interval>,
    until_stopped: bool,
}

/// One of [`Traced`]'s events.
enum Work {
    /// A gone process waited long enough to be read.
    Settle,
    /// The target exited (its code, in launch mode).
    TargetExit(Option<i32>),
    Drain,
    Refresh,
    CgroupScan,
    /// A word from the thread that follows the tree; `None` once it is
    /// gone.
    Tree(Option<TreeRequest>),
}

/// Resolves on `timer`'s next tick, or never without one.
async fn tick_of(timer: &mut Option<tokio::time::Interval>) {
    match timer {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

impl Engine for Traced<'_> {
    type Work = Work;

    async fn work(&mut self) -> Work {
        let settle_at = self.session.gone_since.map(|t| t + SETTLE_AFTER);
        let target_exit = async {
            match (&mut self.exit_rx, &self.exited_fd) {
                (Some(rx), _) => rx.await.ok(),
                (None, Some(fd)) => {
                    let _ = fd.readable().await;
                    None
                }
                (None, None) => std::future::pending().await,
            }
        };
        let tree = async {
            match &mut self.tree_events {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = async {
                match settle_at {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            } => Work::Settle,
            code = target_exit => Work::TargetExit(code),
            _ = tick_of(&mut self.drain) => Work::Drain,
            _ = self.refresh.tick() => Work::Refresh,
            _ = tick_of(&mut self.cgroup_scan) => Work::CgroupScan,
            req = tree => Work::Tree(req),
        }
    }

    async fn handle(&mut self, work: Work) -> Result<Option<End>> {
        let session = &mut *self.session;
        match work {
            Work::Settle => session.settle(),
            Work::TargetExit(code) => {
                // By pid the pidfd says the target is gone, not how: the
                // hold's word of its exit comes at about the same time (a
                // last look, briefly).
                let code = match (code, &mut self.tree_events) {
                    (None, Some(rx)) => {
                        let deadline = tokio::time::Instant::now() + ROOT_GONE_WAIT;
                        while session.root_exit_code().is_none() {
                            match tokio::time::timeout_at(deadline, rx.recv()).await {
                                Ok(Some(req)) => session.handle(req),
                                _ => break,
                            }
                        }
                        session.root_exit_code()
                    }
                    (code, _) => code,
                };
                // Launch mode: processes the command started that still
                // run (a daemon that forked away) are traced until they
                // are gone too: the launch thread ends then.
                let running = session.running_besides_root();
                match (code, &self.tree_events) {
                    (Some(code), Some(_)) if running > 0 => {
                        self.exit_rx = None;
                        session.root_code = Some(code);
                        super::say_running_on(code, running);
                    }
                    _ => {
                        self.exit_rx = None;
                        return Ok(Some(End::TargetExited(code)));
                    }
                }
            }
            Work::Drain => session.drain_all(),
            Work::Refresh => {
                session.keep_paused();
                for proc in session.procs.values() {
                    proc.space.lock().unwrap().refresh(proc.pid);
                }
            }
            Work::CgroupScan => {
                if !session.scan_cgroup() && !self.until_stopped {
                    return Ok(Some(End::CgroupEmpty));
                }
            }
            Work::Tree(Some(req)) => session.handle(req),
            // The launch thread is gone: no more events, and in launch
            // mode no process of the tree is left.
            Work::Tree(None) => {
                self.tree_events = None;
                if let Some(code) = session.root_code {
                    self.exit_rx = None;
                    return Ok(Some(End::TargetExited(Some(code))));
                }
            }
        }
        Ok(None)
    }

    /// Live mode drains first: a reading asked for now has every event
    /// sent before it (the drain's timer may not have come yet).
    fn tick(&mut self) -> Tick {
        self.session.drain_all();
        self.session.tick()
    }

    fn record(&mut self, tick: &Tick) {
        self.session
            .timeline
            .record(tick.elapsed, tick.running, tick.live_bytes, false);
    }

    fn profile(&self) -> Result<Profile> {
        self.session.profile()
    }

    fn snapshot(&mut self) -> Result<()> {
        self.session.drain_all();
        self.session.snapshot(self.sinks)
    }

    fn duty_due(&self) -> Option<Instant> {
        self.session.duty.as_ref().map(|d| d.due)
    }

    fn switch_duty(&mut self) {
        self.session.switch_duty()
    }
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
            tree_events,
            signals,
            stop,
            cgroup,
            wake,
        } = inputs;
        let live = self.options.settings.mode.live;
        let timer = |every: Duration| {
            let mut t = tokio::time::interval(every);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        };
        let scanning = cgroup.is_some();
        self.cgroup = cgroup;
        // Launch mode learns of the exit from the launch thread; by pid, a
        // pidfd becomes readable.
        let exited_fd = match pidfd {
            // SAFETY: the descriptor is ours and lives as long as the AsyncFd.
            Some(fd) => Some(unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?),
            None => None,
        };
        let mut traced = Traced {
            session: self,
            sinks,
            exit_rx,
            exited_fd,
            tree_events,
            drain: live.then(|| timer(DRAIN_EVERY)),
            refresh: tokio::time::interval(REFRESH_EVERY),
            cgroup_scan: scanning.then(|| tokio::time::interval(CGROUP_SCAN_EVERY)),
            until_stopped: schedule.until_stopped,
        };
        let controls = Controls {
            signals,
            stop,
            wake,
        };
        let end = drive(&mut traced, schedule, controls, watchers).await?;
        let exit_rx = traced.exit_rx.take();
        self.settle();
        self.drain_all();
        Ok((end, exit_rx))
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
