//! The agent rows: what `mtrace agent` costs the processes it traces, per
//! policy, on the bench loop (bench.c, launched under the agent, its own
//! ns per iteration) and on a Redis server by pid (its CPU time per
//! request under redis-benchmark, and the requests a second); and a soak
//! run: the agent on a shell loop that starts a short program every 0.1
//! s, its RSS, CPU and descriptors read from its own /metrics every 10 s.
//!
//! Each run measures two copies of the workload at once, one traced and
//! one not (two loops, two Redis servers each with its own client): on
//! this machine a run's speed drifts by 10-30% within minutes, and the
//! drift falls on both copies alike, so their ratio holds the agent's
//! cost and little else. The Redis servers swap roles every run.

use std::{
    fmt::Write as _,
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::compile_c;

/// The policies compared: name, `mtrace agent` arguments.
const POLICIES: [(&str, &[&str]); 3] = [
    ("windows (default)", &[]),
    ("always, exact", &["--policy", "always"]),
    (
        "always, sampled 512 KiB",
        &["--policy", "always", "--sample-bytes", "524288"],
    ),
];

/// Redis runs per policy, at least (its CPU per request varies by about
/// 8% from run to run on this machine).
const REDIS_RUNS: usize = 7;

/// The goal the rows are read against.
const GOAL_PCT: f64 = 2.0;

pub struct CostRow {
    workload: &'static str,
    policy: &'static str,
    /// ns per iteration (bench loop) or CPU µs per request (Redis).
    untraced: f64,
    traced: f64,
    /// Redis: requests a second, untraced and traced.
    rps: Option<(f64, f64)>,
    /// Share of the time the probes were in (windows policy).
    probed_pct: Option<f64>,
    /// Each run's traced over its untraced twin of the same seconds, less
    /// one: their mean and its standard error, percent.
    paired: (f64, f64),
    /// Redis: of the stacks that hold 1% of the exact trace's calls or
    /// more (its runs' reports summed), how many this policy's reports
    /// (summed) have, and whether they rank them as the exact trace does.
    top: Option<(usize, usize, bool)>,
}

impl CostRow {
    /// A policy's row from its runs: untraced and traced figures taken at
    /// once, and the shares probed each run reported.
    fn of(
        workload: &'static str,
        policy: &'static str,
        base: Vec<f64>,
        traced: Vec<f64>,
        probed: Vec<f64>,
    ) -> CostRow {
        CostRow {
            workload,
            policy,
            paired: paired(&base, &traced),
            untraced: median(base),
            traced: median(traced),
            rps: None,
            probed_pct: (!probed.is_empty()).then(|| median(probed)),
            top: None,
        }
    }
}

/// The share of the exact trace's calls from which a stack's rank is
/// compared.
const MAJOR_PCT: f64 = 1.0;

/// The report's stacks in its order, each as its function and frames,
/// with its calls; and the trace's total calls.
fn report_stacks(report: &str) -> (Vec<(String, f64)>, f64) {
    let mut out: Vec<(String, f64)> = Vec::new();
    let mut current: Option<(Vec<String>, f64)> = None;
    let flush = |c: Option<(Vec<String>, f64)>, out: &mut Vec<(String, f64)>| {
        out.extend(c.map(|(f, n)| (f.join(";"), n)));
    };
    for line in report.lines() {
        if let Some(rest) = line.strip_prefix('#') {
            flush(current.take(), &mut out);
            let head = rest.split("  process ").next().unwrap_or(rest);
            let mut words = head.split_whitespace();
            let calls = words.nth(1).and_then(|c| c.parse().ok()).unwrap_or(0.0);
            let func = head.split_whitespace().last().unwrap_or_default();
            current = Some((vec![func.to_string()], calls));
        } else if let Some((frames, _)) = current.as_mut() {
            if line.starts_with("    ") {
                frames.push(line.trim().to_string());
            } else {
                flush(current.take(), &mut out);
            }
        }
    }
    flush(current, &mut out);
    let total = report
        .lines()
        .find_map(|l| l.strip_prefix("total: ")?.split(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    (out, total)
}

/// The stacks of several runs' reports as one report's: each stack's
/// calls summed over the runs, most first; the totals summed.
fn summed_stacks(runs: Vec<(Vec<(String, f64)>, f64)>) -> (Vec<(String, f64)>, f64) {
    let mut sum: std::collections::HashMap<String, f64> = std::collections::HashMap::new();
    let mut total = 0.0;
    for (stacks, t) in runs {
        total += t;
        for (key, calls) in stacks {
            *sum.entry(key).or_default() += calls;
        }
    }
    let mut stacks: Vec<(String, f64)> = sum.into_iter().collect();
    stacks.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    (stacks, total)
}

/// Of the exact trace's stacks with [`MAJOR_PCT`] of its calls or more:
/// how many `other` has, and whether `other` ranks every two of them
/// whose exact counts differ as the exact trace does.
fn top_agreement(
    exact: &(Vec<(String, f64)>, f64),
    other: &[(String, f64)],
) -> (usize, usize, bool) {
    let major: Vec<&(String, f64)> = exact
        .0
        .iter()
        .filter(|(_, n)| *n * 100.0 >= MAJOR_PCT * exact.1)
        .collect();
    let rank = |key: &str| other.iter().position(|(k, _)| k == key);
    let found = major.iter().filter(|(k, _)| rank(k).is_some()).count();
    let ordered = major.iter().all(|(a, na)| {
        major.iter().all(|(b, nb)| {
            na <= nb || matches!((rank(a), rank(b)), (Some(ra), Some(rb)) if ra < rb)
        })
    });
    (found, major.len(), ordered)
}

/// Windows policy on the bench loop: runs at least (the effect is near
/// this machine's run-to-run noise, so its standard error matters).
const WINDOWS_RUNS: usize = 7;

/// The windows policy's loops are timed from this long after the agent is
/// started: its start (loading and verifying its BPF objects, ~0.2 s of
/// CPU each) is over by then.
const WINDOWS_FROM: Duration = Duration::from_secs(3);

/// CLOCK_MONOTONIC now, ns (bench.c's clock).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a live timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Mean and standard error of `traced[i] / untraced[i] - 1`, percent.
fn paired(untraced: &[f64], traced: &[f64]) -> (f64, f64) {
    let d: Vec<f64> = untraced
        .iter()
        .zip(traced)
        .map(|(u, t)| (t / u - 1.0) * 100.0)
        .collect();
    let n = d.len() as f64;
    let mean = d.iter().sum::<f64>() / n;
    let var = d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, (var / n).sqrt())
}

pub struct Soak {
    secs: f64,
    /// Processes the agent saw start.
    processes: u64,
    /// (seconds, RSS KiB, CPU s, open fds) every 10 s.
    points: Vec<(f64, u64, f64, u64)>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The agent, started on `target` args; the address it serves on and
/// the pid it traces first.
pub(super) fn agent(
    mtrace: &Path,
    policy: &[&str],
    target: &[&str],
) -> Result<(Child, String, u32)> {
    agent_with_env(mtrace, policy, target, &[])
}

/// [`agent`] with `env` added to its environment (and so to a program it
/// launches).
fn agent_with_env(
    mtrace: &Path,
    policy: &[&str],
    target: &[&str],
    env: &[(&str, &str)],
) -> Result<(Child, String, u32)> {
    let mut child = Command::new(mtrace)
        .args(["agent", "--listen", "127.0.0.1:0"])
        .args(policy)
        .args(target)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting mtrace agent")?;
    let err = child.stderr.take().context("agent stderr")?;
    let mut lines = BufReader::new(err).lines().map_while(Result::ok);
    let mut traced = 0;
    let addr = lines
        .find_map(|l| {
            if let Some(rest) = l.strip_prefix("mtrace: tracing pid ") {
                traced = rest
                    .split(' ')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(0);
            }
            l.strip_prefix("mtrace agent: serving on http://")
                .map(|a| a.split('/').next().unwrap_or_default().to_string())
        })
        .context("the agent never said where it serves")?;
    std::thread::spawn(move || lines.for_each(drop));
    Ok((child, addr, traced))
}

pub(super) fn get(addr: &str, path: &str) -> Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default())
}

pub(super) fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

fn stop(mut child: Child) -> Result<String> {
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        o.read_to_string(&mut out)?;
    }
    child.wait()?;
    Ok(out)
}

fn ns_per_iter(text: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix("ns_per_iter ")?.trim().parse().ok())
}

/// The probed share from the report's `windows: probes in X s of Y s (Z%`.
fn probed_pct(report: &str) -> Option<f64> {
    let line = report
        .lines()
        .find(|l| l.starts_with("windows: probes in "))?;
    line.split('(').nth(1)?.split('%').next()?.parse().ok()
}

fn bench_loop(mtrace: &Path, bench: &Path, runs: usize) -> Result<Vec<CostRow>> {
    let mut rows = Vec::new();
    for (policy, args) in POLICIES {
        // The windows policy runs long enough for several periods (one
        // window every 10 s at most); the others pay a trap per call.
        let (iterations, runs) = if args.is_empty() {
            ("600000000", runs.max(WINDOWS_RUNS))
        } else {
            ("20000000", runs)
        };
        let (mut base, mut traced, mut probed) = (Vec::new(), Vec::new(), Vec::new());
        for run in 0..runs {
            eprint!(
                "\rxtask: bench agent, bench loop, {policy:<24} run {}",
                run + 1
            );
            // The windows policy's loops are timed from the same moment,
            // past the agent's start (its BPF objects verified, once for
            // weeks of tracing); the others' effects dwarf it.
            let from = args
                .is_empty()
                .then(|| monotonic_ns() + WINDOWS_FROM.as_nanos() as u64);
            let from = from.map(|t| t.to_string()).unwrap_or_default();
            let (child, _, _) = agent_with_env(
                mtrace,
                args,
                &["--", &bench.display().to_string(), iterations, "1"],
                &[("BENCH_FROM", &from)],
            )?;
            // The twin starts once the traced loop runs.
            let twin = Command::new(bench)
                .args([iterations, "1"])
                .env("BENCH_FROM", &from)
                .output()?;
            let out = child.wait_with_output()?;
            base.push(ns_per_iter(&String::from_utf8_lossy(&twin.stdout)).context("bench output")?);
            let text = String::from_utf8_lossy(&out.stdout);
            traced.push(ns_per_iter(&text).context("bench output under the agent")?);
            probed.extend(probed_pct(&text));
        }
        rows.push(CostRow::of(
            "bench loop (ns/iter)",
            policy,
            base,
            traced,
            probed,
        ));
    }
    Ok(rows)
}

/// utime + stime of `pid`, seconds.
fn cpu_secs(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = stat.rsplit_once(')').context("stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    Ok(ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64)
}

/// One redis-benchmark run: server CPU µs per request, requests a second.
fn redis_run(pid: u32, port: u16, requests: u64) -> Result<(f64, f64)> {
    let before = cpu_secs(pid)?;
    let out = Command::new("redis-benchmark")
        .args(["-p", &port.to_string(), "-t", "set,get", "-c", "20", "-q"])
        .args(["-n", &requests.to_string()])
        .output()?;
    let cpu = cpu_secs(pid)? - before;
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    let rates: Vec<f64> = text
        .lines()
        .filter_map(|l| l.split(": ").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    if rates.len() < 2 {
        bail!("redis-benchmark said {text:?}");
    }
    Ok((
        cpu * 1e6 / (2 * requests) as f64,
        rates.iter().sum::<f64>() / rates.len() as f64,
    ))
}

/// A Redis server on a free loopback port, listening: it and its port.
fn redis_server() -> Result<(Child, u16)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut server = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
        .context("starting redis-server")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            let _ = server.kill();
            bail!("redis-server did not listen");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((server, port))
}

fn redis(mtrace: &Path, runs: usize) -> Result<Vec<CostRow>> {
    let mut servers = Vec::new();
    let result = (|| {
        for _ in 0..2 {
            servers.push(redis_server()?);
        }
        let ends: Vec<(u32, u16)> = servers.iter().map(|(c, p)| (c.id(), *p)).collect();
        let requests = 200_000;
        let mut rows = Vec::new();
        let mut reports: Vec<(Vec<(String, f64)>, f64)> = Vec::new();
        for (policy, args) in POLICIES {
            let (mut base, mut traced, mut rb, mut rt, mut probed) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut runs_stacks = Vec::new();
            for run in 0..runs {
                eprint!("\rxtask: bench agent, redis, {policy:<24} run {}", run + 1);
                let ((pid, port), (twin_pid, twin_port)) = (ends[run % 2], ends[1 - run % 2]);
                let (child, _, _) = agent(mtrace, args, &["--pid", &pid.to_string()])?;
                std::thread::sleep(Duration::from_millis(500));
                let (t, u) = std::thread::scope(|s| {
                    let twin = s.spawn(|| redis_run(twin_pid, twin_port, requests));
                    let t = redis_run(pid, port, requests);
                    (t, twin.join().expect("redis-benchmark thread"))
                });
                let report = stop(child)?;
                let ((c, r), (uc, ur)) = (t?, u?);
                traced.push(c);
                rt.push(r);
                base.push(uc);
                rb.push(ur);
                probed.extend(probed_pct(&report));
                runs_stacks.push(report_stacks(&report));
            }
            reports.push(summed_stacks(runs_stacks));
            rows.push(CostRow {
                rps: Some((median(rb), median(rt))),
                ..CostRow::of(
                    "redis by pid (CPU us/request)",
                    policy,
                    base,
                    traced,
                    probed,
                )
            });
        }
        // The exact policy's stacks are the reference.
        if let Some(exact) = POLICIES
            .iter()
            .position(|(_, args)| *args == ["--policy", "always"])
            .and_then(|i| reports.get(i).cloned())
        {
            for (row, (stacks, _)) in rows.iter_mut().zip(&reports) {
                row.top = Some(top_agreement(&exact, stacks));
            }
        }
        Ok(rows)
    })();
    for (mut server, _) in servers {
        let _ = server.kill();
        let _ = server.wait();
    }
    result
}

fn soak(mtrace: &Path, bench: &Path, secs: u64) -> Result<Soak> {
    let script = format!(
        "while :; do {} 200000 1 >/dev/null; sleep 0.1; done",
        bench.display()
    );
    let (child, addr, shell) = agent(mtrace, &[], &["--", "sh", "-c", &script])?;
    let started = Instant::now();
    let mut points = Vec::new();
    let mut processes = 0;
    while started.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_secs(10));
        eprint!(
            "\rxtask: bench agent, soak {:>4.0} s of {secs}",
            started.elapsed().as_secs_f64()
        );
        let text = get(&addr, "/metrics")?;
        let rss = metric(&text, "mtrace_agent_resident_bytes").unwrap_or(0.0) as u64 / 1024;
        let cpu = metric(&text, "mtrace_agent_cpu_seconds_total").unwrap_or(0.0);
        let fds = metric(&text, "mtrace_agent_open_fds").unwrap_or(0.0) as u64;
        processes = metric(&text, "mtrace_processes_seen_total").unwrap_or(0.0) as u64;
        points.push((started.elapsed().as_secs_f64(), rss, cpu, fds));
    }
    // The shell loop ends (its last program runs out); the agent, whose
    // command it was, ends with it.
    if shell != 0 {
        unsafe { libc::kill(shell as i32, libc::SIGKILL) };
    }
    stop(child)?;
    Ok(Soak {
        secs: started.elapsed().as_secs_f64(),
        processes,
        points,
    })
}

pub fn run(root: &Path, runs: usize, soak_secs: u64) -> Result<(Vec<CostRow>, Option<Soak>)> {
    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let bench = out_dir.join("bench-agent");
    compile_c(&root.join("xtask/bench/bench.c"), &bench, &["-pthread"])?;
    let mtrace = root.join("target/release/mtrace");
    let mut rows = bench_loop(&mtrace, &bench, runs)?;
    if Command::new("redis-benchmark")
        .arg("--version")
        .output()
        .is_ok()
    {
        // A run varies by about 8% here: more of them.
        rows.extend(redis(&mtrace, runs.max(REDIS_RUNS))?);
    } else {
        eprintln!("\nxtask: no redis-server/redis-benchmark: the Redis rows are left out");
    }
    let soak = if soak_secs > 0 {
        Some(soak(&mtrace, &bench, soak_secs)?)
    } else {
        None
    };
    eprintln!();
    Ok((rows, soak))
}

/// A windows row's loss as the share probed and the slowdown while probed
/// give it, each measured apart: the probes in for `p` of the time at a
/// slowdown `r` (the always-exact row's paired overhead on the same
/// workload) cost `p·r/(1+r)` of the work. Far less noisy than the paired
/// overhead of a few runs, where the machine's noise exceeds the goal.
fn loss_while_probed(row: &CostRow, rows: &[CostRow]) -> Option<f64> {
    let probed = row.probed_pct?;
    let always = rows
        .iter()
        .find(|a| a.workload == row.workload && a.policy == "always, exact")?;
    let r = always.paired.0 / 100.0;
    Some(probed * r / (1.0 + r))
}

pub fn render_table(rows: &[CostRow], soak: Option<&Soak>, runs: usize, out: &mut String) {
    let _ = writeln!(
        out,
        "\nmtrace agent: cost to the traced process per policy, median of {runs} runs (Redis: {}) (goal: {GOAL_PCT}% on average); each run a traced and an untraced copy of the workload at once; major stacks: of the stacks with {MAJOR_PCT}% of the exact trace's calls or more (every run's report summed), how many the policy's reports have, ranked as in the exact trace or not\n\n| workload | policy | untraced | traced | overhead of medians | paired overhead (traced / its untraced twin), mean ± s.e. | probed | loss while probed | requests/s untraced -> traced | major stacks |\n|---|---|---|---|---|---|---|---|---|---|",
        runs.max(REDIS_RUNS)
    );
    for r in rows {
        let pct = (r.traced / r.untraced - 1.0) * 100.0;
        let _ = writeln!(
            out,
            "| {} | {} | {:.2} | {:.2} | {pct:+.1}% | {:+.1}% ± {:.1}% | {} | {} | {} | {} |",
            r.workload,
            r.policy,
            r.untraced,
            r.traced,
            r.paired.0,
            r.paired.1,
            r.probed_pct.map_or("-".into(), |p| format!("{p:.1}%")),
            loss_while_probed(r, rows).map_or("-".into(), |l| format!("{l:.2}%")),
            r.rps
                .map_or("-".into(), |(a, b)| format!("{a:.0} -> {b:.0}")),
            r.top.map_or("-".into(), |(n, of, ranked)| format!(
                "{n}/{of}, {}",
                if ranked {
                    "same ranking"
                } else {
                    "ranked otherwise"
                }
            )),
        );
    }
    if let Some(s) = soak {
        let _ = writeln!(
            out,
            "\nagent soak: {:.0} s, a short program started every ~0.1 s ({} processes seen)\n\n| s | agent RSS KiB | agent CPU s | open fds |\n|---|---|---|---|",
            s.secs, s.processes
        );
        for (t, rss, cpu, fds) in &s.points {
            let _ = writeln!(out, "| {t:.0} | {rss} | {cpu:.2} | {fds} |");
        }
    }
}

pub fn render_json(rows: &[CostRow], soak: Option<&Soak>) -> String {
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"workload\": \"{}\", \"policy\": \"{}\", \"untraced\": {:.4}, \"traced\": {:.4}, \"paired_pct\": [{:.3}, {:.3}], \"probed_pct\": {}, \"loss_while_probed_pct\": {}, \"rps\": {}, \"top\": {}}}",
                r.workload,
                r.policy,
                r.untraced,
                r.traced,
                r.paired.0,
                r.paired.1,
                r.probed_pct.map_or("null".into(), |p| format!("{p:.2}")),
                loss_while_probed(r, rows).map_or("null".into(), |l| format!("{l:.3}")),
                r.rps.map_or("null".into(), |(a, b)| format!("[{a:.0}, {b:.0}]")),
                r.top.map_or("null".into(), |(n, of, ranked)| format!("[{n}, {of}, {ranked}]")),
            )
        })
        .collect();
    let soak = soak.map_or("null".to_string(), |s| {
        let points: Vec<String> = s
            .points
            .iter()
            .map(|(t, rss, cpu, fds)| format!("[{t:.1}, {rss}, {cpu:.3}, {fds}]"))
            .collect();
        format!(
            "{{\"secs\": {:.1}, \"processes\": {}, \"points_s_rsskib_cpus_fds\": [{}]}}",
            s.secs,
            s.processes,
            points.join(", ")
        )
    });
    format!(
        "  \"agent\": [\n{}\n  ],\n  \"agent_soak\": {soak}",
        rows.join(",\n")
    )
}
