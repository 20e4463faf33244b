//! `mtrace --pid PID` and `mtrace -- CMD`: attach (by pid, or by launching
//! the command), run the session until the trace ends, hand the final
//! profile to the sinks, detach.

use std::{
    sync::{Arc, Mutex},
    time::{Instant, SystemTime},
};

use anyhow::{Context, Result};

use crate::{
    allocators,
    cli::{
        config::{Target, TraceConfig},
        TraceArgs,
    },
    collect::{live_tracker, timeline::Recorder},
    error::{UserError, EXIT_USAGE},
    profile::{Meta, Probe, ProcessMeta},
    session::{
        self, Clock, End, Inputs, Proc, ProcSettings, Session, Signals, TreeRequest, Watcher,
    },
    sinks::{Report, Sink, Snapshots},
    status::StatusLine,
    target::{self, launch, launch::TreeEvent, AddressSpace},
    user_error,
};

/// A trace; with `top`, under the full-screen live view.
pub fn run(args: TraceArgs, top: bool) -> Result<i32> {
    let Some(config) = TraceConfig::from_args(&args) else {
        return Err(anyhow::Error::new(UserError::with_code(
            "nothing to trace: give --pid PID or a command after `--` (see mtrace --help)",
            EXIT_USAGE,
        )));
    };
    // A typo in an output path or a user name must not cost the trace.
    config.outputs.check()?;
    let run_as = config
        .user
        .as_deref()
        .map(target::RunAs::lookup)
        .transpose()?;
    config.outputs.check_weight(config.mode.live)?;
    if !config.snapshot_dir.is_dir() {
        return Err(anyhow::Error::new(UserError::with_code(
            format!(
                "cannot write snapshots to {}: no such directory",
                config.snapshot_dir.display()
            ),
            EXIT_USAGE,
        )));
    }
    if top {
        crate::top::check_terminal()?;
    }
    target::check_privileges()?;
    crate::target::launch::raise_file_limit();
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
    let attach_started = Instant::now();
    let settings = ProcSettings {
        mode: config.mode,
        sizes: config.sizes,
        temporary_ns: config.temporary_ns,
        live_blocks: config.live_blocks,
    };
    let mode = config.mode;
    // What every process's profile shares.
    let template = Meta {
        mtrace_version: env!("CARGO_PKG_VERSION").to_string(),
        start_time: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        kernel_release: kernel_release(),
        mode: if mode.live { "live" } else { "count" }.into(),
        ..Default::default()
    };

    // The thread that traces the target (launch mode's, or the exit hold
    // by pid) tells the session what happens in the process tree: a new
    // process to probe before it runs, an exec, an exit. It holds the
    // process concerned stopped until the session answers.
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
    // By pid: the target is held at its exit for a last look at its
    // mappings (launch mode's ptrace does the same).
    let mut exit_hold = None;
    // By pid with --children: the processes it had created.
    let mut descendants = Vec::new();
    // mtrace top, launch mode: where the command's output went.
    let mut command_log = None;
    let (root, exit_rx) = match &config.target {
        Target::Pid(pid) => {
            let pid = *pid;
            target::check_pid(pid)?;
            let pidfd = session::pidfd_open(pid)?;
            let (hold, found) = target::ExitHold::start(pid, config.children, on_event);
            exit_hold = Some(hold);
            descendants = found;
            let maps = target::read_maps(pid)
                .map_err(|e| user_error!("cannot read /proc/{pid}/maps: {e}"))?;
            let alloc = allocators::require_in_process(pid, &maps)?;
            let space = Arc::new(Mutex::new(AddressSpace::new()));
            let root = Proc::attach_to(pid, alloc, &maps, &settings, space, &template)?;
            (root, Err(pidfd))
        }
        Target::Command(argv) => {
            // The live view has the terminal: the command's output goes
            // to a log meanwhile (mtrace's own is back once it started).
            let redirect = if top {
                Some(crate::top::Redirect::start().context("redirecting the command's output")?)
            } else {
                None
            };
            command_log = redirect.as_ref().map(|r| r.log.clone());
            let template = template.clone();
            let launched = launch::launch(
                argv,
                config.follow,
                run_as,
                move |pid, maps| {
                    let space = Arc::new(Mutex::new(AddressSpace::new()));
                    Proc::attach(pid, maps, &settings, space, &template)
                },
                on_event,
            );
            drop(redirect);
            let launched = launched?;
            (launched.attached, Ok(launched.exit))
        }
    };
    let pid = root.pid;
    log::debug!(
        "attached in {:.1} ms",
        attach_started.elapsed().as_secs_f64() * 1e3
    );
    log_probes(&root.probes.attached);
    for (name, prog) in root.probes.ebpf.programs() {
        if let Some(n) = prog
            .info()
            .ok()
            .and_then(|i| i.verified_instruction_count())
        {
            log::debug!("bpf program {name}: {n} instructions verified");
        }
    }
    let mut meta = root.meta.clone();
    if let Target::Command(argv) = &config.target {
        meta.command = argv.join(" ");
    }
    let tracing = format!(
        "mtrace: tracing pid {pid} ({}): {} probes in {}{}{}",
        target::comm(pid),
        root.probes.attached.len(),
        meta.allocator_object,
        match &config.target {
            Target::Command(_) if config.follow => ", and every process it starts",
            Target::Pid(_) if config.children => ", and its children, present and to come",
            _ => "",
        },
        if config.schedule.duration.is_some() {
            String::new()
        } else {
            ", Ctrl-C to stop".into()
        }
    );
    let mut tree = session::Tree {
        processes: vec![ProcessMeta {
            pid,
            ..Default::default()
        }],
        unlisted: 0,
    };
    tree.probed(&root);
    let shadowed = root.shadowed.clone();
    let family = meta.allocator_family.clone();
    let mut session = Session {
        root: pid,
        procs: [(pid, root)].into(),
        ended: None,
        tree,
        meta,
        clock: Clock {
            started: Instant::now(),
            started_ns: live_tracker::monotonic_ns(),
            min_age_ns: config.min_age_ns,
        },
        settings,
        per_thread: mode.per_thread,
        per_process: config.outputs.table.per_process,
        max_processes: config.max_processes,
        graveyard: Default::default(),
        graveyard_bytes: 0,
        graveyard_detached: 0,
        timeline: Recorder::new(1.0, mode.live || mode.count_frees),
    };
    // The processes it had created are probed before tracing is said to
    // begin; from then on the hold tells the session of the tree.
    for (parent, child) in descendants {
        session.adopt(parent, child);
    }
    if let Some(hold) = &mut exit_hold {
        hold.go();
    }
    eprintln!("{tracing}");
    let mut sinks: Vec<Box<dyn Sink>> = vec![
        Box::new(Snapshots::new(config.snapshot_dir.clone(), pid)),
        Box::new(Report(config.outputs.clone())),
    ];

    // How the target's end is learnt: from the launch thread, or a pidfd.
    let (exit_rx, pidfd) = match exit_rx {
        Ok(rx) => (Some(rx), None),
        Err(fd) => (None, Some(fd)),
    };
    let mut watchers: Vec<Box<dyn Watcher>> = Vec::new();
    let mut stop = None;
    if top {
        let title = format!(
            "mtrace top: pid {pid} ({}), {} mode{}",
            target::comm(pid),
            session.meta.mode,
            match &command_log {
                Some(log) => format!(", the command's output in {}", log.display()),
                None => String::new(),
            }
        );
        let (view, stop_rx) = crate::top::TopView::start(title, mode.live)?;
        watchers.push(Box::new(view));
        stop = Some(stop_rx);
    } else if let Some(line) = StatusLine::new() {
        watchers.push(Box::new(line));
    }
    let inputs = Inputs {
        exit_rx,
        pidfd,
        tree_events: Some(tree_rx),
        signals,
        stop,
    };
    let ran = rt.block_on(session.run(&config.schedule, &mut sinks, inputs, &mut watchers));
    // The status line goes before anything else is said.
    drop(watchers);
    let (end, exit_rx) = ran?;
    eprintln!(
        "mtrace: tracing ended after {:.1} s: {}",
        session.clock.started.elapsed().as_secs_f64(),
        end.describe(config.schedule.duration)
    );
    if let Some(log) = &command_log {
        eprintln!("mtrace: the command's output is in {}", log.display());
    }

    // Counting stops for all functions at once, before the maps are read.
    session.finish()?;
    if let (End::TargetExited(Some(code)), Some(root)) = (&end, session.tree.processes.first_mut())
    {
        root.exit_code = Some(*code);
    }
    if stats_fd.is_some() {
        if let Some(root) = session.procs.get(&pid) {
            log_program_times(&root.probes.ebpf);
        }
    }
    if let Some(root) = session.procs.get(&pid) {
        log_unwind(root, &config);
    }
    drop(stats_fd);
    let profile = session.profile()?;
    if profile.totals.allocs.calls == 0 {
        // Loud: a process that allocates through something mtrace did not
        // probe must not look like one that allocates nothing.
        eprintln!(
            "mtrace: no allocation calls counted: probed {} ({family}){}",
            profile.meta.allocator_object,
            if shadowed.is_empty() {
                String::new()
            } else {
                format!(
                    "; other objects defining allocator functions: {}",
                    shadowed.join(", ")
                )
            }
        );
    }
    drop(exit_hold);
    // Report first: detaching takes the kernel about 0.1 s per probe (an
    // RCU grace period each), and the counts are already read.
    let finished: Result<()> = sinks.iter_mut().try_for_each(|s| s.finish(&profile));
    // Dropping the programs closes their links: the kernel takes the
    // breakpoints out of the target.
    session.detach(matches!(end, End::TargetExited(_)));
    finished?;

    Ok(match end {
        End::TargetExited(code) => code.unwrap_or(0),
        End::Duration => match exit_rx {
            // Launch mode: the command runs on; pass its status through.
            Some(rx) => rt.block_on(rx).unwrap_or(0),
            None => 0,
        },
        // Ctrl-C is how a trace by pid normally ends.
        End::Interrupted(_) if matches!(config.target, Target::Pid(_)) => 0,
        End::Interrupted(sig) => 128 + sig,
        End::Stopped => match exit_rx {
            Some(rx) => rt.block_on(rx).unwrap_or(0),
            None => 0,
        },
    })
}

/// The root's unwinder at work (`-v`).
fn log_unwind(root: &Proc, config: &TraceConfig) {
    let walks = root.unwind.walks();
    let u = &walks.unwinder.stats;
    log::debug!(
        "unwind: {} walks finished by the tracer, {} rules from {} objects ({} where code without call-frame information keeps a frame pointer; loading {:.1} ms, rules {:.1} ms, longest wait in the ring {:.1} ms, records of {:.1} KiB on average, {} with pages that could not be read); {} rules found the kernel map full; memory: rules {} KiB here; in the kernel, rules map {} KiB ({} of {} entries used), cache {} KiB, ring {} KiB",
        u.walks_finished,
        u.rules,
        u.objects,
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
