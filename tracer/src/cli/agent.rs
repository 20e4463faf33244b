//! `mtrace agent`'s own arguments (the trace's are [`TraceArgs`]).

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::{
    parse::{parse_duration, parse_percent},
    TraceArgs,
};

pub(super) const AGENT_EXAMPLES: &str = "\
Examples:
  sudo mtrace agent --pid 1234
  sudo mtrace agent --cgroup system.slice/redis.service --sample-bytes 512KiB
  sudo mtrace agent --live --listen 127.0.0.1:7117 --pid 1234
  sudo mtrace agent --listen 10.0.0.5:7117 --web-config web.yml --pid 1234
  go tool pprof -top http://127.0.0.1:7117/debug/pprof/allocs
  go tool pprof -seconds 30 http://127.0.0.1:7117/debug/pprof/allocs

Endpoints: /debug/pprof/allocs and /debug/pprof/heap (Go's heap profile
format; ?seconds=N for what was allocated during the next N seconds, in-use
values left a snapshot; ?pid=PID for one process), /metrics (Prometheus),
/healthz. GET only. Beyond loopback, --web-config FILE gives TLS and basic
auth in the Prometheus exporters' format (--web.config.file).

Cost: by default (--policy windows) the probes are in for --window seconds,
then out for as long as keeps the slowdown of the traced process that pays
most within --budget (1.5%): a tight allocation loop is probed 1.5% of the
time, a process whose calls cost it little all the time; counts are scaled to the whole time
and labelled as estimates. --policy always keeps them in: exact counts, and
every call pays a uprobe trap (about 0.4-1 us here). docs/agent.md has the
measured cost of each.";

/// `mtrace agent --policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    Windows,
    Always,
}

/// `mtrace agent`.
#[derive(Args, Debug)]
pub struct AgentArgs {
    /// Address and port to serve on. Loopback by default; any other
    /// address needs --web-config with TLS and an authentication, or
    /// --insecure-listen.
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:7117")]
    pub listen: std::net::SocketAddr,

    /// A web configuration file as Prometheus exporters take it
    /// (--web.config.file): tls_server_config (cert_file, key_file,
    /// client_auth_type, client_ca_file) and basic_auth_users (user:
    /// bcrypt hash). Read again when it or a file it names changes.
    #[arg(long, value_name = "FILE", alias = "web.config.file")]
    pub web_config: Option<PathBuf>,

    /// Serve a --listen address that is not loopback without TLS and
    /// authentication: any host that reaches it can read the profiles,
    /// which name the traced processes' functions, files and commands.
    #[arg(long)]
    pub insecure_listen: bool,

    /// How the traced processes pay: `windows` (the default in count
    /// mode) puts the probes in for --window seconds, then takes them out
    /// for as long as keeps the slowdown of the process that pays most
    /// within --budget, and
    /// scales the windows' exact counts to the whole time; `always` keeps
    /// them in (exact counts, or sampled with --sample-bytes; needed by
    /// --live), and every call pays a trap.
    #[arg(long, value_enum)]
    pub policy: Option<PolicyArg>,

    /// Windows policy: seconds each window lasts.
    #[arg(long, value_name = "SECS", default_value = "0.05", value_parser = parse_duration)]
    pub window: f64,

    /// Windows policy: the slowdown allowed, in percent (1.5 by default: a
    /// tight allocation loop loses about all the time it is probed, and
    /// the default keeps it under 2% with room for the machine's noise).
    #[arg(long, value_name = "PCT", default_value = "1.5", value_parser = parse_percent)]
    pub budget: f64,

    /// Windows policy: a window every SECS seconds, whatever it costs
    /// (instead of --budget).
    #[arg(long, value_name = "SECS", value_parser = parse_duration)]
    pub every: Option<f64>,

    #[command(flatten)]
    pub trace: TraceArgs,
}
