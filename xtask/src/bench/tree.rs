//! The process-tree rows: what a tree of short programs pays under mtrace
//! (a shell loop of 200 runs of `ls`, `true`, a small C program and one
//! with a thread making 3,200 calls),
//! against untraced and heaptrack, in milliseconds added per exec, and
//! the same loop run on its own while `mtrace --all` traces the host;
//! how long mtrace takes to let go of a busy target by pid, from Ctrl-C
//! (SIGINT) to its exit, when the kernel has taken every probe out (its
//! links are closed by then); and what a process outside the trace pays
//! (the benchmark loop while mtrace traces another process by pid, and
//! while `mtrace --all` runs).

use std::{
    fmt::Write as _,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use super::make::{make_row, MakeRow, UNITS};
use crate::compile_c;

/// Programs each loop runs.
const EXECS: u32 = 200;

/// The small C program: ten allocations, nothing printed.
const SMALL_C: &str = r#"#include <stdlib.h>
void *volatile sink;
int main(void) {
    for (int i = 0; i < 10; i++) {
        sink = malloc(16 + i);
        free(sink);
    }
    return 0;
}
"#;

/// The threaded C program: one thread beside main making 3,200 calls
/// (1,600 malloc and as many free), as a small service's worker would.
const THREAD_C: &str = r#"#include <pthread.h>
#include <stdlib.h>
void *volatile sink;
static void *work(void *arg) {
    for (int i = 0; i < 1600; i++) {
        sink = malloc(16 + i % 64);
        free(sink);
    }
    return arg;
}
int main(void) {
    pthread_t t;
    if (pthread_create(&t, 0, work, 0)) return 1;
    return pthread_join(t, 0);
}
"#;

pub struct TreeRow {
    program: String,
    untraced_s: f64,
    heaptrack_s: Option<f64>,
    mtrace_s: f64,
    mtrace_live_s: f64,
    /// The loop run on its own while `mtrace --all` traces the host.
    mtrace_all_s: f64,
    /// The loop under `mtrace --file-wide --`.
    file_wide_s: f64,
    /// What mtrace costs a command of one exec (`true`): its start and its
    /// end, whatever the tree; by mode, per-process and `--file-wide`.
    start_s: f64,
    file_wide_start_s: f64,
    /// `true` untraced.
    untraced_one_s: f64,
}

/// What a process pays while mtrace traces something: the benchmark loop
/// (1 thread), ns per iteration, every run.
pub struct OutsideRow {
    scope: &'static str,
    ns: Vec<f64>,
}

/// Everything `run` measures.
pub struct TreeBench {
    rows: Vec<TreeRow>,
    make: Option<MakeRow>,
    detach: Vec<DetachRow>,
    outside: Vec<OutsideRow>,
    /// A no-op `cargo build` and `cargo test` of a small crate.
    cargo: Vec<super::cargo::CargoRow>,
}

/// mtrace started with `args`, tracing (its "mtrace: tracing" line out),
/// until [`Background::stop`].
struct Background {
    child: std::process::Child,
    rest: std::thread::JoinHandle<()>,
}

impl Background {
    fn start(mtrace: &Path, args: &[&str]) -> Result<Background> {
        let mut child = Command::new(mtrace)
            .args(args)
            .args(["-o", "/dev/null"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().context("mtrace's stderr")?;
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok);
        if !lines.any(|l| l.starts_with("mtrace: tracing ")) {
            bail!("mtrace {args:?} did not start tracing");
        }
        // Drained, so that mtrace never blocks on a full pipe.
        let rest = std::thread::spawn(move || lines.for_each(drop));
        Ok(Background { child, rest })
    }

    fn stop(mut self) -> Result<()> {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let status = self.child.wait()?;
        let _ = self.rest.join();
        if !status.success() {
            bail!("mtrace in the background: {status}");
        }
        Ok(())
    }
}

/// The benchmark loop's ns per iteration (`bench ITERATIONS 1`).
fn loop_ns(busy: &Path) -> Result<f64> {
    let out = Command::new(busy)
        .args(["2000000", "1"])
        .stdin(Stdio::null())
        .output()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("ns_per_iter "))
        .and_then(|v| v.trim().parse().ok())
        .context("no ns_per_iter from the benchmark")
}

/// The benchmark loop run on its own while nothing is traced, while
/// mtrace traces another process by pid (per-pid probes: nothing in this
/// one), and while `mtrace --all` traces the host; alternating, `runs`
/// rounds.
fn outside(mtrace: &Path, busy: &Path, runs: usize) -> Result<Vec<OutsideRow>> {
    let mut other = Command::new("sleep")
        .arg("600")
        .stdin(Stdio::null())
        .spawn()?;
    let pid = other.id().to_string();
    let scopes: [(&'static str, Vec<&str>); 3] = [
        ("nothing traced", vec![]),
        ("mtrace --pid (another process)", vec!["--pid", &pid]),
        ("mtrace --all", vec!["--all"]),
    ];
    let mut rows: Vec<OutsideRow> = scopes
        .iter()
        .map(|(scope, _)| OutsideRow {
            scope,
            ns: Vec::new(),
        })
        .collect();
    for _ in 0..runs {
        for (i, (scope, args)) in scopes.iter().enumerate() {
            eprint!("\rxtask: bench a loop outside the scope, {scope:<32}");
            let ns = if args.is_empty() {
                loop_ns(busy)?
            } else {
                let bg = Background::start(mtrace, args)?;
                let ns = loop_ns(busy);
                bg.stop()?;
                ns?
            };
            rows[i].ns.push(ns);
        }
    }
    let _ = other.kill();
    let _ = other.wait();
    eprintln!();
    Ok(rows)
}

pub struct DetachRow {
    mode: &'static str,
    /// SIGINT to mtrace's exit, milliseconds, every run.
    ms: Vec<f64>,
    /// SIGINT to the target's code free of every breakpoint (its
    /// executable mappings read back equal to their files), milliseconds.
    free_ms: Vec<f64>,
    /// SIGINT to mtrace's last link closed (-v's "every probe out" after
    /// counting stopped, plus SIGINT to the stop): the kernel's release
    /// of a link waits out a grace period after the breakpoints are gone.
    out_ms: Vec<f64>,
}

fn shell_loop(program: &str) -> String {
    format!("i=0; while [ $i -lt {EXECS} ]; do {program} >/dev/null; i=$((i+1)); done")
}

pub(super) fn timed(cmd: &mut Command) -> Result<f64> {
    let started = Instant::now();
    let status = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(started.elapsed().as_secs_f64())
}

/// The best of `runs` (a loop's time is its work plus the machine's
/// business; the least is the closest to the work).
pub(super) fn best(runs: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        best = best.min(f()?);
    }
    Ok(best)
}

pub fn run(root: &Path, runs: usize) -> Result<TreeBench> {
    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let src = out_dir.join("small.c");
    std::fs::write(&src, SMALL_C)?;
    let small = out_dir.join("small");
    compile_c(&src, &small, &[])?;
    let src = out_dir.join("thread3k.c");
    std::fs::write(&src, THREAD_C)?;
    let thread3k = out_dir.join("thread3k");
    compile_c(&src, &thread3k, &["-pthread"])?;
    let mtrace = root.join("target/release/mtrace");
    let heaptrack = which("heaptrack");
    let mut rows = Vec::new();
    for program in [
        "/bin/true",
        "ls /",
        &small.display().to_string(),
        &thread3k.display().to_string(),
    ] {
        eprint!("\rxtask: bench process tree, {program:<40}");
        let script = shell_loop(program);
        let sh = || {
            let mut c = Command::new("sh");
            c.args(["-c", &script]);
            c
        };
        let untraced_s = best(runs, || timed(&mut sh()))?;
        let heaptrack_s = match &heaptrack {
            Some(h) => Some(best(runs, || {
                let dir = tempdir(&out_dir)?;
                let t = timed(
                    Command::new(h)
                        .arg("-o")
                        .arg(dir.join("heaptrack"))
                        .args(["sh", "-c", &script]),
                );
                let _ = std::fs::remove_dir_all(&dir);
                t
            })?),
            None => None,
        };
        let traced = |extra: &[&str]| {
            best(runs, || {
                timed(Command::new(&mtrace).args(extra).args([
                    "-o",
                    "/dev/null",
                    "--",
                    "sh",
                    "-c",
                    &script,
                ]))
            })
        };
        let mtrace_s = traced(&[])?;
        let mtrace_live_s = traced(&["--live"])?;
        let file_wide_s = traced(&["--file-wide"])?;
        let once = |extra: &[&str]| {
            best(runs, || {
                timed(
                    Command::new(&mtrace)
                        .args(extra)
                        .args(["-o", "/dev/null", "--", "true"]),
                )
            })
        };
        let untraced_one_s = best(runs, || timed(&mut Command::new("true")))?;
        let start_s = once(&[])?;
        let file_wide_start_s = once(&["--file-wide"])?;
        let mtrace_all_s = best(runs, || {
            let bg = Background::start(&mtrace, &["--all"])?;
            let t = timed(&mut sh());
            bg.stop()?;
            t
        })?;
        rows.push(TreeRow {
            program: program
                .split(' ')
                .next()
                .and_then(|p| p.rsplit('/').next())
                .unwrap_or(program)
                .to_string(),
            untraced_s,
            heaptrack_s,
            mtrace_s,
            mtrace_live_s,
            mtrace_all_s,
            file_wide_s,
            start_s,
            file_wide_start_s,
            untraced_one_s,
        });
    }
    eprintln!();
    eprint!("xtask: bench make -j2 of {UNITS} files");
    let make = make_row(root, &out_dir, runs)?;
    eprintln!();
    let busy = out_dir.join("bench-busy");
    compile_c(&root.join("xtask/bench/bench.c"), &busy, &["-pthread"])?;
    let mut detach = Vec::new();
    for (mode, args) in [("count", &[][..]), ("live", &["--live"][..])] {
        let (mut ms, mut free_ms, mut out_ms) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            eprint!("\rxtask: bench Ctrl-C by pid, {mode:<10}");
            let (exit, free, out) = ctrl_c(&mtrace, &busy, args)?;
            ms.push(exit);
            free_ms.push(free);
            out_ms.push(out);
        }
        detach.push(DetachRow {
            mode,
            ms,
            free_ms,
            out_ms,
        });
    }
    eprintln!();
    let outside = outside(&mtrace, &busy, runs)?;
    let cargo = super::cargo::run(root, &out_dir, runs)?;
    Ok(TreeBench {
        rows,
        make: Some(make),
        detach,
        outside,
        cargo,
    })
}

fn which(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
}

fn tempdir(under: &Path) -> Result<std::path::PathBuf> {
    let dir = under.join(format!("heaptrack-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// By pid, on the benchmark in a long loop (two threads): mtrace attaches,
/// traces a second, gets SIGINT; milliseconds from the signal to its exit,
/// to the target's code free of breakpoints, and to the last link closed.
fn ctrl_c(mtrace: &Path, busy: &Path, args: &[&str]) -> Result<(f64, f64, f64)> {
    let mut target = Command::new(busy)
        .args(["1000000000", "2"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("running {}", busy.display()))?;
    let mut tracer = Command::new(mtrace)
        .arg("-v")
        .args(args)
        .args(["-o", "/dev/null", "--pid", &target.id().to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    // Tracing once its first line is out.
    let stderr = tracer.stderr.take().context("mtrace's stderr")?;
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok);
    let attached = lines.any(|l| l.starts_with("mtrace: tracing pid "));
    // From the signal: when counting stopped, and the last probe out after.
    let (stop_tx, stop_rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut out_after_stop = None;
        for l in lines {
            if l.contains("tracing ended after") {
                let _ = stop_tx.send(Instant::now());
            }
            if let Some(rest) = l.split("every probe out ").nth(1) {
                out_after_stop = rest.split(' ').next().and_then(|v| v.parse::<f64>().ok());
            }
        }
        out_after_stop
    });
    std::thread::sleep(Duration::from_secs(1));
    let text = Text::of(target.id())?;
    if attached && text.clean()? {
        bail!("no breakpoint in the benchmark's code while mtrace traces it");
    }
    // Timed from before kill(2): the target is watched from the signal on.
    let sent = Instant::now();
    unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
    let mut free = None;
    while sent.elapsed() < Duration::from_secs(10) {
        if text.clean()? {
            free = Some(sent.elapsed().as_secs_f64() * 1e3);
            break;
        }
        // Each look reads the whole code (~2 MiB): leave the CPUs to
        // mtrace and the target in between.
        std::thread::sleep(Duration::from_micros(500));
    }
    let status = tracer.wait()?;
    let ms = sent.elapsed().as_secs_f64() * 1e3;
    let _ = target.kill();
    let _ = target.wait();
    let out_after_stop = reader.join().ok().flatten();
    let stopped = stop_rx.try_recv().ok();
    if !attached || !status.success() {
        bail!("mtrace --pid did not trace the benchmark ({status})");
    }
    let (Some(after), Some(stopped)) = (out_after_stop, stopped) else {
        bail!("mtrace -v did not say when its probes were out");
    };
    let Some(free) = free else {
        bail!("the benchmark's code still had breakpoints 10 s after Ctrl-C");
    };
    Ok((
        ms,
        free,
        stopped.duration_since(sent).as_secs_f64() * 1e3 + after,
    ))
}

/// A process's executable file mappings and what their files hold there:
/// a uprobe is a breakpoint written into the process's copy of the page.
struct Text {
    mem: std::fs::File,
    /// (address, the file's bytes mapped there).
    maps: Vec<(u64, Vec<u8>)>,
}

impl Text {
    fn of(pid: u32) -> Result<Text> {
        use std::os::unix::fs::FileExt;
        let mut maps = Vec::new();
        for line in std::fs::read_to_string(format!("/proc/{pid}/maps"))?.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 6 || !f[1].contains('x') || !f[5].starts_with('/') {
                continue;
            }
            let (start, end) = f[0].split_once('-').context("a maps range")?;
            let start = u64::from_str_radix(start, 16)?;
            let len = u64::from_str_radix(end, 16)? - start;
            let offset = u64::from_str_radix(f[2], 16)?;
            let file = std::fs::File::open(f[5])?;
            let mut bytes = vec![0; len as usize];
            // The mapping may run past the file's end: that part is zeroes.
            let n = file.read_at(&mut bytes, offset)?;
            bytes.truncate(n);
            maps.push((start, bytes));
        }
        Ok(Text {
            mem: std::fs::File::open(format!("/proc/{pid}/mem"))?,
            maps,
        })
    }

    /// Whether every executable mapping reads as its file.
    fn clean(&self) -> Result<bool> {
        use std::os::unix::fs::FileExt;
        let mut buf = Vec::new();
        for (at, want) in &self.maps {
            buf.resize(want.len(), 0);
            self.mem.read_exact_at(&mut buf, *at)?;
            if buf != *want {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

pub fn render_table(bench: &TreeBench, out: &mut String) {
    let (rows, make, detach) = (&bench.rows, bench.make.as_ref(), &bench.detach);
    let per_exec = |s: f64, base: f64| (s - base) * 1e3 / EXECS as f64;
    let _ = writeln!(
        out,
        "\nprocess tree: a shell loop of {EXECS} runs, best of the runs; ms added per exec (mtrace --all: the loop run on its own while mtrace traces the host; \"w/o start\": less what mtrace costs `true` alone, its start and end)\n\n| program | untraced s | heaptrack s | +ms/exec | mtrace s | +ms/exec | w/o start | mtrace --live s | +ms/exec | mtrace --all s | +ms/exec | --file-wide s | +ms/exec | w/o start |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    // Less the start and end: what a one-exec command (`true`) costs
    // under the mode, beyond `true` untraced.
    let per_exec_run =
        |s: f64, base: f64, start: f64, one: f64| (s - base - (start - one)) * 1e3 / EXECS as f64;
    for r in rows {
        let (h, hx) = match r.heaptrack_s {
            Some(h) => (
                format!("{h:.2}"),
                format!("{:.2}", per_exec(h, r.untraced_s)),
            ),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            out,
            "| {} | {:.2} | {h} | {hx} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r.program,
            r.untraced_s,
            r.mtrace_s,
            per_exec(r.mtrace_s, r.untraced_s),
            per_exec_run(r.mtrace_s, r.untraced_s, r.start_s, r.untraced_one_s),
            r.mtrace_live_s,
            per_exec(r.mtrace_live_s, r.untraced_s),
            r.mtrace_all_s,
            per_exec(r.mtrace_all_s, r.untraced_s),
            r.file_wide_s,
            per_exec(r.file_wide_s, r.untraced_s),
            per_exec_run(
                r.file_wide_s,
                r.untraced_s,
                r.file_wide_start_s,
                r.untraced_one_s
            ),
        );
    }
    if let Some(m) = make {
        let _ = writeln!(
            out,
            "\nmake -j2 of a C project of {} files, from clean, best of the runs\n\n| untraced s | mtrace s | mtrace --file-wide s | processes seen | traced |\n|---|---|---|---|---|\n| {:.2} | {:.2} | {:.2} | {} | {} |",
            m.units, m.untraced_s, m.mtrace_s, m.file_wide_s, m.processes, m.traced
        );
    }
    let _ = writeln!(
        out,
        "\nby pid, on the benchmark in 2 threads: Ctrl-C (SIGINT) to the target's code free of every breakpoint, to mtrace's last link closed (the kernel waits out a grace period after the breakpoints are gone), and to mtrace's exit (report written), ms\n\n| mode | target free, median | max | last link closed, median | max | exit, median | max |\n|---|---|---|---|---|---|---|"
    );
    let median_max = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v.last().copied().unwrap_or(0.0))
    };
    for d in detach.iter() {
        let (fm, fx) = median_max(&d.free_ms);
        let (om, ox) = median_max(&d.out_ms);
        let (em, ex) = median_max(&d.ms);
        let _ = writeln!(
            out,
            "| {} | {fm:.0} | {fx:.0} | {om:.0} | {ox:.0} | {em:.0} | {ex:.0} |",
            d.mode
        );
    }
    let _ = writeln!(
        out,
        "\nwhat a process outside the trace pays: the benchmark loop (malloc+free, 1 thread) run on its own, ns per iteration, median (min..max) of the runs\n\n| while | ns/iter | min..max |\n|---|---|---|"
    );
    for o in &bench.outside {
        let mut v = o.ns.clone();
        v.sort_by(f64::total_cmp);
        let (Some(lo), Some(hi)) = (v.first(), v.last()) else {
            continue;
        };
        let _ = writeln!(
            out,
            "| {} | {:.0} | {lo:.0}..{hi:.0} |",
            o.scope,
            v[v.len() / 2]
        );
    }
    super::cargo::render_table(&bench.cargo, out);
}

pub fn render_json(bench: &TreeBench) -> String {
    let (rows, make, detach) = (&bench.rows, bench.make.as_ref(), &bench.detach);
    let num = |v: Option<f64>| v.map_or("null".to_string(), |x| format!("{x:.4}"));
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"program\": \"{}\", \"execs\": {EXECS}, \"untraced_s\": {:.4}, \"heaptrack_s\": {}, \"mtrace_s\": {:.4}, \"mtrace_live_s\": {:.4}, \"mtrace_all_s\": {:.4}, \"file_wide_s\": {:.4}, \"start_s\": {:.4}, \"file_wide_start_s\": {:.4}, \"untraced_one_s\": {:.4}}}",
                r.program,
                r.untraced_s,
                num(r.heaptrack_s),
                r.mtrace_s,
                r.mtrace_live_s,
                r.mtrace_all_s,
                r.file_wide_s,
                r.start_s,
                r.file_wide_start_s,
                r.untraced_one_s
            )
        })
        .collect();
    let detach: Vec<String> = detach
        .iter()
        .map(|d| {
            let list = |v: &[f64]| {
                v.iter()
                    .map(|v| format!("{v:.1}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            format!(
                "    {{\"mode\": \"{}\", \"ctrl_c_to_target_free_ms\": [{}], \"ctrl_c_to_last_link_closed_ms\": [{}], \"ctrl_c_to_exit_ms\": [{}]}}",
                d.mode,
                list(&d.free_ms),
                list(&d.out_ms),
                list(&d.ms)
            )
        })
        .collect();
    let make = make.map_or("null".to_string(), |m| {
        format!(
            "{{\"units\": {}, \"untraced_s\": {:.4}, \"mtrace_s\": {:.4}, \"file_wide_s\": {:.4}, \"processes\": {}, \"traced\": {}}}",
            m.units, m.untraced_s, m.mtrace_s, m.file_wide_s, m.processes, m.traced
        )
    });
    let outside: Vec<String> = bench
        .outside
        .iter()
        .map(|o| {
            let ns: Vec<String> = o.ns.iter().map(|v| format!("{v:.1}")).collect();
            format!(
                "    {{\"while\": \"{}\", \"ns_per_iter\": [{}]}}",
                o.scope,
                ns.join(", ")
            )
        })
        .collect();
    format!(
        "  \"process_tree\": [\n{}\n  ],\n  \"make\": {make},\n  \"ctrl_c\": [\n{}\n  ],\n  \"outside_the_trace\": [\n{}\n  ],\n{}",
        rows.join(",\n"),
        detach.join(",\n"),
        outside.join(",\n"),
        super::cargo::render_json(&bench.cargo)
    )
}
