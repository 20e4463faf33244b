//! The pprof renderers' tests: the message decoded, and checked by
//! `protoc` against the official `profile.proto`.

use std::collections::{BTreeMap, HashSet};
use std::io::Read as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use prost::Message as _;

use super::*;
use crate::profile::{Counts, FileMapping, Frame, ENTRY_POINT};
use crate::render::test_util::{entry, on_thread, profile};

const PROTO_DIR: &str = "/usr/share/gocode/src/github.com/google/pprof/proto";

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .expect("gzip");
    out
}

fn decode(p: &Profile) -> proto::Profile {
    let bytes = render(p).expect("render");
    proto::Profile::decode(gunzip(&bytes).as_slice()).expect("decode")
}

fn frame(function: &str, file: &str, line: u32, module: &str, addr: u64) -> Frame {
    Frame {
        function: function.to_string(),
        file: Some(file.to_string()),
        line: Some(line),
        module: Some(module.to_string()),
        build_id: Some(format!("{:x}", module.len())),
        file_offset: Some(addr - 0x1000),
        addr,
        inlined: false,
        mapping: None,
        symbol_offset: None,
    }
}

/// A profile as the symbolizer makes them: modules, files, lines, an
/// inlined frame, threads and a free.
fn realistic() -> Profile {
    let app = "/usr/bin/app";
    let libc = "/usr/lib/libc.so.6";
    let main = frame("main", "app.c", 50, app, 0x1500);
    let start = frame("__libc_start_main", "start.c", 10, libc, 0x2000);
    let mut helper = frame("helper", "util.h", 7, app, 0x1234);
    helper.inlined = true;
    let work = frame("work", "app.c", 20, app, 0x1234);
    let strdup = frame("strdup", "strdup.c", 3, libc, 0x3000);
    let mut e1 = entry("malloc", &[], 10, 1000);
    let (work, main, start) = (Arc::new(work), Arc::new(main), Arc::new(start));
    e1.frames = vec![Arc::new(helper), work.clone(), main.clone(), start.clone()];
    let mut e2 = entry("calloc", &[], 5, 80);
    e2.frames = vec![work.clone(), main.clone(), start.clone()];
    let mut e3 = entry("malloc", &[], 2, 64);
    e3.frames = vec![Arc::new(strdup), main.clone(), start.clone()];
    let e3 = on_thread(e3, 42, "worker");
    let mut e4 = entry("free", &[], 9, 0);
    e4.frames = vec![main, start];
    let mut p = profile(vec![e1, e2, e3, e4]);
    p.meta.mtrace_version = "1.2.3".into();
    p.meta.pid = 4242;
    p.meta.command = "/usr/bin/app --fast".into();
    p.meta.start_time = "2024-05-06T07:08:09Z".into();
    p.meta.duration_secs = 1.5;
    p.meta.allocator_object = libc.into();
    p
}

fn string(p: &proto::Profile, id: i64) -> &str {
    &p.string_table[usize::try_from(id).expect("index")]
}

fn location(p: &proto::Profile, id: u64) -> &proto::Location {
    let l = &p.location[id as usize - 1];
    assert_eq!(l.id, id);
    l
}

fn function_name(p: &proto::Profile, id: u64) -> &str {
    let f = &p.function[id as usize - 1];
    assert_eq!(f.id, id);
    string(p, f.name)
}

/// The names of a location's lines, innermost first.
fn line_names(p: &proto::Profile, id: u64) -> Vec<&str> {
    location(p, id)
        .line
        .iter()
        .map(|l| function_name(p, l.function_id))
        .collect()
}

/// What pprof's `CheckValid` checks, and that every string index is in
/// range.
fn check_valid(p: &proto::Profile) {
    assert_eq!(p.string_table[0], "");
    let n = p.string_table.len() as i64;
    let in_range = |i: i64| (0..n).contains(&i);
    for (i, m) in p.mapping.iter().enumerate() {
        assert_eq!(m.id, i as u64 + 1);
        assert!(in_range(m.filename) && in_range(m.build_id));
    }
    for (i, f) in p.function.iter().enumerate() {
        assert_eq!(f.id, i as u64 + 1);
        assert!(in_range(f.name) && in_range(f.system_name) && in_range(f.filename));
    }
    for (i, l) in p.location.iter().enumerate() {
        assert_eq!(l.id, i as u64 + 1);
        assert!(l.mapping_id as usize <= p.mapping.len());
        assert!(!l.line.is_empty());
        for line in &l.line {
            assert!(line.function_id >= 1 && line.function_id as usize <= p.function.len());
        }
    }
    for s in &p.sample {
        assert_eq!(s.value.len(), p.sample_type.len());
        assert!(!s.location_id.is_empty());
        for &id in &s.location_id {
            assert!(id >= 1 && id as usize <= p.location.len());
        }
        for l in &s.label {
            assert!(in_range(l.key) && in_range(l.str) && in_range(l.num_unit));
        }
    }
    for &c in &p.comment {
        assert!(in_range(c));
    }
    assert!(in_range(p.default_sample_type));
}

#[test]
fn header_fields() {
    let p = decode(&realistic());
    check_valid(&p);
    assert_eq!(p.string_table[0], "");
    let types: Vec<(&str, &str)> = p
        .sample_type
        .iter()
        .map(|t| (string(&p, t.r#type), string(&p, t.unit)))
        .collect();
    assert_eq!(
        types,
        [("alloc_objects", "count"), ("alloc_space", "bytes")]
    );
    assert_eq!(string(&p, p.default_sample_type), "alloc_space");
    assert_eq!(p.time_nanos, 1_714_979_289_000_000_000);
    assert_eq!(p.duration_nanos, 1_500_000_000);
    let comments: Vec<&str> = p.comment.iter().map(|&c| string(&p, c)).collect();
    assert_eq!(comments, ["mtrace 1.2.3, pid 4242: /usr/bin/app --fast"]);
}

#[test]
fn go_heap_shape() {
    let mut input = realistic();
    input.stacks[0].process = Some(crate::profile::ProcessRef {
        pid: 77,
        name: "app".into(),
    });
    let bytes = render_go_heap(&input, "alloc_space").unwrap();
    let p = proto::Profile::decode(gunzip(&bytes).as_slice()).unwrap();
    check_valid(&p);
    let period = p.period_type.as_ref().unwrap();
    assert_eq!(
        (string(&p, period.r#type), string(&p, period.unit)),
        ("space", "bytes")
    );
    assert_eq!(p.period, 1);
    assert_eq!(string(&p, p.default_sample_type), "alloc_space");
    let labels = |s: &proto::Sample| -> Vec<(String, i64, String, String)> {
        s.label
            .iter()
            .map(|l| {
                (
                    string(&p, l.key).to_string(),
                    l.num,
                    string(&p, l.str).to_string(),
                    string(&p, l.num_unit).to_string(),
                )
            })
            .collect()
    };
    // 10 calls of 1000 bytes: 100 bytes each; its process named.
    assert_eq!(
        labels(&p.sample[0]),
        [
            ("bytes".into(), 100, "".into(), "bytes".into()),
            ("pid".into(), 77, "".into(), "".into()),
            ("comm".into(), 0, "app".into(), "".into()),
        ]
    );
    assert_eq!(
        labels(&p.sample[1])[0],
        ("bytes".into(), 16, "".into(), "bytes".into())
    );
    input.meta.sampling = Some(crate::profile::SamplingInfo {
        kind: "bytes".into(),
        rate: 524288,
        samples: 3,
    });
    let bytes = render_go_heap(&input, "inuse_space").unwrap();
    let p = proto::Profile::decode(gunzip(&bytes).as_slice()).unwrap();
    assert_eq!(p.period, 524288);
    assert_eq!(string(&p, p.default_sample_type), "inuse_space");
}

#[test]
fn per_function_sums_match_the_input() {
    let input = realistic();
    let p = decode(&input);
    check_valid(&p);

    let mut want_leaf: BTreeMap<String, Counts> = BTreeMap::new();
    let mut want_caller: BTreeMap<String, Counts> = BTreeMap::new();
    for e in input.stacks.iter().filter(|e| is_allocation(e)) {
        want_leaf.entry(e.func.clone()).or_default().add(e.counts);
        want_caller
            .entry(e.frames[0].function.clone())
            .or_default()
            .add(e.counts);
    }
    let mut leaf: BTreeMap<String, Counts> = BTreeMap::new();
    let mut caller: BTreeMap<String, Counts> = BTreeMap::new();
    for s in &p.sample {
        let counts = Counts {
            calls: s.value[0] as u64,
            bytes: s.value[1] as u64,
        };
        let names = line_names(&p, s.location_id[0]);
        assert_eq!(names.len(), 1);
        leaf.entry(names[0].to_string()).or_default().add(counts);
        // Line 0 of the second location is the innermost frame there:
        // the direct caller.
        let names = line_names(&p, s.location_id[1]);
        caller.entry(names[0].to_string()).or_default().add(counts);
    }
    assert_eq!(leaf, want_leaf);
    assert_eq!(caller, want_caller);
    // The leaves add up to the totals of the allocations.
    let mut sum = Counts::default();
    leaf.values().for_each(|c| sum.add(*c));
    assert_eq!(sum, input.totals.allocs);
}

#[test]
fn free_is_left_out() {
    let p = decode(&realistic());
    assert_eq!(p.sample.len(), 3);
    assert!(!p.function.iter().any(|f| string(&p, f.name) == "free"));
}

#[test]
fn inlined_frames_share_one_location() {
    let p = decode(&realistic());
    let s = &p.sample[0];
    // malloc, helper+work, main, __libc_start_main
    assert_eq!(s.location_id.len(), 4);
    assert_eq!(line_names(&p, s.location_id[0]), ["malloc"]);
    assert_eq!(line_names(&p, s.location_id[1]), ["helper", "work"]);
    let lines: Vec<i64> = location(&p, s.location_id[1])
        .line
        .iter()
        .map(|l| l.line)
        .collect();
    assert_eq!(lines, [7, 20]);
    assert_eq!(location(&p, s.location_id[1]).address, 0x234);
    assert_eq!(line_names(&p, s.location_id[2]), ["main"]);
    assert_eq!(line_names(&p, s.location_id[3]), ["__libc_start_main"]);

    // `work` alone (not inlining `helper`) at the same address in
    // another stack keeps its own location.
    let s = &p.sample[1];
    assert_eq!(line_names(&p, s.location_id[1]), ["work"]);
}

#[test]
fn inlined_frame_without_its_caller_is_its_own_location() {
    let mut e = entry("malloc", &["inner", "outer"], 1, 8);
    Arc::make_mut(&mut e.frames[0]).inlined = true;
    Arc::make_mut(&mut e.frames[0]).addr = 1;
    Arc::make_mut(&mut e.frames[1]).addr = 2;
    let p = decode(&profile(vec![e]));
    check_valid(&p);
    assert_eq!(p.sample[0].location_id.len(), 3);

    let mut e = entry("malloc", &["a", "b", "c"], 1, 8);
    Arc::make_mut(&mut e.frames[0]).inlined = true;
    Arc::make_mut(&mut e.frames[1]).inlined = true;
    let p = decode(&profile(vec![e]));
    assert_eq!(p.sample[0].location_id.len(), 2);
    assert_eq!(line_names(&p, p.sample[0].location_id[1]), ["a", "b", "c"]);
}

#[test]
fn functions_locations_and_mappings_are_shared() {
    let p = decode(&realistic());
    check_valid(&p);
    let names: Vec<&str> = p.function.iter().map(|f| string(&p, f.name)).collect();
    let unique: HashSet<&str> = names.iter().copied().collect();
    assert_eq!(names.len(), unique.len());
    assert_eq!(names.len(), 7); // malloc calloc helper work main __libc_start_main strdup
                                // main and __libc_start_main are in every sample, at the same
                                // locations.
    let tails: HashSet<&[u64]> = p
        .sample
        .iter()
        .map(|s| &s.location_id[s.location_id.len() - 2..])
        .collect();
    assert_eq!(tails.len(), 1);
    // malloc has one location, shared by two samples.
    assert_eq!(p.sample[0].location_id[0], p.sample[2].location_id[0]);
    assert_ne!(p.sample[0].location_id[0], p.sample[1].location_id[0]);
    let f = p
        .function
        .iter()
        .find(|f| string(&p, f.name) == "work")
        .expect("work");
    assert_eq!(string(&p, f.filename), "app.c");
}

#[test]
fn mappings_describe_the_objects() {
    let p = decode(&realistic());
    let files: Vec<&str> = p.mapping.iter().map(|m| string(&p, m.filename)).collect();
    // The program first.
    assert_eq!(files, ["/usr/bin/app", "/usr/lib/libc.so.6"]);
    let app = &p.mapping[0];
    assert_eq!(string(&p, app.build_id), "c");
    assert!(app.has_functions && app.has_filenames && app.has_line_numbers);
    assert!(app.has_inline_frames);
    let libc = &p.mapping[1];
    assert_eq!(string(&p, libc.build_id), "12");
    assert!(libc.has_functions && !libc.has_inline_frames);
    for s in &p.sample {
        assert_eq!(location(&p, s.location_id[0]).mapping_id, 2);
        assert_eq!(
            location(&p, s.location_id[1]).mapping_id,
            if s.label.is_empty() { 1 } else { 2 }
        );
    }
}

#[test]
fn unsymbolized_frames_are_flagged() {
    let mut e = entry("malloc", &["[unknown]", "app+0x10"], 1, 8);
    for f in &mut e.frames {
        Arc::make_mut(f).module = Some("/app".into());
    }
    let p = decode(&profile(vec![e]));
    check_valid(&p);
    let m = &p.mapping[0];
    assert_eq!(string(&p, m.filename), "/app");
    assert!(!m.has_functions && !m.has_filenames && !m.has_line_numbers);
    assert_eq!(m.build_id, 0);
}

/// Frames whose target's mapping was kept are in that mapping, at the
/// target's address, so that `address - memory_start + file_offset` is
/// their offset in the file; one mapping per part of a file each
/// process mapped. A mapping where nothing but the entry point was
/// named is not symbolized.
#[test]
fn kept_mappings_are_the_targets() {
    let place = |start, offset| FileMapping {
        start,
        limit: start + 0x3000,
        offset,
    };
    let at = |function: &str, place: FileMapping, addr: u64| {
        let mut f = frame(function, "x", 1, "/usr/bin/app", addr);
        f.file = None;
        f.line = None;
        f.file_offset = Some(addr - place.start + place.offset);
        f.mapping = Some(place);
        Arc::new(f)
    };
    let (one, two) = (place(0x5500_0000, 0x1000), place(0x7700_0000, 0x1000));
    let mut e1 = entry("malloc", &[], 1, 8);
    e1.frames = vec![
        at("app+0x1234", one, 0x5500_0234),
        at(ENTRY_POINT, one, 0x5500_0100),
    ];
    let mut e2 = entry("malloc", &[], 1, 8);
    e2.frames = vec![at("work", two, 0x7700_0234)];
    let mut input = profile(vec![e1, e2]);
    input.meta.command = "/usr/bin/app".into();
    let p = decode(&input);
    check_valid(&p);
    let got: Vec<(u64, u64, u64, bool)> = p
        .mapping
        .iter()
        .map(|m| {
            (
                m.memory_start,
                m.memory_limit,
                m.file_offset,
                m.has_functions,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (0x5500_0000, 0x5500_3000, 0x1000, false),
            (0x7700_0000, 0x7700_3000, 0x1000, true)
        ]
    );
    let offsets: Vec<Vec<u64>> = p
        .sample
        .iter()
        .map(|s| {
            s.location_id[1..]
                .iter()
                .map(|&l| {
                    let l = location(&p, l);
                    let m = &p.mapping[l.mapping_id as usize - 1];
                    l.address - m.memory_start + m.file_offset
                })
                .collect()
        })
        .collect();
    assert_eq!(offsets, [vec![0x1234, 0x1100], vec![0x1234]]);
    assert_eq!(
        location(&p, p.sample[0].location_id[1]).address,
        0x5500_0234
    );
    assert_eq!(
        location(&p, p.sample[1].location_id[1]).address,
        0x7700_0234
    );
}

#[test]
fn frames_without_address_keep_their_own_locations() {
    let p = decode(&profile(vec![
        entry("malloc", &["a", "main"], 1, 10),
        entry("calloc", &["b", "main"], 2, 20),
    ]));
    check_valid(&p);
    assert!(p.mapping.is_empty());
    let stacks: Vec<Vec<Vec<&str>>> = p
        .sample
        .iter()
        .map(|s| s.location_id.iter().map(|&l| line_names(&p, l)).collect())
        .collect();
    assert_eq!(
        stacks,
        [
            vec![vec!["malloc"], vec!["a"], vec!["main"]],
            vec![vec!["calloc"], vec!["b"], vec!["main"]],
        ]
    );
    assert_eq!(p.location.len(), 5);
}

#[test]
fn threads_become_labels() {
    let p = decode(&realistic());
    let labels: Vec<Vec<(&str, &str, i64)>> = p
        .sample
        .iter()
        .map(|s| {
            s.label
                .iter()
                .map(|l| (string(&p, l.key), string(&p, l.str), l.num))
                .collect()
        })
        .collect();
    assert_eq!(
        labels,
        [
            vec![],
            vec![],
            vec![("thread_id", "", 42), ("thread_name", "worker", 0)]
        ]
    );
}

#[test]
fn empty_profile_and_bad_time() {
    let p = decode(&Profile::default());
    check_valid(&p);
    assert!(p.sample.is_empty());
    assert_eq!(p.time_nanos, 0);

    let mut bad = Profile::default();
    bad.meta.start_time = "yesterday".into();
    assert!(render(&bad).is_err());
}

#[test]
fn huge_counts_saturate() {
    let p = decode(&profile(vec![entry("malloc", &["a"], u64::MAX, 7)]));
    assert_eq!(p.sample[0].value, [i64::MAX, 7]);
}

/// Decodes the output with protoc and the official profile.proto, when
/// both are installed.
#[test]
fn protoc_decodes_it() {
    let proto_file = Path::new(PROTO_DIR).join("profile.proto");
    if !proto_file.exists() {
        eprintln!("skipped: {} is not installed", proto_file.display());
        return;
    }
    let child = Command::new("protoc")
        .args([
            "--decode",
            "perftools.profiles.Profile",
            "--proto_path",
            PROTO_DIR,
        ])
        .arg("profile.proto")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) => {
            eprintln!("skipped: cannot run protoc: {e}");
            return;
        }
    };
    let bytes = gunzip(&render(&realistic()).expect("render"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(&bytes)
        .expect("write to protoc");
    let out = child.wait_with_output().expect("protoc");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "protoc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("\"alloc_space\""), "{stdout}");
    assert!(stdout.contains("has_inline_frames: true"), "{stdout}");
}
