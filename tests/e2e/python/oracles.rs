//! Other tools as oracles of the Python frames: memray's allocations by
//! line, py-spy's frame chain.

use std::fs;

use crate::support::{
    python::{chain_of, run_named, script, write_script, Chain, N},
    require, FixtureProc, Mtrace,
};

/// memray as the oracle: `memray run` and `memray stats` on the chain
/// script give, per Python location of the script, the allocations and
/// bytes made there (innermost Python frame); mtrace's stacks, summed by
/// their innermost frame in the script, must give the same numbers
/// (leaf's bytearrays, Outer.run's list growing, the class statement).
#[test]
fn python_lines_agree_with_memray() {
    let dir = bpf_tempdir!();
    let path = script(dir.path());
    let script = path.to_str().unwrap();
    let py = "/usr/bin/python3.11";
    let memray_ok = std::process::Command::new(py)
        .args(["-c", "import memray"])
        .status()
        .is_ok_and(|s| s.success());
    if !require(
        memray_ok,
        "memray is missing (cargo xtask setup installs it)",
    ) {
        return;
    }
    let n = N.to_string();
    let bin = dir.path().join("run.bin");
    let stats = dir.path().join("stats.json");
    let run = std::process::Command::new(py)
        .args([
            "-m",
            "memray",
            "run",
            "-q",
            "-o",
            bin.to_str().unwrap(),
            script,
            &n,
        ])
        .output()
        .unwrap();
    assert!(run.status.success(), "memray run: {run:?}");
    let out = std::process::Command::new(py)
        .args(["-m", "memray", "stats", "--json", "-n", "1000", "-f"])
        .args(["-o", stats.to_str().unwrap(), bin.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "memray stats: {out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&fs::read(&stats).unwrap()).unwrap();
    // "function:file:line" -> (count, size), for the script's locations.
    let mut memray: std::collections::BTreeMap<(String, u64), (u64, u64)> = Default::default();
    let suffix = format!(":{script}:");
    for (list, field) in [
        ("top_allocations_by_count", "count"),
        ("top_allocations_by_size", "size"),
    ] {
        for e in doc[list].as_array().expect(list) {
            let loc = e["location"].as_str().unwrap();
            let Some(at) = loc.find(&suffix) else {
                continue;
            };
            let key = (
                loc[..at].to_string(),
                loc[at + suffix.len()..].parse().unwrap(),
            );
            let v = memray.entry(key).or_default();
            let n = e[field].as_u64().unwrap();
            if field == "count" {
                v.0 = n
            } else {
                v.1 = n
            }
        }
    }
    assert!(
        memray.len() >= 2,
        "memray's locations in the script: {memray:?}"
    );
    let (out, p) = run_named(&["--", py, script, &n]);
    out.assert_exit(0);
    let mut ours: std::collections::BTreeMap<(String, u64), (u64, u64)> = Default::default();
    for s in p.allocs() {
        let Some((f, line)) = chain_of(s, script).into_iter().next() else {
            continue;
        };
        // memray names a function by co_name: `run`, not `Outer.run`.
        let name = f.rsplit('.').next().unwrap().to_string();
        let v = ours.entry((name, line)).or_default();
        v.0 += s.calls;
        v.1 += s.bytes;
    }
    assert_eq!(
        ours,
        memray,
        "mtrace (left) and memray (right) by Python line\n{}",
        out.describe()
    );
}

/// py-spy as the oracle of the frame chain: a process started before
/// mtrace, traced by pid, allocates in leaf and then waits there; py-spy
/// dump of it at that point names the same functions, in the same order,
/// at the same lines above leaf.
const PAUSE_SCRIPT: &str = include_str!("../../fixtures/python/pause.py");

#[test]
fn python_frames_agree_with_py_spy() {
    let dir = bpf_tempdir!();
    let path = write_script(dir.path(), "pause.py", PAUSE_SCRIPT);
    let script = path.to_str().unwrap();
    let py = "/usr/bin/python3.11";
    let spy_ok = std::process::Command::new("py-spy")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !require(spy_ok, "py-spy is missing (cargo xtask setup installs it)") {
        return;
    }
    let n = N.to_string();
    let mut fx = FixtureProc::start(std::path::Path::new(py), &[script, &n]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let mut m = Mtrace::start_profiled(&["--pid", &pid]);
    m.wait_tracing();
    fx.release();
    fx.stdout
        .wait_for(|l| l == "allocated", crate::support::LINE_TIMEOUT);
    // Without pausing it (mtrace's exit hold has it under ptrace, which
    // py-spy's pause would need): it waits in leaf anyway.
    let dump = std::process::Command::new("py-spy")
        .args(["dump", "--nonblocking", "--pid", &pid])
        .output()
        .unwrap();
    let dump = format!(
        "{}{}",
        String::from_utf8_lossy(&dump.stdout),
        String::from_utf8_lossy(&dump.stderr)
    );
    fx.release();
    let status = fx.proc.wait_timeout(crate::support::EXIT_TIMEOUT);
    assert!(status.success(), "the script failed: {status}");
    let (out, p) = m.finish();
    out.assert_exit(0);
    // `    leaf (pause.py:5)`, innermost first.
    let spied: Chain = dump
        .lines()
        .filter_map(|l| {
            let (func, rest) = l.trim().rsplit_once(" (")?;
            let (file, line) = rest.strip_suffix(')')?.rsplit_once(':')?;
            let ours = file == script || script.ends_with(&format!("/{file}"));
            ours.then_some((func.to_string(), line.parse().ok()?))
        })
        .filter(|(f, _)| ["leaf", "mid", "<module>"].contains(&f.as_str()))
        .collect();
    assert_eq!(
        spied.iter().map(|f| f.0.as_str()).collect::<Vec<_>>(),
        ["leaf", "mid", "<module>"],
        "py-spy dump:\n{dump}"
    );
    let ours: Vec<Chain> = p
        .allocs()
        .filter(|s| s.bytes == s.calls * 4001)
        .map(|s| chain_of(s, script))
        .collect();
    assert_eq!(ours.len(), 1, "{ours:?}\n{}", out.describe());
    let chain = &ours[0];
    let names: Vec<&str> = chain.iter().map(|f| f.0.as_str()).collect();
    // 3.11 names the comprehension a frame of its own, inside leaf.
    let names: Vec<&str> = names
        .into_iter()
        .filter(|n| !n.contains("<listcomp>"))
        .collect();
    assert_eq!(names, ["leaf", "mid", "<module>"], "{chain:?}");
    // Above leaf (whose line is the allocation's for mtrace, the wait's
    // for py-spy), the same lines.
    let outer = |c: &Chain| -> Vec<(String, u64)> {
        c.iter()
            .filter(|f| f.0 != "leaf" && !f.0.contains("<listcomp>"))
            .cloned()
            .collect()
    };
    assert_eq!(
        outer(chain),
        outer(&spied),
        "mtrace {chain:?}, py-spy:\n{dump}"
    );
}
