//! A trace under way: every traced process (one BPF object each), the
//! process tree, the timeline, and the loop that runs until the trace ends.
//! Each concern has a file: how tracing ends ([`end`]), one traced process
//! ([`traced`]), the tree ([`tree`]), letting go of probes ([`detach`]), the
//! loop ([`run`]).

mod detach;
pub mod drive;
pub mod duty;
mod end;
mod run;
mod traced;
mod tree;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use anyhow::Result;

pub use end::{pidfd_open, End, Signals, SnapshotTimer};
pub use run::{Inputs, Schedule};
pub use traced::{ProcSettings, TracedProcess};
pub use tree::{Tree, TreeRequest};

use crate::{
    collect::{self, live_tracker, timeline::Recorder, Running},
    pipeline::Clock,
    profile::{merge, Meta, ProcessMeta, ProcessRef, Profile},
    sinks::Sink,
    tracee::perf_map::{self, PerfMap},
    watch::Tick,
};

/// How a trace treats its processes and its rows.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub settings: ProcSettings,
    /// Rows split per process.
    pub per_process: bool,
    /// Most processes probed at once; a process created beyond it is
    /// counted as not traced.
    pub max_processes: usize,
    /// Live mode: blocks at least this old are leak suspects.
    pub min_age_ns: u64,
    /// `mtrace agent --policy windows`.
    pub windows: Option<duty::Windows>,
    /// `mtrace agent`: what is kept of gone processes is bounded (their
    /// rows joined per command, their records the newest only).
    pub bounded: bool,
}

/// With `Options::bounded`, how many gone processes may keep their own
/// pid on their rows. When one more is gone, the rows of all the gone
/// processes are joined per command (under pid 0) and the count starts
/// again.
const GONE_WITH_PID: u32 = 64;

/// With `Options::bounded`, the most process records the tree keeps.
/// Past it, the oldest record of a gone process is dropped and counted as
/// unlisted; the root's record is never dropped.
const AGENT_RECORDS: usize = 1024;

/// By cgroup: its directory, and the channel to the hold that seizes the
/// processes joining it and lets go of those leaving it.
pub struct Scope {
    pub dir: std::path::PathBuf,
    pub handover: std::sync::mpsc::Sender<crate::tracee::ptrace::Handover>,
}

/// Everything needed to turn the kernel maps into a profile at any time.
pub struct Session {
    /// The process traced by pid, or the command launched.
    root: u32,
    /// Every process with probes in, by pid.
    procs: BTreeMap<u32, TracedProcess>,
    /// What processes that are gone counted, joined.
    ended: merge::Merged,
    tree: Tree,
    /// The root's metadata (its last program's after an `exec`).
    meta: Meta,
    clock: Clock,
    options: Options,
    /// The trace over time.
    timeline: Recorder,
    /// Launch mode: the command's exit status, once it exited while
    /// processes it started still ran.
    root_code: Option<i32>,
    /// The links of every process, closing once counting has stopped.
    letting_go: Option<std::thread::JoinHandle<()>>,
    /// The windows policy at work.
    duty: Option<duty::Duty>,
    /// How many gone processes have been joined into `ended` under their
    /// own pid since `ended` last joined its rows per command (see
    /// [`GONE_WITH_PID`]).
    gone_with_pid: u32,
    /// The programs that an exec replaced. Their counting has stopped;
    /// each is read into its process once the new program has had its
    /// answer ([`Session::settle`]).
    exec_replaced: Vec<TracedProcess>,
    /// Processes that are gone, still to be read ([`Session::settle`]),
    /// and since when the first has waited.
    gone: Vec<u32>,
    gone_since: Option<Instant>,
    /// By cgroup, while the loop runs: the scope its processes must stay in.
    cgroup: Option<Scope>,
    /// Go programs with no malloc to probe (static ones), their own heap
    /// profile read at each reading, by pid; kept once gone (their
    /// reading at exit stands).
    go_only: BTreeMap<u32, Box<crate::golang::GoProcess>>,
}

impl Session {
    /// A trace of `root`, probed already, whose profile says `meta`;
    /// tracing begins now.
    pub fn new(root: TracedProcess, meta: Meta, options: Options) -> Session {
        let pid = root.pid;
        let mut tree = Tree {
            processes: vec![ProcessMeta {
                pid,
                ..Default::default()
            }],
            unlisted: 0,
        };
        tree.probed(&root);
        let duty = options.windows.map(duty::Duty::new);
        let mut session = Session::starting(pid, tree, meta, options, duty);
        session.procs.insert(pid, root);
        session.begin_window();
        session
    }

    /// A trace of `root`, a Go program with nothing to probe: its own heap
    /// profile only (and that of what it starts); tracing begins now.
    pub fn new_go(root: Box<crate::golang::GoProcess>, meta: Meta, options: Options) -> Session {
        let pid = root.pid;
        let tree = Tree {
            processes: vec![ProcessMeta {
                pid,
                name: root.name.clone(),
                command: meta.command.clone(),
                executable: meta.executable.clone(),
                cgroup: crate::tracee::cgroup::of(pid),
                allocator_object: crate::profile::GO_HEAP_FUNC.into(),
                traced: true,
                ..Default::default()
            }],
            unlisted: 0,
        };
        let mut session = Session::starting(pid, tree, meta, options, None);
        session.go_only.insert(pid, root);
        session
    }

    /// A session of root `pid` starting now, with no process in it yet.
    fn starting(
        pid: u32,
        tree: Tree,
        meta: Meta,
        options: Options,
        duty: Option<duty::Duty>,
    ) -> Session {
        let mode = options.settings.mode;
        Session {
            root: pid,
            procs: BTreeMap::new(),
            ended: merge::Merged::default(),
            tree,
            meta,
            clock: Clock {
                started: Instant::now(),
                started_ns: live_tracker::monotonic_ns(),
                min_age_ns: options.min_age_ns,
            },
            options,
            timeline: Recorder::new(1.0, mode.live || mode.count_frees),
            root_code: None,
            letting_go: None,
            duty,
            gone_with_pid: 0,
            exec_replaced: Vec::new(),
            gone: Vec::new(),
            gone_since: None,
            cgroup: None,
            go_only: BTreeMap::new(),
        }
    }

    /// The root process while it has probes in.
    pub fn root(&self) -> Option<&TracedProcess> {
        self.procs.get(&self.root)
    }

    /// How long it has traced.
    pub fn elapsed(&self) -> Duration {
        self.clock.started.elapsed()
    }

    /// Launch mode: the command's exit status, if it exited while
    /// processes it started ran on.
    pub fn root_code(&self) -> Option<i32> {
        self.root_code
    }

    /// The root's exit code, once the thread following it said so.
    fn root_exit_code(&self) -> Option<i32> {
        self.tree
            .processes
            .iter()
            .find(|p| p.pid == self.root)
            .and_then(|p| p.exit_code)
    }

    /// Processes of the tree still running, the root left out.
    fn running_besides_root(&self) -> usize {
        self.tree
            .processes
            .iter()
            .filter(|p| p.pid != self.root && p.exit_code.is_none())
            .count()
    }

    /// The root exited with `code` (launch mode learns it at the end).
    pub fn root_exited(&mut self, code: i32) {
        if let Some(root) = self.tree.processes.first_mut() {
            root.exit_code = Some(code);
        }
    }

    /// The whole trace: every process (each symbolized with its own
    /// mappings), joined by what the stacks say.
    pub fn profile(&self) -> Result<Profile> {
        let mut parts: Vec<Profile> = self.ended.get().into_iter().cloned().collect();
        // What the root's reading found of its Python (its interpreter's
        // state judged unreadable since it was probed).
        let mut python = self.meta.python.clone();
        for proc in self.procs.values() {
            let part = self.proc_profile(proc)?;
            if proc.pid == self.root {
                python.clone_from(&part.meta.python);
            }
            parts.push(part);
        }
        for go in self.go_only.values() {
            let mut part = Profile {
                meta: self.meta.clone(),
                ..Profile::default()
            };
            go.add_to(&mut part);
            if self.options.per_process {
                for st in &mut part.stacks {
                    st.process = Some(ProcessRef {
                        pid: go.pid,
                        name: go.name.clone(),
                    });
                }
            }
            parts.push(part);
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
            windows: self.duty.as_ref().map(duty::Duty::info),
            python,
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
        if let Some(ended) = self.ended.get() {
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
            live_bytes: self.options.settings.mode.live.then(|| {
                self.procs
                    .values()
                    .filter_map(|p| p.tracker.as_ref())
                    .map(|t| t.live_bytes)
                    .sum()
            }),
            // The root's counts stay until the end, after it has exited.
            processes: self.procs.len()
                - usize::from(
                    self.root_exit_code().is_some() && self.procs.contains_key(&self.root),
                ),
        }
    }

    /// One process's profile, its rows named by it with `--per-process`.
    fn proc_profile(&self, proc: &TracedProcess) -> Result<Profile> {
        let mut profile = proc.profile(&self.clock, self.options.settings.mode.per_thread)?;
        if self.options.per_process {
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

    /// Every process's links, for the caller to close (the probes stay in
    /// until then).
    fn take_all_links(&mut self) -> Vec<crate::probes::multi::Link> {
        self.procs
            .values_mut()
            .flat_map(|p| p.probes.take_links())
            .collect()
    }

    /// Live mode: every process's events to its tracker.
    fn drain_all(&mut self) {
        for proc in self.procs.values_mut() {
            proc.drain();
        }
    }

    /// Counting ends in every process; the timeline's last point. Their
    /// perf maps are read to where they are meanwhile, for at most
    /// [`perf_map::CATCH_UP`] (what is left is counted as unread).
    pub fn finish(&mut self) -> Result<()> {
        let stopping = Instant::now();
        let perf_maps: Vec<PerfMap> = self
            .procs
            .values()
            .map(|p| p.space.lock().unwrap().perf_map())
            .collect();
        for m in &perf_maps {
            m.ask();
        }
        for proc in self.procs.values_mut() {
            proc.finish()?;
        }
        // Nothing counts any more: the probes go now, side by side, while
        // the maps are read and the report written (by pid, the target
        // stops paying for them as soon as the kernel has them out).
        let links = self.take_all_links();
        if !links.is_empty() {
            self.letting_go = Some(std::thread::spawn(move || {
                crate::probes::multi::close_all(links);
                log::debug!(
                    "every probe out {:.1} ms after counting stopped",
                    stopping.elapsed().as_secs_f64() * 1e3
                );
            }));
        }
        let tick = self.tick();
        self.timeline
            .record(tick.elapsed, tick.running, tick.live_bytes, true);
        for m in &perf_maps {
            m.wait(stopping + perf_map::CATCH_UP);
        }
        Ok(())
    }
}

/// The running kernel's release, for a profile's meta (empty if unknown).
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The trace's runtime (one thread) and its signal handlers, made in it:
/// from here on a Ctrl-C ends the trace with a report, never kills mtrace.
pub fn runtime_with_signals() -> Result<(tokio::runtime::Runtime, Signals)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let signals = {
        let _in_runtime = rt.enter();
        Signals::new()?
    };
    Ok((rt, signals))
}

/// Says that the command exited (with `code`) and that the `n` processes
/// it started that still run are traced until they are gone (a daemon
/// that forked away), on either engine.
pub(crate) fn say_running_on(code: i32, n: usize) {
    crate::say!(
        "mtrace: the command exited{}; tracing the {n} {} it started that still {} until {} gone, Ctrl-C to stop",
        if code == 0 { String::new() } else { format!(" with status {code}") },
        if n == 1 { "process" } else { "processes" },
        if n == 1 { "runs" } else { "run" },
        if n == 1 { "it is" } else { "they are" },
    );
}
