//! Names of a JIT's code from the perf map the runtime writes
//! (`/tmp/perf-PID.map`, one `START SIZE name` line per piece of code:
//! `node --perf-basic-prof`, the JVM with a perf-map agent, LuaJIT, .NET),
//! as `perf report` reads it.
//!
//! The file is in the target's /tmp (its mount namespace), named by its
//! pid there. Like perf, mtrace reads it only when it is a regular file
//! owned by the target's user or by root (anyone can plant a file in
//! /tmp), and only so much of it.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read},
    os::unix::fs::{MetadataExt, OpenOptionsExt},
};

/// Most bytes of a perf map read (a long-running JVM's grows without end).
const MAX_BYTES: u64 = 256 << 20;

/// JIT code by start address: (end, name). A later line for the same
/// start (code recompiled in place) replaces the earlier.
#[derive(Default)]
pub struct PerfMap {
    code: BTreeMap<u64, (u64, String)>,
    /// (size, modification time) of the file as last read.
    read: Option<(u64, i64)>,
}

impl PerfMap {
    /// Reads the target's perf map again if it changed since the last read.
    pub fn refresh(&mut self, pid: u32) {
        let ns_pid = namespace_pid(pid).unwrap_or(pid);
        let path = format!("/proc/{pid}/root/tmp/perf-{ns_pid}.map");
        let Ok(file) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        else {
            return;
        };
        let Ok(meta) = file.metadata() else { return };
        let owner_ok = meta.uid() == 0 || Some(meta.uid()) == target_uid(pid);
        if !meta.is_file() || !owner_ok {
            log::debug!("{path}: not a regular file of the target's user or root: not read");
            return;
        }
        let stamp = (meta.len(), meta.mtime());
        if self.read == Some(stamp) {
            return;
        }
        self.read = Some(stamp);
        self.code = parse(BufReader::new(file.take(MAX_BYTES)));
    }

    /// The name of the JIT code at `addr`.
    pub fn name(&self, addr: u64) -> Option<&str> {
        let (_, (end, name)) = self.code.range(..=addr).next_back()?;
        (addr < *end).then_some(name.as_str())
    }
}

fn parse(r: impl BufRead) -> BTreeMap<u64, (u64, String)> {
    let mut code = BTreeMap::new();
    for line in r.split(b'\n').map_while(Result::ok) {
        let line = String::from_utf8_lossy(&line);
        let mut parts = line.trim_end().splitn(3, ' ');
        let (Some(start), Some(size), Some(name)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
        if let (Some(start), Some(size)) = (hex(start), hex(size)) {
            if size > 0 && !name.is_empty() {
                code.insert(start, (start.saturating_add(size), name.to_string()));
            }
        }
    }
    code
}

/// The target's pid in its own pid namespace (the last of `NSpid`).
fn namespace_pid(pid: u32) -> Option<u32> {
    status_field(pid, "NSpid:")?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The target's real user id.
fn target_uid(pid: u32) -> Option<u32> {
    status_field(pid, "Uid:")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn status_field(pid: u32, name: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(name).map(str::to_string))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_and_finds_the_code_at_an_address() {
        let text = "7f00 10 JS:*leaf /a.js:1:2\nbad line\n0x7f40 8 stub with spaces\n7f00 20 JS:*leaf recompiled\n";
        let map = PerfMap {
            code: parse(text.as_bytes()),
            read: None,
        };
        assert_eq!(map.name(0x7f00), Some("JS:*leaf recompiled"));
        assert_eq!(map.name(0x7f1f), Some("JS:*leaf recompiled"));
        assert_eq!(map.name(0x7f20), None);
        assert_eq!(map.name(0x7f47), Some("stub with spaces"));
        assert_eq!(map.name(0x7f48), None);
        assert_eq!(map.name(0x10), None);
    }
}
