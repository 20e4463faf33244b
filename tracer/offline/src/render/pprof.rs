//! The pprof format (`profile.proto` of github.com/google/pprof), gzipped,
//! as read by `go tool pprof`, Pyroscope and Parca.
//!
//! Every allocation stack becomes one sample with two values,
//! `alloc_objects/count` (calls) and `alloc_space/bytes` (requested bytes).
//! Its locations are, leaf first: the allocator function itself, then one
//! location per machine address of the stack, innermost first. Frames that
//! share an address (inlined functions and the function they were inlined
//! into) become one location with several lines, the innermost inlined
//! function first and its caller last, as `profile.proto` specifies.
//!
//! Functions are shared by name and source file, locations by mapping,
//! address and lines, and there is one mapping per object file.

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use anyhow::{Context, Result};
use flate2::{write::GzEncoder, Compression};
use prost::Message as _;

use crate::profile::{
    is_go_heap, short_path, FileMapping, Frame, Profile, StackEntry, ENTRY_POINT,
};

use super::{is_allocation, text};

/// The messages of `profile.proto` (package `perftools.profiles`), with
/// the official field numbers and types.
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        /// `string_table[0]` must be "".
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "7")]
        pub drop_frames: i64,
        #[prost(int64, tag = "8")]
        pub keep_frames: i64,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        /// Leaf first.
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
        #[prost(int64, tag = "3")]
        pub num: i64,
        #[prost(int64, tag = "4")]
        pub num_unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub memory_start: u64,
        #[prost(uint64, tag = "3")]
        pub memory_limit: u64,
        #[prost(uint64, tag = "4")]
        pub file_offset: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
        #[prost(int64, tag = "6")]
        pub build_id: i64,
        #[prost(bool, tag = "7")]
        pub has_functions: bool,
        #[prost(bool, tag = "8")]
        pub has_filenames: bool,
        #[prost(bool, tag = "9")]
        pub has_line_numbers: bool,
        #[prost(bool, tag = "10")]
        pub has_inline_frames: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
        /// Innermost inlined function first, the function it was inlined
        /// into last.
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
        #[prost(bool, tag = "5")]
        pub is_folded: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
        #[prost(int64, tag = "4")]
        pub filename: i64,
        #[prost(int64, tag = "5")]
        pub start_line: i64,
    }
}

/// Renders every allocation stack of `profile` as a gzipped pprof profile.
/// `free` entries are left out.
pub fn render(profile: &Profile) -> Result<Vec<u8>> {
    let message = build(profile)?;
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(&message.encode_to_vec())?;
    Ok(gz.finish()?)
}

/// Renders `profile` as Go's heap profiles read (`/debug/pprof/allocs`
/// and `/debug/pprof/heap` of a Go program, which Parca and Grafana
/// Alloy scrape): the samples of [`render`], plus the period (`space`,
/// in bytes: 1 for an exact trace, the mean bytes between samples for a
/// sampled one), each sample's mean request size as its numeric `bytes`
/// label, its process as `pid` and `comm` labels, and `default_type`
/// (`alloc_space`, `inuse_space`) shown first.
pub fn render_go_heap(profile: &Profile, default_type: &str) -> Result<Vec<u8>> {
    let mut message = build(profile)?;
    let mut b = Builder::resume(std::mem::take(&mut message.string_table));
    message.period_type = Some(proto::ValueType {
        r#type: b.string("space"),
        unit: b.string("bytes"),
    });
    message.period = match &profile.meta.sampling {
        Some(s) if s.kind == "bytes" => value(s.rate),
        _ => 1,
    };
    message.default_sample_type = b.string(default_type);
    if let Some(w) = &profile.meta.windows {
        let line = text::windows_line(w, profile.meta.duration_secs);
        message.comment.push(b.string(&line));
    }
    let entries = profile.stacks.iter().filter(|e| is_allocation(e));
    for (sample, entry) in message.sample.iter_mut().zip(entries) {
        // A Go heap row has its objects' size labelled already, exactly.
        let mean = match entry.object_size {
            Some(_) => None,
            None => entry.counts.bytes.checked_div(entry.counts.calls),
        };
        if let Some(mean) = mean {
            sample.label.push(proto::Label {
                key: b.string("bytes"),
                num: value(mean),
                num_unit: b.string("bytes"),
                ..Default::default()
            });
        }
        if let Some(p) = &entry.process {
            sample.label.push(proto::Label {
                key: b.string("pid"),
                num: i64::from(p.pid),
                ..Default::default()
            });
            sample.label.push(proto::Label {
                key: b.string("comm"),
                str: b.string(&p.name),
                ..Default::default()
            });
        }
    }
    message.string_table = b.strings;
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(&message.encode_to_vec())?;
    Ok(gz.finish()?)
}

/// The (uncompressed) profile message.
fn build(profile: &Profile) -> Result<proto::Profile> {
    let meta = &profile.meta;
    let mut b = Builder::new();
    b.add_mappings(profile);

    let mut sample_type = vec![
        proto::ValueType {
            r#type: b.string("alloc_objects"),
            unit: b.string("count"),
        },
        proto::ValueType {
            r#type: b.string("alloc_space"),
            unit: b.string("bytes"),
        },
    ];
    // Live mode: what was still allocated when tracing ended, as
    // go tool pprof's heap profiles name it; a Go program's own heap has
    // it too (malloc's rows hold 0 there outside live mode).
    let with_inuse = profile.live.is_some() || profile.stacks.iter().any(|e| e.in_use.is_some());
    if with_inuse {
        sample_type.push(proto::ValueType {
            r#type: b.string("inuse_objects"),
            unit: b.string("count"),
        });
        sample_type.push(proto::ValueType {
            r#type: b.string("inuse_space"),
            unit: b.string("bytes"),
        });
    }
    let default_sample_type = b.string(if profile.live.is_some() {
        "inuse_space"
    } else {
        "alloc_space"
    });

    let samples: Vec<proto::Sample> = profile
        .stacks
        .iter()
        .filter(|e| is_allocation(e))
        .map(|e| b.sample(e, &meta.allocator_object, with_inuse))
        .collect();

    let version = if meta.mtrace_version.is_empty() {
        env!("CARGO_PKG_VERSION")
    } else {
        &meta.mtrace_version
    };
    let mut comment = vec![b.string(&format!(
        "mtrace {version}, pid {}: {}",
        meta.pid, meta.command
    ))];
    if let Some(q) = &profile.stack_quality {
        comment.push(b.string(&text::quality_line(q)));
    }
    for g in &profile.go_heaps {
        comment.push(b.string(&format!(
            "go heap: pid {} ({}), {}: its runtime's sampled profile, one sample per {} bytes, scaled as Go scales it",
            g.pid, g.name, g.version, g.rate
        )));
    }

    Ok(proto::Profile {
        sample_type,
        sample: samples,
        mapping: b.mappings,
        location: b.locations,
        function: b.functions,
        string_table: b.strings,
        time_nanos: time_nanos(&meta.start_time)?,
        duration_nanos: duration_nanos(meta.duration_secs),
        comment,
        default_sample_type,
        ..Default::default()
    })
}

/// Nanoseconds since the epoch of an RFC 3339 time; 0 when there is none.
fn time_nanos(start_time: &str) -> Result<i64> {
    if start_time.is_empty() {
        return Ok(0);
    }
    let time = humantime::parse_rfc3339(start_time)
        .with_context(|| format!("bad start time {start_time:?} in the profile"))?;
    let since_epoch = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    Ok(i64::try_from(since_epoch.as_nanos()).unwrap_or(i64::MAX))
}

fn duration_nanos(secs: f64) -> i64 {
    if secs.is_finite() && secs > 0.0 {
        // `as` saturates.
        (secs * 1e9).round() as i64
    } else {
        0
    }
}

/// A count as a pprof value.
fn value(count: u64) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

/// Whether the symbolizer found a name for `frame` (it writes `[unknown]`
/// or `module+0xoffset` otherwise).
fn has_function(frame: &Frame) -> bool {
    !frame.function.is_empty()
        && !frame.function.starts_with('[')
        && !frame.function.contains("+0x")
}

/// Whether `frame` is named only as its file's entry point (`_start`,
/// from the ELF header where no symbol names it, or from a symbol): that
/// name alone does not make a file's mapping symbolized, so a backend
/// still symbolizes the mapping of a stripped program.
fn is_entry_point(frame: &Frame) -> bool {
    frame.function == ENTRY_POINT && frame.file.is_none()
}

/// Splits a stack (innermost first) into the frames of each machine
/// address: inlined frames followed by the frame they were inlined into,
/// all with the same address.
fn group_by_address(frames: &[Arc<Frame>]) -> Vec<&[Arc<Frame>]> {
    let mut groups = Vec::new();
    let mut start = 0;
    for (i, frame) in frames.iter().enumerate() {
        let continues = frame.inlined
            && frames
                .get(i + 1)
                .is_some_and(|next| next.addr == frame.addr);
        if !continues {
            groups.push(&frames[start..=i]);
            start = i + 1;
        }
    }
    groups
}

type LocationKey = (u64, u64, Vec<(u64, i64)>);

/// A mapping's file, and where the target mapped that part of it when the
/// target's mappings were kept.
type MappingKey = (String, Option<FileMapping>);

/// Interns strings, mappings, functions and locations; ids are indices + 1.
struct Builder {
    strings: Vec<String>,
    string_ids: HashMap<String, i64>,
    mappings: Vec<proto::Mapping>,
    mapping_ids: HashMap<MappingKey, u64>,
    functions: Vec<proto::Function>,
    function_ids: HashMap<(String, Option<String>), u64>,
    locations: Vec<proto::Location>,
    location_ids: HashMap<LocationKey, u64>,
}

impl Builder {
    fn new() -> Self {
        let mut b = Builder {
            strings: Vec::new(),
            string_ids: HashMap::new(),
            mappings: Vec::new(),
            mapping_ids: HashMap::new(),
            functions: Vec::new(),
            function_ids: HashMap::new(),
            locations: Vec::new(),
            location_ids: HashMap::new(),
        };
        b.string(""); // string_table[0] must be "".
        b
    }

    /// A builder that goes on adding strings to `strings` (a built
    /// profile's table), for fields set after [`build`].
    fn resume(strings: Vec<String>) -> Self {
        let string_ids = strings
            .iter()
            .enumerate()
            .map(|(i, s)| (s.clone(), i as i64))
            .collect();
        Builder {
            strings,
            string_ids,
            ..Builder::new()
        }
    }

    fn string(&mut self, s: &str) -> i64 {
        if let Some(&id) = self.string_ids.get(s) {
            return id;
        }
        let id = self.strings.len() as i64;
        self.strings.push(s.to_string());
        self.string_ids.insert(s.to_string(), id);
        id
    }

    /// One mapping per part of a file a target mapped (one line of its
    /// `/proc/PID/maps`: bounds, file offset and path), with what the
    /// frames in it tell: the file's build id, and whether functions, file
    /// names, line numbers and inlined frames were resolved there. The
    /// mappings of the stacks' outermost frames come first, and among them
    /// those of the file named like the command's program, since pprof
    /// takes `mapping[0]` for the main binary.
    ///
    /// Frames whose target's mappings were not kept (a caller the host
    /// scope found by file offset, a profile written before mappings were
    /// kept, a Go heap row's frames) share one mapping per path with
    /// memory_start, memory_limit and file_offset 0: an address in it is
    /// an offset in its file (see [`Builder::frames_location`]).
    fn add_mappings(&mut self, profile: &Profile) {
        let mut order: Vec<MappingKey> = Vec::new();
        let mut infos: HashMap<MappingKey, proto::Mapping> = HashMap::new();
        let mut build_ids: HashMap<MappingKey, &str> = HashMap::new();
        let stacks = profile.stacks.iter().filter(|e| is_allocation(e));
        for frame in stacks.flat_map(|e| e.frames.iter().rev()) {
            let Some(module) = frame.module.as_deref() else {
                continue;
            };
            let key = (module.to_string(), frame.mapping);
            let info = infos.entry(key.clone()).or_insert_with(|| {
                order.push(key.clone());
                proto::Mapping::default()
            });
            info.has_functions |= has_function(frame) && !is_entry_point(frame);
            info.has_filenames |= frame.file.is_some();
            info.has_line_numbers |= frame.line.is_some();
            info.has_inline_frames |= frame.inlined;
            if let Some(id) = frame.build_id.as_deref() {
                build_ids.entry(key).or_insert(id);
            }
        }
        let allocator = profile.meta.allocator_object.as_str();
        if !allocator.is_empty() {
            // The allocator functions' own locations are named.
            let key = (allocator.to_string(), None);
            infos
                .entry(key.clone())
                .or_insert_with(|| {
                    order.push(key);
                    proto::Mapping::default()
                })
                .has_functions = true;
        }

        let program = profile
            .meta
            .command
            .split_whitespace()
            .next()
            .map(short_path);
        let (mut first, rest): (Vec<MappingKey>, Vec<MappingKey>) = order
            .into_iter()
            .partition(|(m, _)| Some(short_path(m)) == program);
        first.extend(rest);

        for key in first {
            let id = self.mappings.len() as u64 + 1;
            let info = &infos[&key];
            let place = key.1.unwrap_or_default();
            let mapping = proto::Mapping {
                id,
                memory_start: place.start,
                memory_limit: place.limit,
                file_offset: place.offset,
                filename: self.string(&key.0),
                build_id: build_ids.get(&key).map_or(0, |b| self.string(b)),
                ..info.clone()
            };
            self.mappings.push(mapping);
            self.mapping_ids.insert(key, id);
        }
    }

    fn mapping_id(&self, module: Option<&str>, place: Option<FileMapping>) -> u64 {
        module
            .and_then(|m| self.mapping_ids.get(&(m.to_string(), place)))
            .copied()
            .unwrap_or(0)
    }

    fn function(&mut self, name: &str, file: Option<&str>) -> u64 {
        let key = (name.to_string(), file.map(str::to_string));
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let name = self.string(name);
        let filename = file.map_or(0, |f| self.string(f));
        self.functions.push(proto::Function {
            id,
            name,
            system_name: name,
            filename,
            start_line: 0,
        });
        self.function_ids.insert(key, id);
        id
    }

    /// The location of `lines` at `address` in `mapping_id`. Locations are
    /// keyed by their lines too, not only by mapping and address: the
    /// allocator functions all sit at address 0 of the allocator's mapping,
    /// and frames with no known address all have address 0.
    fn location(&mut self, mapping_id: u64, address: u64, lines: Vec<proto::Line>) -> u64 {
        let key: LocationKey = (
            mapping_id,
            address,
            lines.iter().map(|l| (l.function_id, l.line)).collect(),
        );
        if let Some(&id) = self.location_ids.get(&key) {
            return id;
        }
        let id = self.locations.len() as u64 + 1;
        self.locations.push(proto::Location {
            id,
            mapping_id,
            address,
            line: lines,
            is_folded: false,
        });
        self.location_ids.insert(key, id);
        id
    }

    /// The location of the frames of one machine address (innermost first).
    fn frames_location(&mut self, group: &[Arc<Frame>]) -> u64 {
        let outer = &group[group.len() - 1];
        let mapping_id = self.mapping_id(outer.module.as_deref(), outer.mapping);
        // In a mapping of the target's, the address is the target's, so
        // that `address - memory_start + file_offset` is its offset in the
        // file, as a backend symbolizing by build id computes it. In a
        // mapping of a path alone (memory_start = file_offset = 0) the
        // address is the offset in the file where it is known, which is
        // the same arithmetic; without either, the address in the target
        // is the best there is.
        let address = match outer.mapping {
            Some(_) => outer.addr,
            None => group
                .iter()
                .find_map(|f| f.file_offset)
                .unwrap_or(outer.addr),
        };
        let lines = group
            .iter()
            .map(|f| proto::Line {
                function_id: self.function(&f.function, f.file.as_deref()),
                line: f.line.map_or(0, i64::from),
            })
            .collect();
        self.location(mapping_id, address, lines)
    }

    fn sample(
        &mut self,
        entry: &StackEntry,
        allocator_object: &str,
        with_inuse: bool,
    ) -> proto::Sample {
        let mut location_id = Vec::with_capacity(entry.frames.len() + 1);
        // A Go heap row's leaf is the Go code that allocated, as in Go's
        // own heap profile; its samples carry `allocator: go heap`.
        if !is_go_heap(entry) {
            let allocator_mapping = self.mapping_id(Some(allocator_object), None);
            let allocator = proto::Line {
                function_id: self.function(&entry.func, None),
                line: 0,
            };
            location_id.push(self.location(allocator_mapping, 0, vec![allocator]));
        }
        for group in group_by_address(&entry.frames) {
            location_id.push(self.frames_location(group));
        }

        let mut label = Vec::new();
        if is_go_heap(entry) {
            label.push(proto::Label {
                key: self.string("allocator"),
                str: self.string(&entry.func),
                ..Default::default()
            });
        }
        // Each object's size, as Go's own heap profile labels it.
        if let Some(size) = entry.object_size {
            label.push(proto::Label {
                key: self.string("bytes"),
                num: value(size),
                ..Default::default()
            });
        }
        if let Some(thread) = &entry.thread {
            label.push(proto::Label {
                key: self.string("thread_id"),
                num: i64::from(thread.tid),
                ..Default::default()
            });
            label.push(proto::Label {
                key: self.string("thread_name"),
                str: self.string(&thread.name),
                ..Default::default()
            });
        }
        let mut values = vec![value(entry.counts.calls), value(entry.counts.bytes)];
        if with_inuse {
            let (objects, bytes) = match (&entry.live, entry.in_use) {
                (Some(l), _) => (l.outstanding, l.outstanding_bytes),
                (None, Some(u)) => (u.calls, u.bytes),
                (None, None) => (0, 0),
            };
            values.push(value(objects));
            values.push(value(bytes));
        }
        proto::Sample {
            location_id,
            value: values,
            label,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashSet};
    use std::io::Read as _;
    use std::path::Path;
    use std::process::{Command, Stdio};

    use prost::Message as _;

    use super::super::test_util::{entry, on_thread, profile};
    use super::*;
    use crate::profile::Counts;

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
}
