//! Turning a [`RawProfile`] (addresses) into a [`Profile`] (functions, files,
//! lines) with blazesym.
//!
//! The target may be gone by the time we symbolize, so [`AddressSpace`]
//! keeps, while it lives, a copy of its mappings and an open descriptor to
//! every file it maps. Addresses are turned into file offsets with those
//! mappings and symbolized in the files through `/proc/self/fd/N`, which
//! also works for deleted files and other mount namespaces.

use std::{
    collections::{BTreeMap, HashMap},
    fs::File,
    os::fd::AsRawFd,
};

use blazesym::symbolize::{
    source::{Elf, Source},
    Input, Symbolized, Symbolizer,
};

use crate::{
    profile::{Frame, Meta, Profile, StackEntry, Thread, Totals},
    raw_profile::RawProfile,
    target::{read_maps, Mapping},
};

/// The target's mappings as last seen, and the files behind them.
#[derive(Default)]
pub struct AddressSpace {
    /// Every file mapping ever seen, newest last.
    mappings: Vec<Mapping>,
    /// Open file per mapped path.
    files: HashMap<String, File>,
    /// GNU build id (hex) per mapped path, where the file has one.
    build_ids: HashMap<String, String>,
}

impl AddressSpace {
    pub fn new() -> Self {
        Self::default()
    }

    /// Re-reads /proc/PID/maps and opens files not seen before. Returns
    /// false when the process's maps could not be read (it has exited).
    pub fn refresh(&mut self, pid: u32) -> bool {
        let Ok(maps) = read_maps(pid) else {
            return false;
        };
        if maps.is_empty() {
            return false;
        }
        for m in maps.into_iter().filter(|m| m.is_file()) {
            if !self.files.contains_key(&m.path) {
                // map_files reaches the very file mapped (even deleted or in
                // another mount namespace); the root path is the fallback.
                let by_range = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end);
                let file = File::open(&by_range)
                    .or_else(|_| File::open(crate::target::path_in_target(pid, &m.path)));
                if let Ok(f) = file {
                    if let Some(id) = build_id(&f) {
                        self.build_ids.insert(m.path.clone(), id);
                    }
                    self.files.insert(m.path.clone(), f);
                }
            }
            // The same file under a new name (` (deleted)` once removed)
            // that could not be opened any more: keep the mapping known
            // under the old name, whose file is open.
            let same_file_known = !self.files.contains_key(&m.path)
                && self.mappings.iter().any(|k| {
                    k.start == m.start
                        && k.end == m.end
                        && k.offset == m.offset
                        && k.inode == m.inode
                        && self.files.contains_key(&k.path)
                });
            if !same_file_known && !self.mappings.contains(&m) {
                self.mappings.push(m);
            }
        }
        true
    }

    fn mapping(&self, addr: u64) -> Option<&Mapping> {
        self.mappings.iter().rev().find(|m| m.contains(addr))
    }

    /// Fills in where a frame's address lies: object file offset and build id.
    fn locate(&self, frame: &mut Frame) {
        if let Some(m) = self.mapping(frame.addr) {
            frame.file_offset = Some(m.file_offset(frame.addr));
            frame.build_id = self.build_ids.get(&m.path).cloned();
        }
    }
}

/// The GNU build id of an ELF file, read lazily (only the note is read).
fn build_id(file: &File) -> Option<String> {
    use object::Object;
    let cache = object::read::ReadCache::new(file);
    let obj = object::File::parse(&cache).ok()?;
    let id = obj.build_id().ok()??;
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
}

pub fn symbolize(
    raw: &RawProfile,
    space: &AddressSpace,
    func_names: &[String],
    thread_names: &BTreeMap<u32, String>,
    meta: Meta,
) -> Profile {
    // Group every distinct address by the file it falls in.
    let mut by_file: HashMap<&str, Vec<u64>> = HashMap::new();
    for st in &raw.stacks {
        for &addr in &st.addrs {
            if let Some(m) = space.mapping(addr) {
                by_file.entry(m.path.as_str()).or_default().push(addr);
            }
        }
    }
    let symbolizer = Symbolizer::builder()
        .enable_code_info(true)
        .enable_inlined_fns(true)
        .enable_demangling(true)
        .build();
    let mut resolved: HashMap<u64, Vec<Frame>> = HashMap::new();
    for (path, mut addrs) in by_file {
        addrs.sort_unstable();
        addrs.dedup();
        // Return addresses point after the call: look up the call itself.
        let offsets: Vec<u64> = addrs
            .iter()
            .map(|&a| space.mapping(a).unwrap().file_offset(a).saturating_sub(1))
            .collect();
        let results = space.files.get(path).and_then(|f| {
            let src = Source::Elf(Elf::new(format!("/proc/self/fd/{}", f.as_raw_fd())));
            symbolizer.symbolize(&src, Input::FileOffset(&offsets)).ok()
        });
        for (i, &addr) in addrs.iter().enumerate() {
            let frames = match results.as_ref().and_then(|r| r.get(i)) {
                Some(Symbolized::Sym(sym)) => sym_frames(sym, path, addr),
                _ => vec![unknown_frame(Some(path), addr, offsets[i] + 1)],
            };
            resolved.insert(addr, frames);
        }
    }

    let mut stacks = Vec::new();
    for st in &raw.stacks {
        let mut frames = Vec::new();
        for &addr in &st.addrs {
            match resolved.get(&addr) {
                Some(f) => frames.extend(f.iter().cloned()),
                None => frames.push(unknown_frame(None, addr, addr)),
            }
        }
        for frame in &mut frames {
            space.locate(frame);
        }
        stacks.push(StackEntry {
            func: func_name(func_names, st.func),
            frames,
            truncated: st.truncated,
            thread: st.tid.map(|tid| Thread {
                tid,
                name: thread_names
                    .get(&tid)
                    .or_else(|| raw.thread_names.get(&tid))
                    .cloned()
                    .unwrap_or_else(|| "?".into()),
            }),
            counts: st.counts,
            live: st.live.clone(),
        });
    }

    let mut totals = Totals {
        nested: raw.nested,
        ..Totals::default()
    };
    for (f, counts) in raw.per_func.iter().enumerate() {
        if counts.calls == 0 {
            continue;
        }
        let name = func_name(func_names, f as u32);
        if f == tracer_common::AllocFn::Free as usize {
            totals.frees += counts.calls;
        } else {
            totals.allocs.add(*counts);
        }
        totals.per_func.entry(name).or_default().add(*counts);
    }
    Profile {
        meta,
        stacks,
        totals,
        losses: raw.losses,
        live: raw.live.clone(),
        snapshot: None,
    }
}

fn func_name(names: &[String], func: u32) -> String {
    names
        .get(func as usize)
        .cloned()
        .unwrap_or_else(|| format!("func{func}"))
}

/// Frames of one symbolized address, innermost (deepest inlined) first.
fn sym_frames(sym: &blazesym::symbolize::Sym, module: &str, addr: u64) -> Vec<Frame> {
    let loc = |ci: Option<&blazesym::symbolize::CodeInfo>| {
        ci.map(|c| {
            let path = c.to_path();
            (Some(path.display().to_string()), c.line)
        })
        .unwrap_or((None, None))
    };
    let mut frames = Vec::new();
    for inl in sym.inlined.iter().rev() {
        let (file, line) = loc(inl.code_info.as_ref());
        frames.push(Frame {
            function: inl.name.to_string(),
            file,
            line,
            module: Some(module.to_string()),
            addr,
            inlined: true,
            ..Frame::default()
        });
    }
    let (file, line) = loc(sym.code_info.as_deref());
    frames.push(Frame {
        function: sym.name.to_string(),
        file,
        line,
        module: Some(module.to_string()),
        addr,
        inlined: false,
        ..Frame::default()
    });
    frames
}

fn unknown_frame(module: Option<&str>, addr: u64, offset: u64) -> Frame {
    let function = match module {
        Some(m) => format!("{}+{:#x}", crate::profile::short_path(m), offset),
        None => format!("[unknown {addr:#x}]"),
    };
    Frame {
        function,
        file: None,
        line: None,
        module: module.map(str::to_string),
        addr,
        inlined: false,
        ..Frame::default()
    }
}
