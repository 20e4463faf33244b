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
    collect::live_tracker::{self, LiveTracker},
    error::{UserError, EXIT_USAGE},
    probes,
    profile::{Meta, Probe},
    session::{self, End, ExecRequest, Session, Signals},
    sinks::{Report, Sink, Snapshots},
    target::{self, launch, AddressSpace},
    unwind::service::UnwindService,
    user_error,
};

pub fn run(args: TraceArgs) -> Result<i32> {
    let Some(config) = TraceConfig::from_args(&args) else {
        return Err(anyhow::Error::new(UserError::with_code(
            "nothing to trace: give --pid PID or a command after `--` (see mtrace --help)",
            EXIT_USAGE,
        )));
    };
    // A typo in an output path must not cost the trace.
    config.outputs.check()?;
    if !config.snapshot_dir.is_dir() {
        return Err(anyhow::Error::new(UserError::with_code(
            format!(
                "cannot write snapshots to {}: no such directory",
                config.snapshot_dir.display()
            ),
            EXIT_USAGE,
        )));
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
    // Before attaching: the target runs on once probes are in.
    let stats_fd = if config.bpf_stats {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("enabling BPF run-time stats")?,
        )
    } else {
        None
    };
    let space = Arc::new(Mutex::new(AddressSpace::new()));
    let attach_started = Instant::now();
    let (mode, sizes) = (config.mode, config.sizes);

    // At each exec the thread that traces the target (launch mode's, or
    // the exit hold by pid) asks the session to probe the new program,
    // and holds it stopped until that is done.
    let (exec_tx, execs) = tokio::sync::mpsc::unbounded_channel::<ExecRequest>();
    let on_exec = move |_pid: u32, maps: &[target::Mapping]| -> Result<Option<()>> {
        let (reply, done) = std::sync::mpsc::channel();
        let maps = maps.to_vec();
        if exec_tx.send(ExecRequest { maps, reply }).is_err() {
            // The trace has ended.
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
    // The executable is read while the target surely lives: a launched
    // command may be gone by the time tracing is under way.
    let (pid, probes, unwind, (alloc_path, family, shadowed, version), executable, exit_rx) =
        match &config.target {
            Target::Pid(pid) => {
                let pid = *pid;
                target::check_pid(pid)?;
                let pidfd = session::pidfd_open(pid)?;
                exit_hold = Some(target::ExitHold::start(pid, space.clone(), on_exec));
                let maps = target::read_maps(pid)
                    .map_err(|e| user_error!("cannot read /proc/{pid}/maps: {e}"))?;
                let alloc = allocators::require_in_process(pid, &maps)?;
                space.lock().unwrap().refresh(pid);
                let executable = target::executable(pid);
                let (probes, unwind) = probes::attach(pid, &alloc, &maps, mode, sizes, |ebpf| {
                    UnwindService::start(ebpf, pid, space.clone(), mode.live)
                })?;
                (
                    pid,
                    probes,
                    unwind,
                    (alloc.path, alloc.family, alloc.shadowed, alloc.version),
                    executable,
                    Err(pidfd),
                )
            }
            Target::Command(argv) => {
                let shared = space.clone();
                let launched = launch::launch(
                    argv,
                    space.clone(),
                    move |pid, maps| {
                        let Some(alloc) = allocators::find_in_process(pid, maps)? else {
                            return Ok(None);
                        };
                        let (probes, unwind) =
                            probes::attach(pid, &alloc, maps, mode, sizes, |ebpf| {
                                UnwindService::start(ebpf, pid, shared.clone(), mode.live)
                            })?;
                        Ok(Some((
                            probes,
                            unwind,
                            (alloc.path, alloc.family, alloc.shadowed, alloc.version),
                            target::executable(pid),
                        )))
                    },
                    on_exec,
                )?;
                let (probes, unwind, path, executable) = launched.attached;
                (
                    launched.pid,
                    probes,
                    unwind,
                    path,
                    executable,
                    Ok(launched.exit),
                )
            }
        };
    log::debug!(
        "attached in {:.1} ms",
        attach_started.elapsed().as_secs_f64() * 1e3
    );
    log_probes(&probes.attached);
    for (name, prog) in probes.ebpf.programs() {
        if let Some(n) = prog
            .info()
            .ok()
            .and_then(|i| i.verified_instruction_count())
        {
            log::debug!("bpf program {name}: {n} instructions verified");
        }
    }
    let command = match &config.target {
        Target::Pid(_) => target::cmdline(pid),
        Target::Command(argv) => argv.join(" "),
    };
    eprintln!(
        "mtrace: tracing pid {pid} ({}): {} probes in {}{}",
        target::comm(pid),
        probes.attached.len(),
        alloc_path,
        if config.schedule.duration.is_some() {
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
        mode: if mode.live { "live" } else { "count" }.into(),
        sampling: None,
        allocator_object: alloc_path,
        allocator_family: family.to_string(),
        allocator_version: version.unwrap_or_default(),
        probes: probes.attached.clone(),
    };
    let mut session = Session {
        pid,
        tracker: mode
            .live
            .then(|| LiveTracker::new(config.temporary_ns, config.live_blocks)),
        min_age_ns: config.min_age_ns,
        started_ns: live_tracker::monotonic_ns(),
        probes,
        space,
        meta,
        per_thread: mode.per_thread,
        started: Instant::now(),
        unwind,
        mode,
        sizes,
        before_exec: Vec::new(),
    };
    let mut sinks: Vec<Box<dyn Sink>> = vec![
        Box::new(Snapshots::new(config.snapshot_dir.clone(), pid)),
        Box::new(Report(config.outputs.clone())),
    ];

    // How the target's end is learnt: from the launch thread, or a pidfd.
    let (exit_rx, pidfd) = match exit_rx {
        Ok(rx) => (Some(rx), None),
        Err(fd) => (None, Some(fd)),
    };
    let (end, exit_rx) = rt.block_on(session.run(
        &config.schedule,
        &mut sinks,
        exit_rx,
        pidfd,
        Some(execs),
        signals,
    ))?;

    // Counting stops for all functions at once, before the maps are read.
    session.probes.set_enabled(false)?;
    if stats_fd.is_some() {
        log_program_times(&session.probes.ebpf);
    }
    let walks = session.unwind.walks();
    let u = &walks.unwinder.stats;
    log::debug!(
        "unwind: {} walks finished by the tracer, {} rules from {} objects (loading {:.1} ms, rules {:.1} ms); {} rules found the kernel map full; memory: rules {} KiB here; in the kernel, rules map {} KiB ({} of {} entries used), cache {} KiB, ring {} KiB",
        u.walks_finished,
        u.rules,
        u.objects,
        u.load_time.as_secs_f64() * 1e3,
        u.lookup_time.as_secs_f64() * 1e3,
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
    drop(walks);
    drop(stats_fd);
    if let Some(t) = &mut session.tracker {
        t.finish();
    }
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
    drop(session);
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
