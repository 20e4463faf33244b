//! Names of a JIT's code from the perf map the runtime writes
//! (`/tmp/perf-PID.map`, one `START SIZE name` line per piece of code:
//! `node --perf-basic-prof`, the JVM with a perf-map agent or `jcmd PID
//! Compiler.perfmap`, LuaJIT, .NET), as `perf report` reads it.
//!
//! The file is in the target's /tmp (its mount namespace), named by its
//! pid there, and the target writes it: it may be huge, grow without
//! end, be rewritten, hold junk. Like perf, mtrace reads it only when it
//! is a regular file owned by the target's user or by root (anyone can
//! plant a file in /tmp), never through a symbolic link and never
//! blocking on a FIFO. Each map is read by one thread for all
//! ([`reader`]), only what was appended since the last read, in slices;
//! the names are kept within a ceiling ([`table`]), the oldest evicted
//! first, and what could not be kept or read is counted.

mod reader;
mod table;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::profile::PerfMapQuality;

/// How long the end of a trace waits for its perf maps to be read to
/// where they are (a map that the reader has caught up with takes
/// microseconds; what a hostile map leaves unread is counted).
pub const CATCH_UP: Duration = Duration::from_millis(30);

/// A process's perf map, read in the background; cloning it gives
/// another handle on the same map.
#[derive(Clone, Default)]
pub struct PerfMap {
    shared: Option<Arc<reader::Shared>>,
}

impl PerfMap {
    /// Has the map read again from where its last read stopped (the
    /// first time: opened); returns at once.
    pub fn refresh(&mut self, pid: u32) {
        self.shared
            .get_or_insert_with(|| reader::Shared::new(pid))
            .ask();
    }

    /// Has the map read to its end again, once it was found to be read.
    pub fn ask(&self) {
        if let Some(shared) = &self.shared {
            shared.ask();
        }
    }

    /// Waits until every read asked for is done, or `deadline` (the
    /// reading goes on past it).
    pub fn wait(&self, deadline: Instant) {
        if let Some(shared) = &self.shared {
            shared.wait(deadline);
        }
    }

    /// The name of the JIT code at `addr`.
    pub fn name(&self, addr: u64) -> Option<String> {
        self.shared.as_ref()?.name(addr)
    }

    /// What reading it met; `None` when no perf map was found.
    pub fn quality(&self) -> Option<PerfMapQuality> {
        self.shared.as_ref()?.quality()
    }
}

/// A line `START SIZE NAME` (hexadecimal numbers, `0x` allowed, the name
/// to the end of the line, spaces and all): its start, size and name.
/// `None` for anything else: a line without a name, a size of 0 or of
/// 4 GiB or more.
fn parse_line(line: &[u8]) -> Option<(u64, u32, &[u8])> {
    let line = line.trim_ascii_end();
    let mut parts = line.splitn(3, |&b| b == b' ');
    let (start, size, name) = (parts.next()?, parts.next()?, parts.next()?);
    let (start, size) = (hex(start)?, u32::try_from(hex(size)?).ok()?);
    (size > 0 && !name.is_empty()).then_some((start, size, name))
}

/// A hexadecimal number of at most 64 bits, `0x` allowed. (By hand: the
/// standard library's parses a `str`, and checking that a number is
/// UTF-8 first costs more than parsing it.)
fn hex(s: &[u8]) -> Option<u64> {
    let s = s.strip_prefix(b"0x").unwrap_or(s);
    if s.is_empty() || s.len() > 16 {
        return None;
    }
    s.iter().try_fold(0u64, |n, &c| {
        let digit = char::from(c).to_digit(16)?;
        Some(n << 4 | u64::from(digit))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_as_perf_does() {
        assert_eq!(
            parse_line(b"7f00 10 JS:*leaf /a.js:1:2\r"),
            Some((0x7f00, 0x10, &b"JS:*leaf /a.js:1:2"[..]))
        );
        assert_eq!(
            parse_line(b"0x7f40 0x8 stub with spaces"),
            Some((0x7f40, 8, &b"stub with spaces"[..]))
        );
        assert_eq!(
            parse_line(b"ffffffffffffffff FfFfFfFf x"),
            Some((u64::MAX, u32::MAX, &b"x"[..]))
        );
        for bad in [
            &b"bad line"[..],
            b"7f00 10",
            b"7f00 10 ",
            b"7f00 0 zero",
            b"7f00 100000000 four gibibytes",
            b"xyz 10 name",
            b"+7f00 10 name",
            b"0x 10 name",
            b"10000000000000000 10 seventeen digits",
            b"",
        ] {
            assert_eq!(parse_line(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }
}
