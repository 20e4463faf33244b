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
    allocators,
    collect::{
        self,
        live_tracker::{self, LiveTracker},
        raw::RawProfile,
    },
    probes::{self, MapSizes, Mode, Probes, Sampling},
    profile::{merge, Meta, Profile, SamplingInfo},
    sinks::Sink,
    symbolize,
    target::{self, AddressSpace, Mapping},
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
    /// What the probes were attached with (again after an `exec`).
    pub mode: Mode,
    pub sizes: MapSizes,
    /// The profiles of the programs the target ran before its last
    /// `exec`, each symbolized with its own mappings.
    pub before_exec: Vec<Profile>,
}

/// Launch mode: the target called `exec`; the launch thread holds it
/// stopped where the new program's allocator is known and waits for the
/// reply (whether it was probed).
pub struct ExecRequest {
    pub maps: Vec<Mapping>,
    pub reply: std::sync::mpsc::Sender<Result<bool, String>>,
}

impl Session {
    /// The whole trace: the programs before each `exec`, then the current
    /// one.
    pub fn profile(&self) -> Result<Profile> {
        let current = self.current_profile()?;
        if self.before_exec.is_empty() {
            return Ok(current);
        }
        let mut parts = self.before_exec.clone();
        parts.push(current);
        Ok(merge::merge(parts))
    }

    /// The program the target runs now (since its last `exec`).
    fn current_profile(&self) -> Result<Profile> {
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

    /// The target exec'd a new program (launch mode): closes the books of
    /// the old one (its profile, symbolized with its mappings, is kept),
    /// then loads and attaches a new set of probes to the new program's
    /// allocator, with fresh maps, unwind rules and address space. Returns
    /// false when the new program has no allocator mapped yet.
    fn on_exec(&mut self, maps: &[Mapping], events: &mut Vec<RingBuf<MapData>>) -> Result<bool> {
        let pid = self.pid;
        let Some(alloc) = allocators::find_in_process(pid, maps)? else {
            return Ok(false);
        };
        // The old program's counts end here, for every function at once.
        self.probes.set_enabled(false)?;
        self.unwind.walks().finish_all();
        drain(events, &mut self.tracker, &self.unwind);
        if let Some(t) = &mut self.tracker {
            t.flush(None);
            t.finish();
        }
        let old = self.current_profile()?;
        self.before_exec.push(old);
        {
            let mut space = self.space.lock().unwrap();
            *space = AddressSpace::new();
            space.refresh(pid);
        }
        let space = self.space.clone();
        let live = self.mode.live;
        let (probes, unwind) = probes::attach(pid, &alloc, maps, self.mode, self.sizes, |ebpf| {
            UnwindService::start(ebpf, pid, space, live)
        })?;
        let old = (
            std::mem::replace(&mut self.probes, probes),
            std::mem::replace(&mut self.unwind, unwind),
        );
        // Detaching takes the kernel about 0.1 s a probe: not while the
        // target waits.
        std::thread::spawn(move || drop(old));
        if let Some(t) = &mut self.tracker {
            *t = LiveTracker::new(t.temporary_ns, t.capacity());
        }
        *events = self.take_event_rings()?;
        self.meta.executable = target::executable(pid);
        self.meta.allocator_object = alloc.path.clone();
        self.meta.allocator_family = alloc.family.to_string();
        self.meta.allocator_version = alloc.version.clone().unwrap_or_default();
        self.meta.probes = self.probes.attached.clone();
        eprintln!(
            "mtrace: pid {pid} exec'd {}: {} probes in {} ({})",
            self.meta.executable,
            self.probes.attached.len(),
            alloc.path,
            alloc.family
        );
        Ok(true)
    }

    /// Live mode: the event rings, one per CPU.
    fn take_event_rings(&mut self) -> Result<Vec<RingBuf<MapData>>> {
        let mut events = Vec::new();
        if self.tracker.is_some() {
            for name in maps::EVENTS {
                if let Some(map) = self.probes.ebpf.take_map(name) {
                    events.push(RingBuf::try_from(map)?);
                }
            }
        }
        Ok(events)
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
        mut execs: Option<tokio::sync::mpsc::UnboundedReceiver<ExecRequest>>,
        signals: Signals,
    ) -> Result<(End, Option<oneshot::Receiver<i32>>)> {
        let pid = self.pid;
        // Live mode: the event rings, one per CPU. The BPF programs do not
        // wake us per event; we drain them on a timer, often enough that
        // they cannot fill at any allocation rate a uprobe allows (about a
        // million events a second per CPU at most; 4 MiB hold some 70,000).
        let mut events = self.take_event_rings()?;
        let next_exec =
            async |rx: &mut Option<tokio::sync::mpsc::UnboundedReceiver<ExecRequest>>| match rx {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            };
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
                req = next_exec(&mut execs) => match req {
                    Some(req) => {
                        let done = self.on_exec(&req.maps, &mut events);
                        let _ = req.reply.send(done.map_err(|e| format!("{e:#}")));
                    }
                    // The launch thread is gone: no more execs.
                    None => execs = None,
                },
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
