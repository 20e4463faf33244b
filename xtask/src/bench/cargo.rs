//! The cargo rows: a no-op `cargo build` and a `cargo test` of a small
//! crate the bench makes itself (a dependency-free library with one test,
//! built offline in a temp dir), untraced, under `mtrace --max-stack 0`
//! (the direct caller only: no walk) and under `mtrace` (whole stacks),
//! with the share of calls whose stack was whole. Cargo's main thread
//! allocates with up to 72 KiB of stack above it and rustdoc's compile
//! thread with more: the rows show what deep stacks of a big Rust program
//! cost the walk, and how many of them stay whole.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

const LIB_RS: &str = r#"//! A small crate for mtrace's bench.

/// The sum of the first `n` squares.
pub fn squares(n: u64) -> u64 {
    (1..=n).map(|i| i * i).sum()
}

#[cfg(test)]
mod tests {
    #[test]
    fn squares() {
        assert_eq!(super::squares(3), 14);
    }
}
"#;

const CARGO_TOML: &str = "[workspace]\n\n[package]\nname = \"mtrace-bench-crate\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[dependencies]\n";

pub struct CargoRow {
    command: &'static str,
    untraced_s: f64,
    max_stack_0_s: f64,
    mtrace_s: f64,
    /// Calls counted, and those whose stack was whole, in the full-stack
    /// run of the best time.
    calls: u64,
    whole: u64,
    /// Walks the kernel handed to the tracer, and stacks cut short per
    /// reason (`read_failed`, `copy_lost`, ...), as "reason n" pairs.
    finished_by_tracer: u64,
    cut: String,
}

/// The crate, built once (so that each timed run is a no-op build); a
/// workspace of its own, though it lies under mtrace's.
fn make_crate(out_dir: &Path) -> Result<PathBuf> {
    let dir = out_dir.join("cargo-crate");
    std::fs::create_dir_all(dir.join("src"))?;
    std::fs::write(dir.join("Cargo.toml"), CARGO_TOML)?;
    std::fs::write(dir.join("src/lib.rs"), LIB_RS)?;
    for args in [&["build"][..], &["test", "--no-run"][..]] {
        let status = cargo(&dir)
            .args(args)
            .args(["-q", "--offline"])
            .status()
            .context("running cargo")?;
        if !status.success() {
            bail!("cargo {args:?} of the bench crate failed: {status}");
        }
    }
    Ok(dir)
}

/// cargo in `dir`, with a target directory of its own (not the
/// workspace's, whatever `CARGO_TARGET_DIR` says).
fn cargo(dir: &Path) -> Command {
    in_crate(Path::new("cargo"), dir)
}

/// `program` run in `dir` with the environment [`cargo`] gives cargo.
fn in_crate(program: &Path, dir: &Path) -> Command {
    let mut c = Command::new(program);
    c.current_dir(dir)
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .env_remove("RUSTFLAGS");
    c
}

pub fn run(root: &Path, out_dir: &Path, runs: usize) -> Result<Vec<CargoRow>> {
    let dir = make_crate(out_dir)?;
    let mtrace = root.join("target/release/mtrace");
    let json = out_dir.join("cargo.json");
    let mut rows = Vec::new();
    for (command, args) in [
        ("cargo build", &["build", "-q", "--offline"][..]),
        ("cargo test", &["test", "-q", "--offline"][..]),
    ] {
        eprint!("\rxtask: bench {command:<40}");
        let untraced_s = super::tree::best(runs, || super::tree::timed(cargo(&dir).args(args)))?;
        let traced = |extra: &[&str], out: &Path| {
            let mut c = in_crate(&mtrace, &dir);
            c.args(extra)
                .args(["--top", "0", "-o"])
                .arg(out)
                .arg("--")
                .arg("cargo")
                .args(args);
            super::tree::timed(&mut c)
        };
        let max_stack_0_s = super::tree::best(runs, || {
            traced(&["--max-stack", "0"], Path::new("/dev/null"))
        })?;
        // The quality of the run of the best time.
        let (mut mtrace_s, mut quality) = (f64::INFINITY, String::new());
        for _ in 0..runs {
            let s = traced(&[], &json)?;
            if s < mtrace_s {
                mtrace_s = s;
                quality = std::fs::read_to_string(&json)?;
            }
        }
        let (calls, whole, finished_by_tracer, cut) = stack_quality(&quality)?;
        rows.push(CargoRow {
            command,
            untraced_s,
            max_stack_0_s,
            mtrace_s,
            calls,
            whole,
            finished_by_tracer,
            cut,
        });
    }
    eprintln!();
    Ok(rows)
}

/// `stack_quality` of a profile (mtrace's JSON, one field a line): calls,
/// whole, walks finished by the tracer, and the cut reasons. Read by
/// hand, as the tree rows read theirs: xtask has no JSON crate.
fn stack_quality(profile: &str) -> Result<(u64, u64, u64, String)> {
    let q = profile
        .split("\"stack_quality\": {")
        .nth(1)
        .context("no stack_quality in the profile")?;
    let q = &q[..q.find("\n  }").unwrap_or(q.len())];
    let n = |k: &str| {
        q.split(&format!("\"{k}\": "))
            .nth(1)
            .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let cut = q
        .split("\"truncated\": {")
        .nth(1)
        .and_then(|t| t.split('}').next())
        .map(|t| {
            t.split(',')
                .filter_map(|kv| {
                    let (k, v) = kv.split_once(':')?;
                    Some(format!("{} {}", k.trim().trim_matches('"'), v.trim()))
                })
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    Ok((
        n("calls"),
        n("whole"),
        n("finished_by_tracer"),
        if cut.is_empty() { "-".into() } else { cut },
    ))
}

pub fn render_table(rows: &[CargoRow], out: &mut String) {
    let _ = writeln!(
        out,
        "\ncargo on a small crate (one lib, one test, no dependencies), no-op runs, best of the runs; us per counted call: (full - max-stack 0) / calls\n\n| command | untraced s | --max-stack 0 s | mtrace s | us/call | calls | whole % | to the tracer | cut short |\n|---|---|---|---|---|---|---|---|---|"
    );
    for r in rows {
        let per_call = if r.calls == 0 {
            0.0
        } else {
            (r.mtrace_s - r.max_stack_0_s) * 1e6 / r.calls as f64
        };
        let whole = if r.calls == 0 {
            0.0
        } else {
            r.whole as f64 * 100.0 / r.calls as f64
        };
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.2} | {:.2} | {per_call:.1} | {} | {whole:.2} | {} | {} |",
            r.command,
            r.untraced_s,
            r.max_stack_0_s,
            r.mtrace_s,
            r.calls,
            r.finished_by_tracer,
            r.cut
        );
    }
}

pub fn render_json(rows: &[CargoRow]) -> String {
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"command\": \"{}\", \"untraced_s\": {:.4}, \"max_stack_0_s\": {:.4}, \"mtrace_s\": {:.4}, \"calls\": {}, \"whole\": {}, \"finished_by_tracer\": {}, \"cut_short\": \"{}\"}}",
                r.command, r.untraced_s, r.max_stack_0_s, r.mtrace_s, r.calls, r.whole, r.finished_by_tracer, r.cut
            )
        })
        .collect();
    format!("  \"cargo\": [\n{}\n  ]", rows.join(",\n"))
}
