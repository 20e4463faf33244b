//! The command line: what clap parses ([`Cli`]), kept apart from what the
//! arguments mean ([`config`]). A trace's arguments and the output's are
//! here; `mtrace agent`'s own are in [`agent`], `mtrace diff`'s in
//! [`diff`], and the value parsers they share in `parse`.

pub mod agent;
pub mod config;
pub mod diff;
mod parse;
pub mod unknown;

use std::{path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};

use agent::{AgentArgs, AGENT_EXAMPLES};
use diff::{DiffArgs, DIFF_EXAMPLES};
use parse::{
    parse_age, parse_bytes, parse_duration, parse_percent, parse_ring_size, parse_span,
    parse_unwind_ring_size,
};

/// `--sort`: which count orders the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SortArg {
    Calls,
    Bytes,
}

/// `--weight`: what folded stacks and flame graphs count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WeightArg {
    /// Allocating calls.
    Calls,
    /// Requested bytes.
    Bytes,
    /// Live mode: bytes still allocated when tracing ended.
    Inuse,
    /// Live mode: bytes of the leak suspects (still allocated at the end,
    /// at least --min-age old).
    Leaked,
}

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

/// `mtrace --version`: the release and the schema version of the profiles
/// it writes (`-o`).
fn version_text() -> String {
    format!(
        "{} (profile schema version {})",
        env!("CARGO_PKG_VERSION"),
        crate::profile::file::SCHEMA_VERSION
    )
}

/// `-o`'s help: the profile's schema version is the one
/// [`crate::profile::file::to_json`] writes.
fn profile_output_help() -> String {
    format!(
        "Write the profile as JSON (an mtrace-profile file, schema version {}) to FILE",
        crate::profile::file::SCHEMA_VERSION
    )
}

/// Counts every malloc, calloc, realloc, ... of a process per call stack,
/// from outside the process, with uprobes and in-kernel aggregation.
#[derive(Parser, Debug)]
#[command(
    name = "mtrace",
    version = version_text(),
    about,
    after_help = EXAMPLES,
    args_conflicts_with_subcommands = true,
    override_usage = "mtrace [OPTIONS] --pid PID\n       mtrace [OPTIONS] -- CMD [ARGS]...\n       mtrace top [OPTIONS] --pid PID | -- CMD [ARGS]...\n       mtrace agent [OPTIONS] --pid PID | --cgroup PATH | -- CMD [ARGS]...\n       mtrace report [OPTIONS] PROFILE.json\n       mtrace diff [OPTIONS] BASE.json NEW.json"
)]
pub struct Cli {
    #[command(subcommand)]
    pub sub: Option<Sub>,

    #[command(flatten)]
    pub trace: TraceArgs,
}

#[derive(Subcommand, Debug)]
pub enum Sub {
    /// Re-render a saved profile (no target, no privilege needed).
    #[command(after_help = REPORT_EXAMPLES)]
    Report(ReportArgs),
    /// Compare two saved profiles; with --fail-if, a CI regression gate.
    #[command(after_help = DIFF_EXAMPLES)]
    Diff(DiffArgs),
    /// Trace with a full-screen live view of the top stacks (the same
    /// target and options as a trace); q ends it, then the usual report.
    /// A launched command's output goes to a log file meanwhile.
    #[command(after_help = TOP_EXAMPLES)]
    Top(Box<TraceArgs>),
    /// Trace until stopped and serve what is counted over HTTP: Go heap
    /// profiles for Parca and Grafana Alloy/Pyroscope, Prometheus metrics.
    #[command(after_help = AGENT_EXAMPLES)]
    Agent(Box<AgentArgs>),
    /// Write the man pages or a shell's completions (`cargo xtask install`
    /// runs it on the binary it installs, so they describe that binary).
    #[command(hide = true)]
    Generate(GenerateArgs),
}

/// `mtrace generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(subcommand)]
    pub what: Generate,
}

#[derive(Subcommand, Debug)]
pub enum Generate {
    /// mtrace.1 and a page per subcommand (mtrace-report.1, ...), into DIR.
    Man {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
    /// SHELL's completions into DIR: mtrace.bash, _mtrace (zsh),
    /// mtrace.fish, ...
    Completions {
        #[arg(value_name = "SHELL")]
        shell: clap_complete::Shell,
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
}

const TOP_EXAMPLES: &str = "\
Examples:
  sudo mtrace top --pid 1234
  sudo mtrace top --live --pid 1234
  sudo mtrace top -o run.json -- ./bench

Keys: q quit (then the report), up/down select, enter show/hide the stack,
c/b/l order by calls, bytes, live bytes, t last second or since the start.";

const REPORT_EXAMPLES: &str = "\
Examples:
  mtrace report run.json
  mtrace report run.json --top 5 --sort bytes
  mtrace report run.json --flamegraph run.svg --pprof run.pb.gz --speedscope run.speedscope.json
  mtrace report run.json --html run.html
  mtrace report run.json --tree --dot run.dot --weight bytes
  mtrace report live.json --flamegraph leaks.svg --weight leaked";

/// Tracing a live process.
#[derive(Args, Debug)]
pub struct TraceArgs {
    /// Attach to this running process.
    #[arg(short, long, value_name = "PID", conflicts_with = "command")]
    pub pid: Option<u32>,

    /// Trace every process of this cgroup v2 directory (a container, a
    /// pod, `system.slice/redis.service`: absolute, or under the cgroup2
    /// mount), and what they start; a process that joins the cgroup later
    /// is traced from when mtrace sees it (within a tenth of a second). Ends when
    /// the cgroup is empty, or at Ctrl-C.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["pid", "command"])]
    pub cgroup: Option<String>,

    /// Trace every process on the host that allocates, present and to
    /// come, each call under its process and its whole stack (rules by
    /// file and offset, shared by every process that maps the file). One
    /// probe per allocating function of each allocator file,
    /// in every process that maps it: every process on the host takes a
    /// uprobe trap per allocating call while it runs (about count mode's
    /// cost; see docs/performance.md), and none after it ends (kill -9
    /// included). Count mode only; rows are per process.
    #[arg(long, conflicts_with_all = ["pid", "cgroup", "command", "live", "sample_bytes",
          "sample_every", "count_frees", "python_objects", "children", "user", "no_follow"])]
    pub all: bool,

    /// With a command or --cgroup: trace it as --all does, with file-wide
    /// probes (each allocator file probed once, shared by every process
    /// that maps it) and the scope decided in the kernel (the command's
    /// process tree, followed at each fork; the cgroup and those below
    /// it): no BPF object, probe or thread per process, so a tree of many
    /// short programs pays far less per exec. Every process on the host
    /// takes the probes' trap while it calls the allocator, in scope or
    /// not. Count mode only; rows are per process; Python frames as by
    /// pid.
    #[arg(long, conflicts_with_all = ["pid", "all", "live", "sample_bytes",
          "sample_every", "count_frees", "python_objects", "children", "no_follow"])]
    pub file_wide: bool,

    /// Stop tracing after this many seconds (default: until Ctrl-C, SIGTERM
    /// or the target's exit).
    #[arg(short, long, value_name = "SECS", value_parser = parse_duration)]
    pub duration: Option<f64>,

    /// Write a snapshot profile every SECS seconds while tracing (see
    /// --snapshot-dir); SIGUSR1 writes one at any time.
    #[arg(long, value_name = "SECS", value_parser = parse_duration)]
    pub interval: Option<f64>,

    /// Directory for snapshots, named mtrace-PID-NNNN.json.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub snapshot_dir: PathBuf,

    /// Live mode: also follow every block until it is freed (return probes
    /// on the allocating functions): outstanding blocks and leaks, sizes and
    /// lifetimes, temporaries, the peak of live bytes.
    #[arg(long)]
    pub live: bool,

    /// Count mode: also probe `free` and count the frees (live mode always
    /// does). Off by default: one probe per allocating call is all the
    /// counts need, and a probe on `free` doubles what the target pays.
    #[arg(long, conflicts_with_all = ["live", "sample_bytes", "sample_every"])]
    pub count_frees: bool,

    /// Python processes: also probe CPython's object and memory allocators
    /// (PyObject_Malloc, PyMem_Malloc, ... and their Free in live mode), so
    /// that the objects of up to 512 bytes, which never reach malloc, are
    /// counted by Python line too. An object allocation that falls through
    /// to malloc is counted once. An interpreter that copied the object
    /// allocator into its callers (Debian's python3.11) has each copy
    /// probed where it starts, and in live mode where its block is known
    /// and where copies of free start. Every object
    /// allocation then takes a uprobe trap: a pure-Python loop runs many
    /// times slower with this flag, and slower still in live mode (the
    /// figures are in docs/python.md).
    #[arg(long)]
    pub python_objects: bool,

    /// Launch mode: trace the command only, not the processes it starts
    /// (by default every descendant is traced from its first instruction,
    /// whatever it execs).
    #[arg(long)]
    pub no_follow: bool,

    /// Launch mode: run the command as USER (a name or a numeric uid): its
    /// uid, primary group and supplementary groups, HOME, USER and LOGNAME
    /// set as `sudo -u` does; mtrace itself stays root. Without it the
    /// command runs as whoever runs mtrace (root under sudo), as with perf.
    #[arg(long, value_name = "USER", value_hint = clap::ValueHint::Username, conflicts_with_all = ["pid", "cgroup"])]
    pub user: Option<String>,

    /// By pid: also trace the processes the target created (its workers,
    /// say), to any depth, and those it creates while traced (each from
    /// its first instruction).
    #[arg(long, requires = "pid")]
    pub children: bool,

    /// Most processes traced at once (each has its own BPF maps, a few MiB
    /// of kernel memory, loaded once and reused by the processes that come
    /// after it); a process started beyond it is not traced, and the
    /// report says so. Probes are only ever in traced processes. (The host
    /// engine, --all and --file-wide, has no object per process: refused
    /// there.)
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096),
          conflicts_with_all = ["all", "file_wide"])]
    pub max_processes: u32,

    /// Sample instead of counting every call: on average one sample per N
    /// allocated bytes (exponential intervals, as jemalloc and tcmalloc),
    /// each weighted so estimated calls and bytes stay unbiased. Accepts
    /// KiB/MiB suffixes. Unsampled calls skip the stack walk but still
    /// take the uprobe's trap, most of a counted call's cost.
    #[arg(long, value_name = "N", value_parser = parse_bytes, conflicts_with_all = ["sample_every", "live"])]
    pub sample_bytes: Option<u64>,

    /// Sample each allocating call with probability 1/N (weight N).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "live")]
    pub sample_every: Option<u64>,

    /// Keep at most N frames of each stack above the direct caller (0: the
    /// caller only, no stack walk). Walking costs the target a few
    /// nanoseconds a frame on every counted call: a lower limit makes deep
    /// stacks cheaper, and the report counts the stacks it cut
    /// (`max_frames`). Default: the most, 127.
    #[arg(long, value_name = "N", default_value_t = tracer_common::MAX_FRAMES as u32,
          value_parser = clap::value_parser!(u32).range(0..=tracer_common::MAX_FRAMES as i64))]
    pub max_stack: u32,

    /// Benchmark floor: attach programs that do nothing where the real
    /// probes go (used by `cargo xtask bench`).
    #[arg(long, hide = true)]
    pub bench_floor: bool,

    /// Benchmark: have the kernel time every BPF program run and log the
    /// mean time per program with -v (the timing itself adds to every run).
    #[arg(long, hide = true)]
    pub bpf_stats: bool,

    /// Live mode: show as leak suspects only blocks at least SECS old.
    #[arg(long, value_name = "SECS", default_value_t = 0.0, value_parser = parse_age, requires = "live")]
    pub min_age: f64,

    /// Live mode: a block freed sooner than this after its allocation is a
    /// temporary (e.g. 500us, 1ms, 2s).
    #[arg(long, value_name = "DURATION", default_value = "1ms", value_parser = parse_span, requires = "live")]
    pub temporary_under: Duration,

    /// Live mode: how many outstanding blocks mtrace tracks at once;
    /// beyond that, allocations are counted as untracked. The kernel keeps
    /// as many frees and as many allocations aside (72 bytes the pair) for
    /// when the event buffers are full, so that a burst freeing or
    /// allocating them all loses none.
    #[arg(long, value_name = "N", default_value_t = 262144, value_parser = clap::value_parser!(u32).range(1..))]
    pub live_map_size: u32,

    /// Live mode: size in bytes of each kernel-to-tracer event buffer, one
    /// per CPU up to 8 (a power of two, at least 4096).
    #[arg(long, value_name = "BYTES", default_value_t = 4 << 20, value_parser = parse_ring_size)]
    pub event_buffer_size: u32,

    #[command(flatten)]
    pub out: OutputArgs,

    /// Capacity of the in-kernel map of distinct (stack, function) keys.
    #[arg(long, value_name = "N", default_value_t = 65536, value_parser = clap::value_parser!(u32).range(16..))]
    pub count_map_size: u32,

    /// Capacity of the in-kernel stack map (distinct stacks).
    #[arg(long, value_name = "N", default_value_t = 32768, value_parser = clap::value_parser!(u32).range(16..))]
    pub stack_map_size: u32,

    /// Capacity of the in-kernel map of unwind rules (one per distinct
    /// return address on the allocation paths).
    #[arg(long, value_name = "N", default_value_t = 65536, value_parser = clap::value_parser!(u32).range(16..))]
    pub unwind_rules_size: u32,

    /// Size in bytes of the buffer of stack copies the kernel hands to
    /// mtrace to finish (one per traced process; four times this for a
    /// command's tree on the host engine; a power of two, at least 1 MiB).
    /// A stack whose copy found it full is cut short (`copy_lost`): a
    /// program that starts with a burst of deep stacks through new code,
    /// such as cargo, may need 64 MiB. It is mapped into mtrace, which
    /// counts twice its size in mtrace's resident memory.
    #[arg(long, value_name = "BYTES", default_value_t = 16 << 20, value_parser = parse_unwind_ring_size)]
    pub unwind_buffer_size: u32,

    /// Host engine (--all, --file-wide, --cgroup, agent --all): how many
    /// processes the kernel keeps names, runs and tree membership of at
    /// once; beyond that, each loss is counted in the report's host line.
    #[arg(long, value_name = "N", default_value_t = 65536, value_parser = clap::value_parser!(u32).range(4..))]
    pub process_table_size: u32,

    /// Ask no debuginfod server (DEBUGINFOD_URLS) for a stripped file's
    /// debug information; /usr/lib/debug/.build-id and the debuginfod
    /// cache are still read.
    #[arg(long)]
    pub no_debuginfod: bool,

    /// Print what mtrace does (probe placement, timings) to standard error.
    #[arg(short, long)]
    pub verbose: bool,

    /// The command to start, with its arguments (after `--`).
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// What to show and which files to write; the same for a live trace and
/// `mtrace report`.
#[derive(Args, Debug, Clone)]
pub struct OutputArgs {
    /// Show at most N stacks in the table (0: all).
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub top: usize,

    /// Hide stacks with fewer than PCT percent of all allocation calls.
    #[arg(long, value_name = "PCT", default_value_t = 0.0, value_parser = parse_percent)]
    pub threshold: f64,

    /// Order of the table.
    #[arg(long, value_enum, default_value_t = SortArg::Calls)]
    pub sort: SortArg,

    /// Split every stack by thread (id and name); each thread's totals
    /// after the totals, and with --tree a tree per thread.
    #[arg(long)]
    pub per_thread: bool,

    /// Split every stack by process (pid and name): the processes a
    /// launched command starts are traced too, their rows joined unless
    /// this is given.
    #[arg(long)]
    pub per_process: bool,

    /// Sum the allocations of each test (a Rust test binary's, pytest's,
    /// GoogleTest's), found by its function among the frames: lines after
    /// the totals, a `tests` list in -o's profile and the HTML report.
    #[arg(long)]
    pub per_test: bool,

    /// Sum the allocations of every stack one of whose frames' functions
    /// matches PATTERN (a glob: `*` is any run of characters), or with
    /// `thread:PATTERN` whose thread's name does, under NAME; a stack
    /// counts once per group, in every group it matches. May be repeated,
    /// a NAME too.
    #[arg(long = "group", value_name = "NAME=PATTERN", value_parser = crate::profile::groups::Rule::parse)]
    pub groups: Vec<crate::profile::groups::Rule>,

    // Its help names the schema version the writer writes.
    #[arg(short, long, value_name = "FILE.json", help = profile_output_help())]
    pub output: Option<PathBuf>,

    #[command(flatten)]
    pub stacks: StackFiles,

    /// Write a gzipped pprof profile (go tool pprof, Pyroscope, Parca).
    #[arg(long, value_name = "FILE.pb.gz")]
    pub pprof: Option<PathBuf>,

    /// Write a speedscope profile (https://www.speedscope.app).
    #[arg(long, value_name = "FILE.json")]
    pub speedscope: Option<PathBuf>,

    /// Write an HTML report (one self-contained page: summary, sortable
    /// stacks, flame graphs, leak suspects, distributions, plots over time).
    #[arg(long, value_name = "FILE.html")]
    pub html: Option<PathBuf>,
    /// Also print the call tree, top-down from each thread's first frame:
    /// total and self calls and bytes per function, children by --sort,
    /// nodes under --threshold (1% when not given) left out.
    #[arg(long)]
    pub tree: bool,

    /// Write the call graph as Graphviz text (`dot -Tsvg FILE`): functions
    /// shaded by their self share, caller-to-callee edges by --weight;
    /// functions under --threshold (1% when not given) left out.
    #[arg(long, value_name = "FILE.dot")]
    pub dot: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A profile written by --output or a snapshot.
    #[arg(value_name = "PROFILE.json")]
    pub file: PathBuf,

    /// Ask no debuginfod server (DEBUGINFOD_URLS) for the debug
    /// information of the frames the profile left unnamed;
    /// /usr/lib/debug/.build-id and the debuginfod cache are still read.
    #[arg(long)]
    pub no_debuginfod: bool,

    #[command(flatten)]
    pub out: OutputArgs,
}

/// Folded stacks and flame graphs: of a profile, or (`mtrace diff`)
/// differential ones.
#[derive(Args, Debug, Clone)]
pub struct StackFiles {
    /// Write collapsed stacks to FILE: `root;...;caller;malloc N`, or with
    /// `mtrace diff` `stack BASE NEW`.
    #[arg(long, value_name = "FILE")]
    pub folded: Option<PathBuf>,

    /// Write a flamegraph SVG to FILE (with `mtrace diff`: differential,
    /// growth red, shrinkage blue).
    #[arg(long, value_name = "FILE.svg")]
    pub flamegraph: Option<PathBuf>,

    /// What the folded stacks, the flamegraph, the call graph and
    /// speedscope's opening view count (inuse and leaked: of a live profile).
    #[arg(long, value_enum, default_value_t = WeightArg::Calls)]
    pub weight: WeightArg,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// `command`'s long help, its lines joined (clap wraps them).
    fn help_of(command: &mut clap::Command) -> String {
        let help = command.render_long_help().to_string();
        help.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    /// `-o` (of a trace and of `mtrace report`) and `mtrace diff --format
    /// json` name the schema versions their writers write.
    #[test]
    fn help_states_the_schema_versions_written() {
        let mut cli = Cli::command();
        let profile = format!(
            "schema version {}) to FILE",
            crate::profile::file::SCHEMA_VERSION
        );
        let help = help_of(&mut cli);
        assert!(help.contains(&profile), "{help}");
        let report = cli.find_subcommand_mut("report").unwrap();
        let help = help_of(report);
        assert!(help.contains(&profile), "{help}");
        let diff = cli.find_subcommand_mut("diff").unwrap();
        let help = help_of(diff);
        let version = format!(
            "diff.schema.json, version {})",
            crate::render::diff_report::DIFF_SCHEMA_VERSION
        );
        assert!(help.contains(&version), "{help}");
    }
}
