//! Writing a profile file: each distinct frame once, in a table, and each
//! stack's frames as indexes into it (schema version 2).

use std::{fmt::Write as _, sync::Arc};

use foldhash::HashMap;
use serde::Serialize;
use serde_json::value::RawValue;

use super::{FORMAT, SCHEMA_VERSION};
use crate::profile::{
    groups::GroupTotals, Counts, Frame, GoHeap, LiveStats, LiveTotals, Losses, Meta, ProcessRef,
    Profile, StackEntry, StackQuality, Thread, Timeline, Totals, Unseen,
};

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
