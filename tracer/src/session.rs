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
use tracer_common::{maps, LostFree};

/// Live mode: the kernel's map of lost frees (see [`LostFree`]).
type LostFrees = aya::maps::Queue<MapData, LostFree>;

use crate::{
    allocators,
    collect::{
        self,
        live_tracker::{self, LiveTracker},
        raw::RawProfile,
        timeline::Recorder,
        Running,
    },
    probes::{self, MapSizes, Mode, Probes, Sampling},
    profile::{merge, Meta, ProcessMeta, ProcessRef, Profile, SamplingInfo},
    sinks::Sink,
    status::{StatusLine, Tick},
    symbolize,
    target::{self, launch::TreeEvent, AddressSpace, Mapping},
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
    /// `q` in the live view.
    Stopped,
}

impl End {
    /// Why the trace ended, for the line that says so.
    pub fn describe(&self, duration: Option<Duration>) -> String {
        match self {
            End::TargetExited(Some(0)) | End::TargetExited(None) => "the target exited".into(),
            End::TargetExited(Some(code)) if *code > 128 => format!(
                "the target was killed by signal {} ({})",
                code - 128,
                signal_name(code - 128)
            ),
            End::TargetExited(Some(code)) => format!("the target exited with status {code}"),
            End::Duration => match duration {
                Some(d) => format!("--duration {} elapsed", humantime::format_duration(d)),
                None => "the duration elapsed".into(),
            },
            End::Interrupted(sig) if *sig == libc::SIGINT => "interrupted (Ctrl-C)".into(),
            End::Interrupted(sig) => format!("{} received", signal_name(*sig)),
            End::Stopped => "stopped from the live view".into(),
        }
    }
}

fn signal_name(sig: i32) -> String {
    // SAFETY: strsignal returns a static or thread-local string.
    let name = unsafe { libc::strsignal(sig) };
    if name.is_null() {
        return format!("signal {sig}");
    }
    let abbrev = match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGBUS => "SIGBUS",
        libc::SIGPIPE => "SIGPIPE",
        _ => {
            return unsafe { std::ffi::CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        }
    };
    abbrev.to_string()
}

/// Shown every second while tracing: the status line, the live view.
pub trait Watcher {
    fn tick(&mut self, session: &Session, tick: &Tick) -> Result<()>;
}

impl Watcher for StatusLine {
    fn tick(&mut self, _session: &Session, tick: &Tick) -> Result<()> {
        self.show(tick);
        Ok(())
    }
}

/// What a running trace listens to.
pub struct Inputs {
    /// Launch mode: the command's exit code.
    pub exit_rx: Option<oneshot::Receiver<i32>>,
    /// By pid: readable when the target exits (opened before the probes
    /// went in: [`pidfd_open`]).
    pub pidfd: Option<OwnedFd>,
    /// What happens in the process tree.
    pub tree_events: Option<tokio::sync::mpsc::UnboundedReceiver<TreeRequest>>,
    pub signals: Signals,
    /// The live view's `q`.
    pub stop: Option<oneshot::Receiver<()>>,
}

/// How often the timeline, the status line and the live view are fed.
const TICK_EVERY: Duration = Duration::from_secs(1);

/// Live mode: how often the event rings are drained.
const DRAIN_EVERY: Duration = Duration::from_millis(10);

/// How often the target's mappings are re-read (new libraries).
const REFRESH_EVERY: Duration = Duration::from_millis(500);

/// When the loop ends and when it writes snapshots.
pub struct Schedule {
    pub duration: Option<Duration>,
    pub interval: Option<Duration>,
}

/// What every process's probes and tracker are set up with.
#[derive(Clone, Copy, Debug)]
pub struct ProcSettings {
    pub mode: Mode,
    pub sizes: MapSizes,
    /// Live mode: a block freed sooner than this is a temporary.
    pub temporary_ns: u64,
    /// Live mode: outstanding blocks tracked at once, per process.
    pub live_blocks: usize,
}

/// One traced process: its probes and maps (a BPF object of its own, so
/// that addresses, blocks and unwind rules of different processes never
/// meet), the walks its unwinder finishes, its live tracker, and the
/// record of its address space.
pub struct Proc {
    pub pid: u32,
    pub probes: Probes,
    /// Live mode: folds the kernel's events.
    pub tracker: Option<LiveTracker>,
    /// Live mode: its event rings, one per CPU.
    events: Vec<RingBuf<MapData>>,
    /// Live mode: the frees its rings had no room for.
    lost_frees: Option<LostFrees>,
    pub space: Arc<Mutex<AddressSpace>>,
    /// Finishes the walks the BPF side hands over.
    pub unwind: UnwindService,
    pub meta: Meta,
    /// The profiles of the programs it ran before its last `exec`, each
    /// symbolized with its own mappings.
    pub before_exec: Vec<Profile>,
    /// Its allocator's object, family and the other objects defining
    /// allocator functions (for the warning when nothing was counted).
    pub shadowed: Vec<String>,
    /// Its command name when probed (read again after it is gone, it
    /// would be lost).
    pub name: String,
}

impl Proc {
    /// Probes `pid`'s allocator, found in `maps` (`None` when none is
    /// mapped yet). `meta` holds what all processes of the trace share.
    pub fn attach(
        pid: u32,
        maps: &[Mapping],
        settings: &ProcSettings,
        space: Arc<Mutex<AddressSpace>>,
        meta: &Meta,
    ) -> Result<Option<Proc>> {
        let Some(alloc) = allocators::find_in_process(pid, maps)? else {
            return Ok(None);
        };
        Proc::attach_to(pid, alloc, maps, settings, space, meta).map(Some)
    }

    /// As [`Proc::attach`], to the allocator found already.
    pub fn attach_to(
        pid: u32,
        alloc: allocators::AllocatorObject,
        maps: &[Mapping],
        settings: &ProcSettings,
        space: Arc<Mutex<AddressSpace>>,
        meta: &Meta,
    ) -> Result<Proc> {
        space.lock().unwrap().refresh(pid);
        let live = settings.mode.live;
        let max_frames = settings.mode.max_frames;
        let (probes, unwind) =
            probes::attach(pid, &alloc, maps, settings.mode, settings.sizes, |ebpf| {
                UnwindService::start(ebpf, pid, space.clone(), live, max_frames)
            })?;
        let mut meta = meta.clone();
        meta.pid = pid;
        meta.command = target::cmdline(pid);
        meta.executable = target::executable(pid);
        meta.allocator_object = alloc.path.clone();
        meta.allocator_family = alloc.family.to_string();
        meta.allocator_version = alloc.version.clone().unwrap_or_default();
        meta.allocator_beside = alloc.beside.clone().unwrap_or_default();
        meta.probes = probes.attached.clone();
        let mut proc = Proc {
            pid,
            probes,
            tracker: live.then(|| LiveTracker::new(settings.temporary_ns, settings.live_blocks)),
            events: Vec::new(),
            lost_frees: None,
            space,
            unwind,
            meta,
            before_exec: Vec::new(),
            shadowed: alloc.shadowed,
            name: target::comm(pid),
        };
        proc.events = proc.take_event_rings()?;
        if proc.tracker.is_some() {
            if let Some(map) = proc.probes.ebpf.take_map(maps::LOST_FREES) {
                proc.lost_frees = Some(LostFrees::try_from(map)?);
            }
        }
        Ok(proc)
    }

    /// Everything it ran: the programs before each `exec`, then the
    /// current one.
    fn profile(&self, clock: &Clock, per_thread: bool) -> Result<Profile> {
        let current = self.current_profile(clock, per_thread)?;
        if self.before_exec.is_empty() {
            return Ok(current);
        }
        let mut parts = self.before_exec.clone();
        parts.push(current);
        Ok(merge::merge(parts))
    }

    /// The program it runs now (since its last `exec`).
    fn current_profile(&self, clock: &Clock, per_thread: bool) -> Result<Profile> {
        let mut thread_names = BTreeMap::new();
        if per_thread {
            thread_names.extend(target::thread_names(self.pid));
        }
        let mut raw = collect::collect(&self.probes, &self.unwind.walks().counted)
            .context("reading the kernel maps")?;
        if let Some(tracker) = &self.tracker {
            add_live(&mut raw, tracker, clock);
        }
        let mut meta = self.meta.clone();
        meta.duration_secs = clock.started.elapsed().as_secs_f64();
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

    /// Feeds the events waiting in its rings to its tracker.
    fn drain(&mut self) {
        drain(
            &mut self.events,
            self.lost_frees.as_mut(),
            &mut self.tracker,
            &self.unwind,
        );
    }

    /// Its counting ends: every function at once, then the walks and
    /// events under way are taken in.
    fn finish(&mut self) -> Result<()> {
        self.probes.set_enabled(false)?;
        self.unwind.walks().finish_all();
        self.drain();
        if let Some(t) = &mut self.tracker {
            t.flush(None);
            t.finish();
        }
        Ok(())
    }

    /// It exec'd a new program: closes the books of the old one (its
    /// profile, symbolized with its mappings, is kept), then loads and
    /// attaches a new set of probes to the new program's allocator, with
    /// fresh maps, unwind rules and address space. Returns false when the
    /// new program has no allocator mapped yet.
    fn on_exec(
        &mut self,
        maps: &[Mapping],
        settings: &ProcSettings,
        clock: &Clock,
        per_thread: bool,
    ) -> Result<Option<Probes>> {
        let pid = self.pid;
        let Some(alloc) = allocators::find_in_process(pid, maps)? else {
            return Ok(None);
        };
        // The old program's counts end here, for every function at once.
        self.finish()?;
        let old = self.profile(clock, per_thread)?;
        // The same record, emptied: by pid the exit hold refreshes it too.
        *self.space.lock().unwrap() = AddressSpace::new();
        let space = self.space.clone();
        let mut new = Proc::attach_to(pid, alloc, maps, settings, space, &self.meta)?;
        new.before_exec = vec![old];
        let old = std::mem::replace(self, new);
        // The old program's probes, disabled, go with those of the
        // processes that are gone (detaching them now would hold up the
        // probes of the processes to come); its unwinder's thread stops
        // within a poll, away from the session's thread.
        let Proc { probes, unwind, .. } = old;
        std::thread::spawn(move || drop(unwind));
        Ok(Some(probes))
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
}

/// Joins the tracker's per-stack statistics and its table of outstanding
/// blocks to the raw profile.
fn add_live(raw: &mut RawProfile, tracker: &LiveTracker, clock: &Clock) {
    let now = live_tracker::monotonic_ns();
    let outstanding = tracker.outstanding(now, clock.min_age_ns);
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
        t.peak_secs = tracker.peak_ts.saturating_sub(clock.started_ns) as f64 / 1e9;
        t.min_age_secs = clock.min_age_ns as f64 / 1e9;
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

/// When tracing began, and the age from which a block is a leak suspect.
pub struct Clock {
    pub started: Instant,
    /// CLOCK_MONOTONIC when tracing began.
    pub started_ns: u64,
    /// Live mode: blocks at least this old are leak suspects.
    pub min_age_ns: u64,
}

/// The process tree as traced: every process seen, in order.
#[derive(Debug, Default)]
pub struct Tree {
    pub processes: Vec<ProcessMeta>,
    /// Processes neither traced nor listed (beyond
    /// [`Meta::MAX_PROCESS_RECORDS`]).
    pub unlisted: u64,
}

impl Tree {
    fn get(&mut self, pid: u32) -> Option<&mut ProcessMeta> {
        // The newest entry of a pid: pids are reused.
        self.processes.iter_mut().rev().find(|p| p.pid == pid)
    }

    /// `proc` is probed (again, after an exec): its entry says what runs.
    pub fn probed(&mut self, proc: &Proc) {
        if let Some(p) = self.get(proc.pid) {
            p.traced = true;
            p.not_traced = None;
            p.name = proc.name.clone();
            p.command = proc.meta.command.clone();
            p.executable = proc.meta.executable.clone();
            p.allocator_object = proc.meta.allocator_object.clone();
        }
    }

    fn not_traced(&mut self, pid: u32, why: String) {
        if let Some(p) = self.get(pid) {
            p.traced = false;
            p.not_traced = Some(why);
        }
    }
}

/// Everything needed to turn the kernel maps into a profile at any time.
pub struct Session {
    /// The process traced by pid, or the command launched.
    pub root: u32,
    /// Every process with probes in, by pid.
    pub procs: BTreeMap<u32, Proc>,
    /// What processes that are gone counted, joined.
    pub ended: Option<Profile>,
    pub tree: Tree,
    /// The root's metadata (its last program's after an `exec`).
    pub meta: Meta,
    pub clock: Clock,
    pub settings: ProcSettings,
    pub per_thread: bool,
    /// Rows split per process.
    pub per_process: bool,
    /// Most processes probed at once; a process created beyond it is
    /// counted as not traced.
    pub max_processes: usize,
    /// Processes that are gone, their probes not yet detached (oldest
    /// first).
    /// (With the pid they were for.)
    pub graveyard: std::collections::VecDeque<(u32, Probes)>,
    /// Kernel memory the graveyard's maps hold, bytes.
    pub graveyard_bytes: u64,
    /// Programs whose probes were detached while tracing (the graveyard
    /// over its budget).
    pub graveyard_detached: u64,
    /// The trace over time.
    pub timeline: Recorder,
}

/// Kernel memory the probes of gone programs may hold until tracing ends,
/// bytes: an eighth of the memory available when tracing starts, between
/// 256 MiB and 2 GiB.
///
/// Detaching a probe takes the kernel 2-3 RCU grace periods (Linux 6.18:
/// `perf_uprobe_destroy` holds `event_mutex` across
/// `synchronize_rcu_tasks_trace`), and every new probe needs that mutex: a
/// shell loop that ran `env sh -c true` 20 times took 51 s under mtrace
/// when the probes of its gone programs were detached while it ran (a
/// process's probes took 0.5-4 s to attach instead of 25 ms), 7.9 s when
/// they waited for the end. So they wait, unable to fire (their address
/// space is gone), as long as their maps fit in this.
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

/// A [`TreeEvent`] sent to the session, with where to answer.
pub struct TreeRequest {
    pub event: OwnedTreeEvent,
    pub reply: Option<std::sync::mpsc::Sender<Result<bool, String>>>,
}

/// [`TreeEvent`], owning its mappings.
pub enum OwnedTreeEvent {
    Fork {
        parent: u32,
        child: u32,
        vfork: bool,
    },
    Exec {
        pid: u32,
        maps: Vec<Mapping>,
    },
    Exiting {
        pid: u32,
    },
    Gone {
        pid: u32,
        code: i32,
    },
}

impl OwnedTreeEvent {
    fn describe(&self) -> String {
        match self {
            OwnedTreeEvent::Fork {
                parent,
                child,
                vfork,
            } => {
                format!(
                    "pid {parent} {} {child}",
                    if *vfork { "vforked" } else { "forked" }
                )
            }
            OwnedTreeEvent::Exec { pid, .. } => format!("pid {pid} exec'd"),
            OwnedTreeEvent::Exiting { pid } => format!("pid {pid} exiting"),
            OwnedTreeEvent::Gone { pid, code } => format!("pid {pid} gone ({code})"),
        }
    }
}

impl From<TreeEvent<'_>> for OwnedTreeEvent {
    fn from(e: TreeEvent<'_>) -> OwnedTreeEvent {
        match e {
            TreeEvent::Fork {
                parent,
                child,
                vfork,
            } => OwnedTreeEvent::Fork {
                parent,
                child,
                vfork,
            },
            TreeEvent::Exec { pid, maps } => OwnedTreeEvent::Exec {
                pid,
                maps: maps.to_vec(),
            },
            TreeEvent::Exiting { pid } => OwnedTreeEvent::Exiting { pid },
            TreeEvent::Gone { pid, code } => OwnedTreeEvent::Gone { pid, code },
        }
    }
}

impl Session {
    /// The whole trace: every process (each symbolized with its own
    /// mappings), joined by what the stacks say.
    pub fn profile(&self) -> Result<Profile> {
        let mut parts: Vec<Profile> = self.ended.iter().cloned().collect();
        for proc in self.procs.values() {
            parts.push(self.proc_profile(proc)?);
        }
        let mut profile = if parts.len() == 1 {
            parts.pop().unwrap_or_default()
        } else {
            merge::merge(parts)
        };
        profile.meta = Meta {
            duration_secs: self.clock.started.elapsed().as_secs_f64(),
            probes: std::mem::take(&mut profile.meta.probes),
            sampling: profile.meta.sampling.take(),
            processes: if self.tree.processes.len() > 1 {
                self.tree.processes.clone()
            } else {
                Vec::new()
            },
            processes_unlisted: self.tree.unlisted,
            ..self.meta.clone()
        };
        profile.timeline = Some(self.timeline.timeline().clone());
        Ok(profile)
    }

    /// What the whole tree has counted so far, from the counters alone.
    pub fn running(&self) -> Running {
        let of = |p: &Profile| Running {
            calls: p.totals.allocs.calls,
            bytes: p.totals.allocs.bytes,
            frees: p.totals.frees,
            lost: p.losses.map_full + p.live.as_ref().map_or(0, |l| l.events_lost),
        };
        let mut sum = Running::default();
        if let Some(ended) = &self.ended {
            sum.add(of(ended));
        }
        for proc in self.procs.values() {
            for old in &proc.before_exec {
                sum.add(of(old));
            }
            match collect::running(&proc.probes) {
                Ok(r) => sum.add(r),
                Err(e) => log::debug!("pid {}: counters unreadable: {e:#}", proc.pid),
            }
        }
        sum
    }

    /// The second's reading: for the timeline and every watcher.
    pub fn tick(&self) -> Tick {
        Tick {
            elapsed: self.clock.started.elapsed().as_secs_f64(),
            running: self.running(),
            live_bytes: self.settings.mode.live.then(|| {
                self.procs
                    .values()
                    .filter_map(|p| p.tracker.as_ref())
                    .map(|t| t.live_bytes)
                    .sum()
            }),
            processes: self.procs.len(),
        }
    }

    /// One process's profile, its rows named by it with `--per-process`.
    fn proc_profile(&self, proc: &Proc) -> Result<Profile> {
        let mut profile = proc.profile(&self.clock, self.per_thread)?;
        if self.per_process {
            let tag = ProcessRef {
                pid: proc.pid,
                name: proc.name.clone(),
            };
            for st in &mut profile.stacks {
                st.process = Some(tag.clone());
            }
        }
        Ok(profile)
    }

    /// A snapshot for every sink, with fresh mappings.
    fn snapshot(&mut self, sinks: &mut [Box<dyn Sink>]) -> Result<()> {
        for proc in self.procs.values() {
            proc.space.lock().unwrap().refresh(proc.pid);
        }
        let profile = self.profile()?;
        for sink in sinks.iter_mut() {
            sink.snapshot(&profile)?;
        }
        Ok(())
    }

    /// Live mode: every process's events to its tracker.
    fn drain_all(&mut self) {
        for proc in self.procs.values_mut() {
            proc.drain();
        }
    }

    /// Keeps the probes of a program that is gone (its process exited or
    /// exec'd another) in the graveyard until tracing ends; while the
    /// graveyard holds more than [`graveyard_budget`] bytes of kernel
    /// memory, its oldest are detached, away from the session's thread
    /// (and holding up the probes of the processes to come meanwhile).
    fn bury(&mut self, pid: u32, probes: Probes) {
        self.graveyard_bytes += probes.kernel_bytes;
        self.graveyard.push_back((pid, probes));
        while self.graveyard_bytes > graveyard_budget() && self.graveyard.len() > 1 {
            let Some((_, oldest)) = self.graveyard.pop_front() else {
                break;
            };
            self.graveyard_bytes -= oldest.kernel_bytes;
            self.graveyard_detached += 1;
            if self.graveyard_detached == 1 {
                log::info!(
                    "the probes of gone programs hold {} MiB of kernel memory: from now on the oldest are detached while tracing, which slows down attaching to new processes",
                    graveyard_budget() >> 20
                );
            }
            std::thread::spawn(move || drop(oldest));
        }
    }

    /// Ends the trace: the probes of processes that still run are taken
    /// out now (they must not go on paying for them); those of processes
    /// that are gone (each costs the kernel about 0.1 s a probe, under a
    /// lock) are left to a process of their own that outlives mtrace, so
    /// that neither the user nor a CI job waits for them. Their breakpoints
    /// are in no process any more: nothing is left behind.
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
                let Proc { probes, unwind, .. } = proc;
                drop(unwind);
                self.graveyard_bytes += probes.kernel_bytes;
                self.graveyard.push_back((pid, probes));
            }
        }
        // The probes of a program a running process exec'd away from still
        // trap its calls (disabled): they go now, with the running ones.
        let (old_programs, dead): (Vec<_>, Vec<_>) = std::mem::take(&mut self.graveyard)
            .into_iter()
            .partition(|(pid, _)| !gone(&self.tree, *pid));
        self.graveyard = dead.into();
        if !old_programs.is_empty() {
            let started = Instant::now();
            let n: usize = old_programs.iter().map(|(_, p)| p.attached.len()).sum();
            drop(old_programs);
            log::debug!(
                "{n} probes of programs running processes exec'd away from detached in {:.1} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
        }
        let probes: usize = self.graveyard.iter().map(|(_, p)| p.attached.len()).sum();
        if probes == 0 {
            return;
        }
        match reaper() {
            Ok(true) => log::debug!(
                "the {probes} probes of {} exited processes are taken out by a process of their own",
                self.graveyard.len()
            ),
            _ => eprintln!(
                "mtrace: taking out the {probes} probes of {} exited processes (the kernel takes about 0.1 s a probe)",
                self.graveyard.len()
            ),
        }
        // Here, only references go: the reaper holds the probes.
        drop(self);
    }

    /// Counting ends in every process; the timeline's last point.
    pub fn finish(&mut self) -> Result<()> {
        for proc in self.procs.values_mut() {
            proc.finish()?;
        }
        let tick = self.tick();
        self.timeline
            .record(tick.elapsed, tick.running, tick.live_bytes, true);
        Ok(())
    }

    /// Probes a new process (if the limit allows): `false` when no
    /// allocator is mapped in it yet.
    fn start_proc(&mut self, pid: u32, maps: &[Mapping]) -> Result<bool> {
        if self.procs.len() >= self.max_processes {
            let why = format!(
                "more than {} {} at once",
                self.max_processes,
                if self.max_processes == 1 {
                    "process"
                } else {
                    "processes"
                }
            );
            self.tree.not_traced(pid, why);
            return Ok(true);
        }
        let space = Arc::new(Mutex::new(AddressSpace::new()));
        let settings = self.settings;
        match Proc::attach(pid, maps, &settings, space, &self.meta) {
            Ok(Some(proc)) => {
                self.tree.probed(&proc);
                log::debug!(
                    "pid {pid} ({}): {} probes in {}",
                    proc.name,
                    proc.probes.attached.len(),
                    proc.meta.allocator_object
                );
                self.procs.insert(pid, proc);
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => {
                log::warn!("pid {pid} not traced: {e:#}");
                self.tree.not_traced(pid, format!("{e:#}"));
                Ok(true)
            }
        }
    }

    /// By pid with `--children`: a process the target had created before
    /// mtrace came, running, is probed.
    pub fn adopt(&mut self, parent: u32, child: u32) {
        let adopted = self.on_tree_event(OwnedTreeEvent::Fork {
            parent,
            child,
            vfork: false,
        });
        if let Err(e) = adopted {
            log::warn!("pid {child} not traced: {e:#}");
            self.tree.not_traced(child, format!("{e:#}"));
        }
    }

    /// What the launch thread (or the exit hold) tells of the tree.
    fn on_tree_event(&mut self, event: OwnedTreeEvent) -> Result<bool> {
        match event {
            OwnedTreeEvent::Fork {
                parent,
                child,
                vfork,
            } => {
                // A fork bomb: what cannot be traced is counted, not kept.
                if self.tree.processes.len() >= Meta::MAX_PROCESS_RECORDS
                    && self.procs.len() >= self.max_processes
                {
                    self.tree.unlisted += 1;
                    return Ok(true);
                }
                self.tree.processes.push(ProcessMeta {
                    pid: child,
                    ppid: parent,
                    name: target::comm(child),
                    command: target::cmdline(child),
                    executable: target::executable(child),
                    ..Default::default()
                });
                // A vfork child shares its parent's memory, and its probes,
                // until it execs (and may call nothing but exec or _exit).
                if vfork {
                    self.tree
                        .not_traced(child, "vfork child that did not exec".into());
                    return Ok(true);
                }
                let maps = target::read_maps(child)?;
                self.start_proc(child, &maps)
            }
            OwnedTreeEvent::Exec { pid, maps } => {
                let (settings, per_thread) = (self.settings, self.per_thread);
                let mut replaced = None;
                let done = match self.procs.get_mut(&pid) {
                    Some(proc) => {
                        replaced = proc.on_exec(&maps, &settings, &self.clock, per_thread)?;
                        let done = replaced.is_some();
                        if done {
                            let meta = &proc.meta;
                            let said = format!(
                                "pid {pid} exec'd {}: {} probes in {} ({})",
                                meta.executable,
                                meta.probes.len(),
                                meta.allocator_object,
                                meta.allocator_family
                            );
                            // The root's program is the trace's; the
                            // rest of a tree's execs are for -v.
                            if pid == self.root {
                                eprintln!("mtrace: {said}");
                            } else {
                                log::debug!("{said}");
                            }
                            self.tree.probed(proc);
                            if pid == self.root {
                                // The command as given stays the trace's.
                                self.meta = Meta {
                                    command: std::mem::take(&mut self.meta.command),
                                    ..proc.meta.clone()
                                };
                            }
                        }
                        done
                    }
                    None => self.start_proc(pid, &maps)?,
                };
                if let Some(probes) = replaced {
                    // The old program's probes sit on the same places when
                    // the new one maps the same allocator, and still run
                    // (disabled: about 60 ns a call). The root's new program
                    // is most often the one that matters (`env`, `nice`,
                    // `sh -c 'exec ...'` before it), so its old probes go
                    // at once, away from the session's thread; those of
                    // other processes wait with the gone ones, as taking
                    // probes out holds up the probes of new processes.
                    if pid == self.root {
                        std::thread::spawn(move || drop(probes));
                    } else {
                        self.bury(pid, probes);
                    }
                }
                Ok(done)
            }
            OwnedTreeEvent::Exiting { pid } => {
                if let Some(proc) = self.procs.get(&pid) {
                    proc.space.lock().unwrap().refresh(pid);
                }
                Ok(true)
            }
            OwnedTreeEvent::Gone { pid, code } => {
                if let Some(p) = self.tree.get(pid) {
                    p.exit_code = Some(code);
                }
                // The root's counts are read when the trace ends.
                if pid == self.root {
                    return Ok(true);
                }
                if let Some(mut proc) = self.procs.remove(&pid) {
                    proc.finish()?;
                    let profile = self.proc_profile(&proc)?;
                    self.ended = Some(match self.ended.take() {
                        Some(ended) => merge::merge(vec![ended, profile]),
                        None => profile,
                    });
                    // The rest goes now (its unwinder's thread stops
                    // within a poll, away from the session's thread).
                    let Proc { probes, unwind, .. } = proc;
                    std::thread::spawn(move || drop(unwind));
                    self.bury(pid, probes);
                }
                Ok(true)
            }
        }
    }

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
        } = inputs;
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
        let live = self.settings.mode.live;
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

        let end = loop {
            tokio::select! {
                _ = &mut stop => break (End::Stopped, exit_rx),
                _ = second.tick() => {
                    let tick = self.tick();
                    self.timeline.record(tick.elapsed, tick.running, tick.live_bytes, false);
                    for w in watchers.iter_mut() {
                        w.tick(self, &tick)?;
                    }
                }
                code = target_exit(&mut exit_rx) => break (End::TargetExited(code), None),
                _ = &mut sleep => break (End::Duration, exit_rx),
                _ = sigint.recv() => break (End::Interrupted(libc::SIGINT), exit_rx),
                _ = sigterm.recv() => break (End::Interrupted(libc::SIGTERM), exit_rx),
                _ = drain_due(&mut drain_tick) => self.drain_all(),
                _ = sigusr1.recv() => {
                    self.drain_all();
                    self.snapshot(sinks)?;
                }
                _ = snapshot_due(&mut interval) => {
                    self.drain_all();
                    self.snapshot(sinks)?;
                }
                _ = refresh.tick() => {
                    for proc in self.procs.values() {
                        proc.space.lock().unwrap().refresh(proc.pid);
                    }
                }
                req = next_event(&mut tree_events) => match req {
                    Some(req) => {
                        let t = Instant::now();
                        let what = req.event.describe();
                        let done = self.on_tree_event(req.event);
                        log::debug!("{what}: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
                        if let Some(reply) = req.reply {
                            let _ = reply.send(done.map_err(|e| format!("{e:#}")));
                        } else if let Err(e) = done {
                            log::warn!("{e:#}");
                        }
                    }
                    // The launch thread is gone: no more events.
                    None => tree_events = None,
                },
            }
        };
        self.drain_all();
        Ok(end)
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

/// Feeds every event waiting in the rings to the tracker, which applies
/// those stamped before the drain began. The rest wait for the next drain;
/// after the last one, they are events of after the trace's end. The walks
/// the tracer finished come first: an allocation event whose stack the
/// tracer unwound names it by an id that only they resolve.
fn drain(
    events: &mut [RingBuf<MapData>],
    lost_frees: Option<&mut LostFrees>,
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
    // After the rings: a free kept there was stored before its block
    // could be allocated again, so a later allocation drained above never
    // comes without it.
    if let Some(queue) = lost_frees {
        while let Ok(free) = queue.pop(0) {
            tracker.on_lost_free(free);
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
