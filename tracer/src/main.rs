//! mtrace: an out-of-process malloc tracer on eBPF.
//!
//! Data flows one way: kernel maps -> [`raw_profile`] (addresses, read by
//! [`collect`]) -> [`profile`] (symbols, made by [`symbolize`]) -> [`render`].

mod allocator;
mod cli;
mod collect;
mod error;
mod launch;
mod probes;
mod profile;
mod raw_profile;
mod render;
mod symbolize;
mod target;

use std::{
    collections::BTreeMap,
    io::Write,
    os::fd::{FromRawFd, OwnedFd},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use clap::Parser;
use tokio::{io::unix::AsyncFd, signal::unix::SignalKind};

use crate::{
    cli::Cli,
    error::{UserError, EXIT_FAILURE},
    probes::{MapSizes, Probes},
    profile::Meta,
    render::ReportOptions,
    symbolize::AddressSpace,
};

fn main() {
    let cli = Cli::parse();
    env_logger::Builder::new()
        .filter_level(log::LevelFilter::Warn)
        .filter_module(
            "mtrace",
            if cli.verbose {
                log::LevelFilter::Debug
            } else {
                log::LevelFilter::Warn
            },
        )
        .format_timestamp(None)
        .init();
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) => {
            let code = e
                .downcast_ref::<UserError>()
                .map(|u| u.code)
                .unwrap_or(EXIT_FAILURE);
            // One line: the outermost context and its cause.
            let msg = match e.downcast_ref::<UserError>() {
                Some(u) => u.message.clone(),
                None => e
                    .chain()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(": "),
            };
            eprintln!("mtrace: {}", msg.replace('\n', " "));
            code
        }
    };
    std::process::exit(code);
}

/// Why tracing stopped.
#[derive(Debug, PartialEq, Eq)]
enum End {
    TargetExited(Option<i32>),
    Duration,
    Interrupted(i32),
}

fn run(cli: Cli) -> Result<i32> {
    if cli.pid.is_none() && cli.command.is_empty() {
        return Err(user_error!(
            "nothing to trace: give --pid PID or a command after `--` (see mtrace --help)"
        ));
    }
    target::check_privileges()?;
    let sizes = MapSizes {
        counts: cli.count_map_size,
        stacks: cli.stack_map_size,
    };
    let per_thread = cli.per_thread;
    let space = Arc::new(Mutex::new(AddressSpace::new()));
    let started = Instant::now();

    let (pid, probes, alloc_path, exit_rx) = match cli.pid {
        Some(pid) => {
            target::check_pid(pid)?;
            let maps = target::read_maps(pid)
                .map_err(|e| user_error!("cannot read /proc/{pid}/maps: {e}"))?;
            let alloc = allocator::find_in_process(pid, &maps)?;
            space.lock().unwrap().refresh(pid);
            let probes = probes::attach(pid, &alloc, &maps, per_thread, sizes)?;
            (pid, probes, alloc.path, None)
        }
        None => {
            let launched = launch::launch(&cli.command, space.clone(), move |pid, alloc, maps| {
                let probes = probes::attach(pid, alloc, maps, per_thread, sizes)?;
                Ok((probes, alloc.path.clone()))
            })?;
            let (probes, path) = launched.attached;
            (launched.pid, probes, path, Some(launched.exit))
        }
    };
    let command = if cli.command.is_empty() {
        target::cmdline(pid)
    } else {
        cli.command.join(" ")
    };
    log::debug!("attached in {:?}", started.elapsed());
    for p in &probes.attached {
        log::debug!(
            "probe: {}+{} ({}{})",
            p.function,
            p.offset,
            p.instruction,
            if p.emulated { "" } else { ", single-stepped" }
        );
    }
    eprintln!(
        "mtrace: tracing pid {pid} ({}): {} probes in {}{}",
        target::comm(pid),
        probes.attached.len(),
        alloc_path,
        if cli.duration.is_some() {
            String::new()
        } else {
            ", Ctrl-C to stop".into()
        }
    );

    let traced_since = Instant::now();
    let start_time = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (end, exit_rx) = rt.block_on(wait_for_end(pid, cli.duration, exit_rx, &space))?;
    let duration_secs = traced_since.elapsed().as_secs_f64();

    // Names of live threads, before we let go.
    let mut thread_names = BTreeMap::new();
    if per_thread {
        thread_names.extend(target::thread_names(pid));
    }
    let raw = collect::collect(&probes).context("reading the kernel maps")?;
    let func_names = probes.func_names.clone();
    let attached = probes.attached.clone();
    detach(probes);

    let meta = Meta {
        mtrace_version: env!("CARGO_PKG_VERSION").to_string(),
        pid,
        command,
        start_time,
        duration_secs,
        kernel_release: kernel_release(),
        mode: "count".into(),
        allocator_object: alloc_path,
        probes: attached,
    };
    let profile = {
        let space = space.lock().unwrap();
        symbolize::symbolize(&raw, &space, &func_names, &thread_names, meta)
    };
    let opts = ReportOptions {
        top: cli.top,
        threshold_pct: cli.threshold,
        sort: cli.sort,
        per_thread,
    };
    let table = render::table::render(&profile, &opts);
    let mut out = std::io::stdout().lock();
    out.write_all(table.as_bytes())?;
    out.flush()?;
    drop(out);
    write_outputs(&cli, &profile)?;

    Ok(match end {
        End::TargetExited(Some(code)) => code,
        End::TargetExited(None) => 0,
        End::Duration => match exit_rx {
            // Launch mode: the command runs on; pass its status through.
            Some(rx) => rt.block_on(rx).unwrap_or(0),
            None => 0,
        },
        // Ctrl-C is how a trace by pid normally ends.
        End::Interrupted(_) if cli.pid.is_some() => 0,
        End::Interrupted(sig) => 128 + sig,
    })
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn detach(probes: Probes) {
    // Dropping the programs closes their links: the kernel removes the
    // breakpoints from the target.
    drop(probes);
}

fn write_outputs(cli: &Cli, profile: &profile::Profile) -> Result<()> {
    if cli.folded.is_none() && cli.flamegraph.is_none() {
        return Ok(());
    }
    let folded = render::folded::render(profile, cli.weight, cli.per_thread);
    if let Some(path) = &cli.folded {
        std::fs::write(path, &folded)
            .map_err(|e| user_error!("cannot write {}: {e}", path.display()))?;
        eprintln!("mtrace: wrote folded stacks to {}", path.display());
    }
    if let Some(path) = &cli.flamegraph {
        let title = format!(
            "mtrace: {} (pid {})",
            profile.meta.command, profile.meta.pid
        );
        match render::flamegraph::render(&folded, &title, cli.weight) {
            Ok(svg) => {
                std::fs::write(path, svg)
                    .map_err(|e| user_error!("cannot write {}: {e}", path.display()))?;
                eprintln!("mtrace: wrote flamegraph to {}", path.display());
            }
            Err(e) => eprintln!("mtrace: no flamegraph written: {e}"),
        }
    }
    Ok(())
}

/// How often the target's mappings are re-read (new libraries).
const REFRESH_EVERY: Duration = Duration::from_millis(500);

async fn wait_for_end(
    pid: u32,
    duration: Option<f64>,
    exit_rx: Option<tokio::sync::oneshot::Receiver<i32>>,
    space: &Arc<Mutex<AddressSpace>>,
) -> Result<(End, Option<tokio::sync::oneshot::Receiver<i32>>)> {
    let mut sigint = tokio::signal::unix::signal(SignalKind::interrupt())?;
    let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate())?;
    let sleep = async {
        match duration {
            Some(d) => tokio::time::sleep(Duration::from_secs_f64(d)).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(sleep);
    let mut refresh = tokio::time::interval(REFRESH_EVERY);

    match exit_rx {
        Some(mut rx) => loop {
            tokio::select! {
                code = &mut rx => return Ok((End::TargetExited(code.ok()), None)),
                _ = &mut sleep => return Ok((End::Duration, Some(rx))),
                _ = sigint.recv() => return Ok((End::Interrupted(libc::SIGINT), Some(rx))),
                _ = sigterm.recv() => return Ok((End::Interrupted(libc::SIGTERM), Some(rx))),
                _ = refresh.tick() => { space.lock().unwrap().refresh(pid); }
            }
        },
        None => {
            let pidfd = pidfd_open(pid)?;
            // SAFETY: the descriptor is ours and lives as long as the AsyncFd.
            let exited = unsafe { AsyncFd::register(pidfd) }.map_err(|e| e.into_parts().1)?;
            loop {
                tokio::select! {
                    _ = exited.readable() => return Ok((End::TargetExited(None), None)),
                    _ = &mut sleep => return Ok((End::Duration, None)),
                    _ = sigint.recv() => return Ok((End::Interrupted(libc::SIGINT), None)),
                    _ = sigterm.recv() => return Ok((End::Interrupted(libc::SIGTERM), None)),
                    _ = refresh.tick() => { space.lock().unwrap().refresh(pid); }
                }
            }
        }
    }
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
