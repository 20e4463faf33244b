//! What we learn about the traced process from /proc: does it exist, is it
//! a user process, what does it map, what is it called.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use anyhow::Result;

use crate::user_error;

/// One line of /proc/PID/maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub perms: String,
    pub offset: u64,
    /// The file's device (major << 32 | minor), 0 for anonymous mappings.
    pub dev: u64,
    pub inode: u64,
    /// Path as the target sees it (in its own mount namespace); may end in
    /// ` (deleted)`. Empty for anonymous mappings.
    pub path: String,
}

impl Mapping {
    pub fn is_file(&self) -> bool {
        self.inode != 0 && self.path.starts_with('/')
    }

    /// Executable memory that no file backs: code a JIT compiler wrote
    /// (V8, the JVM, LuaJIT), or the vDSO.
    pub fn is_anonymous_code(&self) -> bool {
        !self.is_file() && self.perms.contains('x')
    }

    pub fn contains(&self, addr: u64) -> bool {
        addr >= self.start && addr < self.end
    }

    /// File offset of a runtime address inside this mapping.
    pub fn file_offset(&self, addr: u64) -> u64 {
        addr - self.start + self.offset
    }
}

/// Parses the text of /proc/PID/maps.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines().filter_map(parse_maps_line).collect()
}

fn parse_maps_line(line: &str) -> Option<Mapping> {
    // start-end perms offset dev inode   path
    let mut it = line.splitn(6, ' ');
    let range = it.next()?;
    let perms = it.next()?.to_string();
    let offset = u64::from_str_radix(it.next()?, 16).ok()?;
    let (major, minor) = it.next()?.split_once(':')?;
    let dev = u64::from_str_radix(major, 16).ok()? << 32 | u64::from_str_radix(minor, 16).ok()?;
    let inode = it.next()?.parse().ok()?;
    let path = it.next().unwrap_or("").trim_start().to_string();
    let (s, e) = range.split_once('-')?;
    Some(Mapping {
        start: u64::from_str_radix(s, 16).ok()?,
        end: u64::from_str_radix(e, 16).ok()?,
        perms,
        offset,
        dev,
        inode,
        path,
    })
}

pub fn read_maps(pid: u32) -> io::Result<Vec<Mapping>> {
    Ok(parse_maps(&fs::read_to_string(format!(
        "/proc/{pid}/maps"
    ))?))
}

/// A path inside the target's mount namespace, reachable from ours.
pub fn path_in_target(pid: u32, path: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root{path}"))
}

/// What tells a file's contents apart without reading them, for caches of
/// what was read from a file: a file replaced (even by one of the same
/// size and times) is another inode, one rewritten in place has a new
/// change time, which no user can set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

/// What was read from files, by a key naming them (by [`FileId`]): at
/// most `most` entries, the one used least recently giving way. Shared
/// by threads; two that miss the same key at once both read it, and the
/// later answer stays.
pub struct Kept<K, V> {
    entries: std::sync::Mutex<Vec<(K, V)>>,
    most: usize,
}

impl<K: PartialEq, V: Clone> Kept<K, V> {
    pub const fn new(most: usize) -> Kept<K, V> {
        Kept {
            entries: std::sync::Mutex::new(Vec::new()),
            most,
        }
    }

    pub fn get(&self, key: &K) -> Option<V> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let i = entries.iter().position(|(k, _)| k == key)?;
        let entry = entries.remove(i);
        let value = entry.1.clone();
        entries.push(entry);
        Some(value)
    }

    pub fn put(&self, key: K, value: V) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.retain(|(k, _)| *k != key);
        if entries.len() >= self.most {
            entries.remove(0);
        }
        entries.push((key, value));
    }
}

impl FileId {
    /// The file at `path` as it is now (`None`: not there).
    pub fn of(path: &Path) -> Option<FileId> {
        fs::metadata(path).ok().map(|m| FileId::of_metadata(&m))
    }

    /// An open file as it is now.
    pub fn of_file(file: &fs::File) -> Option<FileId> {
        file.metadata().ok().map(|m| FileId::of_metadata(&m))
    }

    fn of_metadata(m: &fs::Metadata) -> FileId {
        use std::os::unix::fs::MetadataExt;
        FileId {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

const PF_KTHREAD: u64 = 0x0020_0000;

/// The main thread's stack pointer at exec (`startstack` in
/// `/proc/PID/stat`: where `argc` is; the thread's frames all lie below
/// it), 0 when unknown.
pub fn start_stack(pid: u32) -> u64 {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    stat_fields(&stat)
        .get(28 - 3)
        .and_then(|f| f.parse().ok())
        .unwrap_or(0)
}

/// The fields of `/proc/PID/stat` after the parenthesised command name
/// (which may hold spaces): field 3 (the state) first.
fn stat_fields(stat: &str) -> Vec<&str> {
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    rest.split_whitespace().collect()
}

/// Checks that `pid` is a live user-space process we may trace.
pub fn check_pid(pid: u32) -> Result<()> {
    if pid == 0 {
        return Err(user_error!("no such process: pid 0"));
    }
    let stat = match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(user_error!("no such process: pid {pid}"))
        }
        Err(e) => return Err(user_error!("cannot read /proc/{pid}/stat: {e}")),
    };
    // State is field 3, flags field 9.
    let fields = stat_fields(&stat);
    let state = fields.first().copied().unwrap_or("?");
    if state == "Z" || state == "X" {
        return Err(user_error!("pid {pid} has already exited (zombie)"));
    }
    let flags: u64 = fields.get(6).and_then(|f| f.parse().ok()).unwrap_or(0);
    if flags & PF_KTHREAD != 0 {
        return Err(user_error!(
            "pid {pid} ({}) is a kernel thread: it has no user-space allocator to trace",
            comm(pid)
        ));
    }
    // A thread id that is not a process (thread group leader) id.
    if let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) {
        if let Some(tgid) = status
            .lines()
            .find_map(|l| l.strip_prefix("Tgid:"))
            .and_then(|v| v.trim().parse::<u32>().ok())
        {
            if tgid != pid {
                return Err(user_error!(
                    "pid {pid} is a thread of process {tgid}: trace the process, --pid {tgid}"
                ));
            }
        }
    }
    Ok(())
}

/// Its parent's pid, from `/proc/PID/stat` (after the command name, which
/// may hold anything but ends at the last `)`).
pub fn ppid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The process's name (`comm`), or `?`.
pub fn comm(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim_end().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Name of one thread.
pub fn thread_name(pid: u32, tid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// Names of all live threads of `pid`.
pub fn thread_names(pid: u32) -> Vec<(u32, String)> {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|tid| Some((tid, thread_name(pid, tid)?)))
        .collect()
}

/// The target's executable as it sees it, or empty when unreadable.
pub fn executable(pid: u32) -> String {
    fs::read_link(format!("/proc/{pid}/exe"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The command line, space-separated, or the comm when it is unreadable.
pub fn cmdline(pid: u32) -> String {
    match fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(raw) if !raw.is_empty() => raw
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect::<Vec<_>>()
            .join(" "),
        _ => comm(pid),
    }
}

const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;
const CAP_SYS_ADMIN: u32 = 21;

/// Checks that we can load BPF programs and attach uprobes: root, or
/// CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN).
pub fn check_privileges() -> Result<()> {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let has = |c: u32| cap_eff & (1u64 << c) != 0;
    if has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON)) {
        Ok(())
    } else {
        Err(user_error!(
            "not enough privilege: mtrace needs root, or CAP_BPF and CAP_PERFMON (try sudo)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_maps_lines() {
        let text = "55d0c0a00000-55d0c0a01000 r--p 00000000 fe:01 1234   /usr/bin/cat\n\
                    7f00aa000000-7f00aa021000 rw-p 00000000 00:00 0 \n\
                    7f00ab000000-7f00ab100000 r-xp 00028000 fe:01 99 /usr/lib/libc.so.6 (deleted)\n";
        let maps = parse_maps(text);
        assert_eq!(maps.len(), 3);
        assert_eq!(maps[0].path, "/usr/bin/cat");
        assert_eq!(maps[0].start, 0x55d0c0a00000);
        assert!(maps[0].is_file());
        assert!(!maps[1].is_file());
        assert_eq!(maps[2].offset, 0x28000);
        assert_eq!(maps[2].path, "/usr/lib/libc.so.6 (deleted)");
        assert_eq!(maps[2].file_offset(0x7f00ab000010), 0x28010);
    }
}
