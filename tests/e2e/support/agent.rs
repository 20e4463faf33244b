//! `mtrace agent` run by a test: started on a port the kernel chooses,
//! reached on loopback.

use std::{
    io::Write,
    path::{Path, PathBuf},
    sync::OnceLock,
};

use super::{
    fixtures::compile_c,
    http::http,
    mtrace::{mtrace_command, Mtrace},
    process::{FixtureProc, LINE_TIMEOUT},
};

/// A running agent and the address it serves on (`--listen 127.0.0.1:0`:
/// the port the kernel chose, read from its line).
pub(crate) struct Agent {
    pub(crate) mtrace: Mtrace,
    pub(crate) addr: String,
    /// What it said of where it serves.
    pub(crate) line: String,
}

impl Agent {
    pub(crate) fn start(args: &[&str]) -> Agent {
        Agent::start_on("127.0.0.1:0", args)
    }

    /// An agent on `--listen LISTEN` (a port the kernel chooses), reached
    /// on loopback at the port it says.
    pub(crate) fn start_on(listen: &str, args: &[&str]) -> Agent {
        let mut all = vec!["agent", "--listen", listen];
        all.extend_from_slice(args);
        let mut mtrace = Mtrace::spawn(&mut mtrace_command(&all));
        let line = mtrace
            .stderr
            .wait_for(|l| l.starts_with("mtrace agent: serving on "), LINE_TIMEOUT);
        let port = line
            .split("://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .and_then(|addr| addr.rsplit(':').next())
            .unwrap_or_else(|| panic!("no port in {line:?}"));
        Agent {
            mtrace,
            addr: format!("127.0.0.1:{port}"),
            line,
        }
    }

    /// The agent's resident and peak resident memory, in bytes; the peak
    /// is set back to the resident after reading it.
    pub(crate) fn memory(&self) -> (u64, u64) {
        let pid = self.mtrace.proc.child.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kib = |key: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or_else(|| panic!("no {key} in {status}"))
        };
        let read = (kib("VmRSS:") * 1024, kib("VmHWM:") * 1024);
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
        read
    }

    /// The descriptors the agent holds.
    pub(crate) fn descriptors(&self) -> usize {
        let pid = self.mtrace.proc.child.id();
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub(crate) fn get(&self, path: &str) -> (u16, String) {
        http(&self.addr, "GET", path)
    }
}

/// The agent fixture (tests/fixtures/agent.c), compiled once.
pub(crate) fn agent_fixture() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        compile_c(
            "agent",
            "agent",
            &["-O2", "-fno-omit-frame-pointer", "-g"],
            &[],
        )
    })
}

/// Tells the fixture `cmd` and waits until it has made the calls.
pub(crate) fn tell(fx: &mut FixtureProc, cmd: &str) {
    let stdin = fx.stdin.as_mut().expect("fixture stdin open");
    writeln!(stdin, "{cmd}").unwrap();
    stdin.flush().unwrap();
    fx.stdout.wait_for(|l| l == "done", LINE_TIMEOUT);
}
