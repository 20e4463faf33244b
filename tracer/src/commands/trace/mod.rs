//! `mtrace --pid PID` and `mtrace -- CMD`: attach (by pid, or by launching
//! the command), run the session until the trace ends, hand the final
//! profile to the sinks, detach.

use std::path::Path;

use anyhow::Result;
use tokio::sync::oneshot;

use crate::{
    cli::{
        config::{Target, TraceConfig},
        TraceArgs,
    },
    error::{UserError, EXIT_USAGE},
    profile::Profile,
    render::text::printable,
    say,
    session::{self, End, Inputs, ProcSettings, Session, Signals},
    sinks::{files::check_writable_dir, Outcome, Report, Sink, Snapshots},
    tracee::{self, launch, ExitHold, RunAs},
    watch::{self, StatusLine, Watcher},
};

mod attach;
mod log;

use attach::{attach, Aside, Attached, Root, TargetExit};
use log::{log_unwind, tracing_line};

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
pub fn run_agent(args: crate::cli::agent::AgentArgs) -> Result<i32> {
    use crate::cli::agent::PolicyArg;
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
        return crate::host::run(config, top, server, run_as);
    }
    tracee::check_privileges()?;
    launch::raise_file_limit();
    // Signal handlers before anything else: a Ctrl-C from here on ends the
    // trace with a report (once the probes are in), never kills mtrace.
    let (rt, signals) = crate::session::runtime_with_signals()?;
    // Before attaching: the target runs on once probes are in.
    let stats_fd = crate::probes::multi::run_times(config.bpf_stats)?;
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
            for prog in &root.probes.programs {
                prog.log_times();
            }
        }
        log_unwind(root, config);
    }
    let mut profile = session.profile()?;
    crate::profile::window::scale_windows(&mut profile);
    crate::unwind::say_copy_lost(profile.stack_quality.as_ref(), config.sizes.unwind_ring);
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
