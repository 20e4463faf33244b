//! mtrace: an out-of-process malloc tracer on eBPF.
//!
//! Data flows one way: kernel maps -> [`collect`] (raw profile,
//! addresses) -> [`symbolize`] (profile, symbols) -> [`render`] -> [`sinks`];
//! [`pipeline`] is that path for one traced program.

// The modules, roughly in the order data flows. `tracee`, `allocators`,
// `probes`, `unwind` and `collect` prepare and read the kernel's side;
// only `probes`, `unwind`, `collect`, `session` and `commands::trace` touch
// the kernel (aya).
mod tracee; // the traced process: /proc, launch under ptrace, its address space

mod asm; // x86-64 code: decoding, instruction walks, register data flow

mod allocators; // which object allocates, its entry points, probe placement

mod probes; // load the BPF object and attach the probes
mod python; // CPython frames: interpreter layouts, code objects, splicing

mod golang; // Go programs' own heap profile, read from their memory

mod unwind; // unwind rules from call-frame information; walks the tracer finishes

mod collect; // kernel maps and event rings -> raw profile (addresses)

mod symbolize; // raw profile -> profile (functions, files, lines)

mod pipeline; // collect -> live -> symbolize: one program's profile

mod session; // a trace under way: its processes, tree, loop and end

mod watch; // the status line and mtrace top, fed every second

mod sinks; // where profiles go: the report and its files, snapshots

mod agent;
mod host; // --all: file-wide probes in every process, counts by process and caller // mtrace agent: the trace served over HTTP (pprof, Prometheus)

mod cli; // arguments (clap) and what they mean (config)
mod commands; // trace (and top), report, diff, generate

// The offline half (model, file format, diff, renderers) is its own crate,
// with no kernel in its dependency tree.
use tracer_offline::{diff, error, profile, render, say, user_error};

use clap::Parser;

/// mtrace allocates through jemalloc linked into its executable (under
/// `_rjem_` names), never through the C library's malloc: the host
/// engine's probes sit in the C library's file for every process on the
/// host, mtrace included, and each of mtrace's own calls there would take
/// the breakpoint's trap only to be turned away.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use crate::{
    cli::{Cli, Sub},
    error::{UserError, EXIT_FAILURE, EXIT_USAGE},
};

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => usage_error(e),
    };
    env_logger::Builder::new()
        .filter_level(log::LevelFilter::Warn)
        .filter_module(
            "mtrace",
            if matches!(&cli.sub, Some(Sub::Top(a)) if a.verbose)
                || matches!(&cli.sub, Some(Sub::Agent(a)) if a.trace.verbose)
                || cli.trace.verbose
            {
                log::LevelFilter::Debug
            } else {
                log::LevelFilter::Warn
            },
        )
        .format_timestamp(None)
        .init();
    let no_debuginfod = match &cli.sub {
        Some(Sub::Top(a)) => a.no_debuginfod,
        Some(Sub::Agent(a)) => a.trace.no_debuginfod,
        Some(Sub::Report(a)) => a.no_debuginfod,
        _ => cli.trace.no_debuginfod,
    };
    if no_debuginfod {
        symbolize::no_debuginfod();
    }
    let result = match cli.sub {
        Some(Sub::Report(args)) => commands::report::run(args),
        Some(Sub::Diff(args)) => commands::diff::run(args),
        Some(Sub::Top(args)) => commands::trace::run(*args, commands::trace::Front::Top),
        Some(Sub::Agent(args)) => commands::trace::run_agent(*args),
        Some(Sub::Generate(args)) => commands::generate::run(args),
        None => commands::trace::run(cli.trace, commands::trace::Front::Report),
    };
    let code = match result {
        Ok(code) => code,
        Err(e) => {
            let code = e
                .downcast_ref::<UserError>()
                .map(|u| u.code)
                .unwrap_or(EXIT_FAILURE);
            say!("mtrace: {}", sinks::one_line(&e));
            code
        }
    };
    log_resources();
    std::process::exit(code);
}

/// A usage error in one line (clap's first, without its `error: `), a hint
/// on the next, exit code 2; `--help` and `--version` as clap prints them.
fn usage_error(e: clap::Error) -> ! {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        // Help that could not be written (stdout full or closed) is an
        // output error as a report's would be, not a success.
        use std::io::Write;
        let written = if sinks::stdout::stdout_closed() {
            Err(std::io::Error::other("it is closed"))
        } else {
            e.print().and_then(|()| std::io::stdout().flush())
        };
        if let Err(err) = written {
            say!("mtrace: cannot write the help to stdout: {err}");
            std::process::exit(error::EXIT_IO);
        }
        std::process::exit(0);
    }
    let args: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    if let Some(hint) = cli::unknown::hint(&e, &args) {
        say!("mtrace: {hint}");
        std::process::exit(EXIT_USAGE);
    }
    let text = e.render().to_string();
    // clap's message up to its first blank line, on one line.
    let message: Vec<&str> = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let message = message.join(" ");
    say!("mtrace: {}", message.trim_start_matches("error: "));
    // clap's usage line of the (sub)command, or the main one.
    match text.lines().find_map(|l| l.strip_prefix("Usage: ")) {
        _ if std::env::args().nth(1).as_deref() == Some("agent") => say!(
            "usage: mtrace agent [OPTIONS] --pid PID | --cgroup PATH | --all | -- COMMAND... (--help for all)"
        ),
        _ if std::env::args().nth(1).as_deref() == Some("top") => say!(
            "usage: mtrace top [OPTIONS] --pid PID | --cgroup PATH | --all | -- COMMAND... (--help for all)"
        ),
        Some(usage)
            if ["report", "diff", "generate"]
                .iter()
                .any(|s| usage.contains(s)) =>
        {
            say!("usage: {usage} (--help for all)")
        }
        _ => say!(
            "usage: mtrace [OPTIONS] --pid PID | mtrace [OPTIONS] -- COMMAND... (--help for all)"
        ),
    }
    std::process::exit(EXIT_USAGE);
}

/// With -v: mtrace's own CPU time and peak memory (the benchmark reads it).
fn log_resources() {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } == 0 {
        let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
        log::debug!(
            "resources: cpu {:.1} ms, peak rss {} KiB",
            ms(ru.ru_utime) + ms(ru.ru_stime),
            ru.ru_maxrss
        );
    }
}
