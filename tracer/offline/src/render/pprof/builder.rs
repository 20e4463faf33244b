//! The builder of a pprof message: strings, mappings, functions and
//! locations interned once each, and one sample per allocation stack.

use std::collections::HashMap;
use std::sync::Arc;

use super::proto;
use crate::profile::{
    is_go_heap, short_path, FileMapping, Frame, Profile, StackEntry, ENTRY_POINT,
};
use crate::render::is_allocation;

/// A count as a pprof value.
pub(super) fn value(count: u64) -> i64 {
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
pub(super) struct Builder {
    pub(super) strings: Vec<String>,
    string_ids: HashMap<String, i64>,
    pub(super) mappings: Vec<proto::Mapping>,
    mapping_ids: HashMap<MappingKey, u64>,
    pub(super) functions: Vec<proto::Function>,
    function_ids: HashMap<(String, Option<String>), u64>,
    pub(super) locations: Vec<proto::Location>,
    location_ids: HashMap<LocationKey, u64>,
}

impl Builder {
    pub(super) fn new() -> Self {
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
    pub(super) fn resume(strings: Vec<String>) -> Self {
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

    pub(super) fn string(&mut self, s: &str) -> i64 {
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
    pub(super) fn add_mappings(&mut self, profile: &Profile) {
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

    pub(super) fn mapping_id(&self, module: Option<&str>, place: Option<FileMapping>) -> u64 {
        module
            .and_then(|m| self.mapping_ids.get(&(m.to_string(), place)))
            .copied()
            .unwrap_or(0)
    }

    pub(super) fn function(&mut self, name: &str, file: Option<&str>) -> u64 {
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
    pub(super) fn location(
        &mut self,
        mapping_id: u64,
        address: u64,
        lines: Vec<proto::Line>,
    ) -> u64 {
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
    pub(super) fn frames_location(&mut self, group: &[Arc<Frame>]) -> u64 {
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

    pub(super) fn sample(
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
