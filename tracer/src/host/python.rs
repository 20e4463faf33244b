//! The host scope's Python frames. Each CPython interpreter file is read
//! once ([`Interpreters`]): its layout, with `_PyRuntime` as an offset
//! from where the file's offset 0 lies as its code is mapped, goes to the
//! programs by file identity (`HOST_PY_FILES`). A process gets its own
//! `_PyRuntime` (`HOST_PY_PROCS`) from the first walk that meets the
//! interpreter's code in it, in the kernel, or from the tracer when it
//! reads the process's mappings; the programs then read its Python frames
//! as they read a traced process's. Each process's code objects are named
//! from its memory while it lives ([`HostNames`]), told by the programs'
//! notices and by the walks the tracer finishes.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use anyhow::{Context, Result};
use aya::{
    maps::{HashMap as BpfHashMap, MapData, RingBuf},
    Ebpf,
};
use tracer_common::{maps, HostFileId, HostPyProc, PythonLayout};

use super::files::FileKey;
use crate::{
    profile::Frame,
    python::{self, Found, Names},
    tracee::parse_maps,
    unwind::service::read_notice,
};

/// What an interpreter file gives: `_PyRuntime` from its code's base, and
/// what the report calls it.
#[derive(Clone)]
struct Known {
    from_code_base: u64,
    said: String,
}

/// The interpreter files read, by identity (`None`: not an interpreter
/// whose frames the programs read).
#[derive(Default)]
pub struct Interpreters {
    files: HashMap<FileKey, Option<Known>>,
}

/// The kernel's name of file `key`.
fn file_id(key: FileKey) -> HostFileId {
    HostFileId {
        dev: key.0,
        _pad: 0,
        ino: key.1,
    }
}

impl Interpreters {
    /// Reads file `key` (at `path` in process `pid`'s root) once: when it
    /// is an interpreter whose frames the programs read, its layout goes
    /// to them; one it cannot read is said once.
    pub fn learn(&mut self, ebpf: &mut Ebpf, pid: u32, key: FileKey, path: &str) {
        if self.files.contains_key(&key) {
            return;
        }
        let known = match python::in_file(pid, path) {
            Found::Known(i) => {
                let mut layout = i.layout;
                layout.runtime = i.place.offset_from_code_base();
                match files_map(ebpf).and_then(|mut m| Ok(m.insert(file_id(key), layout, 0)?)) {
                    Ok(()) => Some(Known {
                        from_code_base: layout.runtime,
                        said: i.describe(),
                    }),
                    Err(e) => {
                        python::say_once(&format!(
                            "{}: its Python frames are not read ({e:#})",
                            i.name()
                        ));
                        None
                    }
                }
            }
            Found::Unknown(why) => {
                python::say_once(&why);
                None
            }
            Found::None => None,
        };
        self.files.insert(key, known);
    }

    /// An executable about to run or just exec'd (`key`, at `path` in
    /// this process's root): read, and so is the libpython it links, if
    /// its name says Python (pyenv's builds), so that the programs read
    /// the process's Python frames from its first walk through the
    /// interpreter's code, before its mappings are read.
    pub fn learn_executable(&mut self, ebpf: &mut Ebpf, key: FileKey, path: &str) {
        let me = std::process::id();
        self.learn(ebpf, me, key, path);
        if !matches!(self.files.get(&key), Some(None))
            || !crate::profile::short_path(path).contains("python")
        {
            return;
        }
        for lib in linked_libpython(path) {
            if let Some(k) = super::files::key_of_path(&lib) {
                self.learn(ebpf, me, k, &lib.to_string_lossy());
            }
        }
    }

    /// Process `pid`'s mappings read (`maps`, its `/proc/PID/maps`): its
    /// interpreter files learned, and the process given its interpreter
    /// where its code is mapped (the programs may have given it already,
    /// with the same address).
    pub fn note_process(&mut self, ebpf: &mut Ebpf, pid: u32, maps: &str) {
        for m in parse_maps(maps) {
            if !m.is_file() || !m.perms.contains('x') {
                continue;
            }
            let key = (
                ((m.dev >> 32) as u32) << 20 | (m.dev as u32 & 0xfffff),
                m.inode,
            );
            self.learn(ebpf, pid, key, &m.path);
            let Some(Some(k)) = self.files.get(&key) else {
                continue;
            };
            let p = HostPyProc {
                runtime: m
                    .start
                    .wrapping_sub(m.offset)
                    .wrapping_add(k.from_code_base),
                file: file_id(key),
            };
            let put = ebpf
                .map_mut(maps::HOST_PY_PROCS)
                .context("HOST_PY_PROCS map")
                .and_then(|m| Ok(BpfHashMap::<&mut MapData, u32, HostPyProc>::try_from(m)?))
                .and_then(|mut procs| Ok(procs.insert(pid, p, 0)?));
            if let Err(e) = put {
                log::debug!("pid {pid}: its interpreter not put in: {e:#}");
            }
            return;
        }
    }

    /// The interpreters whose frames were read, for the report's header.
    pub fn said(&self) -> String {
        let mut said: Vec<&str> = self.files.values().flatten().map(|k| &*k.said).collect();
        said.sort_unstable();
        said.join("; ")
    }
}

/// The libpython an executable links (`DT_NEEDED`), where its run path
/// (`DT_RUNPATH` or `DT_RPATH`, `$ORIGIN` its directory) or the system's
/// library directories hold it.
fn linked_libpython(exe: &str) -> Vec<std::path::PathBuf> {
    use object::{
        read::elf::{Dyn, ElfFile64, FileHeader, SectionHeader},
        Endianness,
    };
    let Ok(data) = std::fs::read(exe) else {
        return Vec::new();
    };
    let Ok(elf) = ElfFile64::<Endianness>::parse(&*data) else {
        return Vec::new();
    };
    let endian = elf.endian();
    let Ok(sections) = elf.elf_header().sections(endian, &*data) else {
        return Vec::new();
    };
    let Ok(Some((dynamic, index))) = sections.dynamic(endian, &*data) else {
        return Vec::new();
    };
    let Ok(strings) = sections.section(index).and_then(|s| {
        sections.strings(
            endian,
            &*data,
            object::SectionIndex(s.sh_link(endian) as usize),
        )
    }) else {
        return Vec::new();
    };
    let origin = std::path::Path::new(exe)
        .parent()
        .unwrap_or(std::path::Path::new("/"));
    let mut dirs: Vec<std::path::PathBuf> = Vec::new();
    let mut needed = Vec::new();
    for d in dynamic {
        let Ok(text) = d.string(endian, strings) else {
            continue;
        };
        let text = String::from_utf8_lossy(text).into_owned();
        match d.tag32(endian) {
            Some(object::elf::DT_NEEDED) if text.starts_with("libpython") => needed.push(text),
            Some(object::elf::DT_RUNPATH | object::elf::DT_RPATH) => {
                let origin = origin.to_string_lossy();
                dirs.extend(
                    text.split(':')
                        .map(|p| p.replace("$ORIGIN", &origin).into()),
                );
            }
            _ => {}
        }
    }
    dirs.extend(["/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib"].map(Into::into));
    needed
        .iter()
        .filter_map(|n| dirs.iter().map(|d| d.join(n)).find(|p| p.is_file()))
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect()
}

fn files_map(ebpf: &mut Ebpf) -> Result<BpfHashMap<&mut MapData, HostFileId, PythonLayout>> {
    Ok(BpfHashMap::try_from(
        ebpf.map_mut(maps::HOST_PY_FILES)
            .context("HOST_PY_FILES map")?,
    )?)
}

/// The code objects of the host scope's Python processes, by process id.
pub struct HostNames {
    /// The programs' notices of new Python stacks.
    pub(super) ring: RingBuf<MapData>,
    procs: BpfHashMap<MapData, u32, HostPyProc>,
    files: BpfHashMap<MapData, HostFileId, PythonLayout>,
    names: HashMap<u32, Names>,
    /// Code objects that could not be named, of processes forgotten.
    unnamed_gone: u64,
}

impl HostNames {
    pub fn new(ebpf: &Ebpf) -> Result<HostNames> {
        let copy = |name| crate::probes::pool::map_copy(ebpf, name);
        Ok(HostNames {
            ring: RingBuf::try_from(copy(maps::HOST_PY_NOTICES)?)?,
            procs: BpfHashMap::try_from(copy(maps::HOST_PY_PROCS)?)?,
            files: BpfHashMap::try_from(copy(maps::HOST_PY_FILES)?)?,
            names: HashMap::new(),
            unnamed_gone: 0,
        })
    }

    /// Reads the code objects of the stacks the programs' notices tell
    /// of.
    pub fn drain(&mut self) {
        let mut told = Vec::new();
        while let Some(item) = self.ring.next() {
            told.extend(read_notice(&item));
        }
        for (tgid, words) in told {
            self.learn(tgid, &words);
        }
    }

    /// Reads the code objects of `words` (a stack's Python words) in
    /// process `tgid`, while it lives.
    pub fn learn(&mut self, tgid: u32, words: &[u64]) {
        if words.is_empty() || tgid == 0 {
            return;
        }
        if !self.names.contains_key(&tgid) {
            let minor = self
                .procs
                .get(&tgid, 0)
                .and_then(|p| self.files.get(&p.file, 0))
                .map(|l| l.minor as u8);
            let Some(names) = minor.ok().and_then(|m| Names::new(tgid, m, None)) else {
                return;
            };
            self.names.insert(tgid, names);
        }
        if let Some(n) = self.names.get_mut(&tgid) {
            n.learn(words);
        }
    }

    /// `native` (symbolized, innermost first) with process `tgid`'s Python
    /// frames (`words`) in place of its eval-loop frames.
    pub fn splice(&self, tgid: u32, native: Vec<Arc<Frame>>, words: &[u64]) -> Vec<Arc<Frame>> {
        if words.is_empty() {
            return native;
        }
        match self.names.get(&tgid) {
            Some(n) => n.splice(native, words),
            None => Names::unread().splice(native, words),
        }
    }

    /// Code objects that could not be named.
    pub fn unnamed(&self) -> u64 {
        self.unnamed_gone + self.names.values().map(|n| n.unnamed).sum::<u64>()
    }

    /// Forgets the processes `gone` (their rows are read for good).
    pub fn forget(&mut self, gone: &HashSet<u32>) {
        for t in gone {
            if let Some(n) = self.names.remove(t) {
                self.unnamed_gone += n.unnamed;
            }
        }
    }
}
