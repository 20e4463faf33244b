//! The target's address space as last seen: its file mappings (and its
//! anonymous executable ones, JIT code) and an open descriptor to every
//! file it maps, kept while it lives so that stacks can
//! be symbolized after it has exited, its binary was deleted, or from
//! another mount namespace. Filled while tracing (attach, launch, the
//! session's refresh), read by the symbolizer.

use std::{collections::HashMap, fs::File, sync::Arc};

use crate::profile::Frame;

use super::proc::{path_in_target, read_maps, Mapping};

/// The target's mappings as last seen, and the files behind them.
#[derive(Default)]
pub struct AddressSpace {
    /// Every file mapping and anonymous code mapping ever seen, newest
    /// last (an address the target maps anew, as a JIT's code may reuse
    /// the range of an unmapped file, is found in its newest mapping).
    mappings: Vec<Mapping>,
    /// Open file per mapped path.
    files: HashMap<String, File>,
    /// GNU build id (hex) per mapped path, where the file has one.
    build_ids: HashMap<String, String>,
    /// Names of JIT code, where the runtime writes a perf map.
    jit: super::perf_map::PerfMap,
    /// The executable as the command named it, when that is a symbolic
    /// link to the file mapped (`redis-server` -> `redis-check-rdb`):
    /// (mapped path, the link's path).
    exe_alias: Option<(String, String)>,
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
        self.refresh_with(pid, maps)
    }

    /// As [`AddressSpace::refresh`], with `maps` just read (the process
    /// stopped since).
    pub fn refresh_with(&mut self, pid: u32, maps: Vec<Mapping>) -> bool {
        if maps.is_empty() {
            return false;
        }
        if maps.iter().any(Mapping::is_anonymous_code) {
            self.jit.refresh(pid);
        }
        if self.exe_alias.is_none() {
            self.exe_alias = exe_alias(pid);
        }
        for m in maps {
            if m.is_anonymous_code() {
                if !self.mappings.contains(&m) {
                    self.mappings.push(m);
                }
                continue;
            }
            if !m.is_file() {
                continue;
            }
            if !self.files.contains_key(&m.path) {
                if let Some((f, id)) = open_mapped(pid, &m) {
                    if let Some(id) = id {
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

    /// Adds mapping `m` of `file`, opened already: an address space made
    /// of what is known of a process gone.
    pub fn add_mapped(&mut self, m: Mapping, file: File) {
        self.files.insert(m.path.clone(), file);
        self.mappings.push(m);
    }

    pub fn mapping(&self, addr: u64) -> Option<&Mapping> {
        self.mappings.iter().rev().find(|m| m.contains(addr))
    }

    /// The path frames in the object mapped from `path` show: the
    /// symbolic link the command named for the executable, else `path`.
    pub fn display_path<'a>(&'a self, path: &'a str) -> &'a str {
        match &self.exe_alias {
            Some((mapped, alias)) if mapped == path => alias,
            _ => path,
        }
    }

    /// The runtime's name of the JIT code at `addr` (its perf map).
    pub fn jit_name(&self, addr: u64) -> Option<String> {
        self.jit.name(addr)
    }

    /// Whether code no file backs (a JIT's) was mapped.
    pub fn has_jit_code(&self) -> bool {
        self.mappings.iter().any(Mapping::is_anonymous_code)
    }

    /// The perf map (another handle on it: waiting for it to be read
    /// needs no lock on the address space).
    pub fn perf_map(&self) -> super::perf_map::PerfMap {
        self.jit.clone()
    }

    /// Paths of the files mapped executable (each once).
    pub fn executable_paths(&self) -> impl Iterator<Item = &str> {
        let mut seen = std::collections::HashSet::new();
        self.mappings
            .iter()
            .filter(|m| m.is_file() && m.perms.contains('x'))
            .map(|m| m.path.as_str())
            .filter(move |p| seen.insert(*p))
    }

    /// The mappings of a file's code.
    pub fn code_mappings(&self) -> impl Iterator<Item = &Mapping> {
        self.mappings
            .iter()
            .filter(|m| m.is_file() && m.perms.contains('x'))
    }

    /// The open file mapped under `path`.
    pub fn file(&self, path: &str) -> Option<&File> {
        self.files.get(path)
    }

    /// Fills in where a frame's address lies: object file offset and build id.
    pub fn locate(&self, frame: &mut Frame) {
        if let Some(m) = self.mapping(frame.addr).filter(|m| m.is_file()) {
            frame.file_offset = Some(m.file_offset(frame.addr));
            frame.build_id = self.build_ids.get(&m.path).cloned();
        }
    }
}

/// The executable's (mapped path, link path) when the command named it by
/// a symbolic link to it: its first argument, as a path, or by that name
/// in the executable's directory (a link beside the file, as Debian's
/// `redis-server` beside `redis-check-rdb`). Paths are the target's.
fn exe_alias(pid: u32) -> Option<(String, String)> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let argv0 = String::from_utf8(cmdline.split(|&b| b == 0).next()?.to_vec()).ok()?;
    let name = std::path::Path::new(&argv0).file_name()?;
    if Some(name) == exe.file_name() {
        return None;
    }
    let link = if argv0.starts_with('/') {
        std::path::PathBuf::from(&argv0)
    } else {
        exe.parent()?.join(name)
    };
    let inside = path_in_target(pid, link.to_str()?);
    let is_link = std::fs::symlink_metadata(&inside)
        .ok()?
        .file_type()
        .is_symlink();
    let same = std::fs::canonicalize(&inside).ok()?
        == std::fs::canonicalize(path_in_target(pid, exe.to_str()?)).ok()?;
    (is_link && same).then(|| {
        (
            exe.to_string_lossy().into_owned(),
            link.to_string_lossy().into_owned(),
        )
    })
}

/// Files opened for earlier address spaces, by device and inode as the
/// mappings name them (the same file wherever it is mapped, in whatever
/// mount namespace: the kept descriptor holds the inode, so its number is
/// not reused), with their build ids: each process of a tree maps the
/// same few libraries, and opening and reading each anew was most of what
/// recording a new address space cost.
static OPENED: super::proc::Kept<(u64, u64), Arc<Opened>> = super::proc::Kept::new(256);

/// A file opened and its build id.
type Opened = (File, Option<String>);

/// The file `m` maps, opened (its own descriptor) with its build id.
fn open_mapped(pid: u32, m: &Mapping) -> Option<Opened> {
    let key = (m.dev, m.inode);
    if let Some(kept) = OPENED.get(&key) {
        if let Ok(f) = kept.0.try_clone() {
            return Some((f, kept.1.clone()));
        }
    }
    // map_files reaches the very file mapped (even deleted or in another
    // mount namespace); the root path is the fallback, whose file may be
    // another by now (not kept).
    let by_range = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end);
    let (f, very) = match File::open(&by_range) {
        Ok(f) => (f, true),
        Err(_) => (File::open(path_in_target(pid, &m.path)).ok()?, false),
    };
    let id = build_id(&f);
    if let (true, Ok(kept)) = (very, f.try_clone()) {
        OPENED.put(key, Arc::new((kept, id.clone())));
    }
    Some((f, id))
}

/// The GNU build id of an ELF file, read lazily (only the note is read).
pub fn build_id(file: &File) -> Option<String> {
    use object::Object;
    let cache = object::read::ReadCache::new(file);
    let obj = object::File::parse(&cache).ok()?;
    let id = obj.build_id().ok()??;
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
}
