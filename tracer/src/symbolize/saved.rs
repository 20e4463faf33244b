//! A saved profile's frames that name no function (`prog+0x1a2b`), named
//! when `mtrace report` reads the profile, as a trace names them: by the
//! frame's build id and file offset, in the debug file that the debug
//! directories, the debuginfod cache or a `DEBUGINFOD_URLS` server hold
//! for that build id ([`debuginfo`]). A profile recorded where no debug
//! information could be reached shows names where it is reported.

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    path::Path,
    sync::Arc,
};

use super::{debuginfo, in_debug_file};
use crate::profile::{short_path, FileMapping, Frame, Profile, StackEntry, SymbolsQuality};

/// The page size of the machines mtrace traces (x86-64): a mapping of a
/// file starts at a page boundary of the file and of the address space.
const PAGE: u64 = 4096;

/// Names what can be named of `profile`'s frames that name no function
/// and carry a build id and a file offset, and counts the lookups on the
/// profile's `symbols` line: the build ids whose debug information was
/// found here or fetched, and those still missing.
pub fn name_saved(profile: &mut Profile) {
    // Each distinct unnamed frame once, by the build id of its file. The
    // originals are kept alive to the end: their addresses key `named`.
    let mut by_id: HashMap<String, Vec<Arc<Frame>>> = HashMap::new();
    let mut seen: HashSet<*const Frame> = HashSet::new();
    for f in stacks(profile).flat_map(|st| &st.frames) {
        if let (true, Some(id)) = (unnamed(f), &f.build_id) {
            if seen.insert(Arc::as_ptr(f)) {
                by_id.entry(id.clone()).or_default().push(f.clone());
            }
        }
    }
    if by_id.is_empty() {
        return;
    }
    let mut named: HashMap<*const Frame, Vec<Arc<Frame>>> = HashMap::new();
    for (id, frames) in &by_id {
        let Some(debug) = debuginfo::debug_file(id) else {
            continue;
        };
        let place = Placing::of(id, &debug, frames[0].module.as_deref());
        let (asked, addrs): (Vec<&Arc<Frame>>, Vec<u64>) = frames
            .iter()
            .filter_map(|f| place.address(f).map(|a| (f, a)))
            .unzip();
        let found = in_debug_file(&debug, &addrs);
        for (f, found) in asked.into_iter().zip(found) {
            let Some(new) = found else { continue };
            let located = new
                .into_iter()
                .map(|n| {
                    Arc::new(Frame {
                        module: f.module.clone(),
                        build_id: f.build_id.clone(),
                        file_offset: f.file_offset,
                        addr: f.addr,
                        mapping: f.mapping,
                        ..n
                    })
                })
                .collect();
            named.insert(Arc::as_ptr(f), located);
        }
    }
    for st in stacks_mut(profile) {
        if st
            .frames
            .iter()
            .any(|f| named.contains_key(&Arc::as_ptr(f)))
        {
            st.frames = st
                .frames
                .iter()
                .flat_map(|f| {
                    named
                        .get(&Arc::as_ptr(f))
                        .cloned()
                        .unwrap_or_else(|| vec![f.clone()])
                })
                .collect();
        }
    }
    drop(by_id);
    let quality = profile.stack_quality.get_or_insert_with(Default::default);
    let now = debuginfo::quality().unwrap_or_default();
    quality.symbols = Some(after_report(quality.symbols, now));
}

/// The `symbols` counts of a profile whose unnamed frames' build ids were
/// looked up again (`now`): those the trace found stay found, those found
/// now are added, and the missing ones are those still missing now. Every
/// build id looked up now was one the trace left unnamed.
fn after_report(saved: Option<SymbolsQuality>, now: SymbolsQuality) -> SymbolsQuality {
    let saved = saved.unwrap_or_default();
    let local = saved.local + now.local;
    let fetched = saved.fetched + now.fetched;
    let missing = now.not_on_servers + now.not_fetched;
    SymbolsQuality {
        stripped_files: saved.stripped_files.max(local + fetched + missing),
        local,
        fetched,
        not_on_servers: now.not_on_servers,
        not_fetched: now.not_fetched,
    }
}

/// Whether `frame` names no function: its name is its file's and offset
/// (`prog+0x1a2b`, as a trace writes a frame nothing named), or empty.
fn unnamed(frame: &Frame) -> bool {
    if frame.build_id.is_none() || frame.file_offset.is_none() {
        return false;
    }
    let offset_name = || {
        let module = frame.module.as_deref()?;
        let hex = frame
            .function
            .strip_prefix(short_path(module))?
            .strip_prefix("+0x")?;
        Some(!hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    frame.function.is_empty() || offset_name() == Some(true)
}

/// How a file offset of the traced file becomes an address of its debug
/// file.
enum Placing {
    /// By the traced file's own program headers, the file being at hand
    /// (its path in the profile names a file of the same build id).
    File(debuginfo::Split),
    /// By the debug file's program headers, which keep each segment's
    /// addresses but not its place in the traced file, and the target's
    /// mapping the frame was in: `(address, size in memory)` of each
    /// executable segment.
    Mapped(Vec<(u64, u64)>),
}

impl Placing {
    fn of(id: &str, debug: &Path, module: Option<&str>) -> Placing {
        let split = module
            .and_then(|m| File::open(m).ok())
            .and_then(|f| debuginfo::split_of(&f, id, debug.to_path_buf()));
        match split {
            Some(s) => Placing::File(s),
            None => Placing::Mapped(executable_segments(debug)),
        }
    }

    /// The address in the debug file of the call `frame` returns to (the
    /// byte before its return address, as a trace looks it up).
    fn address(&self, frame: &Frame) -> Option<u64> {
        let offset = frame.file_offset?.checked_sub(1)?;
        match self {
            Placing::File(split) => Some(split.virtual_address(offset)),
            Placing::Mapped(segments) => in_segment(segments, frame.mapping?, offset),
        }
    }
}

/// The address of file offset `offset`, in the mapping `m` of a segment
/// among `segments` (executable segments' `(address, size in memory)`).
/// A segment is mapped from the page that holds its first byte, so the
/// mapping's start is that page's address: the address is `offset -
/// m.offset + page of the segment's start`. The segment is the one that
/// address falls in; where several would, the one the mapping's length
/// fits; where that leaves more than one, none is guessed.
fn in_segment(segments: &[(u64, u64)], m: FileMapping, offset: u64) -> Option<u64> {
    let within = offset.checked_sub(m.offset)?;
    let fitting: Vec<(u64, u64, u64)> = segments
        .iter()
        .filter_map(|&(addr, size)| Some((addr, size, (addr & !(PAGE - 1)).checked_add(within)?)))
        .filter(|&(addr, size, at)| at >= addr && at - addr < size)
        .collect();
    let chosen: Vec<u64> = if fitting.len() > 1 {
        fitting
            .iter()
            .filter(|&&(addr, size, _)| {
                let end = addr.saturating_add(size).div_ceil(PAGE) * PAGE;
                Some(end - (addr & !(PAGE - 1))) == m.limit.checked_sub(m.start)
            })
            .map(|&(_, _, at)| at)
            .collect()
    } else {
        fitting.iter().map(|&(_, _, at)| at).collect()
    };
    match chosen[..] {
        [at] => Some(at),
        _ => None,
    }
}

/// `(address, size in memory)` of each executable loaded segment of the
/// ELF file at `path`.
fn executable_segments(path: &Path) -> Vec<(u64, u64)> {
    use object::{elf::PF_X, Object, ObjectSegment, SegmentFlags};
    let Ok(file) = File::open(path) else {
        return Vec::new();
    };
    let cache = object::read::ReadCache::new(&file);
    let Ok(obj) = object::File::parse(&cache) else {
        return Vec::new();
    };
    obj.segments()
        .filter(|s| matches!(s.flags(), SegmentFlags::Elf { p_flags } if p_flags & PF_X != 0))
        .map(|s| (s.address(), s.size()))
        .collect()
}

/// Every stack of `profile`: its stacks and its snapshot's.
fn stacks(profile: &Profile) -> impl Iterator<Item = &StackEntry> {
    profile
        .stacks
        .iter()
        .chain(profile.snapshot.iter().flat_map(|s| &s.delta_stacks))
}

fn stacks_mut(profile: &mut Profile) -> impl Iterator<Item = &mut StackEntry> {
    profile.stacks.iter_mut().chain(
        profile
            .snapshot
            .iter_mut()
            .flat_map(|s| &mut s.delta_stacks),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout `gcc` and `ld` give a small program: the code segment
    /// at 0x1000 (file offset 0x1000), mapped from offset 0x1000 for one
    /// page; a frame at file offset 0x1139 is at address 0x1139.
    #[test]
    fn a_file_offset_is_placed_in_the_segment_its_mapping_holds() {
        let code = [(0x1000, 0x159)];
        let m = FileMapping {
            start: 0x5555_5555_5000,
            limit: 0x5555_5555_6000,
            offset: 0x1000,
        };
        assert_eq!(in_segment(&code, m, 0x1139), Some(0x1139));
        // A segment placed at another address than its offset.
        let code = [(0x401000, 0x2000)];
        let m = FileMapping {
            start: 0x401000,
            limit: 0x403000,
            offset: 0x1000,
        };
        assert_eq!(in_segment(&code, m, 0x1a2b), Some(0x401a2b));
        // Before the mapping, or past every segment: no address.
        assert_eq!(in_segment(&code, m, 0xfff), None);
        assert_eq!(in_segment(&code, m, 0x4000), None);
        // Two segments the offset would fall in: the mapping's length
        // tells them apart.
        let two = [(0x1000, 0x800), (0x201000, 0x2000)];
        let m = FileMapping {
            start: 0x7000_0000,
            limit: 0x7000_2000,
            offset: 0x3000,
        };
        assert_eq!(in_segment(&two, m, 0x3010), Some(0x201010));
    }

    #[test]
    fn only_frames_named_by_their_offset_are_unnamed() {
        let frame = |function: &str| Frame {
            function: function.into(),
            module: Some("/usr/bin/gawk".into()),
            build_id: Some("ab12".into()),
            file_offset: Some(0x65e5d),
            ..Frame::default()
        };
        assert!(unnamed(&frame("gawk+0x65e5d")));
        assert!(unnamed(&frame("")));
        assert!(!unnamed(&frame("main")));
        assert!(!unnamed(&frame("gawk+0x")));
        assert!(!unnamed(&frame("gawk+main")));
        assert!(!unnamed(&Frame {
            build_id: None,
            ..frame("gawk+0x65e5d")
        }));
    }
}
