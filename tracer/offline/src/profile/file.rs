//! The JSON profile file: a [`Profile`] with a format tag and a schema
//! version, written by `--output` and snapshots, read by `mtrace report`
//! and `mtrace diff`. The schema is `tracer/schema/profile.schema.json`.
//! Writing files is the tracer's `sinks` (one place for every output).

use std::{fmt::Write as _, path::Path, sync::Arc};

use foldhash::HashMap;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::{
    error::UserError,
    profile::{
        groups::GroupTotals, Counts, Frame, GoHeap, LiveStats, LiveTotals, Losses, Meta,
        ProcessRef, Profile, Snapshot, StackEntry, StackQuality, Thread, Timeline, Totals, Unseen,
    },
};

/// The `format` field of every profile file.
pub const FORMAT: &str = "mtrace-profile";
/// Bumped on any incompatible change of the file's layout. Version 2 keeps
/// each distinct frame once, in a table (`frames`), and a stack's
/// `frames` are indexes into it; version 1 repeated every frame in full
/// in every stack.
pub const SCHEMA_VERSION: u32 = 2;
/// The oldest version still read.
pub const OLDEST_SCHEMA_VERSION: u32 = 1;

/// Exit code for unreadable, truncated or wrong-version input.
pub const EXIT_BAD_INPUT: i32 = 2;

/// A version 2 file as written: the profile with its frames interned.
#[derive(Serialize)]
struct FileOut<'a> {
    format: &'static str,
    schema_version: u32,
    meta: &'a Meta,
    /// Every distinct frame once, one to a line.
    frames: Vec<Box<RawValue>>,
    stacks: Vec<StackOut<'a>>,
    totals: &'a Totals,
    losses: &'a Losses,
    #[serde(skip_serializing_if = "Option::is_none")]
    stack_quality: &'a Option<StackQuality>,
    #[serde(skip_serializing_if = "Option::is_none")]
    live: &'a Option<LiveTotals>,
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot: Option<SnapshotOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timeline: &'a Option<Timeline>,
    #[serde(skip_serializing_if = "<[GoHeap]>::is_empty")]
    go_heaps: &'a [GoHeap],
    #[serde(skip_serializing_if = "<[Unseen]>::is_empty")]
    unseen: &'a [Unseen],
    #[serde(skip_serializing_if = "<[GroupTotals]>::is_empty")]
    tests: &'a [GroupTotals],
    #[serde(skip_serializing_if = "<[GroupTotals]>::is_empty")]
    groups: &'a [GroupTotals],
}

/// A [`StackEntry`] whose frames are indexes into the frame table, on one
/// line.
#[derive(Serialize)]
struct StackOut<'a> {
    function: &'a str,
    frames: Box<RawValue>,
    truncated: bool,
    thread: &'a Option<Thread>,
    #[serde(skip_serializing_if = "Option::is_none")]
    process: &'a Option<ProcessRef>,
    calls: u64,
    bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    live: &'a Option<LiveStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    in_use: &'a Option<Counts>,
    #[serde(skip_serializing_if = "Option::is_none")]
    object_size: Option<u64>,
}

#[derive(Serialize)]
struct SnapshotOut<'a> {
    index: u32,
    elapsed_secs: f64,
    delta_allocs: Counts,
    delta_frees: u64,
    delta_stacks: Vec<StackOut<'a>>,
}

/// Numbers each distinct frame in the order first met. A frame is looked
/// up by its content once per [`Arc`] of it: stacks that share a frame
/// cost a pointer's lookup each, however long its names.
#[derive(Default)]
struct Interner<'a> {
    index: HashMap<&'a Frame, usize>,
    by_arc: HashMap<*const Frame, usize>,
    frames: Vec<&'a Frame>,
}

impl<'a> Interner<'a> {
    fn number(&mut self, f: &'a Arc<Frame>) -> usize {
        if let Some(&i) = self.by_arc.get(&Arc::as_ptr(f)) {
            return i;
        }
        let next = self.frames.len();
        let i = *self.index.entry(f).or_insert(next);
        if i == next {
            self.frames.push(f);
        }
        self.by_arc.insert(Arc::as_ptr(f), i);
        i
    }

    fn stack(&mut self, e: &'a StackEntry) -> StackOut<'a> {
        let mut list = String::with_capacity(2 + e.frames.len() * 7);
        list.push('[');
        for (n, f) in e.frames.iter().enumerate() {
            let i = self.number(f);
            if n > 0 {
                list.push(',');
            }
            let _ = write!(list, "{i}");
        }
        list.push(']');
        StackOut {
            function: &e.func,
            frames: raw(list),
            truncated: e.truncated,
            thread: &e.thread,
            process: &e.process,
            calls: e.counts.calls,
            bytes: e.counts.bytes,
            live: &e.live,
            in_use: &e.in_use,
            object_size: e.object_size,
        }
    }
}

/// JSON text this module made itself.
fn raw(json: String) -> Box<RawValue> {
    RawValue::from_string(json).expect("well-formed JSON")
}

/// The profile as a version 2 file.
pub fn to_json(profile: &Profile) -> String {
    let mut interner = Interner::default();
    let stacks = profile.stacks.iter().map(|e| interner.stack(e)).collect();
    let snapshot = profile.snapshot.as_ref().map(|s| SnapshotOut {
        index: s.index,
        elapsed_secs: s.elapsed_secs,
        delta_allocs: s.delta_allocs,
        delta_frees: s.delta_frees,
        delta_stacks: s.delta_stacks.iter().map(|e| interner.stack(e)).collect(),
    });
    // Serializing plain data cannot fail.
    let frames = interner
        .frames
        .iter()
        .map(|f| serde_json::value::to_raw_value(f).expect("a frame serializes"))
        .collect();
    let doc = FileOut {
        format: FORMAT,
        schema_version: SCHEMA_VERSION,
        meta: &profile.meta,
        frames,
        stacks,
        totals: &profile.totals,
        losses: &profile.losses,
        stack_quality: &profile.stack_quality,
        live: &profile.live,
        snapshot,
        timeline: &profile.timeline,
        go_heaps: &profile.go_heaps,
        unseen: &profile.unseen,
        tests: &profile.tests,
        groups: &profile.groups,
    };
    serde_json::to_string_pretty(&doc).expect("profile serializes") + "\n"
}

/// A version 2 file, frames still indexes.
#[derive(Deserialize)]
struct FileV2 {
    meta: Meta,
    frames: Vec<Arc<Frame>>,
    stacks: Vec<StackIn>,
    totals: Totals,
    losses: Losses,
    #[serde(default)]
    stack_quality: Option<StackQuality>,
    #[serde(default)]
    live: Option<LiveTotals>,
    #[serde(default)]
    snapshot: Option<SnapshotIn>,
    #[serde(default)]
    timeline: Option<Timeline>,
    #[serde(default)]
    go_heaps: Vec<GoHeap>,
    #[serde(default)]
    unseen: Vec<Unseen>,
    #[serde(default)]
    tests: Vec<GroupTotals>,
    #[serde(default)]
    groups: Vec<GroupTotals>,
}

/// A stack as read, its live statistics boxed: every stack read is held
/// until the last is, and most have none.
#[derive(Deserialize)]
struct StackIn {
    function: String,
    #[serde(deserialize_with = "indexes")]
    frames: Box<[u32]>,
    truncated: bool,
    thread: Option<Thread>,
    #[serde(default)]
    process: Option<ProcessRef>,
    calls: u64,
    bytes: u64,
    #[serde(default)]
    live: Option<Box<LiveStats>>,
    #[serde(default)]
    in_use: Option<Counts>,
    #[serde(default)]
    object_size: Option<u64>,
}

#[derive(Deserialize)]
struct SnapshotIn {
    index: u32,
    elapsed_secs: f64,
    delta_allocs: Counts,
    delta_frees: u64,
    delta_stacks: Vec<StackIn>,
}

/// A stack's frame indexes, in no more memory than they take: the
/// stacks' indexes are all held until the last is read.
fn indexes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Box<[u32]>, D::Error> {
    Vec::<u32>::deserialize(d).map(Vec::into_boxed_slice)
}

impl FileV2 {
    /// The profile with every frame index replaced by its frame of the
    /// table, shared (never copied).
    fn resolve(self) -> Result<Profile, String> {
        let table = self.frames;
        let resolve = |stacks: Vec<StackIn>| -> Result<Vec<StackEntry>, String> {
            stacks
                .into_iter()
                .map(|s| {
                    // As many pointers as frames, no more.
                    let mut frames = Vec::with_capacity(s.frames.len());
                    for &i in &s.frames {
                        let frame = table.get(i as usize).ok_or_else(|| {
                            format!(
                                "corrupt profile: a stack names frame {i} of {}",
                                table.len()
                            )
                        })?;
                        frames.push(frame.clone());
                    }
                    Ok(StackEntry {
                        func: s.function,
                        frames,
                        truncated: s.truncated,
                        thread: s.thread,
                        process: s.process,
                        counts: Counts {
                            calls: s.calls,
                            bytes: s.bytes,
                        },
                        live: s.live.map(|l| *l),
                        in_use: s.in_use,
                        object_size: s.object_size,
                    })
                })
                .collect()
        };
        let snapshot = match self.snapshot {
            Some(s) => Some(Snapshot {
                index: s.index,
                elapsed_secs: s.elapsed_secs,
                delta_allocs: s.delta_allocs,
                delta_frees: s.delta_frees,
                delta_stacks: resolve(s.delta_stacks)?,
            }),
            None => None,
        };
        Ok(Profile {
            meta: self.meta,
            stacks: resolve(self.stacks)?,
            totals: self.totals,
            losses: self.losses,
            stack_quality: self.stack_quality,
            live: self.live,
            snapshot,
            timeline: self.timeline,
            go_heaps: self.go_heaps,
            unseen: self.unseen,
            tests: self.tests,
            groups: self.groups,
        })
    }
}

fn bad_input(path: &Path, what: impl std::fmt::Display) -> anyhow::Error {
    anyhow::Error::new(UserError::with_code(
        format!("{}: {what}", path.display()),
        EXIT_BAD_INPUT,
    ))
}

/// The largest profile file `report` and `diff` read (a profile of 100,000
/// distinct stacks 35 frames deep is some tens of MB).
pub const MAX_PROFILE_BYTES: u64 = 1 << 30;

/// Reads a profile file; every failure is a one-line error with exit code
/// 2. Only regular files up to [`MAX_PROFILE_BYTES`] are read (not
/// `/dev/zero`, a FIFO or a sparse file of terabytes), and no more than
/// that many bytes even if the file grows meanwhile.
pub fn read(path: &Path) -> Result<Profile> {
    use std::{io::Read, os::unix::fs::OpenOptionsExt};
    // Non-blocking: opening a FIFO must not wait for a writer (it is then
    // refused as not a regular file).
    const O_NONBLOCK: i32 = 0o4000;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(O_NONBLOCK)
        .open(path)
        .map_err(|e| bad_input(path, e))?;
    let meta = file.metadata().map_err(|e| bad_input(path, e))?;
    if !meta.is_file() {
        return Err(bad_input(path, "not a regular file"));
    }
    if meta.len() > MAX_PROFILE_BYTES {
        return Err(bad_input(
            path,
            format!(
                "{} bytes, over the {} MiB a profile may have",
                meta.len(),
                MAX_PROFILE_BYTES >> 20
            ),
        ));
    }
    let mut text = String::new();
    file.take(MAX_PROFILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| bad_input(path, e))?;
    if text.len() as u64 > MAX_PROFILE_BYTES {
        return Err(bad_input(path, "grew over the size a profile may have"));
    }
    // The text is let go before the stacks are made of what was read.
    let read = read_text(&text);
    drop(text);
    read.and_then(Parsed::into_profile)
        .map_err(|what| bad_input(path, what))
}

/// The two fields that say what a file is; everything else is skipped
/// unread.
#[derive(Deserialize)]
struct Header {
    format: Option<serde_json::Value>,
    schema_version: Option<serde_json::Value>,
}

/// Parses the text of a profile file (of any version from
/// [`OLDEST_SCHEMA_VERSION`] to [`SCHEMA_VERSION`]), or says what is wrong
/// with it.
pub fn parse(text: &str) -> Result<Profile, String> {
    read_text(text)?.into_profile()
}

/// A profile file as read, before its stacks are made.
enum Parsed {
    V1(Profile),
    V2(FileV2),
}

impl Parsed {
    /// The profile, its values checked.
    fn into_profile(self) -> Result<Profile, String> {
        let profile = match self {
            Parsed::V1(p) => p,
            Parsed::V2(file) => file.resolve()?,
        };
        check_values(&profile)?;
        Ok(profile)
    }
}

/// The text of a profile file read, or what is wrong with it.
fn read_text(text: &str) -> Result<Parsed, String> {
    let header = match serde_json::from_str::<Header>(text) {
        Ok(h) => h,
        Err(e) if e.is_eof() => {
            return Err(format!("truncated profile (ends at line {})", e.line()))
        }
        // Well-formed JSON, but not an object.
        Err(e) if e.is_data() => Header {
            format: None,
            schema_version: None,
        },
        Err(e) => return Err(format!("not a JSON profile: {e}")),
    };
    let format = header.format.as_ref().and_then(|f| f.as_str());
    if format != Some(FORMAT) {
        return Err(format!(
            "not an mtrace profile (format is {}, expected \"{FORMAT}\")",
            format.map_or("missing".to_string(), |f| format!("\"{f}\""))
        ));
    }
    let malformed = |e: serde_json::Error| format!("malformed profile: {e}");
    match header.schema_version.as_ref().map(|v| (v, v.as_u64())) {
        // The fields a profile does not have (`format`, ...) are skipped.
        Some((_, Some(1))) => serde_json::from_str(text).map(Parsed::V1).map_err(malformed),
        Some((_, Some(2))) => serde_json::from_str(text).map(Parsed::V2).map_err(malformed),
        Some((_, Some(v))) => Err(format!(
            "profile schema version {v} is not supported by this mtrace (it reads versions {OLDEST_SCHEMA_VERSION} to {SCHEMA_VERSION})"
        )),
        Some((v, None)) => Err(format!("schema_version must be a number, found {v}")),
        None => Err("profile has no schema_version".into()),
    }
}

/// Values no trace produces: a corrupt (or hand-edited) profile.
fn check_values(p: &Profile) -> Result<(), String> {
    let d = p.meta.duration_secs;
    if !d.is_finite() || d < 0.0 {
        return Err(format!("corrupt profile: duration_secs is {d}"));
    }
    // Exact counts: the stacks hold at most the totals (calls that found
    // the aggregation map full are in the totals only). Sampled counts
    // are rounded estimates, a call each at most.
    let slack = if p.meta.sampling.is_some() {
        p.stacks.len() as u64
    } else {
        0
    };
    // A Go heap's rows are held to its own totals (`go_heaps`), not to
    // malloc's.
    let sum = |go: bool| {
        p.stacks
            .iter()
            .filter(|e| super::is_allocation(e) && super::is_go_heap(e) == go)
            .try_fold(0u64, |sum, e| sum.checked_add(e.counts.calls))
    };
    let go_total = p
        .go_heaps
        .iter()
        .try_fold(0u64, |sum, g| sum.checked_add(g.allocated.calls));
    let totals = [
        (
            "allocation calls",
            sum(false),
            Some(p.totals.allocs.calls.saturating_add(slack)),
            p.totals.allocs.calls,
        ),
        (
            "go heap objects",
            sum(true),
            go_total,
            go_total.unwrap_or(0),
        ),
    ];
    for (what, in_stacks, bound, total) in totals {
        match (in_stacks, bound) {
            (Some(n), Some(b)) if n <= b => {}
            (Some(n), Some(_)) => {
                return Err(format!(
                    "corrupt profile: its stacks hold {n} {what}, its totals {total}"
                ))
            }
            _ => return Err(format!("corrupt profile: the stacks' {what} overflow")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{Counts, Frame, StackEntry};

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
    const VERSION_1: &str = include_str!("../../tests/data/render/profile.json");

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
            serde_json::from_str(include_str!("../../../schema/profile.schema.json")).unwrap();
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
}
