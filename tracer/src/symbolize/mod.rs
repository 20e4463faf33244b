//! Turning a [`RawProfile`] (addresses) into a [`Profile`] (functions, files,
//! lines) with blazesym.
//!
//! The target may be gone by the time we symbolize, so the
//! [`AddressSpace`] (filled by the target stage while it lives) keeps a
//! copy of its mappings and an open descriptor to every file it maps.
//! Addresses are turned into file offsets with those
//! mappings and symbolized in the files through `/proc/self/fd/N`, which
//! also works for deleted files and other mount namespaces.

use std::{
    collections::{BTreeMap, HashMap},
    os::fd::AsRawFd,
    sync::Arc,
};

use blazesym::symbolize::{
    source::{Elf, Source},
    Input, Symbolized, Symbolizer,
};

mod debuginfo;

/// Debug information found for the run's stripped files so far (`None`
/// when no stripped file was met).
pub fn symbols_quality() -> Option<crate::profile::SymbolsQuality> {
    debuginfo::quality()
}
mod entry;
mod parsed;
mod saved;

use parsed::with_symbolizer;

pub use debuginfo::disable_servers as no_debuginfod;
pub use saved::name_saved;

use crate::{
    allocators::FuncInfo,
    collect::raw::RawProfile,
    profile::{
        FileMapping, Frame, Meta, Profile, StackEntry, StackQuality, Thread, Totals, ENTRY_POINT,
    },
    python::{split, Names},
    tracee::{AddressSpace, FileId},
};

thread_local! {
    /// What the symbolizer said of each (file, offset) asked about, with
    /// no process's module name or address in it: the processes of a tree
    /// run the same files, and looking an address up again (its line, its
    /// inlined calls) cost more than anything else a gone process's
    /// reading did. `None`: nothing known there.
    static KNOWN: std::cell::RefCell<Known> = std::cell::RefCell::new(HashMap::new());
}

/// See [`KNOWN`].
type Known = HashMap<(FileId, u64), Option<Vec<Frame>>>;

/// Entries [`KNOWN`] holds before it starts over.
const KNOWN_KEPT: usize = 1 << 16;

/// The frames at `addr` (at `offset` in the file shown as `module`), from
/// what is known of the offset.
fn frames_at(known: Option<&[Frame]>, module: &str, addr: u64, offset: u64) -> Vec<Frame> {
    match known {
        Some(frames) => frames
            .iter()
            .map(|f| Frame {
                module: Some(module.to_string()),
                addr,
                ..f.clone()
            })
            .collect(),
        None => vec![unknown_frame(Some(module), addr, offset + 1)],
    }
}

pub fn symbolize(
    raw: &RawProfile,
    space: &AddressSpace,
    funcs: &[FuncInfo],
    thread_names: &BTreeMap<u32, String>,
    python: Option<&Names>,
    meta: Meta,
) -> Profile {
    // Group every distinct address by the file it falls in.
    let mut by_file: HashMap<&str, Vec<u64>> = HashMap::new();
    for st in &raw.stacks {
        for &addr in split(&st.addrs).0 {
            if let Some(m) = space.mapping(addr).filter(|m| m.is_file()) {
                by_file.entry(m.path.as_str()).or_default().push(addr);
            }
        }
    }
    // The frames of each address, located (with the target's mapping of
    // the file, for pprof's mappings), once: the stacks through an
    // address share them.
    let shared = |frames: Vec<Frame>| -> Vec<Arc<Frame>> {
        frames
            .into_iter()
            .map(|mut f| {
                space.locate(&mut f);
                f.mapping = space
                    .mapping(f.addr)
                    .filter(|m| m.is_file())
                    .map(|m| FileMapping {
                        start: m.start,
                        limit: m.end,
                        offset: m.offset,
                    });
                Arc::new(f)
            })
            .collect()
    };
    let mut resolved: HashMap<u64, Vec<Arc<Frame>>> = HashMap::new();
    {
        let mut known = KNOWN.with(|k| k.take());
        for (path, mut addrs) in by_file {
            addrs.sort_unstable();
            addrs.dedup();
            let display = space.display_path(path);
            let file = space.file(path);
            let id = file.and_then(FileId::of_file);
            // Return addresses point after the call: look up the call
            // itself. What was symbolized for another process of the same
            // file is taken as it is.
            let mut todo: Vec<(u64, u64)> = Vec::new();
            for &addr in &addrs {
                let offset = space
                    .mapping(addr)
                    .unwrap()
                    .file_offset(addr)
                    .saturating_sub(1);
                match id.and_then(|id| known.get(&(id, offset))) {
                    Some(k) => {
                        resolved
                            .insert(addr, shared(frames_at(k.as_deref(), display, addr, offset)));
                    }
                    None => todo.push((addr, offset)),
                }
            }
            if todo.is_empty() {
                continue;
            }
            let offsets: Vec<u64> = todo.iter().map(|&(_, o)| o).collect();
            let mut results = match file {
                Some(f) => frames_in_file(f, id, &offsets),
                None => Vec::new(),
            };
            for (i, &(addr, offset)) in todo.iter().enumerate() {
                let found = results.get_mut(i).and_then(Option::take);
                resolved.insert(
                    addr,
                    shared(frames_at(found.as_deref(), display, addr, offset)),
                );
                if let Some(id) = id {
                    if known.len() >= KNOWN_KEPT {
                        known.clear();
                    }
                    known.insert((id, offset), found);
                }
            }
        }
        KNOWN.with(|k| k.replace(known));
    }

    let mut stacks = Vec::new();
    // Calls running Python code in a process whose interpreter was not
    // found (its frames not read).
    let mut py_not_known = 0;
    for st in &raw.stacks {
        let mut frames = Vec::new();
        let (native, py) = split(&st.addrs);
        for &addr in native {
            match resolved.get(&addr) {
                Some(f) => frames.extend(f.iter().cloned()),
                None => {
                    let mut frame = match space.mapping(addr).filter(|m| m.is_anonymous_code()) {
                        Some(m) => anonymous_code_frame(&m.path, addr, space.jit_name(addr)),
                        None => unknown_frame(None, addr, addr),
                    };
                    space.locate(&mut frame);
                    frames.push(Arc::new(frame));
                }
            }
        }
        if let (Some(names), false) = (python, py.is_empty()) {
            frames = names.splice(frames, py);
        } else if python.is_none() && crate::python::runs_eval_loop(&frames) {
            py_not_known += st.counts.calls;
        }
        stacks.push(StackEntry {
            func: func_name(funcs, st.func),
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
            process: None,
            counts: st.counts,
            live: st.live.clone(),
            in_use: None,
            object_size: None,
        });
    }

    let mut totals = Totals {
        nested: raw.nested,
        frees_counted: raw.frees_counted,
        ..Totals::default()
    };
    for (f, counts) in raw.per_func.iter().enumerate() {
        if counts.calls == 0 {
            continue;
        }
        let name = func_name(funcs, f as u32);
        if funcs.get(f).is_some_and(|i| !i.role.allocates()) {
            totals.frees += counts.calls;
        } else {
            totals.allocs.add(*counts);
        }
        totals.per_func.entry(name).or_default().add(*counts);
    }
    let mut quality = StackQuality {
        perf_map: space.perf_map().quality(),
        symbols: debuginfo::quality(),
        ..raw.stack_quality.clone()
    };
    if py_not_known > 0 {
        quality.python.get_or_insert_default().not_known = py_not_known;
    }
    Profile {
        meta,
        stacks,
        totals,
        losses: raw.losses,
        stack_quality: Some(quality),
        live: raw.live.clone(),
        snapshot: None,
        timeline: None,
        go_heaps: Vec::new(),
        unseen: Vec::new(),
        tests: Vec::new(),
        groups: Vec::new(),
    }
}

/// Loads what the symbolizer needs for the C library this process runs
/// (most targets' too: the symbolizer keeps a file by its identity, not
/// its path), on the thread that will symbolize the trace, while the
/// first probes go in: its debug information is most of a first
/// symbolization (~35 ms for Debian's libc).
pub fn warm_up() {
    let here = libc::malloc as *const () as usize as u64;
    let Ok(maps) = crate::tracee::read_maps(std::process::id()) else {
        return;
    };
    let Some(m) = maps.iter().find(|m| m.contains(here) && m.is_file()) else {
        return;
    };
    if let Ok(file) = std::fs::File::open(&m.path) {
        returns_in_file(&file, "", &[m.file_offset(here) + 1]);
    }
}

/// The frames at each of `returns` (return addresses as file offsets in
/// `file`, shown as `module`): the host scope's callers, whose processes
/// may be gone. An offset nothing is known at reads as `module+offset`.
pub fn returns_in_file(file: &std::fs::File, module: &str, returns: &[u64]) -> Vec<Vec<Frame>> {
    let id = FileId::of_file(file);
    // The call itself, not what follows it.
    let offsets: Vec<u64> = returns.iter().map(|r| r.saturating_sub(1)).collect();
    let mut known = KNOWN.with(|k| k.take());
    let todo: Vec<u64> = offsets
        .iter()
        .copied()
        .filter(|o| id.is_none_or(|id| !known.contains_key(&(id, *o))))
        .collect();
    let mut fresh: HashMap<u64, Option<Vec<Frame>>> = HashMap::new();
    if !todo.is_empty() {
        let results = frames_in_file(file, id, &todo);
        for (&o, found) in todo.iter().zip(results) {
            fresh.insert(o, found);
        }
    }
    let frames = offsets
        .iter()
        .map(|&o| {
            let k = match fresh.get(&o) {
                Some(f) => f.clone(),
                None => id.and_then(|id| known.get(&(id, o)).cloned()).flatten(),
            };
            frames_at(k.as_deref(), module, o + 1, o)
        })
        .collect();
    if let Some(id) = id {
        for (o, f) in fresh {
            if known.len() >= KNOWN_KEPT {
                known.clear();
            }
            known.insert((id, o), f);
        }
    }
    KNOWN.with(|k| k.replace(known));
    frames
}

/// The frames at each of `offsets` (file offsets of calls) in `file`
/// (whose identity is `id`), none where nothing is known. A stripped file
/// (neither symbols nor DWARF) is looked up in its debug file, found by
/// its build id ([`debuginfo`]), where it has one; a program's entry
/// point that nothing names there is `_start` ([`entry`]).
fn frames_in_file(
    file: &std::fs::File,
    id: Option<FileId>,
    offsets: &[u64],
) -> Vec<Option<Vec<Frame>>> {
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let src = Source::Elf(Elf::new(&path));
    let mut found = with_symbolizer(path.as_ref(), |symbolizer| {
        symbolized(symbolizer, &src, Input::FileOffset(offsets))
    });
    if found.iter().all(Option::is_some) {
        return found;
    }
    if let Some(split) = debuginfo::split_for(file, id) {
        let addrs: Vec<u64> = offsets.iter().map(|&o| split.virtual_address(o)).collect();
        for (f, more) in found.iter_mut().zip(in_debug_file(&split.path, &addrs)) {
            if f.is_none() {
                *f = more;
            }
        }
    }
    if found.iter().any(Option::is_none) {
        if let Some(code) = entry::entry_code(file, id) {
            for (f, o) in found.iter_mut().zip(offsets) {
                if f.is_none() && code.contains(o) {
                    *f = Some(vec![Frame {
                        function: ENTRY_POINT.to_string(),
                        module: Some(String::new()),
                        ..Frame::default()
                    }]);
                }
            }
        }
    }
    found
}

/// The frames at each of `input`'s places in `src`, none where nothing
/// is known (or the file could not be read).
fn symbolized(
    symbolizer: &Symbolizer,
    src: &Source,
    input: Input<&[u64]>,
) -> Vec<Option<Vec<Frame>>> {
    let n = input.as_inner_ref().len();
    match symbolizer.symbolize(src, input) {
        Ok(found) => found
            .iter()
            .map(|r| match r {
                Symbolized::Sym(sym) => Some(sym_frames(sym, "", 0)),
                _ => None,
            })
            .collect(),
        Err(_) => vec![None; n],
    }
}

/// The frames at each of `addrs` (virtual addresses, as the file's
/// program headers place its code) in the debug file `debug`.
fn in_debug_file(debug: &std::path::Path, addrs: &[u64]) -> Vec<Option<Vec<Frame>>> {
    let src = Source::Elf(Elf::new(debug));
    with_symbolizer(debug, |symbolizer| {
        symbolized(symbolizer, &src, Input::VirtOffset(addrs))
    })
}

/// What `make` finds for a file, made once per file identity `id` and
/// kept in `cache` (made each time for a file without one).
fn once_per_file<T: Clone>(
    cache: &'static std::thread::LocalKey<std::cell::RefCell<HashMap<FileId, T>>>,
    id: Option<FileId>,
    make: impl FnOnce() -> T,
) -> T {
    if let Some(known) = id.and_then(|id| cache.with(|c| c.borrow().get(&id).cloned())) {
        return known;
    }
    let found = make();
    if let Some(id) = id {
        cache.with(|c| c.borrow_mut().insert(id, found.clone()));
    }
    found
}

fn func_name(funcs: &[FuncInfo], func: u32) -> String {
    funcs
        .get(func as usize)
        .map(|f| f.name.clone())
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
    let frame = |function: &str, ci: Option<&blazesym::symbolize::CodeInfo>, inlined: bool| {
        let (file, line) = loc(ci);
        Frame {
            function: function.to_string(),
            file,
            line,
            module: Some(module.to_string()),
            addr,
            inlined,
            ..Frame::default()
        }
    };
    let mut frames: Vec<Frame> = sym
        .inlined
        .iter()
        .rev()
        .map(|inl| frame(&demangled(&inl.name), inl.code_info.as_ref(), true))
        .collect();
    let mut outer = frame(&demangled(&sym.name), sym.code_info.as_deref(), false);
    if outer.line.is_none() {
        // The symbolizer was asked about the byte before the return
        // address (the call's last): the return address is one further.
        outer.symbol_offset = Some(sym.offset as u64 + 1);
    }
    frames.push(outer);
    frames
}

/// `name` demangled when it is mangled: a Rust name (legacy `_ZN...E`
/// or v0 `_R`, without its hash) or a C++ one (`_Z`); any other name is
/// a C or assembly name, kept as it is even where it reads as a C++
/// type code (`a`, `d`, `Pv`).
fn demangled(name: &str) -> std::borrow::Cow<'_, str> {
    let mangled = ["_Z", "__Z", "_R", "__R"]
        .iter()
        .any(|p| name.starts_with(p));
    if !mangled {
        return name.into();
    }
    if let Ok(d) = rustc_demangle::try_demangle(name) {
        return format!("{d:#}").into();
    }
    cpp_demangle::Symbol::new(name)
        .ok()
        .and_then(|s| s.demangle().ok())
        .map_or(name.into(), Into::into)
}

/// A frame in code no file backs (a JIT's): its address, and the
/// mapping's name where the runtime gave it one (`[anon:...]`).
fn anonymous_code_frame(name: &str, addr: u64, jit: Option<String>) -> Frame {
    Frame {
        function: jit.unwrap_or_else(|| format!("[anonymous code {addr:#x}]")),
        module: (!name.is_empty()).then(|| name.to_string()),
        addr,
        ..Frame::default()
    }
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

#[cfg(test)]
mod tests {
    use super::demangled;

    /// C names stay as they are, even those that read as C++ type codes;
    /// C++ and Rust names are demangled as gdb shows them.
    #[test]
    fn only_mangled_names_are_demangled() {
        for c in ["a", "b", "d", "i", "v", "Pv", "St", "main", "__libc_malloc"] {
            assert_eq!(demangled(c), c);
        }
        assert_eq!(demangled("_ZN3foo3barEv"), "foo::bar()");
        assert_eq!(demangled("_Znwm"), "operator new(unsigned long)");
        assert_eq!(
            demangled("_ZN4core3ptr13drop_in_place17h0123456789abcdefE"),
            "core::ptr::drop_in_place"
        );
        assert_eq!(demangled("_RNvCs1234_7mycrate4main"), "mycrate::main");
    }
}
