//! What the arguments mean: [`TraceArgs`] and [`OutputArgs`] turned into
//! the settings each stage takes (probe mode and map sizes, the session's
//! schedule, the live tracker's limits, the sinks' outputs).

use std::{path::PathBuf, time::Duration};

use super::{OutputArgs, SortArg, TraceArgs, WeightArg};
use crate::{
    error::{UserError, EXIT_USAGE},
    probes::{MapSizes, Mode, Sampling},
    profile::Weight,
    render::{ReportOptions, SortKey, StackWeight},
    session::Schedule,
    sinks::Outputs,
};

/// Fewest frees, and allocations, live mode keeps aside in the kernel when
/// its rings are full (the block table's size when larger).
const MIN_KEPT_ASIDE: u32 = 32768;

/// What to trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Pid(u32),
    Command(Vec<String>),
    /// `--cgroup`, as given.
    Cgroup(String),
    /// `--all`: every process on the host.
    Host,
}

/// A trace, as the arguments ask for it.
pub struct TraceConfig {
    pub target: Target,
    /// `mtrace agent --policy windows`.
    pub windows: Option<crate::session::duty::Windows>,
    pub mode: Mode,
    pub sizes: MapSizes,
    pub schedule: Schedule,
    pub snapshot_dir: PathBuf,
    /// Live mode: blocks at least this old are leak suspects.
    pub min_age_ns: u64,
    /// Live mode: a block freed sooner than this is a temporary.
    pub temporary_ns: u64,
    /// Live mode: outstanding blocks tracked at once.
    pub live_blocks: usize,
    /// Have the kernel time every BPF program (`--bpf-stats`).
    pub bpf_stats: bool,
    /// Launch mode: trace every process the command starts.
    pub follow: bool,
    /// Launch mode: the user to run the command as (`--user`).
    pub user: Option<String>,
    /// By pid: trace the target's descendants too.
    pub children: bool,
    /// Most processes traced at once.
    pub max_processes: usize,
    pub outputs: Outputs,
}

impl TraceConfig {
    /// `None` when there is nothing to trace (no pid, no command).
    pub fn from_args(args: &TraceArgs) -> Option<TraceConfig> {
        let target = match (args.pid, &args.cgroup, args.command.is_empty()) {
            _ if args.all => Target::Host,
            (Some(pid), _, _) => Target::Pid(pid),
            (None, Some(cgroup), _) => Target::Cgroup(cgroup.clone()),
            (None, None, false) => Target::Command(args.command.clone()),
            (None, None, true) => return None,
        };
        let throttle = matches!(target, Target::Command(_));
        Some(TraceConfig {
            target,
            mode: Mode {
                // A thread's group needs the counts split by thread.
                per_thread: args.out.per_thread
                    || args
                        .out
                        .groups
                        .iter()
                        .any(|r| r.target == crate::profile::groups::Target::Thread),
                live: args.live,
                count_frees: args.count_frees,
                sampling: match (args.sample_bytes, args.sample_every) {
                    (Some(n), _) => Some(Sampling::Bytes(n)),
                    (None, Some(n)) => Some(Sampling::Every(n)),
                    _ => None,
                },
                floor: args.bench_floor,
                max_frames: args.max_stack,
                python_objects: args.python_objects,
                // Launch mode follows every process it traces with ptrace.
                throttle,
            },
            sizes: MapSizes {
                counts: args.count_map_size,
                stacks: args.stack_map_size,
                events: args.event_buffer_size,
                unwind_rules: args.unwind_rules_size,
                unwind_ring: args.unwind_buffer_size,
                kept_aside: args.live_map_size.max(MIN_KEPT_ASIDE),
                processes: args.process_table_size,
            },
            schedule: Schedule {
                duration: args.duration.map(Duration::from_secs_f64),
                interval: args.interval.map(Duration::from_secs_f64),
                until_stopped: false,
            },
            windows: None,
            snapshot_dir: args.snapshot_dir.clone(),
            min_age_ns: (args.min_age * 1e9) as u64,
            temporary_ns: args.temporary_under.as_nanos() as u64,
            live_blocks: args.live_map_size as usize,
            bpf_stats: args.bpf_stats,
            follow: !args.no_follow,
            user: args.user.clone(),
            children: args.children,
            max_processes: args.max_processes as usize,
            outputs: outputs(&args.out),
        })
    }
}

/// The table's options and the files to write.
pub fn outputs(out: &OutputArgs) -> Outputs {
    Outputs {
        table: ReportOptions {
            top: out.top,
            threshold_pct: out.threshold,
            sort: match out.sort {
                SortArg::Calls => SortKey::Calls,
                SortArg::Bytes => SortKey::Bytes,
            },
            per_thread: out.per_thread,
            per_process: out.per_process,
            color: stdout_wants_color(),
        },
        profile: out.output.clone(),
        folded: out.stacks.folded.clone(),
        flamegraph: out.stacks.flamegraph.clone(),
        weight: weight(out.stacks.weight),
        pprof: out.pprof.clone(),
        speedscope: out.speedscope.clone(),
        html: out.html.clone(),
        tree: out.tree,
        dot: out.dot.clone(),
        per_test: out.per_test,
        rules: out.groups.clone(),
    }
}

/// Colour on stdout: only a terminal, and not with `NO_COLOR` set or
/// `TERM=dumb` (anstream's rules, which also honour `CLICOLOR_FORCE`).
fn stdout_wants_color() -> bool {
    anstream::AutoStream::choice(&std::io::stdout()) != anstream::ColorChoice::Never
}

pub fn weight(w: WeightArg) -> StackWeight {
    match w {
        WeightArg::Calls => StackWeight::Calls,
        WeightArg::Bytes => StackWeight::Bytes,
        WeightArg::Inuse => StackWeight::InUse,
        WeightArg::Leaked => StackWeight::Leaked,
    }
}

/// `mtrace diff --weight`: calls or bytes, the counts two profiles share.
pub fn diff_weight(w: WeightArg) -> Result<Weight, UserError> {
    match weight(w) {
        StackWeight::Calls => Ok(Weight::Calls),
        StackWeight::Bytes => Ok(Weight::Bytes),
        other => Err(UserError::with_code(
            format!("--weight {}: diff compares calls or bytes", other.name()),
            EXIT_USAGE,
        )),
    }
}
