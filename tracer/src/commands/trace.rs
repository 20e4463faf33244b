//! `mtrace --pid PID` and `mtrace -- CMD`: attach (by pid, or by launching
//! the command), run the session until the trace ends, hand the final
//! profile to the sinks, detach.

use std::{
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Instant, SystemTime},
};

use anyhow::{Context, Result};
use tokio::sync::{mpsc::UnboundedReceiver, oneshot};

use crate::{
    allocators,
    cli::{
        config::{Target, TraceConfig},
        TraceArgs,
    },
    error::{UserError, EXIT_USAGE},
    probes::multi,
    profile::{Meta, Probe, Profile},
    render::text::printable,
    say,
    session::{self, End, Inputs, ProcSettings, Session, Signals, TracedProcess, TreeRequest},
    sinks::{check_writable_dir, Outcome, Report, Sink, Snapshots},
    tracee::{self, launch, launch::TreeEvent, AddressSpace, ExitHold, RunAs},
    user_error,
    watch::{self, StatusLine, Watcher},
};

/// How a trace shows itself while it runs.
pub enum Front {
    /// The status line, then the report.
    Report,
    /// `mtrace top`: the full-screen live view, then the report.
    Top,
    /// `mtrace agent`: served over HTTP at this address until stopped,
    /// with the windows policy or not.
    Agent(crate::agent::Listen, Option<session::duty::Windows>),
}

/// The smallest `--budget`, in percent.
const MIN_BUDGET_PCT: f64 = 0.01;

/// `mtrace agent`: its policy checked, then a trace served over HTTP.
pub fn run_agent(args: crate::cli::AgentArgs) -> Result<i32> {
    use crate::cli::PolicyArg;
    let t = &args.trace;
    let always_needed = t.live || t.sample_bytes.is_some() || t.sample_every.is_some();
    let windows = match (args.policy, always_needed) {
        (Some(PolicyArg::Windows), true) => {
            return Err(anyhow::Error::new(UserError::with_code(
                "--policy windows counts exact windows: not with --live (frees would be missed) or sampling; use --policy always",
                EXIT_USAGE,
            )))
        }
        (Some(PolicyArg::Always), _) | (None, true) => None,
        (Some(PolicyArg::Windows), false) | (None, false) => {
            // At it, a window of 0.05 s that costs the processes all
            // their time is followed by 8 minutes without probes; far
            // below it, by a pause too long to compute.
            if args.budget < MIN_BUDGET_PCT {
                return Err(anyhow::Error::new(UserError::with_code(
                    format!("--budget must be at least {MIN_BUDGET_PCT}%"),
                    EXIT_USAGE,
                )));
            }
            let window = std::time::Duration::from_secs_f64(args.window.max(0.01));
            let every = args.every.map(std::time::Duration::from_secs_f64);
            if every.is_some_and(|e| e < window) {
                return Err(anyhow::Error::new(UserError::with_code(
                    "--every must be at least --window",
                    EXIT_USAGE,
                )));
            }
            Some(session::duty::Windows {
                window,
                budget: args.budget / 100.0,
                every,
            })
        }
    };
    let listen = crate::agent::Listen {
        addr: args.listen,
        web_config: args.web_config,
        insecure: args.insecure_listen,
    };
    run(args.trace, Front::Agent(listen, windows))
}

/// A trace; with `top`, under the full-screen live view.
pub fn run(args: TraceArgs, front: Front) -> Result<i32> {
    let top = matches!(front, Front::Top);
    let (mut config, run_as) = checked_config(&args, top)?;
    // The agent's port is taken before anything is attached: one in use
    // is a usage error, not a trace lost.
    let server = match front {
        Front::Agent(listen, windows) => {
            config.windows = windows;
            // Every sample carries its process (pid and comm labels, ?pid=).
            config.outputs.table.per_process = true;
            config.schedule.until_stopped = true;
            Some(crate::agent::Server::bind(&listen)?)
        }
        _ => None,
    };
    if config.target == Target::Host || args.file_wide {
        if config.outputs.table.per_thread {
            return Err(anyhow::Error::new(UserError::with_code(
                "--all and --file-wide count per process, not per thread",
                EXIT_USAGE,
            )));
        }
        return crate::host::run(config, top, server, run_as);
    }
    tracee::check_privileges()?;
    launch::raise_file_limit();
    // Signal handlers before anything else: a Ctrl-C from here on ends the
    // trace with a report (once the probes are in), never kills mtrace.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let signals = {
        let _in_runtime = rt.enter();
        Signals::new()?
    };
    // Before attaching: the target runs on once probes are in.
    let stats_fd = if config.bpf_stats {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("enabling BPF run-time stats")?,
        )
    } else {
        None
    };
    let (attached, mut aside) = attach(&config, top, run_as)?;
    let pid = attached.root.pid();
    let (mut session, mut inputs) = start(&config, attached, aside.exit_hold.as_mut(), signals);
    let mut sinks: Vec<Box<dyn Sink>> = vec![
        Box::new(Snapshots::new(config.snapshot_dir.clone(), pid).grouped_as(&config.outputs)),
        Box::new(Report(config.outputs.clone())),
    ];
    let (mut watchers, stop) = watchers(&config, top, pid, aside.command_log.as_deref())?;
    if let Some(server) = server {
        inputs.wake = Some(crate::agent::serve(server, &mut watchers)?);
    }
    inputs.stop = stop;
    let ran = rt.block_on(session.run(&config.schedule, &mut sinks, inputs, &mut watchers));
    if let Ok((end @ End::TargetExited(_), _)) = &ran {
        let (why, tick) = (end.describe(None), session.tick());
        for w in watchers.iter_mut() {
            w.ended(&why, &tick, &|| session.profile());
        }
    }
    // The status line goes before anything else is said.
    drop(watchers);
    let (end, exit_rx) = ran?;
    let profile = conclude(&mut session, &end, &config, &aside, stats_fd.is_some())?;
    drop(stats_fd);
    drop(aside);
    // Report first: detaching waits for the kernel, and the counts are
    // already read.
    // Every sink is given the profile, whichever fails.
    let mut finished = Outcome::default();
    for sink in &mut sinks {
        finished.add(sink.finish(&profile));
    }
    let root_code = session.root_code();
    // Dropping the programs closes their links: the kernel takes the
    // breakpoints out of the target.
    session.detach();
    finished.result()?;
    Ok(exit_code(end, exit_rx, root_code, &config.target, &rt))
}

/// The session of the attached root, and what its loop listens to
/// (all but the live view's `q`). Tracing begins: the target runs on.
fn start(
    config: &TraceConfig,
    attached: Attached,
    exit_hold: Option<&mut ExitHold>,
    signals: Signals,
) -> (Session, Inputs) {
    let Attached {
        root,
        exit,
        tree_rx,
        descendants,
    } = attached;
    let mut meta = match &root {
        Root::Probed(p) => p.meta.clone(),
        Root::Go { meta, .. } => (**meta).clone(),
    };
    if let Target::Command(argv) = &config.target {
        meta.command = argv.join(" ");
    }
    let tracing = tracing_line(config, &root);
    let options = session::Options {
        settings: settings(config),
        per_process: config.outputs.table.per_process,
        max_processes: config.max_processes,
        min_age_ns: config.min_age_ns,
        windows: config.windows,
        bounded: config.schedule.until_stopped,
    };
    let mut session = match root {
        Root::Probed(root) => Session::new(*root, meta, options),
        Root::Go { go, .. } => Session::new_go(go, meta, options),
    };
    // The processes it had created are probed before tracing is said to
    // begin; from then on the hold tells the session of the tree.
    for (parent, child) in descendants {
        session.adopt(parent, child);
    }
    if let Some(hold) = exit_hold {
        hold.go();
    }
    say!("{tracing}");
    let (exit_rx, pidfd, cgroup) = match exit {
        TargetExit::Launched(rx) => (Some(rx), None, None),
        TargetExit::Pidfd(fd) => (None, Some(fd), None),
        TargetExit::Cgroup(dir, handover) => (None, None, Some(session::Scope { dir, handover })),
    };
    let inputs = Inputs {
        exit_rx,
        pidfd,
        tree_events: Some(tree_rx),
        signals,
        stop: None,
        cgroup,
        wake: None,
    };
    (session, inputs)
}

/// The trace has ended: says why, stops counting in every process at once,
/// and reads the final profile.
fn conclude(
    session: &mut Session,
    end: &End,
    config: &TraceConfig,
    aside: &Aside,
    bpf_stats: bool,
) -> Result<Profile> {
    say!(
        "mtrace: tracing ended after {:.1} s: {}",
        session.elapsed().as_secs_f64(),
        end.describe(config.schedule.duration)
    );
    if let Some(log) = &aside.command_log {
        say!("mtrace: the command's output is in {}", log.display());
    }
    // Counting stops for all functions at once, before the maps are read.
    session.finish()?;
    if let End::TargetExited(Some(code)) = end {
        session.root_exited(*code);
    }
    if let Some(root) = session.root() {
        if bpf_stats {
            log_program_times(&root.probes.programs);
        }
        log_unwind(root, config);
    }
    let mut profile = session.profile()?;
    crate::profile::window::scale_windows(&mut profile);
    for u in &profile.unseen {
        say!(
            "mtrace: pid {} ({}): {} not seen: {}",
            u.pid,
            printable(&u.name),
            u.heap,
            u.why
        );
    }
    if profile.totals.allocs.calls == 0 && profile.meta.allocator_object.is_empty() {
        // A Go program read only: its heap rows are the trace.
    } else if profile.totals.allocs.calls == 0 {
        // Loud: a process that allocates through something mtrace did not
        // probe must not look like one that allocates nothing.
        say!(
            "mtrace: no allocation calls counted: probed {} ({}){}",
            profile.meta.allocator_object,
            profile.meta.allocator_family,
            if aside.shadowed.is_empty() {
                String::new()
            } else {
                format!(
                    "; other objects defining allocator functions: {}",
                    aside.shadowed.join(", ")
                )
            }
        );
    }
    Ok(profile)
}

/// The configuration, checked before anything is attached: a typo in an
/// output path or a user name must not cost the trace.
fn checked_config(args: &TraceArgs, top: bool) -> Result<(TraceConfig, Option<RunAs>)> {
    let Some(config) = TraceConfig::from_args(args) else {
        return Err(anyhow::Error::new(UserError::with_code(
            "nothing to trace: give --pid PID, --cgroup PATH, --all or a command after `--` (see mtrace --help)",
            EXIT_USAGE,
        )));
    };
    config.outputs.check()?;
    let run_as = config.user.as_deref().map(RunAs::lookup).transpose()?;
    config.outputs.check_weight(config.mode.live)?;
    let snapshots = |why: String| {
        anyhow::Error::new(UserError::with_code(
            format!(
                "cannot write snapshots to {}: {why}",
                config.snapshot_dir.display()
            ),
            EXIT_USAGE,
        ))
    };
    if !config.snapshot_dir.is_dir() {
        return Err(snapshots("no such directory".into()));
    }
    // Snapshots asked for (an interval, a directory named) must be
    // possible; the default directory only serves a SIGUSR1, whose failed
    // snapshot is said without ending the trace.
    if config.schedule.interval.is_some() || config.snapshot_dir != Path::new(".") {
        check_writable_dir(&config.snapshot_dir).map_err(|e| snapshots(e.to_string()))?;
    }
    if top {
        watch::top::check_terminal()?;
    }
    Ok((config, run_as))
}

/// What every process's probes and tracker are set up with.
fn settings(config: &TraceConfig) -> ProcSettings {
    ProcSettings {
        mode: config.mode,
        sizes: config.sizes,
        temporary_ns: config.temporary_ns,
        live_blocks: config.live_blocks,
    }
}

/// How the target's end is learnt.
enum TargetExit {
    /// Launch mode: the launch thread sends the command's exit code.
    Launched(oneshot::Receiver<i32>),
    /// By pid: a pidfd becomes readable.
    Pidfd(OwnedFd),
    /// By cgroup: the cgroup is empty; and where to send the processes
    /// that join it or leave it for the hold to seize or let go.
    Cgroup(PathBuf, std::sync::mpsc::Sender<tracee::launch::Handover>),
}

/// The process a trace begins with: probed, or a Go program with no
/// malloc whose own heap profile is read (`meta` is its profile's).
enum Root {
    Probed(Box<TracedProcess>),
    Go {
        go: Box<crate::golang::GoProcess>,
        meta: Box<Meta>,
    },
}

impl Root {
    fn pid(&self) -> u32 {
        match self {
            Root::Probed(p) => p.pid,
            Root::Go { go, .. } => go.pid,
        }
    }

    /// A Go program's, if `pid` (mapping `maps`) is one with no malloc.
    fn go(pid: u32, maps: &[tracee::Mapping], template: &Meta) -> Option<Result<Root>> {
        match crate::golang::detect(pid, maps) {
            crate::golang::Found::Go(go) => Some(Ok(Root::Go {
                go,
                meta: Box::new(Meta {
                    pid,
                    command: tracee::cmdline(pid),
                    executable: tracee::executable(pid),
                    ..template.clone()
                }),
            })),
            crate::golang::Found::Unreadable(u) => Some(Err(user_error!(
                "pid {pid}: no malloc found, and its Go heap cannot be read: {}",
                u.why
            ))),
            crate::golang::Found::None => None,
        }
    }
}

/// The root process, probed, and what the session listens to.
struct Attached {
    root: Root,
    exit: TargetExit,
    /// What the thread that traces the tree tells the session.
    tree_rx: UnboundedReceiver<TreeRequest>,
    /// By pid with --children: the processes it had created.
    descendants: Vec<(u32, u32)>,
}

/// What the trace keeps beside the session until it ends.
struct Aside {
    /// By pid: the target is held at its exit for a last look at its
    /// mappings (launch mode's ptrace does the same).
    exit_hold: Option<ExitHold>,
    /// mtrace top, launch mode: where the command's output went.
    command_log: Option<PathBuf>,
    /// Objects other than the probed one that define allocator functions.
    shadowed: Vec<String>,
}

/// By cgroup: the process whose profile leads the trace (the first of the
/// cgroup's processes with an allocator mapped, parents before children),
/// its allocator and mappings, and the others.
type CgroupRoot = (
    u32,
    Option<allocators::AllocatorObject>,
    Vec<tracee::Mapping>,
    Vec<u32>,
);

fn cgroup_root(dir: &Path, given: &str, python_objects: bool) -> Result<CgroupRoot> {
    let members = tracee::cgroup::members_below(dir);
    if members.is_empty() {
        return Err(user_error!("cgroup {given} has no process to trace"));
    }
    for &pid in &members {
        let Ok(maps) = tracee::read_maps(pid) else {
            continue;
        };
        if let Ok(Some(alloc)) = allocators::find_in_process(pid, &maps, python_objects) {
            let others = members.iter().copied().filter(|&p| p != pid).collect();
            return Ok((pid, Some(alloc), maps, others));
        }
    }
    // None with malloc: a Go program's own heap leads.
    for &pid in &members {
        let Ok(maps) = tracee::read_maps(pid) else {
            continue;
        };
        if crate::golang::binary::is_go(Path::new(&format!("/proc/{pid}/exe"))) {
            let others = members.iter().copied().filter(|&p| p != pid).collect();
            return Ok((pid, None, maps, others));
        }
    }
    Err(user_error!(
        "cgroup {given}: none of its {} processes has an allocator mapped",
        members.len()
    ))
}

/// Probes the target: by pid, or by launching the command.
fn attach(config: &TraceConfig, top: bool, run_as: Option<RunAs>) -> Result<(Attached, Aside)> {
    let started = Instant::now();
    crate::probes::kernel::prepare();
    let settings = settings(config);
    // What every process's profile shares.
    let template = Meta {
        mtrace_version: env!("CARGO_PKG_VERSION").to_string(),
        start_time: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        kernel_release: crate::session::kernel_release(),
        mode: if config.mode.live { "live" } else { "count" }.into(),
        ..Default::default()
    };
    let (on_event, tree_rx) = tree_channel();
    let tree = match &config.target {
        Target::Pid(_) => config.children,
        Target::Cgroup(_) => true,
        Target::Command(_) => config.follow,
        // Traced by `host::run`, never attached here.
        Target::Host => unreachable!("--all is traced by host::run"),
    };
    if tree {
        crate::probes::pool::keep_spares();
    }
    let (attached, exit_hold, command_log) = match &config.target {
        Target::Pid(pid) => {
            let pid = *pid;
            tracee::check_pid(pid)?;
            let pidfd = session::pidfd_open(pid)?;
            let (hold, descendants) = ExitHold::start(pid, config.children, on_event);
            let maps = tracee::read_maps(pid)
                .map_err(|e| user_error!("cannot read /proc/{pid}/maps: {e}"))?;
            let root = match allocators::find_in_process(pid, &maps, config.mode.python_objects)? {
                Some(alloc) => {
                    let space = Arc::new(Mutex::new(AddressSpace::new()));
                    Root::Probed(Box::new(TracedProcess::attach_to(
                        pid, alloc, &maps, &settings, space, &template,
                    )?))
                }
                None => match Root::go(pid, &maps, &template) {
                    Some(root) => root?,
                    None => {
                        allocators::require_in_process(pid, &maps, config.mode.python_objects)?;
                        unreachable!("no allocator found twice")
                    }
                },
            };
            let attached = Attached {
                root,
                exit: TargetExit::Pidfd(pidfd),
                tree_rx,
                descendants,
            };
            (attached, Some(hold), None)
        }
        Target::Cgroup(given) => {
            let dir = tracee::cgroup::resolve(given)?;
            let (root, alloc, maps, others) = cgroup_root(&dir, given, config.mode.python_objects)?;
            let (adopt_tx, adopt_rx) = std::sync::mpsc::channel();
            let (hold, descendants) =
                ExitHold::start_with(root, others, true, Some(adopt_rx), on_event);
            let root = match alloc {
                Some(alloc) => {
                    let space = Arc::new(Mutex::new(AddressSpace::new()));
                    Root::Probed(Box::new(TracedProcess::attach_to(
                        root, alloc, &maps, &settings, space, &template,
                    )?))
                }
                None => Root::go(root, &maps, &template)
                    .unwrap_or_else(|| Err(user_error!("cgroup {given}: no process to trace")))?,
            };
            let attached = Attached {
                root,
                exit: TargetExit::Cgroup(dir, adopt_tx),
                tree_rx,
                descendants,
            };
            (attached, Some(hold), None)
        }
        Target::Host => unreachable!("--all is traced by host::run"),
        Target::Command(argv) => {
            // The live view has the terminal: the command's output goes
            // to a log meanwhile (mtrace's own is back once it started).
            let redirect = if top {
                Some(watch::top::Redirect::start().context("redirecting the command's output")?)
            } else {
                None
            };
            let command_log = redirect.as_ref().map(|r| r.log.clone());
            let launched = launch::launch(
                argv,
                config.follow,
                run_as,
                move |pid, maps| {
                    let space = Arc::new(Mutex::new(AddressSpace::new()));
                    match TracedProcess::attach(pid, maps, &settings, space, &template)? {
                        Some(p) => Ok(Some(Root::Probed(Box::new(p)))),
                        None => Root::go(pid, maps, &template).transpose(),
                    }
                },
                on_event,
                crate::symbolize::warm_up,
            );
            drop(redirect);
            let launched = launched?;
            let attached = Attached {
                root: launched.attached,
                exit: TargetExit::Launched(launched.exit),
                tree_rx,
                descendants: Vec::new(),
            };
            (attached, None, command_log)
        }
    };
    log::debug!(
        "attached in {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    let shadowed = match &attached.root {
        Root::Probed(root) => {
            log_probes(&root.probes.attached);
            log_verified(&root.probes.programs);
            root.shadowed.clone()
        }
        Root::Go { .. } => Vec::new(),
    };
    let aside = Aside {
        exit_hold,
        command_log,
        shadowed,
    };
    Ok((attached, aside))
}

/// The thread that traces the target (launch mode's, or the exit hold by
/// pid) tells the session what happens in the process tree: a new process
/// to probe before it runs, an exec, an exit. It holds the process
/// concerned stopped until the session answers.
fn tree_channel() -> (
    impl FnMut(TreeEvent) -> Result<Option<()>> + Send + 'static,
    UnboundedReceiver<TreeRequest>,
) {
    let (tree_tx, tree_rx) = tokio::sync::mpsc::unbounded_channel::<TreeRequest>();
    let on_event = move |event: TreeEvent| -> Result<Option<()>> {
        let wait = !matches!(event, TreeEvent::Gone { .. });
        let (reply, done) = std::sync::mpsc::channel();
        let request = TreeRequest {
            event: event.into(),
            reply: wait.then_some(reply),
        };
        if tree_tx.send(request).is_err() || !wait {
            // The trace has ended, or nothing to wait for.
            return Ok(Some(()));
        }
        match done.recv() {
            Ok(Ok(true)) | Err(_) => Ok(Some(())),
            Ok(Ok(false)) => Ok(None),
            Ok(Err(e)) => Err(anyhow::anyhow!(e)),
        }
    };
    (on_event, tree_rx)
}

/// `mtrace: tracing pid 1234 (name): 8 probes in libc.so.6, ...`
fn tracing_line(config: &TraceConfig, root: &Root) -> String {
    let pid = root.pid();
    let placement = match root {
        Root::Probed(root) => {
            let mut placed = root.probes.placement();
            if let Some(go) = &root.go {
                placed.push_str(&format!(
                    "; its Go heap ({}) read from its memory",
                    go.version()
                ));
            }
            placed
        }
        Root::Go { go, .. } => format!(
            "no malloc, its Go heap ({}) read from its memory",
            go.version()
        ),
    };
    format!(
        "mtrace: tracing pid {} ({}): {}{}{}",
        pid,
        printable(&tracee::comm(pid)),
        placement,
        match &config.target {
            Target::Command(_) if config.follow => ", and every process it starts",
            Target::Pid(_) if config.children => ", and its children, present and to come",
            Target::Cgroup(_) => ", and every process of its cgroup, present and to come",
            _ => "",
        },
        if config.schedule.duration.is_some() {
            String::new()
        } else {
            ", Ctrl-C to stop".into()
        }
    )
}

/// The live view (`top`) and the receiver of its `q`, or the status line.
fn watchers(
    config: &TraceConfig,
    top: bool,
    pid: u32,
    command_log: Option<&Path>,
) -> Result<crate::session::drive::Watchers> {
    let mut watchers: Vec<Box<dyn Watcher>> = Vec::new();
    let mut stop = None;
    if top {
        let title = format!(
            "mtrace top: pid {pid} ({}), {} mode{}",
            printable(&tracee::comm(pid)),
            if config.mode.live { "live" } else { "count" },
            match command_log {
                Some(log) => format!(", the command's output in {}", log.display()),
                None => String::new(),
            }
        );
        let (view, stop_rx) = watch::top::TopView::start(title, config.mode.live, false)?;
        watchers.push(Box::new(view));
        stop = Some(stop_rx);
    } else if let Some(line) = StatusLine::new() {
        watchers.push(Box::new(line));
    }
    Ok((watchers, stop))
}

/// mtrace's exit status: the command's in launch mode, 0 when a trace by
/// pid ends as it normally does.
fn exit_code(
    end: End,
    exit_rx: Option<oneshot::Receiver<i32>>,
    root_code: Option<i32>,
    target: &Target,
    rt: &tokio::runtime::Runtime,
) -> i32 {
    // Launch mode, the trace ended first: the command runs on; pass its
    // status through.
    let command_status = |rx: Option<oneshot::Receiver<i32>>| match rx {
        Some(rx) => rt.block_on(rx).unwrap_or(0),
        None => 0,
    };
    match end {
        // By pid, the target's end is said (with its status when known),
        // and is how a trace normally ends.
        End::TargetExited(_) if !matches!(target, Target::Command(_)) => 0,
        End::TargetExited(code) => code.unwrap_or(0),
        // The command exited while processes it started ran on.
        _ if root_code.is_some() => root_code.unwrap_or(0),
        End::Duration | End::Stopped => command_status(exit_rx),
        End::CgroupEmpty => 0,
        // Ctrl-C is how a trace by pid normally ends.
        End::Interrupted(_) if !matches!(target, Target::Command(_)) => 0,
        End::Interrupted(sig) => 128 + sig,
    }
}

/// The verifier's work on each program (`-v`).
fn log_verified(programs: &[multi::Program]) {
    for prog in programs {
        if let Ok(info) = prog.info() {
            log::debug!(
                "bpf program {}: {} instructions verified",
                prog.name,
                info.verified_instructions
            );
        }
    }
}

/// The root's unwinder at work (`-v`).
fn log_unwind(root: &TracedProcess, config: &TraceConfig) {
    let walks = root.unwind.walks();
    let u = &walks.unwinder.stats;
    log::debug!(
        "unwind: {} walks finished by the tracer, {} rules from {} objects ({} of them learned in other processes of the run, given at the start; {} where code without call-frame information keeps a frame pointer; loading {:.1} ms, rules {:.1} ms, longest wait in the ring {:.1} ms, records of {:.1} KiB on average, {} with pages that could not be read); {} rules found the kernel map full; memory: rules {} KiB here; in the kernel, rules map {} KiB ({} of {} entries used), cache {} KiB, ring {} KiB",
        u.walks_finished,
        u.rules,
        u.objects,
        u.seeded,
        u.frame_pointer_rules,
        u.load_time.as_secs_f64() * 1e3,
        u.lookup_time.as_secs_f64() * 1e3,
        u.max_wait.as_secs_f64() * 1e3,
        u.record_bytes as f64 / 1024.0 / u.walks_finished.max(1) as f64,
        u.copies_with_holes,
        walks.rules_full,
        // A hash-map entry here: key, rule and the table's overhead.
        u.rules * 32 / 1024,
        // The kernel's hash map, preallocated: key, value and ~64 bytes
        // of element each.
        config.sizes.unwind_rules as usize * 80 / 1024,
        u.rules,
        config.sizes.unwind_rules,
        tracer_common::RULE_CACHE_SLOTS as usize * std::mem::size_of::<tracer_common::CachedRule>() / 1024,
        config.sizes.unwind_ring / 1024,
    );
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
fn log_program_times(programs: &[multi::Program]) {
    for prog in programs {
        if let Ok(info) = prog.info() {
            if info.runs > 0 {
                log::debug!(
                    "bpf program {}: {} runs, {:.1} ns per run",
                    prog.name,
                    info.runs,
                    info.run_time_ns as f64 / info.runs as f64
                );
            }
        }
    }
}
