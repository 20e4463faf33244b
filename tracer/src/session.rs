//! A trace under way: the tick loop that finishes the stack walks the BPF
//! side hands over (adding the unwind rules they need), drains live mode's
//! event rings, refreshes the target's mappings, hands snapshots to the
//! sinks, and ends on the target's exit, `--duration`, SIGINT or SIGTERM.
//! Also where the kernel maps, the tracer's walks, the live tracker and the
//! address space become a profile.

use std::{
    collections::BTreeMap,
    os::fd::{FromRawFd, OwnedFd},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use tokio::{io::unix::AsyncFd, signal::unix::SignalKind, sync::oneshot};
use tracer_common::maps;

use crate::{
    collect::{
        self,
        live_tracker::{self, LiveTracker},
        raw::RawProfile,
    },
    probes::{Probes, Sampling},
    profile::{Meta, Profile, SamplingInfo},
    sinks::Sink,
    symbolize,
    target::{self, AddressSpace},
    unwind::service::UnwindService,
    user_error,
};

/// Why tracing stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// With the exit code to pass through (launch mode).
    TargetExited(Option<i32>),
    Duration,
    Interrupted(i32),
}

/// Live mode: how often the event rings are drained.
const DRAIN_EVERY: Duration = Duration::from_millis(10);

/// How often the target's mappings are re-read (new libraries).
const REFRESH_EVERY: Duration = Duration::from_millis(500);

/// When the loop ends and when it writes snapshots.
pub struct Schedule {
    pub duration: Option<Duration>,
    pub interval: Option<Duration>,
}

/// Everything needed to turn the kernel maps into a profile at any time.
pub struct Session {
    pub pid: u32,
    pub probes: Probes,
    /// Live mode: folds the kernel's events.
    pub tracker: Option<LiveTracker>,
    /// Live mode: blocks at least this old are leak suspects.
    pub min_age_ns: u64,
    /// CLOCK_MONOTONIC when tracing began.
    pub started_ns: u64,
    pub space: Arc<Mutex<AddressSpace>>,
    pub meta: Meta,
    pub per_thread: bool,
    pub started: Instant,
    /// Finishes the walks the BPF side hands over.
    pub unwind: UnwindService,
}

impl Session {
    pub fn profile(&self) -> Result<Profile> {
        let mut thread_names = BTreeMap::new();
        if self.per_thread {
            thread_names.extend(target::thread_names(self.pid));
        }
        let mut raw = collect::collect(&self.probes, &self.unwind.walks().counted)
            .context("reading the kernel maps")?;
        if let Some(tracker) = &self.tracker {
            self.add_live(&mut raw, tracker);
        }
        let mut meta = self.meta.clone();
        meta.duration_secs = self.started.elapsed().as_secs_f64();
        meta.sampling = self.probes.sampling.map(|s| {
            let (kind, rate) = match s {
                Sampling::Bytes(n) => ("bytes", n),
                Sampling::Every(n) => ("every", n),
            };
            SamplingInfo {
                kind: kind.into(),
                rate,
                samples: raw.samples,
            }
        });
        let space = self.space.lock().unwrap();
        Ok(symbolize::symbolize(
            &raw,
            &space,
            &self.probes.funcs,
            &thread_names,
            meta,
        ))
    }

    /// Joins the tracker's per-stack statistics and its table of
    /// outstanding blocks to the raw profile.
    fn add_live(&self, raw: &mut RawProfile, tracker: &LiveTracker) {
        let now = live_tracker::monotonic_ns();
        let outstanding = tracker.outstanding(now, self.min_age_ns);
        for st in &mut raw.stacks {
            // Every stack gets live data in live mode: zeros for one whose
            // calls all failed.
            st.live = Some(
                tracker
                    .stats(&st.key, outstanding.get(&st.key), now)
                    .unwrap_or_default(),
            );
        }
        if let Some(t) = &mut raw.live {
            t.peak_bytes = tracker.peak_bytes;
            t.peak_secs = tracker.peak_ts.saturating_sub(self.started_ns) as f64 / 1e9;
            t.min_age_secs = self.min_age_ns as f64 / 1e9;
            t.temporary_under_ns = tracker.temporary_ns;
            t.live_map_size = tracker.capacity() as u64;
            for o in outstanding.values() {
                t.outstanding += o.blocks;
                t.outstanding_bytes += o.bytes;
                t.old_outstanding += o.old_blocks;
                t.old_outstanding_bytes += o.old_bytes;
            }
            t.untracked = tracker.untracked;
            t.frees_unknown = tracker.frees_unknown;
            t.stale = tracker.stale;
            for (_, k) in tracker.stacks() {
                t.tracked_allocations += k.allocations;
                t.temporaries += k.temporaries;
            }
        }
    }

    /// A snapshot for every sink, with fresh mappings.
    fn snapshot(&mut self, sinks: &mut [Box<dyn Sink>]) -> Result<()> {
        self.space.lock().unwrap().refresh(self.pid);
        let profile = self.profile()?;
        for sink in sinks.iter_mut() {
            sink.snapshot(&profile)?;
        }
        Ok(())
    }

    /// Runs until the trace ends; returns why, and in launch mode the
    /// receiver of the command's exit code when it still runs. The target's
    /// end is learnt from `exit_rx` in launch mode, from `pidfd` (opened
    /// before the probes went in: [`pidfd_open`]) by pid.
    pub async fn run(
        &mut self,
        schedule: &Schedule,
        sinks: &mut [Box<dyn Sink>],
        exit_rx: Option<oneshot::Receiver<i32>>,
        pidfd: Option<OwnedFd>,
        signals: Signals,
    ) -> Result<(End, Option<oneshot::Receiver<i32>>)> {
        let pid = self.pid;
        // Live mode: the event rings, one per CPU. The BPF programs do not
        // wake us per event; we drain them on a timer, often enough that
        // they cannot fill at any allocation rate a uprobe allows (about a
        // million events a second per CPU at most; 4 MiB hold some 70,000).
        let mut events = Vec::new();
        if self.tracker.is_some() {
            for name in maps::EVENTS {
                if let Some(map) = self.probes.ebpf.take_map(name) {
                    events.push(RingBuf::try_from(map)?);
                }
            }
        }
        let mut drain_tick = tokio::time::interval(DRAIN_EVERY);
        drain_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let drain_due = async |events: &Vec<RingBuf<MapData>>, tick: &mut tokio::time::Interval| {
            if events.is_empty() {
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
        let mut interval = schedule
            .interval
            .map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every));
        let snapshot_due = async |interval: &mut Option<tokio::time::Interval>| match interval {
            Some(i) => {
                i.tick().await;
            }
            None => std::future::pending().await,
        };

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

        let end = loop {
            tokio::select! {
                code = target_exit(&mut exit_rx) => break (End::TargetExited(code), None),
                _ = &mut sleep => break (End::Duration, exit_rx),
                _ = sigint.recv() => break (End::Interrupted(libc::SIGINT), exit_rx),
                _ = sigterm.recv() => break (End::Interrupted(libc::SIGTERM), exit_rx),
                _ = drain_due(&events, &mut drain_tick) => {
                    drain(&mut events, &mut self.tracker, &self.unwind);
                }
                _ = sigusr1.recv() => {
                    drain(&mut events, &mut self.tracker, &self.unwind);
                    self.snapshot(sinks)?;
                }
                _ = snapshot_due(&mut interval) => {
                    drain(&mut events, &mut self.tracker, &self.unwind);
                    self.snapshot(sinks)?;
                }
                _ = refresh.tick() => { self.space.lock().unwrap().refresh(pid); }
            }
        };
        drain(&mut events, &mut self.tracker, &self.unwind);
        Ok(end)
    }
}

/// Feeds every event waiting in the rings to the tracker, which applies
/// those stamped before the drain began. The rest wait for the next drain;
/// after the last one, they are events of after the trace's end. The walks
/// the tracer finished come first: an allocation event whose stack the
/// tracer unwound names it by an id that only they resolve.
fn drain(
    events: &mut [RingBuf<MapData>],
    tracker: &mut Option<LiveTracker>,
    unwind: &UnwindService,
) {
    let Some(tracker) = tracker.as_mut() else {
        return;
    };
    let started = live_tracker::monotonic_ns();
    for (id, key) in unwind.walks().take_remaps() {
        tracker.remap_stack(id, key);
    }
    for ring in events.iter_mut() {
        while let Some(item) = ring.next() {
            tracker.on_bytes(&item);
        }
    }
    tracker.flush(Some(started));
}

/// The signals that end a trace or ask for a snapshot. Installed before
/// anything else: a Ctrl-C from then on ends the trace with a report (once
/// the probes are in), never kills mtrace.
pub struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
}

impl Signals {
    /// Must be called inside the runtime.
    pub fn new() -> Result<Signals> {
        use tokio::signal::unix::signal;
        Ok(Signals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            usr1: signal(SignalKind::user_defined1())?,
        })
    }
}

/// A descriptor that becomes readable when `pid` exits. Opened before the
/// probes are attached: a target that exits during the attach is still
/// seen to exit (and a recycled pid is never watched).
pub fn pidfd_open(pid: u32) -> Result<OwnedFd> {
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(user_error!(
            "cannot watch pid {pid}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
