//! `cargo xtask`: set-up, build, demo, test and install for mtrace.
//!
//! Every command runs `setup` first, which installs what building BPF code
//! needs and does nothing when it is already there:
//! - Debian's Rust toolchain with its library source (`rustc-web`,
//!   `cargo-web`, `rust-web-src`): rustup's toolchains cannot build
//!   `core` for `bpfel-unknown-none` here; and its clippy
//!   (`rust-web-clippy`), which lints the BPF crate for that target;
//! - LLVM 22 (`llvm-22-dev`) and `bpf-linker` 0.13.0 built against it;
//! - memray and py-spy from PyPI for Debian's `/usr/bin/python3.11`, which
//!   the Python benchmark and tests compare mtrace with.

use std::{
    env,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{bail, Context, Result};

mod bench;
mod install;
#[cfg(test)]
mod layout;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "mtrace's development tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the BPF toolchain (apt packages and bpf-linker) and memray
    /// and py-spy for Debian's python3.11; idempotent.
    Setup,
    /// Set up, then build mtrace (release).
    Build,
    /// Set up, build, and trace the bundled demo workload.
    Demo,
    /// Set up, build, and run every test (unit and end-to-end; needs root).
    Test {
        /// Extra arguments for `cargo test`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Set up, build, and measure mtrace's overhead on a malloc-heavy
    /// benchmark against the uprobe floor, on process trees, and on a
    /// Python loop against memray (needs root).
    Bench {
        /// Iterations of malloc+free per thread and run.
        #[arg(long, default_value_t = 1_000_000)]
        iterations: u64,
        /// Runs of every mode (they alternate) [default: 5; 3 for the
        /// Python rows].
        #[arg(long)]
        runs: Option<usize>,
        /// Where to write the JSON results.
        #[arg(long, default_value = "target/bench/bench.json")]
        json: PathBuf,
        /// Only the process-tree and Ctrl-C rows.
        #[arg(long, conflicts_with = "python_only")]
        tree_only: bool,
        /// Only the Python rows: a pure-Python allocation loop untraced,
        /// under mtrace's modes and under memray.
        #[arg(long, conflicts_with = "agent_only")]
        python_only: bool,
        /// Only the agent rows: each policy's cost on the bench loop and on
        /// Redis, and the ten-minute soak run.
        #[arg(long, conflicts_with = "tree_only")]
        agent_only: bool,
        /// Seconds of the agent's soak run (0: none).
        #[arg(long, default_value_t = bench::SOAK_SECS)]
        soak_secs: u64,
        /// Only `mtrace agent --all` for MINUTES on a loop of `make -j2`
        /// builds, scraped every 10 s: its RSS, processes, stacks and
        /// losses, and what it leaves after SIGTERM (never run by default).
        #[arg(long, value_name = "MINUTES", conflicts_with_all = ["tree_only", "python_only", "agent_only"])]
        soak: Option<u64>,
    },
    /// Set up, build, and install a stripped mtrace to PREFIX/bin (ahead of
    /// glibc's /usr/bin/mtrace on root's PATH), its man pages to
    /// PREFIX/share/man/man1 (ahead of glibc's mtrace(1)) and its bash, zsh
    /// and fish completions under PREFIX/share.
    Install {
        #[arg(long, default_value = install::DEFAULT_PREFIX)]
        prefix: PathBuf,
    },
}

/// The BPF toolchain, then what the tests use to check pprof output
/// independently (protoc and the official profile.proto), the allocators
/// the benchmark and the family tests also run under, and the oracle of the
/// stack tests (gdb, with libc's debug info) and the C++ compiler of their
/// fixtures; the browser that opens the HTML report in its test
/// (chromium), the terminal the live view and the status line are tested
/// in (tmux), and `man`, which renders the man page in its test; and
/// Debian's pip for its python3.11 (see [`PYPI_PACKAGES`]); the real
/// clients of `mtrace agent`'s tests, `go tool pprof` (golang-go) and
/// Prometheus, the Redis server and client its benchmark traces, the
/// sqlite3 shell the gate's stability test runs five times, and the
/// debuginfod server stripped files are symbolized through in their test,
/// and the JVM (with javac and jcmd) whose stacks are walked through Java.
const APT_PACKAGES: [&str; 25] = [
    "rustc-web",
    "cargo-web",
    "rust-web-src",
    "rust-web-clippy",
    "llvm-22-dev",
    "protobuf-compiler",
    "golang-github-google-pprof-dev",
    "libjemalloc2",
    "libtcmalloc-minimal4",
    "libmimalloc2.0",
    "gdb",
    "libc6-dbg",
    "g++",
    "chromium",
    "tmux",
    "man-db",
    "python3-pip",
    "python3-pytest",
    "golang-go",
    "prometheus",
    "redis-server",
    "redis-tools",
    "sqlite3",
    "debuginfod",
    "openjdk-17-jdk-headless",
];
const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

/// The Python that the Python benchmark and tests trace: Debian's, stripped,
/// as a distribution's users run it.
pub(crate) const PYTHON: &str = "/usr/bin/python3.11";
/// memray (`python3.11 -m memray`) and py-spy (`py-spy` on PATH), the
/// Python profilers mtrace is compared with, pinned like bpf-linker.
///
/// They go into Debian's python3.11 with Debian's own pip (`python3-pip`,
/// in [`APT_PACKAGES`]; the machine image has it, and the list makes sure)
/// and `--break-system-packages` (PEP 668: Debian marks its Python as
/// externally managed). Installed as root, they land in
/// /usr/local/lib/python3.11/dist-packages and /usr/local/bin/py-spy,
/// outside dpkg's files. Not pyenv's pip: that installs into pyenv's own
/// 3.11.7, whose `-m memray` /usr/bin/python3.11 cannot import, and puts
/// `py-spy` behind a pyenv shim that fails whenever another pyenv version
/// is selected.
const PYPI_PACKAGES: [(&str, &str); 2] = [("memray", "1.20.0"), ("py-spy", "0.4.3")];

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.task) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(task: Task) -> Result<()> {
    let root = workspace_root();
    env::set_current_dir(&root)?;
    match task {
        Task::Setup => setup(),
        Task::Build => {
            setup()?;
            build()
        }
        Task::Demo => {
            setup()?;
            build()?;
            demo(&root)
        }
        Task::Test { args } => {
            setup()?;
            build()?;
            test(&args)
        }
        Task::Bench {
            iterations,
            runs,
            json,
            tree_only,
            python_only,
            agent_only,
            soak_secs,
            soak,
        } => {
            setup()?;
            build()?;
            let only = match (soak, tree_only, python_only, agent_only) {
                (Some(minutes), ..) => bench::Only::Soak(minutes),
                (_, true, _, _) => bench::Only::Tree,
                (_, _, true, _) => bench::Only::Python,
                (_, _, _, true) => bench::Only::Agent,
                _ => bench::Only::All,
            };
            bench::run(&root, iterations, runs, &json, only, soak_secs)
        }
        Task::Install { prefix } => {
            setup()?;
            build()?;
            install::run(&root, &prefix)
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn cargo() -> String {
    env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

pub(crate) fn status(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let st = cmd.status().with_context(|| format!("running {shown}"))?;
    if !st.success() {
        bail!("{shown} failed ({st})");
    }
    Ok(())
}

fn setup() -> Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if !missing.is_empty() {
        eprintln!("xtask: installing {}", missing.join(" "));
        require_root("installing Debian packages")?;
        status(Command::new("apt-get").arg("update").arg("-q"))?;
        status(
            Command::new("apt-get")
                .args(["install", "-y", "-q", "--no-install-recommends"])
                .args(&missing)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
    }
    if !bpf_linker_ok() {
        eprintln!("xtask: installing bpf-linker {BPF_LINKER_VERSION} (LLVM 22)");
        status(
            Command::new(cargo())
                .args([
                    "install",
                    &format!("bpf-linker@{BPF_LINKER_VERSION}"),
                    "--locked",
                    "--no-default-features",
                    "--features",
                    "llvm-22",
                ])
                // /usr/bin/llvm-config is LLVM 14: point at LLVM 22.
                .env("LLVM_PREFIX", LLVM_PREFIX),
        )?;
    }
    if !python_tools_ok() {
        let specs: Vec<String> = PYPI_PACKAGES
            .iter()
            .map(|(name, version)| format!("{name}=={version}"))
            .collect();
        eprintln!("xtask: installing {} for {PYTHON}", specs.join(" "));
        require_root("installing memray and py-spy for Debian's python3.11")?;
        status(
            Command::new(PYTHON)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--break-system-packages",
                    "--root-user-action=ignore",
                ])
                .args(&specs),
        )?;
        if !python_tools_ok() {
            bail!(
                "after pip install, `{PYTHON} -c 'import memray'` or `py-spy --version` still fails \
                 (is a pyenv shim for py-spy ahead of /usr/local/bin on PATH?)"
            );
        }
    }
    if !Command::new("cc")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
    {
        bail!("no C compiler (cc): the demo and the test fixtures need one (apt-get install gcc)");
    }
    Ok(())
}

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

/// memray imports in Debian's python3.11 and `py-spy` on PATH runs, both
/// at their pinned versions: two short processes (some 60 ms), no pip.
fn python_tools_ok() -> bool {
    let version_of = |cmd: &mut Command| {
        cmd.output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let [(_, memray), (_, py_spy)] = PYPI_PACKAGES;
    version_of(Command::new(PYTHON).args(["-c", "import memray; print(memray.__version__)"]))
        .is_some_and(|v| v == memray)
        && version_of(Command::new("py-spy").arg("--version"))
            .is_some_and(|v| v == format!("py-spy {py_spy}"))
}

fn bpf_linker_path() -> PathBuf {
    let home = env::var("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env::var("HOME").unwrap_or_default()).join(".cargo"));
    home.join("bin/bpf-linker")
}

fn bpf_linker_ok() -> bool {
    Command::new(bpf_linker_path())
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION))
        .unwrap_or(false)
}

pub(crate) fn require_root(what: &str) -> Result<()> {
    if unsafe_geteuid() != 0 {
        bail!("{what} needs root (run as root or with sudo)");
    }
    Ok(())
}

fn unsafe_geteuid() -> u32 {
    // No libc dependency for one call: /proc tells us.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(u32::MAX)
}

/// `cc -O2 -fno-omit-frame-pointer EXTRA -o OUT SRC`: frame pointers so
/// mtrace sees whole stacks.
pub(crate) fn compile_c(src: &Path, out: &Path, extra: &[&str]) -> Result<()> {
    status(
        Command::new("cc")
            .args(["-O2", "-fno-omit-frame-pointer"])
            .args(extra)
            .arg("-o")
            .arg(out)
            .arg(src),
    )
}

fn build() -> Result<()> {
    status(Command::new(cargo()).args(["build", "--release", "--package", "tracer"]))
}

fn demo(root: &Path) -> Result<()> {
    require_root("tracing (loading BPF programs)")?;
    let out = root.join("target/demo");
    std::fs::create_dir_all(&out)?;
    let workload = out.join("workload");
    compile_c(&root.join("xtask/demo/workload.c"), &workload, &["-g"])?;
    let svg = out.join("flamegraph.svg");
    let folded = out.join("allocations.folded");
    eprintln!("xtask: mtrace -- {} 2000", workload.display());
    status(
        Command::new(root.join("target/release/mtrace"))
            .args(["--top", "8", "--flamegraph"])
            .arg(&svg)
            .arg("--folded")
            .arg(&folded)
            .arg("--")
            .arg(&workload)
            .arg("2000"),
    )?;
    eprintln!(
        "xtask: flamegraph: {}\nxtask: folded stacks: {}",
        svg.display(),
        folded.display()
    );
    Ok(())
}

fn test(args: &[String]) -> Result<()> {
    if unsafe_geteuid() != 0 {
        eprintln!("xtask: warning: not root; the end-to-end tests need BPF and will skip (or fail under CI)");
    }
    if !args.is_empty() {
        return status(
            Command::new(cargo())
                .args(["test", "--release", "--workspace"])
                .args(args),
        );
    }
    // The Rust fixture with jemalloc from crates.io compiles jemalloc's C
    // sources (a minute on 2 CPUs): built here, before the tests, where
    // its test finds it built (same cargo, same target directory).
    let root = workspace_root();
    status(
        Command::new(cargo())
            .args([
                "build",
                "--release",
                "--locked",
                "--quiet",
                "--manifest-path",
            ])
            .arg(root.join("tests/fixtures/rustjem/Cargo.toml"))
            .arg("--target-dir")
            .arg(root.join("target/tmp/rustjem")),
    )?;
    // The stress tests keep both CPUs of a small machine busy for a
    // minute each: they run alone, one after the other, after the rest,
    // so that no other test's waits run out beside them.
    let mut rest = vec!["test", "--release", "--workspace", "--"];
    for name in ALONE {
        rest.extend(["--skip", name]);
    }
    status(Command::new(cargo()).args(rest))?;
    status(
        Command::new(cargo())
            .args(["test", "--release", "-p", "tracer", "--test", "e2e", "--"])
            .args(["--exact", "--test-threads", "1"])
            .args(ALONE),
    )
}

/// The end-to-end stress tests of live mode (a minute each).
const ALONE: [&str; 2] = [
    "losses::a_minute_of_cross_thread_frees_in_live_mode_is_exact",
    "losses::a_burst_at_any_table_size_reports_every_leak_and_no_freed_block",
];
