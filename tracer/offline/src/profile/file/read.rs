//! Reading a profile file of either schema version: bounded in size, its
//! values checked, a bad file said in one line that names it.

use std::{path::Path, sync::Arc};

use anyhow::Result;
use serde::Deserialize;

use super::{EXIT_BAD_INPUT, FORMAT, OLDEST_SCHEMA_VERSION, SCHEMA_VERSION};
use crate::{
    error::UserError,
    profile::{
        groups::GroupTotals, Counts, Frame, GoHeap, LiveStats, LiveTotals, Losses, Meta,
        ProcessRef, Profile, Snapshot, StackEntry, StackQuality, Thread, Timeline, Totals, Unseen,
    },
};

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
pub(super) fn indexes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Box<[u32]>, D::Error> {
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
            .filter(|e| crate::profile::is_allocation(e) && crate::profile::is_go_heap(e) == go)
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
