//! `cargo xtask bench`: mtrace's cost on a malloc-heavy program, against
//! the floor of what any uprobe tracer pays.
//!
//! The benchmark (`xtask/bench/bench.c`) does malloc+free from three call
//! sites at stack depths of about 3, 8 and 20, in 1 and in 2 threads, built
//! twice: with frame pointers (`fp`) and without (`no-fp`, as `-O2` builds
//! and Debian's libc are), where whole stacks need the unwind rules. Every
//! mode runs `runs` times, the modes alternating so that drift of the
//! machine hits all alike:
//! - untraced;
//! - floor: `mtrace --bench-floor`, a BPF program that does nothing, on the
//!   same functions as count mode (entry probes);
//! - count, count on the host's engine (`--file-wide`), and two sampled
//!   count modes;
//! - live floor (`--live --bench-floor`: entry, return and free probes that
//!   do nothing) and live.
//!
//! The benchmark times its own loop, so start-up and attach are not in
//! ns/iteration. mtrace -v reports its attach time, CPU time and peak RSS.
//! A mode's ratio to its floor is the median over rounds of the ratio
//! within a round: this machine's speed drifts, and the runs of one round
//! are close in time (every other round runs the modes in reverse order).
//!
//! A last pass runs each traced mode once more with `--bpf-stats`: the
//! kernel times every BPF program run, which says where mtrace's cost on
//! the target goes (the timing adds some 30 ns per run of its own, so this
//! pass is not in the table above).
//!
//! Then the process-tree rows (`tree`, alone with `--tree-only`) and the
//! Python rows (`python`, alone with `--python-only`).

use std::{
    fmt::Write as _,
    io::IsTerminal,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::{compile_c, require_root};

mod agent;
mod cargo;
mod make;
mod python;
mod soak;
mod tree;

struct Mode {
    name: &'static str,
    args: &'static [&'static str],
    /// The mode this one is compared with.
    floor: Option<&'static str>,
}

const MODES: &[Mode] = &[
    Mode {
        name: "untraced",
        args: &[],
        floor: None,
    },
    Mode {
        name: "floor",
        args: &["--bench-floor"],
        floor: None,
    },
    Mode {
        name: "count",
        args: &[],
        floor: Some("floor"),
    },
    Mode {
        name: "count caller only",
        args: &["--max-stack", "0"],
        floor: Some("floor"),
    },
    // The host's engine on the same command (file-wide probes, the scope
    // told in the kernel), against the same floor.
    Mode {
        name: "count file-wide",
        args: &["--file-wide"],
        floor: Some("floor"),
    },
    Mode {
        name: "sampled 512KiB",
        args: &["--sample-bytes", "512KiB"],
        floor: Some("floor"),
    },
    Mode {
        name: "sampled 1/1000",
        args: &["--sample-every", "1000"],
        floor: Some("floor"),
    },
    Mode {
        name: "live floor",
        args: &["--live", "--bench-floor"],
        floor: None,
    },
    Mode {
        name: "live",
        args: &["--live"],
        floor: Some("live floor"),
    },
];

#[derive(Default, Clone)]
struct Sample {
    ns_per_iter: f64,
    /// The share of calls with a whole stack, from the report.
    whole_pct: Option<f64>,
    attach_ms: Option<f64>,
    cpu_ms: Option<f64>,
    rss_kib: Option<f64>,
}

struct Result1 {
    build: &'static str,
    threads: u32,
    mode: &'static str,
    floor: Option<&'static str>,
    samples: Vec<Sample>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl Result1 {
    fn ns(&self) -> Vec<f64> {
        self.samples.iter().map(|s| s.ns_per_iter).collect()
    }
    fn median_ns(&self) -> f64 {
        median(&mut self.ns())
    }
    fn spread(&self) -> (f64, f64) {
        let v = self.ns();
        (
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(0.0, f64::max),
        )
    }
    /// Median over rounds of this mode's time over `floor`'s.
    fn ratio_to(&self, floor: &Result1) -> f64 {
        let mut v: Vec<f64> = self
            .samples
            .iter()
            .zip(&floor.samples)
            .map(|(a, b)| a.ns_per_iter / b.ns_per_iter)
            .collect();
        median(&mut v)
    }
    fn median_of(&self, f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
        let mut v: Vec<f64> = self.samples.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(&mut v))
    }
}

fn parse_after(text: &str, key: &str) -> Option<f64> {
    let at = text.find(key)? + key.len();
    text[at..]
        .split_whitespace()
        .next()?
        .trim_end_matches(',')
        .parse()
        .ok()
}

/// The benchmark program and what it runs under.
struct Target<'a> {
    bench: &'a Path,
    /// `LD_PRELOAD` for the benchmark (and, harmlessly, mtrace).
    preload: Option<&'static str>,
}

/// Waits (at most two minutes) until no process of mtrace's is left: one
/// still taking its probes out takes CPU time from the next run, which
/// then measured the machine's business rather than its own mode (on 2
/// CPUs, a 2-thread run has none to spare).
fn wait_for_reapers() {
    let running = || {
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                std::fs::read_to_string(e.path().join("comm"))
                    .is_ok_and(|c| c.trim_end() == "mtrace")
            })
    };
    let started = std::time::Instant::now();
    while running() && started.elapsed() < std::time::Duration::from_secs(120) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn run_once(
    root: &Path,
    target: &Target,
    mode: &Mode,
    iterations: u64,
    threads: u32,
    bpf_stats: bool,
) -> Result<(Sample, Vec<ProgramTime>)> {
    let bench = target.bench;
    let mut cmd = if mode.name == "untraced" {
        Command::new(bench)
    } else {
        let mut c = Command::new(root.join("target/release/mtrace"));
        c.arg("-v")
            .args(mode.args)
            .args(bpf_stats.then_some("--bpf-stats"))
            .args(["--top", "1", "--"])
            .arg(bench);
        c
    };
    if let Some(lib) = target.preload {
        cmd.env("LD_PRELOAD", lib);
    }
    cmd.arg(iterations.to_string())
        .arg(threads.to_string())
        .stdin(Stdio::null());
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    wait_for_reapers();
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            mode.name,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let sample = Sample {
        ns_per_iter: parse_after(&stdout, "ns_per_iter ")
            .with_context(|| format!("no ns_per_iter from {}", mode.name))?,
        whole_pct: stdout
            .lines()
            .find_map(|l| l.strip_prefix("stacks: "))
            .and_then(|l| l.split('%').next()?.parse().ok()),
        attach_ms: parse_after(&stderr, "attached in "),
        cpu_ms: parse_after(&stderr, "resources: cpu "),
        rss_kib: parse_after(&stderr, "peak rss "),
    };
    Ok((sample, program_times(&stderr)))
}

/// Time inside one BPF program, from `mtrace -v --bpf-stats`.
struct ProgramTime {
    mode: &'static str,
    program: String,
    runs: u64,
    ns_per_run: f64,
}

/// Parses "bpf program NAME: RUNS runs, NS ns per run" lines.
fn program_times(stderr: &str) -> Vec<ProgramTime> {
    let mut out: Vec<ProgramTime> = stderr
        .lines()
        .filter_map(|l| {
            let rest = &l[l.find("bpf program ")? + "bpf program ".len()..];
            let (name, rest) = rest.split_once(": ")?;
            let mut words = rest.split_whitespace();
            let runs = words.next()?.parse().ok()?;
            let ns_per_run = words.nth(1)?.parse().ok()?;
            Some(ProgramTime {
                mode: "",
                program: name.to_string(),
                runs,
                ns_per_run,
            })
        })
        .collect();
    out.sort_by(|a, b| b.runs.cmp(&a.runs).then(a.program.cmp(&b.program)));
    out
}

/// Runs of every mode when `--runs` is not given; the Python rows take
/// fewer (each of their runs is a whole process, best of the runs).
const RUNS: usize = 5;
const PYTHON_RUNS: usize = 3;

/// Which part of the benchmark runs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Only {
    All,
    Tree,
    Python,
    Agent,
    /// `agent --all` on a `make -j2` loop for this many minutes.
    Soak(u64),
}

/// The agent's soak run, seconds.
pub const SOAK_SECS: u64 = 600;

pub fn run(
    root: &Path,
    iterations: u64,
    runs: Option<usize>,
    json_path: &Path,
    only: Only,
    soak_secs: u64,
) -> Result<()> {
    require_root("the benchmark (it loads BPF programs)")?;
    let python_runs = runs.unwrap_or(PYTHON_RUNS);
    let runs = runs.unwrap_or(RUNS);
    if only == Only::Python {
        let rows = python::run(root, python_runs)?;
        let mut table = String::new();
        python::render_table(&rows, python_runs, &mut table);
        return soak::print_and_write(&table, &python::render_json(&rows), json_path);
    }
    if let Only::Soak(minutes) = only {
        let soak = soak::run(root, minutes)?;
        return soak::print_and_write(
            &soak::render_table(&soak),
            &soak::render_json(&soak),
            json_path,
        );
    }
    if only == Only::Agent {
        let (rows, soak) = agent::run(root, runs, soak_secs)?;
        let mut table = String::new();
        agent::render_table(&rows, soak.as_ref(), runs, &mut table);
        return soak::print_and_write(&table, &agent::render_json(&rows, soak.as_ref()), json_path);
    }
    if only == Only::Tree {
        let bench = tree::run(root, runs)?;
        let mut table = String::new();
        tree::render_table(&bench, &mut table);
        return soak::print_and_write(&table, &tree::render_json(&bench), json_path);
    }
    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let progress = std::io::stderr().is_terminal();
    let mut results: Vec<Result1> = Vec::new();
    let mut fp_bench = None;
    for (build, flags, preload) in BUILDS {
        let bench = out_dir.join(format!("bench-{}", build.replace(' ', "-")));
        let mut args = vec!["-pthread"];
        args.extend(flags.iter());
        compile_c(&root.join("xtask/bench/bench.c"), &bench, &args)?;
        fp_bench.get_or_insert(bench.clone());
        let target = Target {
            bench: &bench,
            preload,
        };
        run_build(
            root,
            &target,
            build,
            iterations,
            runs,
            progress,
            &mut results,
        )?;
    }
    let bench = fp_bench.expect("a build");
    let bench = Target {
        bench: &bench,
        preload: None,
    };

    let mut programs = Vec::new();
    for mode in MODES.iter().filter(|m| m.name != "untraced") {
        eprint!("\rxtask: bench BPF program times, {:<16}", mode.name);
        let (_, times) = run_once(root, &bench, mode, iterations, 1, true)?;
        programs.extend(times.into_iter().map(|t| ProgramTime {
            mode: mode.name,
            ..t
        }));
    }
    if progress {
        eprintln!();
    }

    let tree_bench = tree::run(root, runs)?;
    let python_rows = python::run(root, python_runs)?;
    let (agent_rows, soak) = agent::run(root, runs, soak_secs)?;
    let mut table = render_table(&results, &programs, iterations, runs);
    tree::render_table(&tree_bench, &mut table);
    python::render_table(&python_rows, python_runs, &mut table);
    agent::render_table(&agent_rows, soak.as_ref(), runs, &mut table);
    println!("{table}");
    let json = render_json(&results, &programs, iterations, runs);
    let json = format!(
        "{},\n{},\n{},\n{}\n}}\n",
        json.trim_end().trim_end_matches('}').trim_end(),
        tree::render_json(&tree_bench),
        python::render_json(&python_rows),
        agent::render_json(&agent_rows, soak.as_ref())
    );
    std::fs::write(json_path, json).with_context(|| format!("writing {}", json_path.display()))?;
    eprintln!("xtask: wrote {}", json_path.display());
    Ok(())
}

/// The benchmark with frame pointers, and without (what `-O2` gives), and
/// the latter under Debian's jemalloc (`LD_PRELOAD`): its `malloc` begins
/// with a `cmp`, which the kernel would single-step.
const BUILDS: [(&str, &[&str], Option<&str>); 3] = [
    ("fp", &[], None),
    ("no-fp", &["-fomit-frame-pointer"], None),
    ("no-fp jemalloc", &["-fomit-frame-pointer"], Some(JEMALLOC)),
];

/// Debian's libjemalloc2 (installed by `cargo xtask setup`).
const JEMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";

/// Every mode of one build, in 1 and 2 threads.
fn run_build(
    root: &Path,
    bench: &Target,
    build: &'static str,
    iterations: u64,
    runs: usize,
    progress: bool,
    results: &mut Vec<Result1>,
) -> Result<()> {
    for threads in [1u32, 2] {
        let mut per_mode: Vec<Result1> = MODES
            .iter()
            .map(|m| Result1 {
                build,
                threads,
                mode: m.name,
                floor: m.floor,
                samples: Vec::new(),
            })
            .collect();
        for run in 0..runs {
            // Every other round in reverse order: a drift of the machine's
            // speed then favours neither a mode nor its floor.
            let mut order: Vec<usize> = (0..MODES.len()).collect();
            if run % 2 == 1 {
                order.reverse();
            }
            for i in order {
                let mode = &MODES[i];
                eprint!(
                    "\rxtask: bench {build}, {threads} thread(s), run {}/{runs}, {:<16}",
                    run + 1,
                    mode.name
                );
                let (sample, _) = run_once(root, bench, mode, iterations, threads, false)?;
                per_mode[i].samples.push(sample);
            }
        }
        if progress {
            eprintln!();
        }
        results.extend(per_mode);
    }
    Ok(())
}

fn find<'a>(results: &'a [Result1], of: &Result1, mode: &str) -> Option<&'a Result1> {
    results
        .iter()
        .find(|r| r.build == of.build && r.threads == of.threads && r.mode == mode)
}

/// Each iteration makes two allocator calls (malloc and free).
const CALLS_PER_ITER: f64 = 2.0;

fn render_table(
    results: &[Result1],
    programs: &[ProgramTime],
    iterations: u64,
    runs: usize,
) -> String {
    let mut out = String::new();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let _ = writeln!(
        out,
        "mtrace overhead: {iterations} iterations of malloc+free per thread, {runs} runs per mode, medians (vs floor: median of the ratios within a round)\nmachine: {cpu}, {} CPUs, Linux {}",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        kernel.trim()
    );
    let _ = writeln!(
        out,
        "\n| build | threads | mode | ns/iter | min..max | +ns per call | vs floor | whole stacks | tracer CPU ms | tracer RSS MiB | attach ms |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in results {
        let base = find(results, r, "untraced").map(|u| u.median_ns());
        let ns = r.median_ns();
        let (lo, hi) = r.spread();
        let added = base
            .filter(|_| r.mode != "untraced")
            .map(|b| format!("{:.0}", (ns - b) / CALLS_PER_ITER))
            .unwrap_or_else(|| "-".into());
        let vs_floor = r
            .floor
            .and_then(|f| find(results, r, f))
            .map(|f| format!("{:.2}x", r.ratio_to(f)))
            .unwrap_or_else(|| "-".into());
        let whole = r
            .floor
            .and(r.median_of(|s| s.whole_pct))
            .map(|p| format!("{p:.2}%"))
            .unwrap_or_else(|| "-".into());
        let opt = |v: Option<f64>, scale: f64| {
            v.map(|x| format!("{:.1}", x / scale))
                .unwrap_or_else(|| "-".into())
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.0} | {:.0}..{:.0} | {} | {} | {} | {} | {} | {} |",
            r.build,
            r.threads,
            r.mode,
            ns,
            lo,
            hi,
            added,
            vs_floor,
            whole,
            opt(r.median_of(|s| s.cpu_ms), 1.0),
            opt(r.median_of(|s| s.rss_kib), 1024.0),
            opt(r.median_of(|s| s.attach_ms), 1.0),
        );
    }
    if !programs.is_empty() {
        let _ = writeln!(
            out,
            "\nTime inside each BPF program (1 thread, one run with --bpf-stats; the kernel's timing adds ~30 ns a run, the whole of the floor's):\n\n| mode | program | runs | ns per run |\n|---|---|---|---|"
        );
        for p in programs.iter().filter(|p| p.runs >= iterations / 2) {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.0} |",
                p.mode, p.program, p.runs, p.ns_per_run
            );
        }
    }
    out
}

fn render_json(
    results: &[Result1],
    programs: &[ProgramTime],
    iterations: u64,
    runs: usize,
) -> String {
    let mut rows = Vec::new();
    for r in results {
        let (lo, hi) = r.spread();
        let floor = r
            .floor
            .and_then(|f| find(results, r, f))
            .map(|f| r.ratio_to(f));
        let num = |v: Option<f64>| v.map_or("null".to_string(), |x| format!("{x:.3}"));
        rows.push(format!(
            "    {{\"build\": \"{}\", \"threads\": {}, \"mode\": \"{}\", \"ns_per_iter_median\": {:.3}, \"ns_per_iter_min\": {:.3}, \"ns_per_iter_max\": {:.3}, \"ns_per_iter_runs\": [{}], \"vs_floor\": {}, \"whole_stacks_pct\": {}, \"tracer_cpu_ms\": {}, \"tracer_peak_rss_kib\": {}, \"attach_ms\": {}}}",
            r.build,
            r.threads,
            r.mode,
            r.median_ns(),
            lo,
            hi,
            r.ns()
                .iter()
                .map(|v| format!("{v:.3}"))
                .collect::<Vec<_>>()
                .join(", "),
            num(floor),
            num(r.median_of(|s| s.whole_pct)),
            num(r.median_of(|s| s.cpu_ms)),
            num(r.median_of(|s| s.rss_kib)),
            num(r.median_of(|s| s.attach_ms)),
        ));
    }
    let programs: Vec<String> = programs
        .iter()
        .map(|p| {
            format!(
                "    {{\"mode\": \"{}\", \"program\": \"{}\", \"runs\": {}, \"ns_per_run\": {:.1}}}",
                p.mode, p.program, p.runs, p.ns_per_run
            )
        })
        .collect();
    format!(
        "{{\n  \"iterations\": {iterations},\n  \"runs\": {runs},\n  \"calls_per_iteration\": {CALLS_PER_ITER},\n  \"results\": [\n{}\n  ],\n  \"bpf_programs\": [\n{}\n  ]\n}}\n",
        rows.join(",\n"),
        programs.join(",\n")
    )
}
