//! The profile file's tests: round trips, both schema versions, and bad
//! input refused.

use super::*;
use std::sync::Arc;

use crate::profile::{Counts, Frame, Profile, StackEntry};

#[test]
fn deep_distinct_stacks_make_a_small_file() {
    // A tenth of the 100,000 stacks of tests/e2e/artifacts/scale.rs
    // (a debug build takes long over those).
    let p = crate::profile::synthetic::deep_stacks(10_000, 35);
    let text = to_json(&p);
    // Each frame of the 350 is written once; a stack is its counts
    // and 35 indexes. Version 1 repeated the frames: 117 MB.
    assert!(text.len() < 4 << 20, "{} bytes", text.len());
    let back = parse(&text).unwrap();
    assert!(back == p, "the profile reads back as written");
}

#[test]
fn frames_are_written_once() {
    let mut p = sample();
    let mut second = p.stacks[0].clone();
    let mut outer = (*second.frames[0]).clone();
    outer.function = "main".into();
    outer.addr += 1;
    second.frames.push(Arc::new(outer));
    second.func = "calloc".into();
    p.stacks.push(second);
    p.snapshot = Some(crate::profile::Snapshot {
        index: 1,
        delta_stacks: vec![p.stacks[1].clone()],
        ..Default::default()
    });
    p.totals.allocs.calls *= 2;
    let text = to_json(&p);
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(doc["frames"].as_array().unwrap().len(), 2, "{text}");
    assert_eq!(doc["stacks"][0]["frames"], serde_json::json!([0]));
    assert_eq!(doc["stacks"][1]["frames"], serde_json::json!([0, 1]));
    assert_eq!(
        doc["snapshot"]["delta_stacks"][0]["frames"],
        serde_json::json!([0, 1])
    );
    // A stack's indexes are on one line, and so is each frame.
    assert!(text.contains("\"frames\": [0,1],\n"), "{text}");
    assert!(text.contains("\n    {\"function\":\"main\","), "{text}");
    assert_eq!(parse(&text).unwrap(), p);
    // An index past the table is refused.
    let bad = text.replace("[0,1]", "[0,2]");
    assert_eq!(
        parse(&bad).unwrap_err(),
        "corrupt profile: a stack names frame 2 of 2"
    );
}

/// The renderers' golden input is a version 1 file.
const VERSION_1: &str = include_str!("../../../tests/data/render/profile.json");

#[test]
fn version_1_files_still_read() {
    assert!(VERSION_1.contains("\"schema_version\": 1,"));
    let old = parse(VERSION_1).unwrap();
    assert!(old.stacks.iter().any(|e| e.frames.len() > 1));
    // Written again, as version 2: the same profile.
    let text = to_json(&old);
    assert!(text.contains("\"schema_version\": 2,"));
    assert_eq!(parse(&text).unwrap(), old);
}

fn sample() -> Profile {
    let mut p = Profile::default();
    p.meta.pid = 42;
    p.meta.command = "./fixture".into();
    p.meta.mode = "count".into();
    p.stacks.push(StackEntry {
        func: "malloc".into(),
        frames: vec![Arc::new(Frame {
            function: "alloc_small".into(),
            file: Some("/src/counts.c".into()),
            line: Some(25),
            module: Some("/tmp/counts".into()),
            build_id: Some("abcd".into()),
            file_offset: Some(0x1234),
            addr: 0x5555_1234,
            inlined: false,
            mapping: Some(crate::profile::FileMapping {
                start: 0x5555_1000,
                limit: 0x5555_3000,
                offset: 0x1000,
            }),
            symbol_offset: None,
        })],
        truncated: false,
        thread: None,
        process: None,
        counts: Counts {
            calls: 1000,
            bytes: 48000,
        },
        live: None,
        in_use: None,
        object_size: None,
    });
    p.totals.allocs = Counts {
        calls: 1000,
        bytes: 48000,
    };
    p
}

#[test]
fn values_no_trace_produces_are_refused() {
    let mut p = sample();
    assert!(parse(&to_json(&p)).is_ok());
    p.stacks[0].counts.calls = u64::MAX;
    let e = parse(&to_json(&p)).unwrap_err();
    assert!(e.starts_with("corrupt profile: its stacks hold"), "{e}");
    let mut p = sample();
    p.meta.duration_secs = -1.0;
    let e = parse(&to_json(&p)).unwrap_err();
    assert_eq!(e, "corrupt profile: duration_secs is -1");
}

#[test]
fn go_heap_rows_are_held_to_their_own_totals() {
    let mut p = sample();
    let mut row = p.stacks[0].clone();
    row.func = crate::profile::GO_HEAP_FUNC.into();
    row.counts = Counts {
        calls: 5125,
        bytes: 5_248_001,
    };
    row.object_size = Some(1024);
    p.stacks.push(row);
    p.go_heaps.push(crate::profile::GoHeap {
        allocated: Counts {
            calls: 5125,
            bytes: 5_248_001,
        },
        ..Default::default()
    });
    let back = parse(&to_json(&p)).unwrap();
    assert_eq!(back.stacks[1].object_size, Some(1024));
    p.go_heaps[0].allocated.calls = 5124;
    let e = parse(&to_json(&p)).unwrap_err();
    assert_eq!(
        e,
        "corrupt profile: its stacks hold 5125 go heap objects, its totals 5124"
    );
}

#[test]
fn a_schema_version_of_the_wrong_type_says_so() {
    let text = to_json(&sample()).replace("\"schema_version\": 2", "\"schema_version\": \"2\"");
    assert_eq!(
        parse(&text).unwrap_err(),
        "schema_version must be a number, found \"2\""
    );
}

#[test]
fn round_trips() {
    let p = sample();
    let text = to_json(&p);
    assert!(text.contains("\"schema_version\": 2"));
    assert_eq!(parse(&text).unwrap(), p);
}

#[test]
fn truncated_input_is_named() {
    let text = to_json(&sample());
    let err = parse(&text[..text.len() / 2]).unwrap_err();
    assert!(err.contains("truncated"), "{err}");
}

#[test]
fn wrong_version_is_refused() {
    let text = to_json(&sample()).replace("\"schema_version\": 2", "\"schema_version\": 99");
    let err = parse(&text).unwrap_err();
    assert!(err.contains("version 99"), "{err}");
}

#[test]
fn output_validates_against_the_schema() {
    let schema: serde_json::Value =
        serde_json::from_str(include_str!("../../../../schema/profile.schema.json")).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let mut p = sample();
    let doc: serde_json::Value = serde_json::from_str(&to_json(&p)).unwrap();
    let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}");
    // A snapshot validates too, and a stray field does not.
    p.snapshot = Some(crate::profile::Snapshot {
        index: 1,
        ..Default::default()
    });
    let doc: serde_json::Value = serde_json::from_str(&to_json(&p)).unwrap();
    assert!(validator.is_valid(&doc));
    let mut bad = doc.clone();
    bad["meta"]["surprise"] = serde_json::json!(1);
    assert!(!validator.is_valid(&bad));
    // Version 2 stacks name frames by index, version 1 stacks hold
    // them; each validates as its version only.
    let v1: serde_json::Value = serde_json::from_str(VERSION_1).unwrap();
    let errors: Vec<String> = validator.iter_errors(&v1).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}");
    let mut v1_as_v2 = v1.clone();
    v1_as_v2["schema_version"] = serde_json::json!(2);
    v1_as_v2["frames"] = serde_json::json!([]);
    assert!(!validator.is_valid(&v1_as_v2));
    let mut v2_as_v1 = doc.clone();
    v2_as_v1["schema_version"] = serde_json::json!(1);
    assert!(!validator.is_valid(&v2_as_v1));
}

#[test]
fn other_json_is_refused() {
    assert!(parse("{\"a\": 1}")
        .unwrap_err()
        .contains("not an mtrace profile"));
    assert!(parse("garbage").unwrap_err().contains("not a JSON profile"));
}
