//! The host scope's JIT code: a process that maps code no file backs (a
//! JIT's) has its perf map read (`/tmp/perf-PID.map`, with the per-process
//! engine's reader and its guards against a planted or hostile file) from
//! the first look that finds such code, while it lives; a frame in that
//! code is named from it, as a traced process's is.

use std::{
    collections::{HashMap, HashSet},
    time::Instant,
};

use crate::{
    profile::PerfMapQuality,
    tracee::perf_map::{self, PerfMap},
};

/// The perf maps of the scope's processes with JIT code, by process id.
#[derive(Default)]
pub struct HostJit {
    maps: HashMap<u32, PerfMap>,
}

/// Processes whose perf maps are read at once, at most (the oldest
/// forgotten past it: a host of many JIT processes, each map's names kept
/// within their own ceiling).
const MAPS_KEPT: usize = 256;

impl HostJit {
    /// Looks at process `pid`'s mappings (`maps`, its `/proc/PID/maps`):
    /// with code no file backs, its perf map is read from now on.
    pub fn look(&mut self, pid: u32, maps: &str) {
        if self.maps.contains_key(&pid) || !maps.lines().any(anonymous_code) {
            return;
        }
        if self.maps.len() >= MAPS_KEPT {
            return;
        }
        let mut map = PerfMap::default();
        map.refresh(pid);
        self.maps.insert(pid, map);
    }

    /// Reads process `pid`'s perf map through `map` (a handle on the one
    /// its walks' mappings started reading), unless one is read already.
    pub fn adopt(&mut self, pid: u32, map: PerfMap) {
        if self.maps.len() < MAPS_KEPT {
            self.maps.entry(pid).or_insert(map);
        }
    }

    /// Has every map read to where it is now, waiting a moment at most
    /// (what is left is counted as unread).
    pub fn catch_up(&mut self) {
        for (pid, m) in self.maps.iter_mut() {
            m.refresh(*pid);
        }
        let until = Instant::now() + perf_map::CATCH_UP;
        for m in self.maps.values() {
            m.wait(until);
        }
    }

    /// The name of process `pid`'s JIT code at `addr`.
    pub fn name(&self, pid: u32, addr: u64) -> Option<String> {
        self.maps.get(&pid)?.name(addr)
    }

    /// What reading the maps met, over every process.
    pub fn quality(&self) -> Option<PerfMapQuality> {
        self.maps
            .values()
            .filter_map(PerfMap::quality)
            .reduce(PerfMapQuality::plus)
    }

    /// [`HostJit::quality`] of processes `pids` alone.
    pub fn quality_of(&self, pids: &HashSet<u32>) -> Option<PerfMapQuality> {
        self.maps
            .iter()
            .filter(|(p, _)| pids.contains(p))
            .filter_map(|(_, m)| m.quality())
            .reduce(PerfMapQuality::plus)
    }

    /// Forgets processes `gone` (their rows are read out for good).
    pub fn forget(&mut self, gone: &HashSet<u32>) {
        self.maps.retain(|p, _| !gone.contains(p));
    }
}

/// Whether a `/proc/PID/maps` line is executable memory no file backs.
fn anonymous_code(line: &str) -> bool {
    let mut fields = line.split_ascii_whitespace();
    let perms = fields.nth(1).unwrap_or("");
    let inode = fields.nth(2).unwrap_or("0");
    let path = fields.next().unwrap_or("");
    perms.contains('x') && inode == "0" && (path.is_empty() || path.starts_with("[anon"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn anonymous_code_is_executable_memory_without_a_file() {
        use super::anonymous_code;
        assert!(anonymous_code(
            "7f0000000000-7f0000001000 rwxp 00000000 00:00 0"
        ));
        assert!(anonymous_code(
            "7f0000000000-7f0000001000 r-xp 00000000 00:00 0 [anon:v8]"
        ));
        assert!(!anonymous_code(
            "7f0000000000-7f0000001000 r-xp 00000000 08:01 1234 /usr/lib/libc.so.6"
        ));
        assert!(!anonymous_code(
            "7f0000000000-7f0000001000 rw-p 00000000 00:00 0"
        ));
        assert!(!anonymous_code(
            "7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0 [vdso]"
        ));
    }
}
