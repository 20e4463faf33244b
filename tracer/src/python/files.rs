//! Interpreters by file, for the host scope: the layout of the CPython a
//! file holds with `_PyRuntime` given from the file's code mapping (so a
//! process's walk finds it from any return address into that code), and
//! the libpython an executable will load (before the dynamic linker has
//! mapped it).

use object::{
    elf,
    read::elf::{Dyn, ElfFile64},
    Object, ObjectSegment, SegmentFlags,
};

use super::{detect, layout::Interpreter, Found};
use crate::tracee::{path_in_target, Mapping};

/// The interpreter file `path` (as process `pid` sees it) holds, its
/// `layout.runtime` given from its code mapping's base: a process that
/// maps the file's code at `start` from file offset `offset` has
/// `_PyRuntime` at `start - offset + runtime`. `None` when it holds none
/// mtrace reads.
pub fn in_file(pid: u32, path: &str) -> Option<Interpreter> {
    let f = std::fs::File::open(path_in_target(pid, path)).ok()?;
    // SAFETY: a read-only mapping of a file, only read as bytes (see
    // unwind::object_cfi for the caveat).
    let data = unsafe { memmap2::Mmap::map(&f) }.ok()?;
    let file = object::File::parse(&*data).ok()?;
    let first_load = file.segments().map(|s| s.address()).min()?;
    // How far the code's addresses are from its file offsets.
    let code_shift = file.segments().find_map(|s| match s.flags() {
        SegmentFlags::Elf { p_flags } if p_flags & elf::PF_X != 0 => {
            Some(s.address().wrapping_sub(s.file_range().0))
        }
        _ => None,
    })?;
    // As if mapped where its addresses say: `_PyRuntime` at its address.
    let at_home = Mapping {
        start: first_load & !0xfff,
        end: (first_load & !0xfff) + 0x1000,
        perms: "r--p".into(),
        offset: 0,
        dev: 1,
        inode: 1,
        path: path.to_string(),
    };
    match detect(pid, &[at_home]) {
        Found::Known(mut i) => {
            i.layout.runtime = i.layout.runtime.wrapping_sub(code_shift);
            Some(i)
        }
        _ => None,
    }
}

/// [`Interpreter::layout`]'s `runtime` from the base of its code mapping
/// in `maps` (see [`in_file`]), with that mapping.
pub fn from_code_mapping<'m>(i: &Interpreter, maps: &'m [Mapping]) -> Option<(&'m Mapping, u64)> {
    let code = maps
        .iter()
        .find(|m| m.path == i.path && m.perms.contains('x'))?;
    Some((
        code,
        i.layout
            .runtime
            .wrapping_sub(code.start.wrapping_sub(code.offset)),
    ))
}

/// Whether executable `path` is named like a CPython interpreter
/// (`python3`, `python3.11`, ...): one to look at as it execs.
pub fn named_like_interpreter(path: &str) -> bool {
    path.rsplit('/')
        .next()
        .is_some_and(|n| n.contains("python"))
}

/// Directories the dynamic linker looks in after an executable's own
/// run paths (its cache lists what they hold on a Debian system).
const SYSTEM_DIRS: [&str; 6] = [
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
];

/// The libpython executable `exe` (as process `pid` sees it) needs, as
/// the dynamic linker would find it: in the executable's run path
/// (`$ORIGIN` expanded), then the system's directories. A subset of the
/// dynamic linker's search (no `LD_LIBRARY_PATH`, no cache of other
/// directories), written here because no crate reads it without loading
/// the library: where it finds another file, the process's interpreter
/// is learned once it has mapped it instead.
pub fn needed_libpython(pid: u32, exe: &str) -> Option<String> {
    let f = std::fs::File::open(path_in_target(pid, exe)).ok()?;
    // SAFETY: as in [`in_file`].
    let data = unsafe { memmap2::Mmap::map(&f) }.ok()?;
    let obj = ElfFile64::<object::Endianness>::parse(&*data).ok()?;
    let endian = obj.endian();
    let sections = obj.elf_section_table();
    let (entries, link) = sections.dynamic(endian, &*data).ok()??;
    let strings = sections.strings(endian, &*data, link).ok()?;
    let text = |d: &elf::Dyn64<object::Endianness>| {
        d.string(endian, strings)
            .ok()
            .map(|s| String::from_utf8_lossy(s).into_owned())
    };
    let mut needed = None;
    let mut run_paths = Vec::new();
    for d in entries {
        match d.tag32(endian) {
            Some(elf::DT_NEEDED) => {
                if let Some(name) = text(d).filter(|n| n.starts_with("libpython")) {
                    needed = Some(name);
                }
            }
            Some(elf::DT_RUNPATH | elf::DT_RPATH) => run_paths.extend(text(d)),
            _ => {}
        }
    }
    let needed = needed?;
    let origin = std::path::Path::new(exe).parent()?.to_str()?.to_string();
    let dirs = run_paths
        .iter()
        .flat_map(|p| p.split(':'))
        .map(|d| d.replace("${ORIGIN}", &origin).replace("$ORIGIN", &origin))
        .chain(SYSTEM_DIRS.iter().map(|d| d.to_string()));
    for dir in dirs {
        let path = format!("{dir}/{needed}");
        if path_in_target(pid, &path).exists() {
            return Some(path);
        }
    }
    None
}
