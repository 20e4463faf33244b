//! `cargo xtask bench --soak MINUTES`: `mtrace agent --all` for that long
//! on a host running a loop of `make -j2` builds of the tree bench's
//! generated C project (`make clean` between builds), scraped as a real
//! client would: `/metrics` every 10 s (Prometheus' default interval is
//! 15 s), and `/debug/pprof/allocs` by `go tool pprof -raw` every minute.
//! mtrace's RSS (VmRSS and VmHWM of /proc/PID/status) is read every 10 s.
//! At the end the agent is stopped with SIGTERM; it must exit 0, and
//! none of the BPF links and programs it held (read from its
//! /proc/PID/fdinfo before it is stopped) nor any uprobe event of its own
//! may outlive it.
//!
//! Not run by default, nor by CI: it takes as long as it is told.

use std::{
    fmt::Write as _,
    path::Path,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use super::agent::{agent, get, metric};

/// One reading, every 10 s.
struct Point {
    /// Its number: reading `n` is due at `10 n` s.
    tick: u64,
    secs: f64,
    rss_kib: u64,
    hwm_kib: u64,
    /// Whether /metrics answered with a reading.
    answered: bool,
    processes_held: u64,
    processes_seen: u64,
    /// `mtrace_lost_total` and `mtrace_stacks_cut_total`, every label
    /// with a count above zero.
    losses: Vec<(String, u64)>,
    builds: u64,
    /// How long the agent took to make the reading (its
    /// `mtrace_agent_reading_seconds`).
    reading_s: Option<f64>,
}

/// One `go tool pprof -raw` of `/debug/pprof/allocs`, every minute.
struct Scrape {
    /// The reading it followed.
    tick: u64,
    stacks: usize,
    took_s: f64,
}

/// What the soak measured.
pub struct HostSoak {
    secs: f64,
    points: Vec<Point>,
    scrapes: Vec<Scrape>,
    builds: u64,
    /// The agent's exit status after SIGTERM, and how long it took.
    exit: (Option<i32>, f64),
    /// BPF links and programs the agent held, and how many of them were
    /// still in the kernel after it exited.
    bpf_held: (usize, usize),
    bpf_left: usize,
    /// The agent's own uprobe events left in tracefs, or `None` when no
    /// tracefs is mounted (the agent's uprobe-multi links make none).
    uprobe_events_left: Option<usize>,
    /// Lines of the report the agent wrote at its end.
    report_lines: usize,
}

/// VmRSS and VmHWM of `pid`, KiB.
fn rss_kib(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("VmRSS:"), field("VmHWM:")))
}

/// Every sample of a labelled counter `name{label="..."}` above zero.
fn labelled(text: &str, name: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix('{')?;
            let (labels, value) = rest.split_once("} ")?;
            let value: f64 = value.trim().parse().ok()?;
            let label = labels.split_once('=')?.1.trim_matches('"');
            (value > 0.0).then(|| (label.to_string(), value as u64))
        })
        .collect()
}

/// The samples of a `go tool pprof -raw` output: the lines of its
/// `Samples:` section that are values and location ids.
fn raw_samples(text: &str) -> usize {
    text.lines()
        .skip_while(|l| *l != "Samples:")
        .take_while(|l| *l != "Locations")
        .filter(|l| {
            l.split_once(':').is_some_and(|(values, _)| {
                !values.trim().is_empty()
                    && values
                        .chars()
                        .all(|c| c.is_ascii_digit() || c.is_whitespace())
            })
        })
        .count()
}

/// `go tool pprof -raw` of the agent's allocation profile: the stacks
/// served and the seconds the fetch took.
fn pprof_stacks(addr: &str, tmp: &Path) -> Result<(usize, f64)> {
    let started = Instant::now();
    let out = Command::new("go")
        .args(["tool", "pprof", "-raw"])
        .arg(format!("http://{addr}/debug/pprof/allocs"))
        .env("PPROF_TMPDIR", tmp)
        .env("HOME", tmp)
        .stdin(Stdio::null())
        .output()
        .context("running go tool pprof")?;
    if !out.status.success() {
        bail!(
            "go tool pprof failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((
        raw_samples(&String::from_utf8_lossy(&out.stdout)),
        started.elapsed().as_secs_f64(),
    ))
}

/// The ids of the BPF links and programs a process holds, from its
/// descriptors' fdinfo.
fn bpf_ids(pid: u32) -> (Vec<u32>, Vec<u32>) {
    let (mut links, mut progs) = (Vec::new(), Vec::new());
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return (links, progs);
    };
    for entry in dir.flatten() {
        let Ok(info) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        for line in info.lines() {
            let id = |key: &str| line.strip_prefix(key)?.trim().parse::<u32>().ok();
            if let Some(id) = id("link_id:") {
                links.push(id);
            } else if let Some(id) = id("prog_id:") {
                progs.push(id);
            }
        }
    }
    links.sort_unstable();
    links.dedup();
    progs.sort_unstable();
    progs.dedup();
    (links, progs)
}

/// Whether the kernel still has the BPF object of this id: `bpf(2)`'s
/// `BPF_*_GET_FD_BY_ID` opens it, or fails with ENOENT once it is gone.
/// By hand: two syscalls do not warrant a BPF crate in xtask.
fn bpf_object_exists(cmd: libc::c_long, id: u32) -> bool {
    // The attribute's first word is the id; next_id and open_flags zero.
    let attr: [u32; 3] = [id, 0, 0];
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    if fd >= 0 {
        unsafe { libc::close(fd as i32) };
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOENT)
}

const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;

/// The agent's own uprobe events (aya names them `aya_PID_...`) in
/// tracefs, or `None` when no tracefs is mounted.
fn uprobe_events(pid: u32) -> Option<usize> {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .iter()
        .find_map(|d| std::fs::read_to_string(format!("{d}/uprobe_events")).ok())
        .map(|t| t.matches(&format!("aya_{pid}_")).count())
}

/// `make -j2` of the project in `dir` from clean, until `stop`.
fn make_loop(dir: &Path, stop: &AtomicBool, builds: &AtomicU64) -> Result<()> {
    while !stop.load(Ordering::Relaxed) {
        for args in [&["clean"][..], &["-j2"]] {
            let status = Command::new("make")
                .arg("-C")
                .arg(dir)
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()?;
            if !status.success() {
                bail!("make {args:?} in {} failed: {status}", dir.display());
            }
        }
        builds.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// SIGTERM, then the exit status and the seconds until it came (killed
/// after 60 s).
fn terminate(child: &mut Child) -> Result<(Option<i32>, f64)> {
    let started = Instant::now();
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok((status.code(), started.elapsed().as_secs_f64()));
        }
        if started.elapsed() > Duration::from_secs(60) {
            child.kill()?;
            child.wait()?;
            return Ok((None, started.elapsed().as_secs_f64()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn run(root: &Path, minutes: u64) -> Result<HostSoak> {
    let out_dir = root.join("target/bench");
    let dir = out_dir.join("soak-make-project");
    super::make::make_project(&dir)?;
    let tmp = out_dir.join("soak-pprof");
    std::fs::create_dir_all(&tmp)?;
    let mtrace = root.join("target/release/mtrace");
    let (mut child, addr, _) = agent(&mtrace, &["--all"], &[])?;
    let pid = child.id();
    // The report on standard output is read as it comes: a pipe left full
    // would stop the agent as it writes it.
    let mut stdout = child.stdout.take().context("the agent's stdout")?;
    let report = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        text
    });
    let stop = Arc::new(AtomicBool::new(false));
    let builds = Arc::new(AtomicU64::new(0));
    let maker = {
        let (dir, stop, builds) = (dir.clone(), stop.clone(), builds.clone());
        std::thread::spawn(move || make_loop(&dir, &stop, &builds))
    };
    let started = Instant::now();
    let secs = minutes * 60;
    let (mut points, mut scrapes) = (Vec::new(), Vec::new());
    // A reading every 10 s until the time is up (a request the agent
    // answers late delays the next).
    for tick in 1.. {
        let next = Duration::from_secs(10 * tick);
        if next > Duration::from_secs(secs) || started.elapsed() >= Duration::from_secs(secs) {
            break;
        }
        std::thread::sleep(next.saturating_sub(started.elapsed()));
        if let Some(status) = child.try_wait()? {
            bail!("the agent ended during the soak: {status}");
        }
        let (rss_kib, hwm_kib) = rss_kib(pid)?;
        let text = get(&addr, "/metrics")?;
        let mut losses = labelled(&text, "mtrace_lost_total");
        losses.extend(labelled(&text, "mtrace_stacks_cut_total"));
        // A reading the agent could not make in time is an answer without
        // metrics, kept as such (a client would have seen it).
        let answered = text.contains("mtrace_processes_seen_total ");
        if !answered {
            eprintln!("\nxtask: soak: /metrics at {tick}0 s: {}", text.trim());
        }
        points.push(Point {
            tick,
            answered,
            secs: started.elapsed().as_secs_f64(),
            rss_kib,
            hwm_kib,
            processes_held: metric(&text, "mtrace_processes_traced").unwrap_or(0.0) as u64,
            processes_seen: metric(&text, "mtrace_processes_seen_total").unwrap_or(0.0) as u64,
            losses,
            builds: builds.load(Ordering::Relaxed),
            reading_s: metric(&text, "mtrace_agent_reading_seconds"),
        });
        if tick % 6 == 0 {
            match pprof_stacks(&addr, &tmp) {
                Ok((stacks, took_s)) => scrapes.push(Scrape {
                    tick,
                    stacks,
                    took_s,
                }),
                Err(e) => eprintln!("\nxtask: soak: pprof at {tick}0 s: {e:#}"),
            }
        }
        eprint!(
            "\rxtask: bench soak {:>4.0} s of {secs}, RSS {} KiB",
            started.elapsed().as_secs_f64(),
            rss_kib
        );
    }
    eprintln!();
    let soak_secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let (links, progs) = bpf_ids(pid);
    let exit = terminate(&mut child)?;
    let report = report.join().unwrap_or_default();
    let make_result = maker.join();
    // The kernel frees a program after a grace period once its last
    // reference is gone: what is left is looked for again for up to 5 s.
    let left = || {
        links
            .iter()
            .filter(|&&id| bpf_object_exists(BPF_LINK_GET_FD_BY_ID, id))
            .count()
            + progs
                .iter()
                .filter(|&&id| bpf_object_exists(BPF_PROG_GET_FD_BY_ID, id))
                .count()
    };
    let gone_by = Instant::now() + Duration::from_secs(5);
    let mut bpf_left = left();
    while bpf_left > 0 && Instant::now() < gone_by {
        std::thread::sleep(Duration::from_millis(200));
        bpf_left = left();
    }
    match make_result {
        Ok(r) => r?,
        Err(_) => bail!("the make loop panicked"),
    }
    Ok(HostSoak {
        secs: soak_secs,
        points,
        scrapes,
        builds: builds.load(Ordering::Relaxed),
        exit,
        bpf_held: (links.len(), progs.len()),
        bpf_left,
        uprobe_events_left: uprobe_events(pid),
        report_lines: report.lines().count(),
    })
}

fn losses_text(losses: &[(String, u64)]) -> String {
    if losses.is_empty() {
        return "none".into();
    }
    let l: Vec<String> = losses.iter().map(|(w, n)| format!("{w} {n}")).collect();
    l.join(", ")
}

pub fn render_table(s: &HostSoak) -> String {
    let mut out = String::new();
    let out = &mut out;
    let _ = writeln!(
        out,
        "\nagent --all soak: {:.0} s, {} builds of `make -j2` ({} units, `make clean` between); /metrics every 10 s, /debug/pprof/allocs every 60 s\n\n| minute | RSS KiB | peak RSS KiB | processes held | processes seen | stacks served | pprof fetch s | builds | losses |\n|---|---|---|---|---|---|---|---|---|",
        s.secs,
        s.builds,
        super::make::UNITS
    );
    for p in s.points.iter().filter(|p| p.tick % 6 == 0) {
        if !p.answered {
            let _ = writeln!(
                out,
                "| {} ({:.0} s) | {} | {} | no reading in time | | | | {} | |",
                p.tick / 6,
                p.secs,
                p.rss_kib,
                p.hwm_kib,
                p.builds
            );
            continue;
        }
        let scrape = s.scrapes.iter().find(|c| c.tick == p.tick);
        let _ = writeln!(
            out,
            "| {} ({:.0} s) | {} | {} | {} | {} | {} | {} | {} | {} |",
            p.tick / 6,
            p.secs,
            p.rss_kib,
            p.hwm_kib,
            p.processes_held,
            p.processes_seen,
            scrape.map_or("-".into(), |c| c.stacks.to_string()),
            scrape.map_or("-".into(), |c| format!("{:.1}", c.took_s)),
            p.builds,
            losses_text(&p.losses),
        );
    }
    let (links, progs) = s.bpf_held;
    let _ = writeln!(
        out,
        "\nRSS every 10 s, KiB: {}\nThe reading's time every 10 s, s: {}\nSIGTERM: exit {} after {:.1} s, a report of {} lines; BPF links and programs held {links} + {progs}, left after exit {}; the agent's uprobe events left: {}",
        s.points
            .iter()
            .map(|p| p.rss_kib.to_string())
            .collect::<Vec<_>>()
            .join(" "),
        s.points
            .iter()
            .map(|p| p.reading_s.map_or("-".into(), |r| format!("{r:.2}")))
            .collect::<Vec<_>>()
            .join(" "),
        s.exit.0.map_or("killed (no exit in 60 s)".into(), |c| c.to_string()),
        s.exit.1,
        s.report_lines,
        s.bpf_left,
        s.uprobe_events_left
            .map_or("no tracefs mounted".into(), |n| n.to_string()),
    );
    out.clone()
}

pub fn render_json(s: &HostSoak) -> String {
    let points: Vec<String> = s
        .points
        .iter()
        .map(|p| {
            format!(
                "[{:.1}, {}, {}, {}, {}, {}]",
                p.secs, p.rss_kib, p.hwm_kib, p.processes_held, p.processes_seen, p.builds
            )
        })
        .collect();
    let scrapes: Vec<String> = s
        .scrapes
        .iter()
        .map(|c| format!("[{}, {}, {:.2}]", c.tick * 10, c.stacks, c.took_s))
        .collect();
    let last = s.points.last().map(|p| p.losses.as_slice()).unwrap_or(&[]);
    let losses: Vec<String> = last.iter().map(|(w, n)| format!("\"{w}\": {n}")).collect();
    format!(
        "  \"host_soak\": {{\"secs\": {:.1}, \"builds\": {}, \"points_s_rsskib_hwmkib_held_seen_builds\": [{}], \"scrapes_s_stacks_took\": [{}], \"losses\": {{{}}}, \"exit_code\": {}, \"exit_s\": {:.2}, \"bpf_held\": [{}, {}], \"bpf_left\": {}, \"uprobe_events_left\": {}}}",
        s.secs,
        s.builds,
        points.join(", "),
        scrapes.join(", "),
        losses.join(", "),
        s.exit.0.map_or("null".into(), |c| c.to_string()),
        s.exit.1,
        s.bpf_held.0,
        s.bpf_held.1,
        s.bpf_left,
        s.uprobe_events_left
            .map_or("null".into(), |n| n.to_string()),
    )
}

/// One part's table on standard output and its JSON in `json_path`.
pub(super) fn print_and_write(table: &str, json: &str, json_path: &Path) -> Result<()> {
    println!("{table}");
    std::fs::write(json_path, format!("{{\n{json}\n}}\n"))
        .with_context(|| format!("writing {}", json_path.display()))?;
    eprintln!("xtask: wrote {}", json_path.display());
    Ok(())
}
