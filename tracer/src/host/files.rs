//! The files the host's processes map, by the kernel's identity of a file
//! (device and inode, as the programs read them from a mapping), so that a
//! caller in a process gone before the report is still symbolized: any
//! path one of the host's processes mapped it under, opened and checked
//! to be the same file.

use std::{
    collections::HashMap,
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

/// A file as the kernel names it: `s_dev` (major << 20 | minor) and inode.
pub type FileKey = (u32, u64);

/// Where a file was seen: the paths it was mapped under, each with a
/// process that mapped it (for its mount namespace).
#[derive(Default)]
pub struct FileIndex {
    seen: HashMap<FileKey, Vec<(u32, String)>>,
    /// Files looked for in every process and not found: not looked for
    /// again (a view redrawn every second would read every process's
    /// mappings each time).
    missing: std::collections::HashSet<FileKey>,
    /// Return addresses symbolized in opened files, by (file, offset):
    /// a view redrawn every second, or a snapshot, names each once.
    symbols: HashMap<(u32, u64, u64), Vec<std::sync::Arc<crate::profile::Frame>>>,
}

/// Most return addresses whose names are kept (past it the store starts
/// over).
const SYMBOLS_KEPT: usize = 1 << 20;

/// Most places kept per file.
const PLACES_KEPT: usize = 4;

/// Most files indexed (a host that keeps mapping new files must not grow
/// mtrace without bound; a file beyond it is looked for at the end).
const FILES_KEPT: usize = 1 << 17;

impl FileIndex {
    /// Notes the files of `pid`'s mappings (the text of its
    /// `/proc/PID/maps`).
    pub fn note(&mut self, pid: u32, maps: &str) {
        for (key, path) in mapped_files(maps) {
            self.place(key, pid, &path);
        }
    }

    /// Notes the file at `path` (as process `pid` named it at exec), when
    /// it can be opened now.
    pub fn note_file(&mut self, pid: u32, path: &str) {
        for candidate in [
            crate::tracee::path_in_target(pid, path),
            PathBuf::from(path),
        ] {
            if let Some(key) = key_of_path(&candidate) {
                self.place(key, pid, path);
                return;
            }
        }
    }

    /// Notes file `key` at `path` (in mtrace's own mount namespace).
    pub fn note_known(&mut self, key: FileKey, path: &str) {
        self.place(key, std::process::id(), path);
    }

    /// Notes that process `pid` maps file `key` at `path` (at most
    /// `PLACES_KEPT` places a file, `FILES_KEPT` files).
    fn place(&mut self, key: FileKey, pid: u32, path: &str) {
        if self.seen.len() >= FILES_KEPT && !self.seen.contains_key(&key) {
            return;
        }
        let places = self.seen.entry(key).or_default();
        if places.len() < PLACES_KEPT && !places.iter().any(|(_, p)| p == path) {
            places.push((pid, path.to_string()));
        }
    }

    /// The frames return address `key` (file and offset) was named as.
    pub fn symbols(
        &self,
        key: &(u32, u64, u64),
    ) -> Option<&Vec<std::sync::Arc<crate::profile::Frame>>> {
        self.symbols.get(key)
    }

    /// Keeps what return address `key` was named as.
    pub fn keep_symbols(
        &mut self,
        key: (u32, u64, u64),
        frames: Vec<std::sync::Arc<crate::profile::Frame>>,
    ) {
        if self.symbols.len() >= SYMBOLS_KEPT {
            self.symbols.clear();
        }
        self.symbols.insert(key, frames);
    }

    /// Notes the files of every process alive now.
    pub fn rescan(&mut self) {
        for pid in all_pids() {
            if let Ok(maps) = fs::read_to_string(format!("/proc/{pid}/maps")) {
                self.note(pid, &maps);
            }
        }
    }

    /// Whether `key` was seen.
    pub fn knows(&self, key: FileKey) -> bool {
        self.seen.contains_key(&key)
    }

    /// Looks for the files of `keys` not seen yet in every process alive
    /// now, once: one still not found is not looked for again.
    pub fn find(&mut self, keys: impl Iterator<Item = FileKey>) {
        let unknown: Vec<FileKey> = keys
            .filter(|k| !self.knows(*k) && !self.missing.contains(k))
            .collect();
        if unknown.is_empty() {
            return;
        }
        self.rescan();
        for k in unknown {
            if !self.knows(k) && self.missing.len() < FILES_KEPT {
                self.missing.insert(k);
            }
        }
    }

    /// The file `key`, opened (with the path to show), from where it was
    /// seen.
    pub fn open(&self, key: FileKey) -> Option<(fs::File, String)> {
        for (pid, path) in self.seen.get(&key)? {
            let path = path.trim_end_matches(" (deleted)");
            for candidate in [
                crate::tracee::path_in_target(*pid, path),
                PathBuf::from(path),
            ] {
                if let Some(f) = open_if(&candidate, key) {
                    return Some((f, path.to_string()));
                }
            }
        }
        None
    }
}

/// `path`, opened, when it is the file `key`.
fn open_if(path: &Path, key: FileKey) -> Option<fs::File> {
    let f = fs::File::open(path).ok()?;
    (key_of(&f.metadata().ok()?) == key).then_some(f)
}

/// The file at `path` (symbolic links followed), as the kernel names it.
pub fn key_of_path(path: &Path) -> Option<FileKey> {
    fs::metadata(path).ok().map(|m| key_of(&m))
}

/// A file as the kernel names it, from what `stat` says: the device in the
/// kernel's encoding (`s_dev`, not `stat`'s), and the inode.
fn key_of(m: &fs::Metadata) -> FileKey {
    let (major, minor) = (libc::major(m.dev()), libc::minor(m.dev()));
    ((major << 20) | minor, m.ino())
}

/// Each file mapping of a `/proc/PID/maps` text: its key and path.
pub fn mapped_files(maps: &str) -> impl Iterator<Item = (FileKey, String)> + '_ {
    maps.lines().filter_map(|line| {
        // start-end perms offset dev inode   path
        let mut it = line.splitn(6, ' ');
        let (_, _, _) = (it.next()?, it.next()?, it.next()?);
        let (major, minor) = it.next()?.split_once(':')?;
        let ino: u64 = it.next()?.parse().ok()?;
        let path = it.next().unwrap_or("").trim_start();
        if ino == 0 || !path.starts_with('/') {
            return None;
        }
        let dev =
            (u32::from_str_radix(major, 16).ok()? << 20) | u32::from_str_radix(minor, 16).ok()?;
        Some(((dev, ino), path.to_string()))
    })
}

/// Every process id in `/proc` now.
pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A maps line's device and inode read as the kernel names the file,
    /// the same as `stat` of the path says.
    #[test]
    fn maps_and_stat_name_a_file_alike() {
        let maps = fs::read_to_string("/proc/self/maps").unwrap();
        let (key, path) = mapped_files(&maps).next().expect("a file mapping");
        let m = fs::metadata(&path).unwrap();
        assert_eq!(key, key_of(&m), "{path}");
        let mut index = FileIndex::default();
        assert!(index.open(key).is_none());
        index.rescan();
        assert!(index.knows(key));
        assert!(index.open(key).is_some());
        assert!(index.open((key.0, u64::MAX)).is_none());
    }
}
