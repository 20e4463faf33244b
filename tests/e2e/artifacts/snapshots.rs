//! Snapshots (--interval, SIGUSR1) of a process traced by pid.

use std::{
    fs,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::support::{
    s, validate_profile, Fixture, FixtureProc, Mtrace, Profile, EXIT_TIMEOUT, LINE_TIMEOUT,
};

/// `mtrace-PID-NNNN.json` -> NNNN.
fn snapshot_index(name: &str, pid: u32) -> Option<u32> {
    let n = name
        .strip_prefix(&format!("mtrace-{pid}-"))?
        .strip_suffix(".json")?;
    (n.len() == 4 && n.bytes().all(|b| b.is_ascii_digit())).then(|| n.parse().unwrap())
}

fn counts_of(v: &Value) -> (u64, u64) {
    (
        v["calls"].as_u64().expect("calls"),
        v["bytes"].as_u64().expect("bytes"),
    )
}

#[test]
fn snapshots_while_tracing_by_pid() {
    need_bpf!();
    let snap_dir = tempfile::tempdir().unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let final_json = out_dir.path().join("final.json");

    let mut fx = FixtureProc::start(Fixture::Longrun.path(), &[]);
    fx.wait_ready();
    let pid = fx.pid();
    let mut m = Mtrace::start(&[
        "--pid",
        &pid.to_string(),
        "--count-frees",
        "--interval",
        "0.5",
        "--snapshot-dir",
        s(snap_dir.path()),
        "-o",
        s(&final_json),
    ]);
    assert_eq!(m.wait_tracing(), pid);
    fx.release();
    // Once a snapshot is written the signal handlers are surely in place;
    // then one on demand.
    m.stderr
        .wait_for(|l| l.starts_with("mtrace: wrote snapshot "), LINE_TIMEOUT);
    assert!(fx.proc.running(), "the fixture's loop ended too soon");
    unsafe { libc::kill(m.proc.id() as i32, libc::SIGUSR1) };
    // The loop's end.
    let line = fx
        .stdout
        .wait_for(|l| l.starts_with("iterations="), EXIT_TIMEOUT);
    let iterations: u64 = line
        .strip_prefix("iterations=")
        .and_then(|l| l.split_once(' '))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("bad line {line:?}"));
    // Ctrl-C just after the interval wrote one more (the target now
    // idle): the next tick is 0.5 s away, so the interval cannot have
    // written more than duration / 0.5 snapshots (see below).
    let written = || {
        fs::read_dir(snap_dir.path())
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                snapshot_index(name.to_str().unwrap(), pid).is_some()
            })
            .count()
    };
    let before = written();
    let deadline = Instant::now() + LINE_TIMEOUT;
    while written() == before {
        assert!(
            Instant::now() < deadline,
            "no snapshot after the loop's end"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(m.proc.running(), "mtrace ended before Ctrl-C");
    unsafe { libc::kill(m.proc.id() as i32, libc::SIGINT) };
    let out = m.finish();
    out.assert_exit(0);
    drop(fx.stdin.take());
    assert_eq!(fx.proc.wait_timeout(EXIT_TIMEOUT).code(), Some(0));

    // The files: mtrace-PID-0001.json, -0002.json, ... and nothing else.
    let mut indices: Vec<u32> = fs::read_dir(snap_dir.path())
        .unwrap()
        .map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            snapshot_index(&name, pid)
                .unwrap_or_else(|| panic!("unexpected file {name:?} in the snapshot directory"))
        })
        .collect();
    indices.sort();
    let n = indices.len() as u32;
    assert!(n >= 3, "only {n} snapshots\n{}", out.describe());
    assert_eq!(indices, (1..=n).collect::<Vec<_>>(), "numbering");
    let announced = out
        .stderr
        .iter()
        .filter(|l| l.starts_with("mtrace: wrote snapshot "))
        .count();
    assert_eq!(announced as u32, n, "{}", out.describe());

    let mut prev: Option<((u64, u64), u64)> = None;
    let mut prev_elapsed = 0.0;
    for i in 1..=n {
        let path = snap_dir.path().join(format!("mtrace-{pid}-{i:04}.json"));
        let doc = validate_profile(&path);
        let snap = &doc["snapshot"];
        assert!(
            snap.is_object(),
            "{} has no snapshot object",
            path.display()
        );
        assert_eq!(snap["index"].as_u64(), Some(i as u64), "{}", path.display());
        let elapsed = snap["elapsed_secs"].as_f64().unwrap();
        assert!(elapsed >= prev_elapsed, "elapsed_secs goes back");
        prev_elapsed = elapsed;
        assert_eq!(doc["meta"]["pid"].as_u64(), Some(pid as u64));
        let totals = counts_of(&doc["totals"]["allocs"]);
        let frees = doc["totals"]["frees"].as_u64().unwrap();
        let (p_totals, p_frees) = prev.unwrap_or(((0, 0), 0));
        assert!(
            totals.0 >= p_totals.0 && totals.1 >= p_totals.1 && frees >= p_frees,
            "snapshot {i}: totals {totals:?}/{frees} below the previous {p_totals:?}/{p_frees}"
        );
        assert_eq!(
            counts_of(&snap["delta_allocs"]),
            (totals.0 - p_totals.0, totals.1 - p_totals.1),
            "snapshot {i}: delta_allocs is not the change of the totals"
        );
        assert_eq!(
            snap["delta_frees"].as_u64(),
            Some(frees - p_frees),
            "snapshot {i}"
        );
        prev = Some((totals, frees));
    }
    let (last, last_frees) = prev.unwrap();
    assert!(last.0 > 0, "the snapshots saw no allocation");

    let fin_profile = Profile::load(&final_json);
    fin_profile.assert_no_losses();
    let fin = &fin_profile.doc;
    // The interval ticks at 0.5, 1.0, ... s after tracing started (a
    // little after meta's start) and wrote at most duration / 0.5
    // snapshots: one more is SIGUSR1's.
    let duration = fin["meta"]["duration_secs"].as_f64().unwrap();
    let by_interval = (duration / 0.5).floor() as u32;
    assert!(
        n > by_interval,
        "{n} snapshots in {duration:.3} s at --interval 0.5: none for SIGUSR1?\n{}",
        out.describe()
    );
    assert!(
        fin.get("snapshot").is_none(),
        "the final profile is not a snapshot"
    );
    let fin_totals = counts_of(&fin["totals"]["allocs"]);
    let fin_frees = fin["totals"]["frees"].as_u64().unwrap();
    assert!(
        fin_totals.0 >= last.0 && fin_totals.1 >= last.1 && fin_frees >= last_frees,
        "final {fin_totals:?}/{fin_frees} below the last snapshot {last:?}/{last_frees}"
    );
    // Attached before the loop, which does malloc, realloc and calloc and
    // two frees per iteration, and nothing else.
    assert_eq!(
        fin_totals.0,
        3 * iterations,
        "calls over {iterations} iterations"
    );
    assert_eq!(
        fin_frees,
        2 * iterations,
        "frees over {iterations} iterations"
    );
    for f in ["malloc", "realloc", "calloc"] {
        assert_eq!(
            fin_profile.calls_of(f),
            Some(iterations),
            "{f}: {:?}",
            fin_profile.totals.per_func
        );
    }
    assert_eq!(
        fin_profile.per_func_alloc_calls(),
        3 * iterations,
        "{:?}",
        fin_profile.totals.per_func
    );
}
