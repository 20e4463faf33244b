//! Full kernel maps: what does not fit is counted and shown, and the
//! totals stay exact. tests/fixtures/manystacks.c makes 40 calls of 10
//! bytes, each under its own stack (1 to 40 frames of `rec` below main).

use crate::support::{run_profiled, Fixture, Profile};

const CALLS: u64 = 40;

fn traced(extra: &[&str]) -> Profile {
    let mut args = extra.to_vec();
    args.extend(["--top", "0", "--", Fixture::ManyStacks.path_str()]);
    let (out, p) = run_profiled(&args);
    out.assert_exit(0);
    p
}

#[test]
fn a_full_aggregation_map_is_counted_and_the_totals_stay_exact() {
    need_bpf!();
    let p = traced(&["--count-map-size", "16"]);
    let d = p.dump();
    assert_eq!(p.total(), (CALLS, CALLS * 10), "{d}");
    let in_stacks: u64 = p.stacks.iter().map(|s| s.calls).sum();
    // The kernel's map holds 16 stacks; walks the tracer finished (the
    // first through code without unwind rules yet) are counted by the
    // tracer, outside the map.
    let by_tracer = p.doc["stack_quality"]["finished_by_tracer"]
        .as_u64()
        .unwrap();
    assert!(p.stacks.len() >= 16, "{d}");
    assert!(p.stacks.len() as u64 <= 16 + by_tracer, "{d}");
    // Every call not in a stack is a loss, and only those.
    assert_eq!(p.losses["map_full"], CALLS - in_stacks, "{d}");
    assert!(
        p.losses["map_full"] >= CALLS.saturating_sub(16 + by_tracer),
        "{d}"
    );
}

#[test]
fn a_full_stack_map_keeps_the_direct_caller_and_is_counted() {
    need_bpf!();
    let p = traced(&["--stack-map-size", "16"]);
    let d = p.dump();
    assert_eq!(p.total().0, CALLS, "{d}");
    assert_eq!(p.stacks.len() as u64, CALLS, "one stack per depth: {d}");
    let (truncated, whole): (Vec<_>, Vec<_>) = p.stacks.iter().partition(|s| s.truncated);
    // 16 stacks fit the kernel's map; walks the tracer finished keep their
    // stacks outside it.
    let by_tracer = p.doc["stack_quality"]["finished_by_tracer"]
        .as_u64()
        .unwrap();
    assert_eq!(truncated.len() as u64, p.losses["stack_map_full"], "{d}");
    assert!(
        p.losses["stack_map_full"] >= CALLS.saturating_sub(16 + by_tracer),
        "{d}"
    );
    assert!(p.losses["stack_map_full"] > 0, "{d}");
    for s in truncated {
        // The direct caller, from [rsp], is never lost.
        assert_eq!(s.caller(), Some("rec"), "{s:?}");
    }
    // The stored stacks are whole: caller, then depth-1 more rec frames,
    // main and libc's start.
    for s in whole {
        let names = s.names();
        let recs = names.iter().filter(|f| **f == "rec").count();
        assert_eq!(names[recs], "main", "{s:?}");
    }
}
