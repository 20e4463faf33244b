//! A live trace: attach (by pid or by launching a command), wait for the
//! end while writing snapshots, collect, detach, symbolize, report.

use std::{
    collections::BTreeMap,
    os::fd::{FromRawFd, OwnedFd},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use tokio::{io::unix::AsyncFd, signal::unix::SignalKind, sync::oneshot};

use crate::{
    allocator,
    cli::TraceArgs,
    collect, launch,
    live::{self, LiveTracker},
    outputs,
    probes::{self, MapSizes, Mode, Probes, Sampling},
    profile::{Meta, Probe, Profile, SamplingInfo},
    profile_file,
    raw_profile::RawProfile,
    snapshot,
    symbolize::{self, AddressSpace},
    target, user_error,
};

/// Why tracing stopped.
#[derive(Debug, PartialEq, Eq)]
enum End {
    TargetExited(Option<i32>),
    Duration,
    Interrupted(i32),
}

/// Live mode: how often the event ring buffer is drained.
const DRAIN_EVERY: Duration = Duration::from_millis(10);

/// How often the target's mappings are re-read (new libraries).
const REFRESH_EVERY: Duration = Duration::from_millis(500);

/// Everything needed to turn the kernel maps into a profile at any time.
struct Session {
    pid: u32,
    probes: Probes,
    /// Live mode: folds the kernel's events.
    tracker: Option<LiveTracker>,
    /// Live mode: blocks at least this old are leak suspects.
    min_age_ns: u64,
    /// CLOCK_MONOTONIC when tracing began.
    started_ns: u64,
    space: Arc<Mutex<AddressSpace>>,
    meta: Meta,
    per_thread: bool,
    started: Instant,
    snapshots: u32,
    last_snapshot: Option<Profile>,
}

impl Session {
    fn profile(&self) -> Result<Profile> {
        let mut thread_names = BTreeMap::new();
        if self.per_thread {
            thread_names.extend(target::thread_names(self.pid));
        }
        let mut raw = collect::collect(&self.probes).context("reading the kernel maps")?;
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
            &self.probes.func_names,
            &thread_names,
            meta,
        ))
    }

    /// Joins the tracker's per-stack statistics and its table of
    /// outstanding blocks to the raw profile.
    fn add_live(&self, raw: &mut RawProfile, tracker: &LiveTracker) {
        let now = live::monotonic_ns();
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

    fn write_snapshot(&mut self, dir: &std::path::Path) -> Result<()> {
        self.space.lock().unwrap().refresh(self.pid);
        let mut profile = self.profile()?;
        self.snapshots += 1;
        let snap = snapshot::delta(
            self.snapshots,
            profile.meta.duration_secs,
            self.last_snapshot.as_ref(),
            &profile,
        );
        profile.snapshot = Some(snap);
        let path = snapshot::path(dir, self.pid, self.snapshots);
        profile_file::write(&path, &profile)?;
        eprintln!("mtrace: wrote snapshot {}", path.display());
        profile.snapshot = None;
        self.last_snapshot = Some(profile);
        Ok(())
    }
}

pub fn run(args: TraceArgs) -> Result<i32> {
    if args.pid.is_none() && args.command.is_empty() {
        return Err(user_error!(
            "nothing to trace: give --pid PID or a command after `--` (see mtrace --help)"
        ));
    }
    target::check_privileges()?;
    // Signal handlers before anything else: a Ctrl-C from here on ends the
    // trace with a report (once the probes are in), never kills mtrace.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let signals = {
        let _in_runtime = rt.enter();
        Signals::new()?
    };
    let sizes = MapSizes {
        counts: args.count_map_size,
        stacks: args.stack_map_size,
        events: args.event_buffer_size,
    };
    let per_thread = args.out.per_thread;
    let mode = Mode {
        per_thread,
        live: args.live,
        sampling: match (args.sample_bytes, args.sample_every) {
            (Some(n), _) => Some(Sampling::Bytes(n)),
            (None, Some(n)) => Some(Sampling::Every(n)),
            _ => None,
        },
        floor: args.bench_floor,
    };
    // Before attaching: the target runs on once probes are in.
    let stats_fd = if args.bpf_stats {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("enabling BPF run-time stats")?,
        )
    } else {
        None
    };
    let space = Arc::new(Mutex::new(AddressSpace::new()));
    let attach_started = Instant::now();

    // The executable is read while the target surely lives: a launched
    // command may be gone by the time tracing is under way.
    let (pid, probes, alloc_path, executable, exit_rx) = match args.pid {
        Some(pid) => {
            target::check_pid(pid)?;
            let maps = target::read_maps(pid)
                .map_err(|e| user_error!("cannot read /proc/{pid}/maps: {e}"))?;
            let alloc = allocator::find_in_process(pid, &maps)?;
            space.lock().unwrap().refresh(pid);
            let executable = target::executable(pid);
            let probes = probes::attach(pid, &alloc, &maps, mode, sizes)?;
            (pid, probes, alloc.path, executable, None)
        }
        None => {
            let launched =
                launch::launch(&args.command, space.clone(), move |pid, alloc, maps| {
                    let probes = probes::attach(pid, alloc, maps, mode, sizes)?;
                    Ok((probes, alloc.path.clone(), target::executable(pid)))
                })?;
            let (probes, path, executable) = launched.attached;
            (launched.pid, probes, path, executable, Some(launched.exit))
        }
    };
    log::debug!(
        "attached in {:.1} ms",
        attach_started.elapsed().as_secs_f64() * 1e3
    );
    log_probes(&probes.attached);
    let command = if args.command.is_empty() {
        target::cmdline(pid)
    } else {
        args.command.join(" ")
    };
    eprintln!(
        "mtrace: tracing pid {pid} ({}): {} probes in {}{}",
        target::comm(pid),
        probes.attached.len(),
        alloc_path,
        if args.duration.is_some() {
            String::new()
        } else {
            ", Ctrl-C to stop".into()
        }
    );

    let meta = Meta {
        mtrace_version: env!("CARGO_PKG_VERSION").to_string(),
        pid,
        command,
        executable,
        start_time: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        duration_secs: 0.0,
        kernel_release: kernel_release(),
        mode: if args.live { "live" } else { "count" }.into(),
        sampling: None,
        allocator_object: alloc_path,
        probes: probes.attached.clone(),
    };
    let mut session = Session {
        pid,
        tracker: args.live.then(|| {
            LiveTracker::new(
                args.temporary_under.as_nanos() as u64,
                args.live_map_size as usize,
            )
        }),
        min_age_ns: (args.min_age * 1e9) as u64,
        started_ns: live::monotonic_ns(),
        probes,
        space,
        meta,
        per_thread,
        started: Instant::now(),
        snapshots: 0,
        last_snapshot: None,
    };

    let (end, exit_rx) = rt.block_on(wait_for_end(&mut session, &args, exit_rx, signals))?;

    if stats_fd.is_some() {
        log_program_times(&session.probes.ebpf);
    }
    drop(stats_fd);
    if let Some(t) = &mut session.tracker {
        t.finish();
    }
    let profile = session.profile()?;
    // Report first: detaching takes the kernel about 0.1 s per probe (an
    // RCU grace period each), and the counts are already read.
    let emitted = outputs::emit(&profile, &args.out);
    // Dropping the programs closes their links: the kernel takes the
    // breakpoints out of the target.
    drop(session);
    emitted?;

    Ok(match end {
        End::TargetExited(code) => code.unwrap_or(0),
        End::Duration => match exit_rx {
            // Launch mode: the command runs on; pass its status through.
            Some(rx) => rt.block_on(rx).unwrap_or(0),
            None => 0,
        },
        // Ctrl-C is how a trace by pid normally ends.
        End::Interrupted(_) if args.pid.is_some() => 0,
        End::Interrupted(sig) => 128 + sig,
    })
}

fn log_probes(probes: &[Probe]) {
    for p in probes {
        log::debug!(
            "probe: {}+{} ({}{})",
            p.function,
            p.offset,
            p.instruction,
            if p.emulated { "" } else { ", single-stepped" }
        );
    }
}

/// Time spent inside each BPF program (`--bpf-stats`).
fn log_program_times(ebpf: &aya::Ebpf) {
    for (name, prog) in ebpf.programs() {
        if let Ok(info) = prog.info() {
            let runs = info.run_count();
            if runs > 0 {
                log::debug!(
                    "bpf program {name}: {runs} runs, {:.1} ns per run",
                    info.run_time().as_nanos() as f64 / runs as f64
                );
            }
        }
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The signals that end a trace or ask for a snapshot.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Signals> {
        use tokio::signal::unix::signal;
        Ok(Signals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            usr1: signal(SignalKind::user_defined1())?,
        })
    }
}

async fn wait_for_end(
    session: &mut Session,
    args: &TraceArgs,
    exit_rx: Option<oneshot::Receiver<i32>>,
    signals: Signals,
) -> Result<(End, Option<oneshot::Receiver<i32>>)> {
    let pid = session.pid;
    // Live mode: the event rings, one per CPU. The BPF programs do not
    // wake us per event; we drain them on a timer, often enough that they
    // cannot fill at any allocation rate a uprobe allows (about a million
    // events a second per CPU at most; 4 MiB hold some 70,000).
    let mut events = Vec::new();
    if session.tracker.is_some() {
        for i in 0..tracer_common::EVENT_RINGS {
            if let Some(map) = session.probes.ebpf.take_map(&format!("EVENTS{i}")) {
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
        match args.duration {
            Some(d) => tokio::time::sleep(Duration::from_secs_f64(d)).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(sleep);
    let mut refresh = tokio::time::interval(REFRESH_EVERY);
    let mut interval = args.interval.map(|secs| {
        let every = Duration::from_secs_f64(secs);
        tokio::time::interval_at(tokio::time::Instant::now() + every, every)
    });
    let snapshot_due = async |interval: &mut Option<tokio::time::Interval>| match interval {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    };

    // Launch mode learns of the exit from the launch thread; by pid, a
    // pidfd becomes readable.
    let exited_fd = match exit_rx {
        Some(_) => None,
        None => {
            let fd = pidfd_open(pid)?;
            // SAFETY: the descriptor is ours and lives as long as the AsyncFd.
            Some(unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?)
        }
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
            _ = drain_due(&events, &mut drain_tick) => drain(&mut events, &mut session.tracker),
            _ = sigusr1.recv() => {
                drain(&mut events, &mut session.tracker);
                session.write_snapshot(&args.snapshot_dir)?;
            }
            _ = snapshot_due(&mut interval) => {
                drain(&mut events, &mut session.tracker);
                session.write_snapshot(&args.snapshot_dir)?;
            }
            _ = refresh.tick() => { session.space.lock().unwrap().refresh(pid); }
        }
    };
    drain(&mut events, &mut session.tracker);
    Ok(end)
}

/// Feeds every event waiting in the rings to the tracker, which applies
/// those stamped before the drain began. The rest wait for the next drain;
/// after the last one, they are events of after the trace's end.
fn drain(events: &mut [RingBuf<MapData>], tracker: &mut Option<LiveTracker>) {
    let Some(tracker) = tracker.as_mut() else {
        return;
    };
    let started = live::monotonic_ns();
    for ring in events.iter_mut() {
        while let Some(item) = ring.next() {
            tracker.on_bytes(&item);
        }
    }
    tracker.flush(Some(started));
}

/// A descriptor that becomes readable when `pid` exits.
fn pidfd_open(pid: u32) -> Result<OwnedFd> {
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(user_error!(
            "cannot watch pid {pid}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
