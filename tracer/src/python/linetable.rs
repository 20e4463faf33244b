//! CPython's line tables: from a bytecode byte offset to a source line.
//!
//! Pure functions on the bytes of a code object's table (read out of process
//! by [`super::code`]). Three formats, each specified by CPython itself:
//!
//! - 3.8, 3.9: `co_lnotab` (Objects/lnotab_notes.txt of those versions,
//!   `PyCode_Addr2Line`).
//! - 3.10: `co_linetable` (Objects/lnotab_notes.txt of 3.10, `advance` and
//!   `PyLineTable_NextAddressRange` in Objects/codeobject.c).
//! - 3.11 and later: the location table (Objects/locations.md,
//!   InternalDocs/locations.md since 3.13; `advance`, `get_line_delta` in
//!   Objects/codeobject.c).
//!
//! Every function takes the code object's `co_firstlineno` and a byte offset
//! into its bytecode (`co_code`, or `co_code_adaptive` since 3.11) and gives
//! the line `co_lines()` (3.10+) or `PyCode_Addr2Line` (3.8, 3.9) gives for
//! it. `None` means "no line": the table says so (3.10+), the offset lies past
//! the table's end (3.10+), or the table is malformed. A malformed or truncated
//! table never panics and never reads past the slice.

/// Which of CPython's line table formats a table is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// 3.8, 3.9: `co_lnotab`.
    Lnotab,
    /// 3.10: `co_linetable`.
    Linetable310,
    /// 3.11 and later: `co_linetable`, the location table.
    Locations,
}

/// The line of bytecode byte `offset` in a table of format `format`.
pub fn line(format: Format, table: &[u8], first_line: i32, offset: u32) -> Option<u32> {
    match format {
        Format::Lnotab => lnotab_line(table, first_line, offset),
        Format::Linetable310 => linetable310_line(table, first_line, offset),
        Format::Locations => locations_line(table, first_line, offset),
    }
}

/// A computed line as CPython would report it. Lines are `int`s there; a
/// negative one only comes out of a corrupt table.
fn to_line(line: i64) -> Option<u32> {
    u32::try_from(line).ok()
}

/// 3.8, 3.9 `co_lnotab`: pairs of (unsigned byte-offset increment, signed
/// line increment). Pair k says: from the offset the increments up to and
/// including its own reach, the line is `first_line` plus the line increments
/// up to and including its own. Large increments are split over several pairs
/// (a pair with a 0 byte increment only moves the line, and vice versa).
///
/// Like `PyCode_Addr2Line` of those versions, offsets past the last pair keep
/// the last line (the table has no end marker; the caller checks the offset
/// against the bytecode's length). An odd trailing byte is ignored.
pub fn lnotab_line(table: &[u8], first_line: i32, offset: u32) -> Option<u32> {
    let mut line = i64::from(first_line);
    let mut addr: u64 = 0;
    for pair in table.chunks_exact(2) {
        addr += u64::from(pair[0]);
        if addr > u64::from(offset) {
            break;
        }
        line += i64::from(pair[1] as i8);
    }
    to_line(line)
}

/// 3.10 `co_linetable`: pairs of (unsigned byte length of a range, signed line
/// delta). The ranges are consecutive from offset 0. The line delta applies to
/// a running line that starts at `first_line`, and the range has that line;
/// a delta of -128 means the range has no line and leaves the running line as
/// it is. Zero-length ranges only move the running line.
pub fn linetable310_line(table: &[u8], first_line: i32, offset: u32) -> Option<u32> {
    let offset = u64::from(offset);
    let mut running = i64::from(first_line);
    let mut end: u64 = 0;
    for pair in table.chunks_exact(2) {
        let start = end;
        end += u64::from(pair[0]);
        let delta = pair[1] as i8;
        let line = if delta == -128 {
            None
        } else {
            running += i64::from(delta);
            Some(running)
        };
        if start <= offset && offset < end {
            return line.and_then(to_line);
        }
    }
    None
}

/// 3.11+ location table codes (`_PyCodeLocationInfoKind`).
const LOCATION_ONE_LINE0: u8 = 10;
const LOCATION_ONE_LINE2: u8 = 12;
const LOCATION_NO_COLUMNS: u8 = 13;
const LOCATION_LONG: u8 = 14;
const LOCATION_NONE: u8 = 15;

/// The location code of an entry's first byte: bits 3-6. (Bit 7 marks the
/// first byte of an entry; bits 0-2 are its length in code units, minus one.)
pub fn location_code(first_byte: u8) -> u8 {
    (first_byte >> 3) & 15
}

/// 3.11+ location table: a sequence of entries, each covering 1 to 8 code
/// units (2 bytes each) consecutively from offset 0. An entry's first byte has
/// bit 7 set; the bytes that follow it (varints, column bytes) have it clear.
/// Its code (bits 3-6) says how the line changes relative to the previous
/// entry's (the running line starts at `first_line`):
///
/// - 0-9 short forms: same line (a column byte follows);
/// - 10-12 one-line forms: line + (code - 10) (two column bytes follow);
/// - 13 no columns: line + signed varint;
/// - 14 long form: line + signed varint (end line, columns follow);
/// - 15 no location: the entry has no line; the running line is unchanged.
///
/// Inline cache entries (`CACHE` code units after an instruction) are covered
/// by the entries of their instruction, so any code unit of an instruction,
/// cache included, has the instruction's line.
pub fn locations_line(table: &[u8], first_line: i32, offset: u32) -> Option<u32> {
    let offset = u64::from(offset);
    let mut running = i64::from(first_line);
    let mut end: u64 = 0;
    let mut i = 0;
    while i < table.len() {
        let first = table[i];
        if first & 0x80 == 0 {
            // Not the start of an entry: the table is not a location table.
            return None;
        }
        let code = location_code(first);
        let delta = match code {
            LOCATION_NONE => 0,
            LOCATION_NO_COLUMNS | LOCATION_LONG => read_svarint(&table[i + 1..])?,
            LOCATION_ONE_LINE0..=LOCATION_ONE_LINE2 => i64::from(code - LOCATION_ONE_LINE0),
            _ => 0,
        };
        running += delta;
        end += (u64::from(first & 7) + 1) * 2;
        if offset < end {
            return if code == LOCATION_NONE {
                None
            } else {
                to_line(running)
            };
        }
        // The rest of this entry: every byte up to the next one with bit 7.
        i += 1;
        while i < table.len() && table[i] & 0x80 == 0 {
            i += 1;
        }
    }
    None
}

/// An unsigned varint of the location table: 6 bits a byte, least significant
/// first; bit 6 says another byte follows. `None` if the bytes end before the
/// varint does or it does not fit in 32 bits (CPython's are `unsigned int`).
fn read_varint(bytes: &[u8]) -> Option<u64> {
    let mut value: u64 = 0;
    let mut shift = 0;
    for &b in bytes {
        value |= u64::from(b & 63) << shift;
        if b & 64 == 0 {
            return (value <= u64::from(u32::MAX)).then_some(value);
        }
        shift += 6;
        if shift >= 36 {
            return None;
        }
    }
    None
}

/// A signed varint: an unsigned one with the sign in bit 0 and the magnitude
/// in the bits above.
fn read_svarint(bytes: &[u8]) -> Option<i64> {
    let u = read_varint(bytes)?;
    let magnitude = (u >> 1) as i64;
    Some(if u & 1 != 0 { -magnitude } else { magnitude })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Encodes a location table entry's varint, the way CPython's compiler
    /// does (`write_varint` in Python/assemble.c).
    fn varint(mut v: u32, out: &mut Vec<u8>) {
        while v >= 64 {
            out.push(64 | (v & 63) as u8);
            v >>= 6;
        }
        out.push(v as u8);
    }

    fn svarint(v: i32, out: &mut Vec<u8>) {
        let u = if v < 0 {
            ((v.unsigned_abs()) << 1) | 1
        } else {
            (v as u32) << 1
        };
        varint(u, out);
    }

    fn entry(code: u8, units: u8) -> u8 {
        0x80 | (code << 3) | (units - 1)
    }

    fn lines(format: Format, table: &[u8], first: i32, len: u32) -> Vec<Option<u32>> {
        (0..len).map(|o| line(format, table, first, o)).collect()
    }

    #[test]
    fn python_lnotab_pairs_and_splits() {
        // Offsets 0..6 line 10; 6..300 line 12 (the byte increment of 294
        // split 255+39); at 300 a line jump of +200 split 127+73; at 304 one
        // of -130 split -128-2.
        let table = [6, 2, 255, 0, 39, 127, 0, 73, 4, 0x80, 0, 0xfe];
        // After offset 300: line 12 + 127 + 73 = 212.
        // After offset 304: 212 - 130 = 82.
        assert_eq!(lnotab_line(&table, 10, 0), Some(10));
        assert_eq!(lnotab_line(&table, 10, 5), Some(10));
        assert_eq!(lnotab_line(&table, 10, 6), Some(12));
        assert_eq!(lnotab_line(&table, 10, 260), Some(12));
        assert_eq!(lnotab_line(&table, 10, 299), Some(12));
        assert_eq!(lnotab_line(&table, 10, 300), Some(212));
        assert_eq!(lnotab_line(&table, 10, 303), Some(212));
        assert_eq!(lnotab_line(&table, 10, 304), Some(82));
        // Past the table: the last line, as PyCode_Addr2Line.
        assert_eq!(lnotab_line(&table, 10, 10_000), Some(82));
        assert_eq!(lnotab_line(&[], 7, 0), Some(7));
    }

    #[test]
    fn python_linetable310_ranges_no_line_and_zero_length() {
        // 0..2 line 5 (delta 0); a zero-length range moving the line +127;
        // 2..256 (254) line 5+127+3 = 135; 256..260 no line; 260..262 line
        // 135 - 100 = 35 (the no-line range did not move the running line).
        let table = [2, 0, 0, 127, 254, 3, 4, 0x80, 2, (-100i8) as u8];
        let l = lines(Format::Linetable310, &table, 5, 264);
        assert_eq!(l[0], Some(5));
        assert_eq!(l[1], Some(5));
        assert_eq!(l[2], Some(135));
        assert_eq!(l[255], Some(135));
        assert_eq!(l[256], None);
        assert_eq!(l[259], None);
        assert_eq!(l[260], Some(35));
        assert_eq!(l[261], Some(35));
        // Past the last range: no line.
        assert_eq!(l[262], None);
    }

    #[test]
    fn python_locations_every_form() {
        let mut t = Vec::new();
        // 2 units, short form 0 (same line): column byte.
        t.push(entry(0, 2));
        t.push(5);
        // 1 unit, one-line form +2: two column bytes.
        t.push(entry(12, 1));
        t.extend([1, 9]);
        // 8 units, long form: line -300, end line delta, start/end columns.
        t.push(entry(14, 8));
        svarint(-300, &mut t);
        varint(3, &mut t);
        varint(200, &mut t);
        varint(1, &mut t);
        // 3 units: no location.
        t.push(entry(15, 3));
        // 1 unit: no columns, +1000.
        t.push(entry(13, 1));
        svarint(1000, &mut t);
        // 1 unit: one-line form +0.
        t.push(entry(10, 1));
        t.extend([0, 1]);
        let first = 500;
        let l = lines(Format::Locations, &t, first, 2 * 17);
        let expect = |from: usize, to: usize, line: Option<u32>| {
            for (o, got) in l.iter().enumerate().take(to).skip(from) {
                assert_eq!(*got, line, "offset {o}");
            }
        };
        expect(0, 4, Some(500));
        expect(4, 6, Some(502));
        expect(6, 22, Some(202));
        expect(22, 28, None);
        expect(28, 30, Some(1202));
        expect(30, 32, Some(1202));
        // Past the table.
        expect(32, 34, None);
    }

    #[test]
    fn python_varints() {
        for v in [0u32, 1, 63, 64, 4095, 4096, 1 << 20, u32::MAX] {
            let mut b = Vec::new();
            varint(v, &mut b);
            assert_eq!(read_varint(&b), Some(u64::from(v)), "{v}");
        }
        for v in [
            0i32,
            1,
            -1,
            31,
            -32,
            1000,
            -1000,
            i32::MAX >> 1,
            -(i32::MAX >> 1),
        ] {
            let mut b = Vec::new();
            svarint(v, &mut b);
            assert_eq!(read_svarint(&b), Some(i64::from(v)), "{v}");
        }
        // Truncated, and too long to be CPython's.
        assert_eq!(read_varint(&[64]), None);
        assert_eq!(read_varint(&[]), None);
        assert_eq!(read_varint(&[127; 12]), None);
    }

    #[test]
    fn python_malformed_tables_give_none_not_panics() {
        // A table that does not start with an entry byte.
        assert_eq!(locations_line(&[0x05, 0x80], 1, 0), None);
        // A long-form entry cut off in its line delta.
        assert_eq!(locations_line(&[entry(14, 1), 0x40], 1, 0), None);
        // A line that goes below zero.
        let mut t = vec![entry(13, 1)];
        svarint(-10, &mut t);
        assert_eq!(locations_line(&t, 3, 0), None);
        assert_eq!(lnotab_line(&[2, 0x80], 3, 4), None);
        assert_eq!(linetable310_line(&[2, 0x81], 3, 0), None);
        // Pseudo-random bytes in every format, every offset: no panic.
        let mut x: u32 = 0x1234_5678;
        let mut bytes = vec![0u8; 4096];
        for b in &mut bytes {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *b = x as u8;
        }
        for format in [Format::Lnotab, Format::Linetable310, Format::Locations] {
            for len in [0, 1, 2, 3, 17, 4096] {
                for o in (0..70_000).step_by(97) {
                    let _ = line(format, &bytes[..len], 1, o);
                }
                let _ = line(format, &bytes[..len], i32::MAX, u32::MAX);
                let _ = line(format, &bytes[..len], i32::MIN, u32::MAX);
            }
        }
    }
}
