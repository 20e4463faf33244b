//! Command-line interface.

use std::path::PathBuf;

use clap::Parser;

use crate::render::{SortKey, Weight};

const EXAMPLES: &str = "\
Examples:
  sudo mtrace --pid 1234                    trace a running process until Ctrl-C
  sudo mtrace --pid 1234 --duration 10      ... for ten seconds
  sudo mtrace -- ./bench --iterations 1000  start a command with the probes attached
  sudo mtrace --flamegraph allocs.svg -- ./bench
  sudo mtrace --folded allocs.folded --weight bytes --pid 1234
  sudo mtrace --per-thread --top 5 --sort bytes -- ./server

The report goes to standard output; progress and errors to standard error.
In launch mode mtrace exits with the command's exit status.";

/// Counts every malloc, calloc, realloc, ... of a process per call stack,
/// from outside the process, with uprobes and in-kernel aggregation.
#[derive(Parser, Debug)]
#[command(
    name = "mtrace",
    version,
    about,
    after_help = EXAMPLES,
    override_usage = "mtrace [OPTIONS] --pid PID\n       mtrace [OPTIONS] -- CMD [ARGS]..."
)]
pub struct Cli {
    /// Attach to this running process.
    #[arg(short, long, value_name = "PID", conflicts_with = "command")]
    pub pid: Option<u32>,

    /// Stop tracing after this many seconds (default: until Ctrl-C, SIGTERM
    /// or the target's exit).
    #[arg(short, long, value_name = "SECS", value_parser = parse_duration)]
    pub duration: Option<f64>,

    /// Show at most N stacks in the table (0: all).
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub top: usize,

    /// Hide stacks with fewer than PCT percent of all allocation calls.
    #[arg(long, value_name = "PCT", default_value_t = 0.0, value_parser = parse_percent)]
    pub threshold: f64,

    /// Order of the table.
    #[arg(long, value_enum, default_value_t = SortKey::Calls)]
    pub sort: SortKey,

    /// Split every stack by thread (id and name).
    #[arg(long)]
    pub per_thread: bool,

    /// Write collapsed stacks (`root;...;caller;malloc N`) to FILE.
    #[arg(long, value_name = "FILE")]
    pub folded: Option<PathBuf>,

    /// Write a flamegraph SVG to FILE.
    #[arg(long, value_name = "FILE.svg")]
    pub flamegraph: Option<PathBuf>,

    /// What the folded stacks and the flamegraph count.
    #[arg(long, value_enum, default_value_t = Weight::Calls)]
    pub weight: Weight,

    /// Capacity of the in-kernel map of distinct (stack, function) keys.
    #[arg(long, value_name = "N", default_value_t = 65536, value_parser = clap::value_parser!(u32).range(16..))]
    pub count_map_size: u32,

    /// Capacity of the in-kernel stack map (distinct stacks).
    #[arg(long, value_name = "N", default_value_t = 32768, value_parser = clap::value_parser!(u32).range(16..))]
    pub stack_map_size: u32,

    /// Print what mtrace does (probe placement, timings) to standard error.
    #[arg(short, long)]
    pub verbose: bool,

    /// The command to start, with its arguments (after `--`).
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

fn parse_duration(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!(
            "duration must be a positive number of seconds, not {s}"
        ))
    }
}

fn parse_percent(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("`{s}` is not a percentage"))?;
    if (0.0..=100.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("threshold must be between 0 and 100, not {s}"))
    }
}
