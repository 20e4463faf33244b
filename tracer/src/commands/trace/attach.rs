//! Attaching to the target: the root process found or launched (by pid,
//! command or cgroup), its probes attached, and the channel over which the
//! thread that follows the process tree tells the session what happened.

use std::{
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Instant, SystemTime},
};

use anyhow::{Context, Result};
use tokio::sync::{mpsc::UnboundedReceiver, oneshot};

use super::log::{log_probes, log_verified};
use super::settings;
use crate::{
    allocators,
    cli::config::{Target, TraceConfig},
    profile::Meta,
    session::{self, TracedProcess, TreeRequest},
    tracee::{self, launch, ptrace::TreeEvent, AddressSpace, ExitHold, RunAs},
    user_error,
    watch::{self},
};

/// How the target's end is learnt.
pub(super) enum TargetExit {
    /// Launch mode: the launch thread sends the command's exit code.
    Launched(oneshot::Receiver<i32>),
    /// By pid: a pidfd becomes readable.
    Pidfd(OwnedFd),
    /// By cgroup: the cgroup is empty; and where to send the processes
    /// that join it or leave it for the hold to seize or let go.
    Cgroup(PathBuf, std::sync::mpsc::Sender<tracee::ptrace::Handover>),
}

/// The process a trace begins with: probed, or a Go program with no
/// malloc whose own heap profile is read (`meta` is its profile's).
pub(super) enum Root {
    Probed(Box<TracedProcess>),
    Go {
        go: Box<crate::golang::GoProcess>,
        meta: Box<Meta>,
    },
}

impl Root {
    pub(super) fn pid(&self) -> u32 {
        match self {
            Root::Probed(p) => p.pid,
            Root::Go { go, .. } => go.pid,
        }
    }

    /// A Go program's, if `pid` (mapping `maps`) is one with no malloc.
    pub(super) fn go(pid: u32, maps: &[tracee::Mapping], template: &Meta) -> Option<Result<Root>> {
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
pub(super) struct Attached {
    pub(super) root: Root,
    pub(super) exit: TargetExit,
    /// What the thread that traces the tree tells the session.
    pub(super) tree_rx: UnboundedReceiver<TreeRequest>,
    /// By pid with --children: the processes it had created.
    pub(super) descendants: Vec<(u32, u32)>,
}

/// What the trace keeps beside the session until it ends.
pub(super) struct Aside {
    /// By pid: the target is held at its exit for a last look at its
    /// mappings (launch mode's ptrace does the same).
    pub(super) exit_hold: Option<ExitHold>,
    /// mtrace top, launch mode: where the command's output went.
    pub(super) command_log: Option<PathBuf>,
    /// Objects other than the probed one that define allocator functions.
    pub(super) shadowed: Vec<String>,
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
pub(super) fn attach(
    config: &TraceConfig,
    top: bool,
    run_as: Option<RunAs>,
) -> Result<(Attached, Aside)> {
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
        // A throttle signal no session answers for is the program's.
        let unanswered = match event {
            TreeEvent::Throttled { .. } => None,
            _ => Some(()),
        };
        let (reply, done) = std::sync::mpsc::channel();
        let request = TreeRequest {
            event: event.into(),
            reply: wait.then_some(reply),
        };
        if tree_tx.send(request).is_err() || !wait {
            // The trace has ended, or nothing to wait for.
            return Ok(unanswered);
        }
        match done.recv() {
            Err(_) => Ok(unanswered),
            Ok(Ok(true)) => Ok(Some(())),
            Ok(Ok(false)) => Ok(None),
            Ok(Err(e)) => Err(anyhow::anyhow!(e)),
        }
    };
    (on_event, tree_rx)
}
