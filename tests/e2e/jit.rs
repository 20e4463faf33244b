//! JIT frames named from the runtime's perf map: node with
//! `--perf-basic-prof` writes /tmp/perf-PID.map, and the JavaScript
//! functions on an allocation's stack are named from it instead of
//! `[anonymous code 0x...]`.

use std::{fs, path::Path};

use crate::support::{require, run_profiled};

/// 5000 buffers of 100000 or 100001 bytes (one malloc each), from
/// `leafAlloc` called by `midAlloc`.
const SCRIPT: &str = "\
function leafAlloc(i) {
  return Buffer.allocUnsafeSlow(100000 + (i & 1));
}
function midAlloc(i) {
  return leafAlloc(i);
}
const keep = [];
for (let i = 0; i < 5000; i++) {
  keep.push(midAlloc(i));
  if (keep.length > 10) keep.shift();
}
";

#[test]
fn node_jit_frames_are_named_from_its_perf_map() {
    let dir = bpf_tempdir!();
    let node = "/usr/bin/node";
    if !require(Path::new(node).exists(), "node is missing") {
        return;
    }
    let path = dir.path().join("alloc.js");
    fs::write(&path, SCRIPT).unwrap();
    let script = path.to_str().unwrap();
    let log = format!("--logfile={}", dir.path().join("v8.log").display());
    let (out, p) = run_profiled(&[
        "--",
        node,
        "--perf-basic-prof",
        "--interpreted-frames-native-stack",
        // (Its log, which the perf map turns on, goes with the script.)
        "--no-logfile-per-isolate",
        &log,
        script,
    ]);
    out.assert_exit(0);
    let buffers: Vec<_> = p
        .allocs()
        .filter(|s| s.calls * 100_000 <= s.bytes && s.bytes <= s.calls * 100_001)
        .collect();
    let calls: u64 = buffers.iter().map(|s| s.calls).sum();
    assert_eq!(calls, 5000, "{}", out.describe());
    // Every JIT frame on their stacks has its name (the walk may stop
    // short at V8's interpreter trampoline before the script's code is
    // compiled, how often depending on when V8 tiers up: it compiles on
    // another thread).
    for s in &buffers {
        let names = s.names();
        assert!(
            !names.iter().any(|n| n.starts_with("[anonymous code")),
            "an unnamed JIT frame: {names:?}"
        );
    }
    let named: u64 = buffers
        .iter()
        .filter(|s| {
            s.names()
                .iter()
                .any(|n| n.starts_with("JS:") && n.contains(script))
        })
        .map(|s| s.calls)
        .sum();
    assert!(
        named * 10 >= calls,
        "{named} of {calls} buffers under a named script frame\n{}",
        out.describe()
    );
}
