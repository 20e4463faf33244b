//! Code objects the kernel copied ([`PyCodeSnap`]) at the call that first
//! stored a stack holding them: read as the process's memory would be,
//! so that code the interpreter frees at once (a module's body run at its
//! import, code `exec`'d) is named all the same.

use std::io;

use tracer_common::{py_snap, PyCodeSnap};

use super::code::{self, Code, CodeLayout, Memory};

/// The memory a [`PyCodeSnap`] holds: the code object's first bytes and
/// the first bytes of the objects it points at, each at its address.
struct Copied<'a> {
    parts: [(u64, &'a [u8]); 5],
}

impl<'a> Copied<'a> {
    fn of(s: &'a PyCodeSnap) -> Copied<'a> {
        let part =
            |at: u64, bytes: &'a [u8], len: u32| (at, &bytes[..(len as usize).min(bytes.len())]);
        Copied {
            parts: [
                part(s.code, &s.code_bytes, s.code_len),
                part(s.at[py_snap::NAME], &s.name, s.len[py_snap::NAME]),
                part(s.at[py_snap::FILE], &s.file, s.len[py_snap::FILE]),
                part(s.at[py_snap::TABLE], &s.table, s.len[py_snap::TABLE]),
                part(
                    s.at[py_snap::CODE_OBJ],
                    &s.code_obj,
                    s.len[py_snap::CODE_OBJ],
                ),
            ],
        }
    }

    /// The bytes held from `addr` on.
    fn from(&self, addr: u64) -> Option<&'a [u8]> {
        self.parts.iter().find_map(|&(at, bytes)| {
            let d = addr.checked_sub(at)?;
            (at != 0 && d < bytes.len() as u64).then(|| &bytes[d as usize..])
        })
    }
}

impl Memory for Copied<'_> {
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        match self.from(addr) {
            Some(b) if b.len() >= buf.len() => {
                buf.copy_from_slice(&b[..buf.len()]);
                Ok(())
            }
            _ => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "not in the kernel's copy",
            )),
        }
    }

    fn copied(&self, addr: u64) -> Option<u64> {
        Some(self.from(addr).map_or(0, |b| b.len() as u64))
    }
}

/// The record `bytes` (one of the ring's), when it is a [`PyCodeSnap`].
pub fn parse(bytes: &[u8]) -> Option<PyCodeSnap> {
    if bytes.len() != std::mem::size_of::<PyCodeSnap>() {
        return None;
    }
    // SAFETY: PyCodeSnap is plain data; the record holds one whole.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr() as *const PyCodeSnap) })
}

/// The code object `snap` copied, read with its interpreter's layout
/// (`None`: a version mtrace does not read, or a copy that does not hold
/// what naming it needs).
pub fn read(snap: &PyCodeSnap) -> Option<Code> {
    let layout = CodeLayout::for_minor(snap.minor)?;
    read_with(snap, layout)
}

fn read_with(snap: &PyCodeSnap, layout: &CodeLayout) -> Option<Code> {
    match code::read_code(&Copied::of(snap), layout, snap.code) {
        Ok(c) => Some(c),
        Err(e) => {
            log::debug!("python: the copy of code object {:#x}: {e}", snap.code);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy as the kernel makes it of a 3.11 code object named `f` in
    /// `m.py`, first line 3, whose line table (`lines`) has `table_len`
    /// bytes of which the copy holds `lines.len()`.
    fn snap_311(lines: &[u8], table_len: i64) -> PyCodeSnap {
        let layout = CodeLayout::for_minor(11).unwrap();
        // SAFETY: plain data, all zeroes valid.
        let mut s: PyCodeSnap = unsafe { std::mem::zeroed() };
        s.minor = 11;
        s.code = 0x1000;
        s.code_len = s.code_bytes.len() as u32;
        let put = |b: &mut [u8], at: u64, v: u64| {
            b[at as usize..at as usize + 8].copy_from_slice(&v.to_le_bytes())
        };
        // ob_size: 8 code units; first line 3; name, file and table.
        put(&mut s.code_bytes, 16, 8);
        put(&mut s.code_bytes, layout.co_firstlineno, 3);
        put(&mut s.code_bytes, layout.co_qualname.unwrap(), 0x2000);
        put(&mut s.code_bytes, layout.co_filename, 0x3000);
        put(&mut s.code_bytes, layout.co_linetable, 0x4000);
        let u = layout.unicode;
        let ascii = |b: &mut [u8], text: &str| {
            put(b, u.length, text.len() as u64);
            // Compact, ASCII, kind 1, ready.
            put(b, u.state, (1 << 2) | (1 << 5) | (1 << 6) | (1 << 7));
            let at = u.ascii_data as usize;
            b[at..at + text.len()].copy_from_slice(text.as_bytes());
        };
        ascii(&mut s.name, "f");
        ascii(&mut s.file, "m.py");
        s.at = [0x2000, 0x3000, 0x4000, 0];
        s.len = [
            s.name.len() as u32,
            s.file.len() as u32,
            32 + lines.len() as u32,
            0,
        ];
        put(&mut s.table, 16, table_len as u64);
        s.table[32..32 + lines.len()].copy_from_slice(lines);
        s
    }

    #[test]
    fn a_copied_code_object_is_named_with_its_lines() {
        // Two entries of 2 code units each: line 3 + 1, then + 1 more
        // (short forms "one line" 1).
        let lines = [0x80 | (11 << 3) | 1, 0x80 | (11 << 3) | 1];
        let c = read(&snap_311(&lines, 2)).expect("named");
        assert_eq!(
            (c.name.as_str(), c.file.as_str(), c.first_line),
            ("f", "m.py", 3)
        );
        assert_eq!(c.line_at_offset(0), Some(4));
        assert_eq!(c.line_at_offset(6), Some(5));
    }

    #[test]
    fn a_line_table_cut_short_gives_no_line_past_its_cut() {
        let lines = [0x80 | (11 << 3) | 1];
        let c = read(&snap_311(&lines, 2)).expect("named");
        assert_eq!(c.line_at_offset(0), Some(4));
        assert_eq!(c.line_at_offset(6), None);
    }

    #[test]
    fn a_copy_without_its_name_is_not_read() {
        let mut s = snap_311(&[], 0);
        s.len[py_snap::NAME] = 0;
        assert!(read(&s).is_none());
    }
}
