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
};

use blazesym::symbolize::{
    source::{Elf, Source},
    Input, Symbolized, Symbolizer,
};

use crate::{
    allocators::FuncInfo,
    collect::raw::RawProfile,
    profile::{Frame, Meta, Profile, StackEntry, Thread, Totals},
    python::{split, Names},
    tracee::AddressSpace,
};

thread_local! {
    /// One symbolizer for the whole trace, per thread (blazesym's is not
    /// `Sync`). It keeps every file it parsed, keyed by device, inode,
    /// size and modification time (not by path, so the same library
    /// through each process's `/proc/self/fd/N` is parsed once, and a
    /// reused descriptor number never finds another file's symbols): in a
    /// tree of 63 short programs, inflating libc's compressed debug
    /// sections again for each took a third of mtrace's time.
    static SYMBOLIZER: Symbolizer = Symbolizer::builder()
        .enable_code_info(true)
        .enable_inlined_fns(true)
        .enable_demangling(true)
        .build();
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
    let mut resolved: HashMap<u64, Vec<Frame>> = HashMap::new();
    SYMBOLIZER.with(|symbolizer| {
        for (path, mut addrs) in by_file {
            addrs.sort_unstable();
            addrs.dedup();
            // Return addresses point after the call: look up the call
            // itself.
            let offsets: Vec<u64> = addrs
                .iter()
                .map(|&a| space.mapping(a).unwrap().file_offset(a).saturating_sub(1))
                .collect();
            let results = space.file(path).and_then(|f| {
                let src = Source::Elf(Elf::new(format!("/proc/self/fd/{}", f.as_raw_fd())));
                symbolizer.symbolize(&src, Input::FileOffset(&offsets)).ok()
            });
            for (i, &addr) in addrs.iter().enumerate() {
                let frames = match results.as_ref().and_then(|r| r.get(i)) {
                    Some(Symbolized::Sym(sym)) => sym_frames(sym, space.display_path(path), addr),
                    _ => vec![unknown_frame(
                        Some(space.display_path(path)),
                        addr,
                        offsets[i] + 1,
                    )],
                };
                resolved.insert(addr, frames);
            }
        }
    });

    let mut stacks = Vec::new();
    for st in &raw.stacks {
        let mut frames = Vec::new();
        let (native, py) = split(&st.addrs);
        for &addr in native {
            match resolved.get(&addr) {
                Some(f) => frames.extend(f.iter().cloned()),
                None => match space.mapping(addr).filter(|m| m.is_anonymous_code()) {
                    Some(m) => {
                        frames.push(anonymous_code_frame(&m.path, addr, space.jit_name(addr)))
                    }
                    None => frames.push(unknown_frame(None, addr, addr)),
                },
            }
        }
        for frame in &mut frames {
            space.locate(frame);
        }
        if let (Some(names), false) = (python, py.is_empty()) {
            frames = names.splice(frames, py);
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
    Profile {
        meta,
        stacks,
        totals,
        losses: raw.losses,
        stack_quality: Some(raw.stack_quality.clone()),
        live: raw.live.clone(),
        snapshot: None,
        timeline: None,
    }
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
        .map(|inl| frame(&inl.name, inl.code_info.as_ref(), true))
        .collect();
    frames.push(frame(&sym.name, sym.code_info.as_deref(), false));
    frames
}

/// A frame in code no file backs (a JIT's): its address, and the
/// mapping's name where the runtime gave it one (`[anon:...]`).
fn anonymous_code_frame(name: &str, addr: u64, jit: Option<&str>) -> Frame {
    Frame {
        function: jit
            .map(str::to_string)
            .unwrap_or_else(|| format!("[anonymous code {addr:#x}]")),
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
