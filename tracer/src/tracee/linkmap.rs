//! The dynamic linker's list of loaded objects, read from the target's
//! memory: `_r_debug.r_map` and the `link_map` chain behind it (the
//! interface debuggers use, `<link.h>`). Its order is the order in which
//! the dynamic linker looks up symbols: the executable, preloaded
//! libraries, then `DT_NEEDED` breadth-first; so the first object in it
//! that defines `malloc` is the one calls bind to, whatever the addresses
//! the objects were mapped at.

use std::{fs::File, os::unix::fs::FileExt, path::Path};

use object::{Object, ObjectSymbol};

use super::proc::{path_in_target, FileId, Kept, Mapping};

/// `r_debug.r_state` after the dynamic linker has finished loading (or
/// unloading) a set of objects.
pub const RT_CONSISTENT: u32 = 0;

/// At most this many objects are read from the chain (a guard against a
/// corrupt or cyclic list).
const MAX_OBJECTS: usize = 4096;

/// The dynamic linker of a process: where `_r_debug` and `_dl_debug_state`
/// (the function it calls on every change of the list) are in its memory.
#[derive(Clone, Copy, Debug)]
pub struct DynamicLinker {
    pub r_debug: u64,
    pub debug_state: Option<u64>,
}

/// What [`DynamicLinker::find`] needs of the dynamic linker's file, as
/// addresses in the file: read once per file (every exec of a tree maps
/// the same one).
#[derive(Clone, Copy)]
struct LinkerSymbols {
    first_load: u64,
    r_debug: u64,
    debug_state: Option<u64>,
}

/// The dynamic linkers read, by file (a handful at most: one per libc on
/// the host).
static LINKERS: Kept<FileId, LinkerSymbols> = Kept::new(8);

impl LinkerSymbols {
    fn of(path: &Path) -> Option<LinkerSymbols> {
        let id = FileId::of(path)?;
        if let Some(s) = LINKERS.get(&id) {
            return Some(s);
        }
        let data = std::fs::read(path).ok()?;
        let file = object::File::parse(&*data).ok()?;
        let symbol = |name: &str| {
            file.dynamic_symbols()
                .chain(file.symbols())
                .find(|s| s.name() == Ok(name))
                .map(|s| s.address())
        };
        let symbols = LinkerSymbols {
            first_load: file
                .segments()
                .map(|s| object::ObjectSegment::address(&s))
                .min()?,
            r_debug: symbol("_r_debug")?,
            debug_state: symbol("_dl_debug_state"),
        };
        LINKERS.put(id, symbols);
        Some(symbols)
    }
}

/// Paths of the executable mappings of the dynamic linker (`ld-linux*`,
/// `ld64.so*`, `ld-musl*`).
pub fn is_dynamic_linker(path: &str) -> bool {
    let base = path.rsplit('/').next().unwrap_or(path);
    base.starts_with("ld-linux") || base.starts_with("ld64.so") || base.starts_with("ld-musl")
}

impl DynamicLinker {
    /// Finds the dynamic linker among `maps` and its symbols in its file.
    /// `None` for a statically linked program, or a dynamic linker that
    /// does not export `_r_debug`.
    pub fn find(pid: u32, maps: &[Mapping]) -> Option<DynamicLinker> {
        let ld = maps
            .iter()
            .find(|m| m.is_file() && is_dynamic_linker(&m.path))?;
        // Its load bias: the first mapping of the file is its first
        // PT_LOAD segment, whose address in the file is 0 for every
        // dynamic linker we know; checked below.
        let first = maps
            .iter()
            .filter(|m| m.path == ld.path)
            .min_by_key(|m| m.start)?;
        let symbols = LinkerSymbols::of(&path_in_target(pid, &ld.path))?;
        let bias = first.start.checked_sub(symbols.first_load & !0xfff)?;
        Some(DynamicLinker {
            r_debug: bias + symbols.r_debug,
            debug_state: symbols.debug_state.map(|a| bias + a),
        })
    }

    /// `r_debug.r_state`, or `None` when it cannot be read.
    pub fn state(&self, pid: u32) -> Option<u32> {
        let mem = Mem::open(pid)?;
        // struct r_debug { int r_version; struct link_map *r_map;
        //                  ElfW(Addr) r_brk; enum r_state; ... }
        Some(mem.u64(self.r_debug + 24)? as u32)
    }

    /// The paths (as `/proc/PID/maps` names them) of the objects in the
    /// link map, in its order; `None` when the list cannot be read or is
    /// still empty (the dynamic linker has not started on it).
    pub fn objects(&self, pid: u32, maps: &[Mapping]) -> Option<Vec<String>> {
        let mem = Mem::open(pid)?;
        let mut node = mem.u64(self.r_debug + 8)?;
        let mut out: Vec<String> = Vec::new();
        for _ in 0..MAX_OBJECTS {
            if node == 0 {
                break;
            }
            // struct link_map { ElfW(Addr) l_addr; char *l_name;
            //                   ElfW(Dyn) *l_ld; link_map *l_next, *l_prev; }
            // l_ld, the object's dynamic section, lies in its mapping: it
            // names the object without trusting l_name (empty for the
            // executable, a path that differs from the mapping's name
            // through symbolic links).
            let l_ld = mem.u64(node + 16)?;
            let mapping = maps.iter().rfind(|m| m.is_file() && m.contains(l_ld));
            if let Some(m) = mapping {
                if !out.contains(&m.path) {
                    out.push(m.path.clone());
                }
            }
            node = mem.u64(node + 24)?;
        }
        (!out.is_empty()).then_some(out)
    }
}

/// The target's memory, read through `/proc/PID/mem`.
pub struct Mem(File);

impl Mem {
    pub fn open(pid: u32) -> Option<Mem> {
        File::open(format!("/proc/{pid}/mem")).ok().map(Mem)
    }

    pub fn u64(&self, addr: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Some(u64::from_le_bytes(b))
    }

    /// Fills `buf` from the target's memory at `addr`.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Option<()> {
        self.0.read_exact_at(buf, addr).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracee::read_maps;

    /// This test process's own link map: the test binary first, libc in
    /// it, the dynamic linker in it, every entry a mapped file.
    #[test]
    fn reads_this_process_link_map() {
        let pid = std::process::id();
        let maps = read_maps(pid).unwrap();
        let ld = DynamicLinker::find(pid, &maps).expect("a dynamically linked test binary");
        assert!(ld.debug_state.is_some());
        assert_eq!(ld.state(pid), Some(RT_CONSISTENT));
        let objects = ld.objects(pid, &maps).expect("a link map");
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        assert_eq!(objects[0], exe.to_str().unwrap(), "{objects:?}");
        assert!(objects.iter().any(|p| p.contains("libc.so")), "{objects:?}");
        assert!(objects.iter().any(|p| is_dynamic_linker(p)), "{objects:?}");
    }
}
