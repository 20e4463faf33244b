//! The Python rows: what a pure-Python allocation loop pays, run by
//! Debian's python3.11 (stripped, pymalloc), untraced, under mtrace's
//! modes and under memray's, wall-clock from start to exit (start-up,
//! attach and the report included), the best of `runs` (the configs
//! alternate, every other round in reverse order).
//!
//! Each config also runs an empty script, as often: what it costs to start,
//! attach and write a report. (The loop's time less the empty script's is
//! not the allocations' cost: mtrace's own start-up work goes on on the
//! second CPU while the loop runs, and that difference came out below the
//! untraced loop's time.)
//!
//! Under mtrace each config runs once more, untimed and first (it warms
//! the page cache too), with `-o FILE.json`: the calls its profile
//! counted (`totals.allocs.calls`, an estimate when sampled) and, when
//! sampled, the calls it recorded (`meta.sampling.samples`), which show
//! that each mode did what it says. A flag this build of mtrace does not
//! have (a usage error, exit code 2) makes its row "n/a".

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{bail, Context, Result};

use crate::PYTHON;

/// Iterations of the loop: about 0.12 s untraced on the development VM
/// (python3.11 itself starts in 15 ms).
const ITERATIONS: u32 = 250_000;
/// Objects the loop makes per iteration: 1.75 million in all.
const OBJECTS_PER_ITERATION: u32 = 7;

/// Each iteration makes seven objects: a str, two ints (past the cache of
/// small ones), a list (and its item array), a dict (and its keys), a tuple
/// and a second str; every 100th also a bytearray
/// of 600 B to 4.6 KiB (past pymalloc's 512-byte limit: glibc's malloc),
/// of which at most 64 are kept. Lists, dicts and tuples mostly come back
/// from CPython's free lists, not from its allocator.
fn script() -> String {
    format!(
        r#"# mtrace's Python benchmark (written by cargo xtask bench).
def run(n):
    keep = []
    total = 0
    for i in range(n):
        key = str(i)
        item = [i, i + 1000, key]
        rec = {{"k": key, "v": item}}
        pair = (rec, key + "x")
        total += len(pair[1])
        if i % 100 == 0:
            keep.append(bytearray(600 + i % 4000))
            if len(keep) > 64:
                keep.clear()
    return total


run({ITERATIONS})
"#
    )
}

enum Tool {
    Untraced,
    /// mtrace with these flags (and `-o /dev/null`).
    Mtrace(&'static [&'static str]),
    /// `python3.11 -m memray run` with these flags.
    Memray(&'static [&'static str]),
}

struct Config {
    name: &'static str,
    tool: Tool,
}

/// The flag being added on main; a build without it says "n/a".
const PYTHON_OBJECTS: &str = "--python-objects";

const CONFIGS: &[Config] = &[
    Config {
        name: "untraced",
        tool: Tool::Untraced,
    },
    Config {
        name: "mtrace (count, Python frames)",
        tool: Tool::Mtrace(&[]),
    },
    Config {
        name: "mtrace --sample-bytes 524288",
        tool: Tool::Mtrace(&["--sample-bytes", "524288"]),
    },
    Config {
        name: "mtrace --python-objects",
        tool: Tool::Mtrace(&[PYTHON_OBJECTS]),
    },
    Config {
        name: "mtrace --python-objects --sample-bytes 524288",
        tool: Tool::Mtrace(&[PYTHON_OBJECTS, "--sample-bytes", "524288"]),
    },
    Config {
        name: "mtrace --live --python-objects",
        tool: Tool::Mtrace(&["--live", PYTHON_OBJECTS]),
    },
    Config {
        name: "memray run",
        tool: Tool::Memray(&[]),
    },
    Config {
        name: "memray run --native",
        tool: Tool::Memray(&["--native"]),
    },
    Config {
        name: "memray run --trace-python-allocators",
        tool: Tool::Memray(&["--trace-python-allocators"]),
    },
];

pub struct PythonRow {
    config: &'static str,
    /// Wall-clock seconds of every timed run; empty when not run.
    seconds: Vec<f64>,
    /// The same for the empty script.
    empty_seconds: Vec<f64>,
    /// Allocation calls the profile counted (an estimate when sampled).
    calls: Option<u64>,
    /// Calls recorded, when sampled.
    samples: Option<u64>,
    /// Why the row has no figures.
    na: Option<&'static str>,
}

impl PythonRow {
    fn best(&self) -> Option<f64> {
        self.seconds.iter().copied().reduce(f64::min)
    }
    fn best_empty(&self) -> Option<f64> {
        self.empty_seconds.iter().copied().reduce(f64::min)
    }
}

/// What the loop runs and where its outputs go.
struct Paths {
    mtrace: PathBuf,
    script: PathBuf,
    /// A script that does nothing.
    empty: PathBuf,
    /// memray's capture file, removed before and after every run.
    memray_out: PathBuf,
    /// Where the counting runs' profiles are kept.
    out_dir: PathBuf,
}

/// The command of one config; `json`: mtrace's profile there instead of
/// /dev/null.
fn command(p: &Paths, tool: &Tool, script: &Path, json: Option<&Path>) -> Command {
    let mut c = match tool {
        Tool::Untraced => Command::new(PYTHON),
        Tool::Mtrace(flags) => {
            let mut c = Command::new(&p.mtrace);
            c.args(*flags)
                .arg("-o")
                .arg(json.unwrap_or(Path::new("/dev/null")))
                .args(["--", PYTHON]);
            c
        }
        Tool::Memray(flags) => {
            let mut c = Command::new(PYTHON);
            c.args(["-m", "memray", "run"])
                .args(*flags)
                .arg("-o")
                .arg(&p.memray_out)
                .arg("-f");
            c
        }
    };
    c.arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

enum Outcome {
    Seconds(f64),
    /// mtrace refused a flag: exit code 2 with its usage line.
    Usage,
}

fn run_once(p: &Paths, tool: &Tool, script: &Path, json: Option<&Path>) -> Result<Outcome> {
    let _ = std::fs::remove_file(&p.memray_out);
    let mut cmd = command(p, tool, script, json);
    let started = Instant::now();
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    let seconds = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&p.memray_out);
    if matches!(tool, Tool::Mtrace(_)) {
        super::wait_for_reapers();
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    if matches!(tool, Tool::Mtrace(_)) && out.status.code() == Some(2) && stderr.contains("usage") {
        return Ok(Outcome::Usage);
    }
    if !out.status.success() {
        bail!("{cmd:?} failed ({}): {}", out.status, stderr.trim());
    }
    Ok(Outcome::Seconds(seconds))
}

/// The number after `"key": ` at or after `from` in `json`.
fn number_after(json: &str, from: usize, key: &str) -> Option<u64> {
    let pat = format!("\"{key}\":");
    let at = from + json.get(from..)?.find(&pat)? + pat.len();
    let digits: String = json[at..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// `totals.allocs.calls` and `meta.sampling.samples` of a profile (the
/// xtask has no JSON parser: each key is found by its indentation in the
/// pretty-printed file, then the first `calls` or `samples` after it).
fn calls_and_samples(json: &str) -> (Option<u64>, Option<u64>) {
    let calls = json
        .find("\n  \"totals\":")
        .and_then(|t| Some(t + json[t..].find("\"allocs\":")?))
        .and_then(|a| number_after(json, a, "calls"));
    let samples = json
        .find("\n    \"sampling\":")
        .and_then(|s| number_after(json, s, "samples"));
    (calls, samples)
}

pub fn run(root: &Path, runs: usize) -> Result<Vec<PythonRow>> {
    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let tmp = std::env::temp_dir().join(format!("mtrace-bench-python-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let result = run_in(root, runs, &out_dir, &tmp);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn run_in(root: &Path, runs: usize, out_dir: &Path, tmp: &Path) -> Result<Vec<PythonRow>> {
    let p = Paths {
        mtrace: root.join("target/release/mtrace"),
        script: tmp.join("loop.py"),
        empty: tmp.join("empty.py"),
        memray_out: tmp.join("memray.bin"),
        out_dir: out_dir.to_path_buf(),
    };
    std::fs::write(&p.script, script())?;
    std::fs::write(&p.empty, "pass\n")?;
    let mut rows: Vec<PythonRow> = CONFIGS
        .iter()
        .map(|c| PythonRow {
            config: c.name,
            seconds: Vec::new(),
            empty_seconds: Vec::new(),
            calls: None,
            samples: None,
            na: None,
        })
        .collect();
    // The counting runs, first: they also find the flags this build lacks.
    for (i, c) in CONFIGS.iter().enumerate() {
        let Tool::Mtrace(_) = c.tool else { continue };
        eprint!("\rxtask: bench python, counting, {:<48}", c.name);
        let json = p.out_dir.join(format!("python-{i}.json"));
        let _ = std::fs::remove_file(&json);
        match run_once(&p, &c.tool, &p.script, Some(&json))? {
            Outcome::Usage => rows[i].na = Some("n/a (flag not in this build)"),
            Outcome::Seconds(_) => {
                let text = std::fs::read_to_string(&json)
                    .with_context(|| format!("reading {}", json.display()))?;
                (rows[i].calls, rows[i].samples) = calls_and_samples(&text);
            }
        }
    }
    for round in 0..runs {
        let mut order: Vec<usize> = (0..CONFIGS.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            if rows[i].na.is_some() {
                continue;
            }
            let c = &CONFIGS[i];
            eprint!(
                "\rxtask: bench python, run {}/{runs}, {:<48}",
                round + 1,
                c.name
            );
            for (script, times) in [(&p.script, 0), (&p.empty, 1)] {
                match run_once(&p, &c.tool, script, None)? {
                    Outcome::Seconds(s) if times == 0 => rows[i].seconds.push(s),
                    Outcome::Seconds(s) => rows[i].empty_seconds.push(s),
                    Outcome::Usage => rows[i].na = Some("n/a (flag not in this build)"),
                }
            }
        }
    }
    eprintln!();
    Ok(rows)
}

pub fn render_table(rows: &[PythonRow], runs: usize, out: &mut String) {
    let base = rows
        .iter()
        .find(|r| r.config == "untraced")
        .and_then(PythonRow::best);
    let _ = writeln!(
        out,
        "\nPython: a pure-Python allocation loop ({ITERATIONS} iterations, {} objects) run by {PYTHON}, wall-clock from start to exit, best of {runs} runs; an empty script the same way; calls counted from one more run with -o FILE.json\n\n| config | s | x untraced | empty script s | calls counted | samples |\n|---|---|---|---|---|---|",
        ITERATIONS * OBJECTS_PER_ITERATION
    );
    let secs = |v: Option<f64>| v.map_or("-".to_string(), |s| format!("{s:.3}"));
    let ratio = |v: Option<f64>, base: Option<f64>| {
        v.zip(base)
            .map_or("-".to_string(), |(s, b)| format!("{:.2}x", s / b))
    };
    let count = |v: Option<u64>| v.map_or("-".to_string(), |n| n.to_string());
    for r in rows {
        if let Some(na) = r.na {
            let _ = writeln!(out, "| {} | {na} | - | - | - | - |", r.config);
            continue;
        }
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            r.config,
            secs(r.best()),
            ratio(r.best(), base),
            secs(r.best_empty()),
            count(r.calls),
            count(r.samples)
        );
    }
}

pub fn render_json(rows: &[PythonRow]) -> String {
    let num = |v: Option<u64>| v.map_or("null".to_string(), |n| n.to_string());
    let list = |v: &[f64]| {
        v.iter()
            .map(|s| format!("{s:.4}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"config\": \"{}\", \"best_s\": {}, \"seconds\": [{}], \"empty_best_s\": {}, \"empty_seconds\": [{}], \"calls\": {}, \"samples\": {}, \"available\": {}}}",
                r.config,
                r.best().map_or("null".to_string(), |s| format!("{s:.4}")),
                list(&r.seconds),
                r.best_empty()
                    .map_or("null".to_string(), |s| format!("{s:.4}")),
                list(&r.empty_seconds),
                num(r.calls),
                num(r.samples),
                r.na.is_none()
            )
        })
        .collect();
    format!(
        "  \"python\": {{\"iterations\": {ITERATIONS}, \"objects\": {}, \"python\": \"{PYTHON}\", \"rows\": [\n{}\n  ]}}",
        ITERATIONS * OBJECTS_PER_ITERATION,
        rows.join(",\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_and_samples_read_the_totals_and_the_sampling() {
        let json = "{\n  \"meta\": {\n    \"pid\": 1,\n    \"sampling\": {\n      \"kind\": \"bytes\",\n      \"rate\": 524288,\n      \"samples\": 17\n    }\n  },\n  \"stacks\": [{\"calls\": 5}],\n  \"totals\": {\n    \"per_func\": {\n      \"malloc\": {\n        \"calls\": 40\n      }\n    },\n    \"allocs\": {\n      \"calls\": 42,\n      \"bytes\": 9\n    }\n  }\n}\n";
        assert_eq!(calls_and_samples(json), (Some(42), Some(17)));
        let unsampled = json.replace("\"sampling\"", "\"other\"");
        assert_eq!(calls_and_samples(&unsampled), (Some(42), None));
    }
}
