//! The host engine's trace from start to end: the scope made (every
//! process, a command's tree or a cgroup), the probes enabled, the loop
//! ([`drive`]) fed with the kernel's word of execs, and the profile and
//! its sinks at the end.

use std::{
    cell::RefCell,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use aya::maps::RingBuf;
use tracer_common::{maps, HostExec, MAX_HOST_FUNCS};

use super::{windows::switch, windows::HostWindows, Host, HostScope, FOLD_EVERY};
use crate::{
    cli::config::{Target, TraceConfig},
    collect::{timeline::Recorder, Running},
    profile::{Meta, Profile},
    say,
    session::{
        drive::{drive, Controls, Engine},
        duty::Duty,
        End,
    },
    sinks::{Outcome, Report, Sink, Snapshots},
    tracee::{self, launch, RunAs},
    user_error,
    watch::{self, StatusLine, Tick, Watcher},
};

/// `mtrace --all` / `mtrace top --all`, and `--file-wide` with a command
/// or a cgroup (`run_as`: the command's user, `--user`).
pub fn run(
    config: TraceConfig,
    top: bool,
    server: Option<crate::agent::Server>,
    run_as: Option<RunAs>,
) -> Result<i32> {
    tracee::check_privileges()?;
    launch::raise_file_limit();
    let (rt, signals) = crate::session::runtime_with_signals()?;
    if crate::probes::kernel::vma_offsets().known == 0 {
        return Err(user_error!(
            "--all and --file-wide need the kernel's BTF (/sys/kernel/btf/vmlinux) to name the callers' files"
        ));
    }
    let scope = match &config.target {
        Target::Host => HostScope::All,
        Target::Command(argv) => HostScope::Tree {
            argv: argv.clone(),
            run_as,
        },
        Target::Cgroup(path) => HostScope::Cgroup(tracee::cgroup::resolve(path)?),
        Target::Pid(_) => {
            return Err(user_error!(
                "--file-wide traces a command or a cgroup; a pid is traced by its own probes"
            ))
        }
    };
    // Before the program runs: the kernel times it from then on.
    let _stats = crate::probes::multi::run_times(config.bpf_stats)?;
    let started = Instant::now();
    let start_time = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let mut host = Host::start(
        &config.sizes,
        config.mode.max_frames,
        config.windows.is_some(),
        config.outputs.table.per_thread,
        &scope,
    )?;
    if server.is_some() {
        host.bound();
    }
    if let HostScope::Cgroup(dir) = &scope {
        let (id, level) = tracee::cgroup::id_and_level(dir)?;
        host.probes.scope_cgroup(id, level)?;
    }
    if host.probes.links() == 0 {
        return Err(user_error!(
            "--all: no process on the host maps an allocator mtrace knows"
        ));
    }
    host.probes.set_enabled(true)?;
    // A tree's processes held at their exec, asking for their probes.
    let mut held = None;
    // Under `top`, where the command's output went.
    let mut command_log = None;
    let (described, exit) = match &scope {
        HostScope::All => (
            Described {
                command: "every process on the host (--all)".into(),
                pid: 0,
                scope: scope.name(),
            },
            None,
        ),
        HostScope::Cgroup(dir) => (
            Described {
                command: format!("cgroup {}", dir.display()),
                pid: 0,
                scope: scope.name(),
            },
            None,
        ),
        HostScope::Tree { argv, run_as } => {
            let (asks, on_exec) = super::held::exec_hold(
                host.libc.clone(),
                host.walks.finisher(),
                host.walks.throttle_taker(),
            );
            held = Some(asks);
            host.held_execs = true;
            // The live view has the terminal: the command's output goes to
            // a log meanwhile (mtrace's own is back once it started).
            let redirect = if top && server.is_none() {
                Some(watch::top::Redirect::start().context("redirecting the command's output")?)
            } else {
                None
            };
            command_log = redirect.as_ref().map(|r| r.log.clone());
            let launched = launch::launch_held(
                argv,
                run_as.as_ref(),
                |pid| {
                    host.probes.scope_pid(pid)?;
                    host.probe_command(pid, &argv[0]);
                    Ok(())
                },
                Some(on_exec),
            );
            drop(redirect);
            let (pid, exit) = launched?;
            (
                Described {
                    command: argv.join(" "),
                    pid,
                    scope: scope.name(),
                },
                Some(exit),
            )
        }
    };
    let what = match &scope {
        HostScope::All => "every process on the host (--all)".to_string(),
        HostScope::Cgroup(dir) => format!(
            "cgroup {} (--file-wide)",
            crate::render::text::printable(&dir.to_string_lossy())
        ),
        HostScope::Tree { argv, .. } => format!(
            "pid {} ({} and its descendants, --file-wide)",
            described.pid,
            crate::render::text::printable(crate::profile::short_path(&argv[0]))
        ),
    };
    say!(
        "mtrace: tracing {what}: {} probes in {} files ({}), attached in {:.0} ms",
        host.probes.funcs.len(),
        host.probes.files.len(),
        host.probes
            .files
            .iter()
            .map(|f| crate::profile::short_path(&f.path).to_string())
            .collect::<Vec<_>>()
            .join(", "),
        started.elapsed().as_secs_f64() * 1e3
    );
    // Tracing begins: its duration (and `--duration`) counts from here, as
    // for every scope.
    let started = Instant::now();

    let execs = RingBuf::try_from(
        host.probes
            .ebpf
            .take_map(maps::HOST_EXECS)
            .context("BPF map HOST_EXECS missing")?,
    )?;
    let title = match &scope {
        HostScope::Tree { argv, .. } => format!(
            "mtrace top: pid {} ({}, --file-wide), count mode (p: per process or per stack){}",
            described.pid,
            crate::render::text::printable(crate::profile::short_path(&argv[0])),
            match &command_log {
                Some(log) => format!(", the command's output in {}", log.display()),
                None => String::new(),
            }
        ),
        HostScope::Cgroup(dir) => format!(
            "mtrace top: cgroup {} (--file-wide), count mode (p: per process or per stack)",
            crate::render::text::printable(&dir.to_string_lossy())
        ),
        HostScope::All => {
            "mtrace top --all: every process on the host, count mode (p: per process or per stack)"
                .to_string()
        }
    };
    // A command's view opens on its stacks, as by pid; the host's and a
    // cgroup's on their processes.
    let by_process = !matches!(scope, HostScope::Tree { .. });
    let (mut watchers, stop) = host_watchers(top && server.is_none(), title, by_process)?;
    let wake = server
        .map(|server| crate::agent::serve(server, &mut watchers))
        .transpose()?;
    // The windows policy (`mtrace agent --all`), measured against the
    // host's busy CPU time: the processes of a host are what pays.
    let mut duty = config.windows.map(Duty::new);
    let mut host_windows = HostWindows::default();
    if let Some(d) = duty.as_mut() {
        d.begin(host_windows.begin(&host.probes));
    }
    let _in_runtime = rt.enter();
    let mut run = HostRun {
        host: RefCell::new(host),
        execs,
        held,
        poll: tokio::time::interval(POLL_EVERY),
        next_fold: Instant::now() + FOLD_EVERY,
        duty,
        host_windows,
        snapshots: Snapshots::named(
            config.snapshot_dir.clone(),
            match described.pid {
                0 => "all".into(),
                pid => pid.to_string(),
            },
        )
        .grouped_as(&config.outputs),
        started,
        start_time,
        described,
        end: match (&scope, exit) {
            (HostScope::Tree { .. }, Some(exit)) => ScopeEnd::Tree {
                exit,
                code: None,
                said: false,
            },
            (HostScope::Cgroup(dir), _) if !config.schedule.until_stopped => {
                ScopeEnd::Cgroup(dir.clone())
            }
            _ => ScopeEnd::Never,
        },
        next_end_look: Instant::now(),
        timeline: Recorder::new(1.0, false),
    };
    let controls = Controls {
        signals,
        stop,
        wake,
    };
    let end = rt.block_on(drive(&mut run, &config.schedule, controls, &mut watchers))?;
    if let End::TargetExited(_) = end {
        // The live view keeps the last state until it is left.
        let (why, tick) = (end.describe(None), run.tick());
        for w in watchers.iter_mut() {
            w.ended(&why, &tick, &|| run.profile());
        }
    }
    let HostRun {
        host: cell,
        duty,
        mut snapshots,
        start_time,
        described,
        mut timeline,
        mut execs,
        ..
    } = run;
    let meta = |elapsed: f64| host_meta(&described, &start_time, elapsed, duty.as_ref());
    let elapsed = started.elapsed().as_secs_f64();
    let mut host = cell.into_inner();
    host.probes.set_enabled(false)?;
    if config.bpf_stats {
        host.probes.program().log_times();
    }
    // The walks still waiting are finished now, those of processes gone
    // in the files their last execs name: the kernel counted their calls
    // in its totals, so a walk left waiting would be a row missing.
    read_execs(&mut execs, &mut host);
    host.walks.finish_at_end();
    drop(watchers);
    say!(
        "mtrace: tracing ended after {elapsed:.1} s: {}",
        end.describe(config.schedule.duration)
    );
    if let Some(log) = &command_log {
        say!("mtrace: the command's output is in {}", log.display());
    }
    if host.late > 0 {
        say!(
            "mtrace: {} processes had probes added after they started (see above)",
            host.late
        );
    }
    let mut profile = host.profile(meta(elapsed))?;
    let last = running_tick(&host, elapsed);
    timeline.record(elapsed, last.running, None, true);
    profile.timeline = Some(timeline.timeline().clone());
    crate::profile::window::scale_windows(&mut profile);
    if host.probes.unprobed > 0 {
        say!(
            "mtrace: {} allocator functions not probed: more than {MAX_HOST_FUNCS} functions or {} files",
            host.probes.unprobed,
            tracer_common::MAX_HOST_FILES
        );
    }
    let (gone, gone_whole) = {
        let walks = host.walks.walks();
        log_unwind(&walks);
        (walks.gone, walks.gone_whole)
    };
    if gone > 0 {
        say!(
            "mtrace: {gone} walks were finished after their process was gone, in the files the kernel's walks had met: {gone_whole} whole, {} cut (process_gone)",
            gone - gone_whole
        );
    }
    crate::unwind::say_copy_lost(
        profile.stack_quality.as_ref(),
        crate::probes::host_ring(&config.sizes, scope.kind()),
    );
    if let Some(l) = profile.losses.host {
        say_host_losses(&l);
    }
    let mut report = Report(config.outputs.clone());
    let mut finished = Outcome::default();
    finished.add(report.finish(&profile));
    finished.add(snapshots.finish(&profile));
    host.probes.detach();
    finished.result()?;
    Ok(match end {
        End::TargetExited(code) => code.unwrap_or(0),
        End::Interrupted(sig) if described.pid != 0 => 128 + sig,
        _ => 0,
    })
}

/// What a host engine's run traces, for its profile.
struct Described {
    command: String,
    /// The command's pid (0: no command).
    pid: u32,
    scope: &'static str,
}

/// When the scope ends by itself.
enum ScopeEnd {
    /// `--all`, the agent: at a signal or the duration.
    Never,
    /// A command's tree: once the command exited (`code`) and no process
    /// of its tree is left (`said`: that some run on after the command
    /// was said).
    Tree {
        exit: tokio::sync::oneshot::Receiver<i32>,
        code: Option<i32>,
        said: bool,
    },
    /// A cgroup: once no process is left in it or below it.
    Cgroup(std::path::PathBuf),
}

/// `host::run`'s engine for the loop ([`drive`]): the host, and what
/// tells of its processes.
struct HostRun {
    /// Borrowed by the watchers' profile, which the loop gives them behind
    /// a shared reference.
    host: RefCell<Host>,
    /// The kernel's word of each exec.
    execs: RingBuf<aya::maps::MapData>,
    /// A tree's processes held at their exec ([`super::held`]).
    held: Option<std::sync::mpsc::Receiver<super::held::Ask>>,
    poll: tokio::time::Interval,
    next_fold: Instant,
    duty: Option<Duty>,
    host_windows: HostWindows,
    snapshots: Snapshots,
    started: Instant,
    start_time: String,
    described: Described,
    end: ScopeEnd,
    next_end_look: Instant,
    /// The trace over time, fed by the ticks (count mode: no frees).
    timeline: Recorder,
}

/// How often a scope that ends by itself is listed for what is left.
const END_LOOKS: Duration = Duration::from_millis(20);

/// How often the kernel's word of execs is read.
const POLL_EVERY: Duration = Duration::from_millis(5);

/// The profile's meta of the host scope, `elapsed` seconds in.
fn host_meta(described: &Described, start_time: &str, elapsed: f64, duty: Option<&Duty>) -> Meta {
    Meta {
        mtrace_version: env!("CARGO_PKG_VERSION").to_string(),
        pid: described.pid,
        command: described.command.clone(),
        start_time: start_time.to_string(),
        duration_secs: elapsed,
        kernel_release: crate::session::kernel_release(),
        mode: "count".into(),
        scope: described.scope.into(),
        windows: duty.map(Duty::info),
        ..Meta::default()
    }
}

impl HostRun {
    fn meta(&self) -> Meta {
        host_meta(
            &self.described,
            &self.start_time,
            self.started.elapsed().as_secs_f64(),
            self.duty.as_ref(),
        )
    }
}

impl HostRun {
    /// Whether the scope has ended by itself (looked at each poll; the
    /// processes of a tree only once its command has exited).
    fn scope_ended(&mut self) -> Option<End> {
        match &mut self.end {
            ScopeEnd::Never => None,
            ScopeEnd::Tree { exit, code, .. } => {
                if code.is_none() {
                    *code = match exit.try_recv() {
                        Ok(c) => Some(c),
                        Err(tokio::sync::oneshot::error::TryRecvError::Empty) => None,
                        Err(tokio::sync::oneshot::error::TryRecvError::Closed) => Some(1),
                    };
                }
                let code = (*code)?;
                if !self.look_for_end() {
                    return None;
                }
                match self.host.get_mut().probes.scope_pids() {
                    Ok(left) if !left.is_empty() => {
                        // A daemon that forked away: traced until it is gone.
                        let first = match &mut self.end {
                            ScopeEnd::Tree { said, .. } => !std::mem::replace(said, true),
                            _ => false,
                        };
                        if first {
                            let n = left.len();
                            crate::session::say_running_on(code, n);
                        }
                        None
                    }
                    _ => Some(End::TargetExited(Some(code))),
                }
            }
            ScopeEnd::Cgroup(dir) => {
                let dir = dir.clone();
                (self.look_for_end() && tracee::cgroup::members_below(&dir).is_empty())
                    .then_some(End::CgroupEmpty)
            }
        }
    }

    /// Whether it is time to list what is left in the scope (every
    /// [`END_LOOKS`]).
    fn look_for_end(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next_end_look {
            return false;
        }
        self.next_end_look = now + END_LOOKS;
        true
    }
}

/// Reads the kernel's word of the execs since the last read.
fn read_execs(execs: &mut RingBuf<aya::maps::MapData>, host: &mut Host) {
    while let Some(item) = execs.next() {
        if item.len() >= std::mem::size_of::<HostExec>() {
            // SAFETY: the programs write a `HostExec` per record.
            let e = unsafe { std::ptr::read_unaligned(item.as_ptr() as *const HostExec) };
            host.on_exec(&e);
        }
    }
}

impl Engine for HostRun {
    type Work = ();

    async fn work(&mut self) {
        self.poll.tick().await;
    }

    async fn handle(&mut self, (): ()) -> Result<Option<End>> {
        let mut host = self.host.borrow_mut();
        if let Some(asks) = &self.held {
            host.answer_held(asks);
        }
        read_execs(&mut self.execs, &mut host);
        host.recheck();
        if Instant::now() >= self.next_fold {
            if let Err(e) = host.fold_gone() {
                log::warn!("reading the processes gone: {e:#}");
            }
            self.next_fold = Instant::now() + FOLD_EVERY;
        }
        drop(host);
        Ok(self.scope_ended())
    }

    fn tick(&mut self) -> Tick {
        let tick = running_tick(&self.host.borrow(), self.started.elapsed().as_secs_f64());
        self.timeline
            .record(tick.elapsed, tick.running, None, false);
        tick
    }

    fn profile(&self) -> Result<Profile> {
        let mut p = self.host.borrow_mut().profile(self.meta())?;
        p.timeline = Some(self.timeline.timeline().clone());
        Ok(p)
    }

    /// A snapshot that cannot be made is said, and tracing goes on.
    fn snapshot(&mut self) -> Result<()> {
        let made = self.profile().and_then(|mut p| {
            crate::profile::window::scale_windows(&mut p);
            self.snapshots.snapshot(&p)
        });
        if let Err(e) = made {
            say!("mtrace: a snapshot: {e:#}");
        }
        Ok(())
    }

    fn duty_due(&self) -> Option<Instant> {
        self.duty.as_ref().map(|d| d.due)
    }

    fn switch_duty(&mut self) {
        if let Some(d) = self.duty.as_mut() {
            switch(&mut self.host.get_mut().probes, d, &mut self.host_windows);
        }
    }

    /// The host's view is best effort: a failed redraw is logged.
    fn watcher_failed(&self, e: anyhow::Error) -> Result<()> {
        log::debug!("watcher: {e:#}");
        Ok(())
    }
}

/// The status line, or the live view (rows per process from the start
/// when `by_process`) and the receiver of its `q`.
fn host_watchers(
    top: bool,
    title: String,
    by_process: bool,
) -> Result<crate::session::drive::Watchers> {
    let mut watchers: Vec<Box<dyn Watcher>> = Vec::new();
    let mut stop = None;
    if top {
        let (view, rx) = watch::top::TopView::start(title, false, by_process)?;
        watchers.push(Box::new(view));
        stop = Some(rx);
    } else if let Some(line) = StatusLine::new() {
        watchers.push(Box::new(line));
    }
    Ok((watchers, stop))
}

/// The totals so far, for the status line.
fn running_tick(host: &Host, elapsed: f64) -> Tick {
    let mut running = Running::default();
    for (calls, bytes) in host.probes.totals_by_func() {
        running.calls += calls;
        running.bytes += bytes;
    }
    Tick {
        elapsed,
        running,
        live_bytes: None,
        processes: host.allocating,
    }
}

/// One line on stderr per host table or ring that had no room, with what
/// it cost.
fn say_host_losses(l: &crate::profile::HostLosses) {
    let lines = [
        (
            l.frames_untagged,
            format!(
                "frames in files beyond the table of {} files: kept as addresses (named only while their process ran)",
                tracer_common::MAX_HOST_TAGS
            ),
        ),
        (
            l.python_full,
            "Python processes beyond the table of interpreters: native frames only".into(),
        ),
        (
            l.processes_unnumbered,
            "calls of processes beyond the table of processes: their mappings looked up at each walk".into(),
        ),
        (
            l.exec_events_lost,
            "execs not heard of (the exec ring was full): a program's own allocator was probed only when next seen".into(),
        ),
        (
            l.process_names_full,
            "rows made while their process was beyond the table of names: named from /proc while it ran".into(),
        ),
        (
            l.process_runs_full,
            "processes beyond the table of runs: their runs not counted".into(),
        ),
        (
            l.tree_full,
            "children beyond the tree's table: neither they nor their descendants counted".into(),
        ),
    ];
    for (n, what) in lines {
        if n > 0 {
            say!("mtrace: {n} {what}");
        }
    }
}

/// The tracer's unwinders at work over the run (`-v`), as a trace by pid
/// says them.
fn log_unwind(walks: &super::walks::HostWalks) {
    let u = walks.unwind_stats();
    log::debug!(
        "unwind: {} walks finished by the tracer ({} after their process was gone), {}; {} rules found the kernel map full",
        walks.finished,
        walks.gone,
        u.describe(),
        walks.rules_full,
    );
}
