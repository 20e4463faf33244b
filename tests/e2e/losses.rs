//! Full kernel maps: what does not fit is counted and shown, and the
//! totals stay exact. tests/fixtures/manystacks.c makes 40 calls of 10
//! bytes, each under its own stack (1 to 40 frames of `rec` below main).

use serde_json::Value;

use crate::support::{public_tempdir, require_bpf, run_mtrace, Fixture};

const CALLS: u64 = 40;

fn traced(extra: &[&str]) -> Value {
    let dir = public_tempdir();
    let path = dir.path().join("p.json");
    let mut args = extra.to_vec();
    let path_str = path.to_str().unwrap();
    args.extend([
        "--top",
        "0",
        "-o",
        path_str,
        "--",
        Fixture::ManyStacks.path_str(),
    ]);
    let out = run_mtrace(&args);
    out.assert_exit(0);
    let text = std::fs::read_to_string(&path).expect("profile written");
    serde_json::from_str(&text).expect("profile is JSON")
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn a_full_aggregation_map_is_counted_and_the_totals_stay_exact() {
    if !require_bpf() {
        return;
    }
    let p = traced(&["--count-map-size", "16"]);
    assert_eq!(n(&p["totals"]["allocs"]["calls"]), CALLS, "{p}");
    assert_eq!(n(&p["totals"]["allocs"]["bytes"]), CALLS * 10, "{p}");
    let stacks = p["stacks"].as_array().unwrap();
    let in_stacks: u64 = stacks.iter().map(|s| n(&s["calls"])).sum();
    assert_eq!(stacks.len(), 16, "{p}");
    // Every call not in a stack is a loss, and only those.
    assert_eq!(n(&p["losses"]["map_full"]), CALLS - in_stacks, "{p}");
}

#[test]
fn a_full_stack_map_keeps_the_direct_caller_and_is_counted() {
    if !require_bpf() {
        return;
    }
    let p = traced(&["--stack-map-size", "16"]);
    assert_eq!(n(&p["totals"]["allocs"]["calls"]), CALLS, "{p}");
    let stacks = p["stacks"].as_array().unwrap();
    assert_eq!(stacks.len() as u64, CALLS, "one stack per depth: {p}");
    let truncated: Vec<&Value> = stacks
        .iter()
        .filter(|s| s["truncated"] == Value::Bool(true))
        .collect();
    assert_eq!(truncated.len(), 24, "{p}");
    assert_eq!(n(&p["losses"]["stack_map_full"]), 24, "{p}");
    for s in truncated {
        // The direct caller, from [rsp], is never lost.
        assert_eq!(s["frames"][0]["function"], "rec", "{s}");
    }
    // The stored stacks are whole: caller, then depth-1 more rec frames,
    // main and libc's start.
    for s in stacks
        .iter()
        .filter(|s| s["truncated"] == Value::Bool(false))
    {
        let frames = s["frames"].as_array().unwrap();
        let recs = frames.iter().filter(|f| f["function"] == "rec").count();
        assert_eq!(frames[recs]["function"], "main", "{s}");
    }
}
