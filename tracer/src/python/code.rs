//! A CPython code object, read out of process: its name, file and lines.
//!
//! mtrace's BPF probe records, per Python frame, the address of the frame's
//! code object and a raw instruction value (`instr_raw`, see [`Code::line`]).
//! [`read_code`] reads the code object at such an address through a
//! [`Memory`] (the process's `/proc/PID/mem`: [`ProcessMemory`]) with the
//! struct offsets of the interpreter's minor version ([`CodeLayout`]), and
//! [`Code::line`] turns the raw value into a source line.
//!
//! Every read is bounded: a garbage address or a garbage length gives a
//! [`CodeError`], never a large allocation or a panic.
//!
//! The offsets are those of CPython's x86_64 builds (LP64), taken from the
//! debug information of pyenv's 3.8.18, 3.9.18, 3.10.13, 3.11.7, 3.12.1 and
//! 3.13.0 (`ptype /o PyCodeObject` etc. in gdb). They do not change within a
//! minor version: Debian's 3.11.2 has 3.11.7's.

// Until the symbolizer uses this module, only its tests do.

use std::{fmt, fs::File, io, os::unix::fs::FileExt};

use super::linetable::{self, Format};

/// Longest name (`co_qualname` / `co_name`) read, in bytes of string data.
pub const MAX_NAME_BYTES: usize = 1024;
/// Longest file name (`co_filename`) read, in bytes of string data.
pub const MAX_FILE_BYTES: usize = 4096;
/// Longest line table read, in bytes.
pub const MAX_LINE_TABLE_BYTES: usize = 1 << 20;
/// Longest bytecode believed, in bytes. CPython's offsets into it are C
/// `int`s; a length above this is taken for garbage, not for a program.
pub const MAX_CODE_BYTES: u64 = 1 << 28;

/// Where a reader finds things in an interpreter's objects (x86_64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeLayout {
    /// The interpreter's minor version: 3.`minor`.
    pub minor: u32,
    /// `PyCodeObject.co_firstlineno` (C `int`).
    pub co_firstlineno: u64,
    /// `PyCodeObject.co_name` (`str *`).
    pub co_name: u64,
    /// `PyCodeObject.co_qualname` (`str *`), 3.11 and later.
    pub co_qualname: Option<u64>,
    /// `PyCodeObject.co_filename` (`str *`).
    pub co_filename: u64,
    /// The line table (`bytes *`): `co_lnotab` (3.8, 3.9) or `co_linetable`
    /// (3.10+).
    pub co_linetable: u64,
    /// The format of that table.
    pub line_format: Format,
    /// `PyCodeObject.co_code` (`bytes *`, the bytecode), up to 3.10.
    pub co_code: Option<u64>,
    /// `PyCodeObject.co_code_adaptive` (the bytecode, inline), 3.11 and
    /// later. There the code object is a variable-size object whose `ob_size`
    /// counts the bytecode's 2-byte code units; `type(code).__basicsize__`
    /// equals this offset.
    pub co_code_adaptive: Option<u64>,
    /// How [`Code::line`] reads `instr_raw`.
    pub instr: InstrForm,
    /// `str` objects.
    pub unicode: UnicodeLayout,
}

/// Where a reader finds things in a `str` (`PyASCIIObject`,
/// `PyCompactUnicodeObject`, `PyUnicodeObject`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnicodeLayout {
    /// `length`: the number of code points (`Py_ssize_t`).
    pub length: u64,
    /// `state`: the bit field of `interned` (bits 0-1), `kind` (bits 2-4:
    /// 1, 2 or 4 bytes a code point), `compact` (bit 5), `ascii` (bit 6) and,
    /// up to 3.11, `ready` (bit 7).
    pub state: u64,
    /// `sizeof(PyASCIIObject)`: where a compact ASCII string's data begins.
    pub ascii_data: u64,
    /// `sizeof(PyCompactUnicodeObject)`: where a compact non-ASCII string's
    /// data begins, and where a non-compact string (`PyUnicodeObject`) keeps
    /// the pointer to its data (`data.any`).
    pub compact_data: u64,
    /// Whether bit 7 of `state` is `ready` (3.8-3.11); a string that is not
    /// ready has only its `wchar_t` form.
    pub has_ready_bit: bool,
}

/// How the raw instruction value the BPF probe records for a frame locates
/// the frame's current instruction (the contract with the BPF side).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstrForm {
    /// 3.8, 3.9: `PyFrameObject.f_lasti` as stored (a C `int`): the byte
    /// offset of the last instruction started; -1 before the first.
    LastiBytes,
    /// 3.10: `PyFrameObject.f_lasti` as stored (a C `int`): the index of the
    /// last instruction started in 2-byte code units; -1 before the first.
    LastiUnits,
    /// 3.11, 3.12: `frame->prev_instr` minus the code object's address, in
    /// bytes; 3.13: `frame->instr_ptr` minus it. The bytecode byte offset is
    /// that minus the offset of `co_code_adaptive`. Before a 3.11/3.12 frame
    /// runs its first instruction, `prev_instr` is one code unit before the
    /// bytecode.
    FromCodeObject,
}

/// `ob_type` in every object (`PyObject`).
const OB_TYPE: u64 = 8;
/// `ob_size` in variable-size objects (`PyVarObject`): `bytes`, and code
/// objects since 3.11.
const OB_SIZE: u64 = 16;
/// `tp_name` in `PyTypeObject` (a `PyVarObject` header, then the name).
const TP_NAME: u64 = 24;
/// `ob_sval` in `PyBytesObject`: where a `bytes` object's data begins.
const OB_SVAL: u64 = 32;

/// `str` up to 3.11: `PyASCIIObject` has a `wchar_t *wstr` after `state`.
const UNICODE_3_8: UnicodeLayout = UnicodeLayout {
    length: 16,
    state: 32,
    ascii_data: 48,
    compact_data: 72,
    has_ready_bit: true,
};

/// `str` since 3.12 (PEP 623 removed `wstr` and `wstr_length`).
const UNICODE_3_12: UnicodeLayout = UnicodeLayout {
    length: 16,
    state: 32,
    ascii_data: 40,
    compact_data: 56,
    has_ready_bit: false,
};

/// 3.8 and 3.9 share every offset used here.
const LAYOUT_3_8: CodeLayout = CodeLayout {
    minor: 8,
    co_firstlineno: 40,
    co_name: 112,
    co_qualname: None,
    co_filename: 104,
    co_linetable: 120,
    line_format: Format::Lnotab,
    co_code: Some(48),
    co_code_adaptive: None,
    instr: InstrForm::LastiBytes,
    unicode: UNICODE_3_8,
};

/// 3.11: the code object's fields moved for the specialising
/// interpreter, its bytecode inline (`co_code_adaptive`).
const LAYOUT_3_11: CodeLayout = CodeLayout {
    minor: 11,
    co_firstlineno: 72,
    co_name: 120,
    co_qualname: Some(128),
    co_filename: 112,
    co_linetable: 136,
    line_format: Format::Locations,
    co_code: None,
    co_code_adaptive: Some(184),
    instr: InstrForm::FromCodeObject,
    unicode: UNICODE_3_8,
};

/// 3.12: as 3.11 but for the first line's offset, the bytecode's and the
/// strings' layout.
const LAYOUT_3_12: CodeLayout = CodeLayout {
    minor: 12,
    co_firstlineno: 68,
    co_code_adaptive: Some(192),
    unicode: UNICODE_3_12,
    ..LAYOUT_3_11
};

/// The layouts by minor version, 3.8 to 3.13.
const LAYOUTS: [CodeLayout; 6] = [
    LAYOUT_3_8,
    CodeLayout {
        minor: 9,
        ..LAYOUT_3_8
    },
    CodeLayout {
        minor: 10,
        line_format: Format::Linetable310,
        instr: InstrForm::LastiUnits,
        ..LAYOUT_3_8
    },
    LAYOUT_3_11,
    LAYOUT_3_12,
    CodeLayout {
        minor: 13,
        co_code_adaptive: Some(200),
        ..LAYOUT_3_12
    },
];

impl CodeLayout {
    /// The layout of CPython 3.`minor` on x86_64; `None` outside 3.8-3.13.
    pub fn for_minor(minor: u32) -> Option<&'static CodeLayout> {
        LAYOUTS.iter().find(|l| l.minor == minor)
    }
}

/// Reads another process's memory.
pub trait Memory {
    /// Fills `buf` from `addr` on, or fails (an unmapped address, a process
    /// gone); a short read is a failure.
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()>;

    /// A copy of some of the memory (not the process's own): the bytes
    /// it holds from `addr` on. A copy was taken of a code object known
    /// then (its type is not checked), and a line table it cut short is
    /// read as far as it goes.
    fn copied(&self, _addr: u64) -> Option<u64> {
        None
    }
}

/// A process's memory through `/proc/PID/mem`, opened once. Reading needs
/// ptrace access to the process (root, or its parent under Yama's default).
#[derive(Debug)]
pub struct ProcessMemory {
    file: File,
}

impl ProcessMemory {
    pub fn open(pid: u32) -> io::Result<Self> {
        Ok(Self {
            file: File::open(format!("/proc/{pid}/mem"))?,
        })
    }
}

impl Memory for ProcessMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, addr)
    }
}

/// Why a code object could not be read.
#[derive(Debug)]
pub enum CodeError {
    /// Memory that should hold `what` could not be read.
    Read {
        what: &'static str,
        addr: u64,
        source: io::Error,
    },
    /// The object at the address is not a code object (its type's name is
    /// not `code`).
    NotCode { addr: u64 },
    /// A length beyond what is read (or believed).
    TooLong {
        what: &'static str,
        len: u64,
        max: u64,
    },
    /// A value no live interpreter holds.
    Invalid { what: &'static str, value: i64 },
}

impl fmt::Display for CodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodeError::Read { what, addr, source } => {
                write!(f, "reading {what} at {addr:#x}: {source}")
            }
            CodeError::NotCode { addr } => write!(f, "no code object at {addr:#x}"),
            CodeError::TooLong { what, len, max } => {
                write!(f, "{what}: {len} bytes, more than {max}")
            }
            CodeError::Invalid { what, value } => write!(f, "{what}: invalid value {value}"),
        }
    }
}

impl std::error::Error for CodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CodeError::Read { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// A code object's name, file and line table, as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Code {
    /// `co_qualname` where the version has it (3.11+), else `co_name`.
    pub name: String,
    /// `co_filename`.
    pub file: String,
    /// `co_firstlineno`.
    pub first_line: u32,
    /// The bytecode's length in bytes.
    pub code_len: u32,
    instr: InstrForm,
    /// The offset of `co_code_adaptive` (3.11+), else 0.
    code_adaptive: u32,
    format: Format,
    line_table: Vec<u8>,
    /// The line table was cut short (a copy's): offsets past what it
    /// holds have no line.
    cut: bool,
}

/// Where `instr_raw` points (see [`Code::byte_offset`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstrOffset {
    /// The frame has not started its first instruction.
    NotStarted,
    /// A byte offset into the bytecode (not checked against its length).
    At(u32),
}

impl Code {
    /// Where in the bytecode the raw instruction value of a frame points:
    ///
    /// - 3.8, 3.9: `instr_raw` is `f_lasti` (a C `int` stored in 32 bits), a
    ///   byte offset.
    /// - 3.10: `f_lasti`, an index of 2-byte code units: byte offset
    ///   `2 * f_lasti`.
    /// - 3.11, 3.12: `prev_instr - code object address`; 3.13:
    ///   `instr_ptr - code object address`, in bytes: byte offset
    ///   `instr_raw - offsetof(co_code_adaptive)`.
    ///
    /// A negative `f_lasti`, or a pointer before `co_code_adaptive` (3.11 and
    /// 3.12 start a frame with `prev_instr` one code unit before it), is a
    /// frame that has not started.
    pub fn byte_offset(&self, instr_raw: u32) -> InstrOffset {
        match self.instr {
            InstrForm::LastiBytes => match u32::try_from(instr_raw as i32) {
                Ok(off) => InstrOffset::At(off),
                Err(_) => InstrOffset::NotStarted,
            },
            InstrForm::LastiUnits => match u32::try_from(instr_raw as i32) {
                // 2 * i32::MAX fits in u32.
                Ok(units) => InstrOffset::At(units * 2),
                Err(_) => InstrOffset::NotStarted,
            },
            InstrForm::FromCodeObject => match instr_raw.checked_sub(self.code_adaptive) {
                Some(off) => InstrOffset::At(off),
                None => InstrOffset::NotStarted,
            },
        }
    }

    /// The source line of a frame of this code whose probe recorded
    /// `instr_raw` (its form by version: [`Code::byte_offset`]).
    ///
    /// - Any byte of an instruction, its inline `CACHE` code units (3.11+)
    ///   included, has the instruction's line: the line tables cover cache
    ///   units with their instruction's entries. A frame in the middle of a
    ///   call points at the call's opcode or, for a Python-to-Python call in
    ///   3.11 and 3.12, at its last cache unit; both have the call's line.
    /// - A frame that has not started has `first_line`, as py-spy reports
    ///   (and as `PyCode_Addr2Line` gives for a negative offset).
    /// - An offset at or past the bytecode's end gives `None` (py-spy would
    ///   report the last line it decoded; such a value is not a live frame's).
    /// - An instruction the table gives no line (3.10+: compiler-generated
    ///   code, e.g. exception cleanup) gives `None`, as `co_lines()` does.
    pub fn line(&self, instr_raw: u32) -> Option<u32> {
        match self.byte_offset(instr_raw) {
            InstrOffset::NotStarted => Some(self.first_line),
            InstrOffset::At(off) => self.line_at_offset(off),
        }
    }

    /// The source line of bytecode byte `offset`; `None` past the bytecode
    /// or where the table gives none.
    pub fn line_at_offset(&self, offset: u32) -> Option<u32> {
        if offset >= self.code_len {
            return None;
        }
        if self.cut && self.format == Format::Lnotab {
            // (Past its last pair, an lnotab gives its last line.)
            let covered: u64 = self
                .line_table
                .chunks_exact(2)
                .map(|p| u64::from(p[0]))
                .sum();
            if u64::from(offset) >= covered {
                return None;
            }
        }
        // first_line came from a C int.
        linetable::line(
            self.format,
            &self.line_table,
            self.first_line as i32,
            offset,
        )
    }

    /// Whether the line table was cut short (a kernel's copy of it).
    pub fn lines_cut(&self) -> bool {
        self.cut
    }

    /// The raw bytes of the line table.
    #[cfg(test)]
    pub fn line_table(&self) -> &[u8] {
        &self.line_table
    }
}

/// Reads the code object at `addr` with the offsets of `layout`.
///
/// Checks that the object's type is named `code`, then reads its name
/// (`co_qualname` where there is one), file name, first line, line table and
/// bytecode length, each within the bounds of the `MAX_*` constants.
pub fn read_code(mem: &impl Memory, layout: &CodeLayout, addr: u64) -> Result<Code, CodeError> {
    if mem.copied(addr).is_none() {
        check_type_name(mem, addr, b"code\0")?;
    }

    let first_line = read_i32(mem, "co_firstlineno", add(addr, layout.co_firstlineno)?)?;
    let first_line = u32::try_from(first_line).map_err(|_| CodeError::Invalid {
        what: "co_firstlineno",
        value: first_line.into(),
    })?;

    let name_field = layout.co_qualname.unwrap_or(layout.co_name);
    let name_ptr = read_u64(mem, "co_name", add(addr, name_field)?)?;
    let name = read_str(mem, &layout.unicode, "co_name", name_ptr, MAX_NAME_BYTES)?;
    let file_ptr = read_u64(mem, "co_filename", add(addr, layout.co_filename)?)?;
    let file = read_str(
        mem,
        &layout.unicode,
        "co_filename",
        file_ptr,
        MAX_FILE_BYTES,
    )?;

    let table_ptr = read_u64(mem, "co_linetable", add(addr, layout.co_linetable)?)?;
    let (line_table, cut) = read_table(mem, table_ptr)?;

    let code_len = match (layout.co_code, layout.co_code_adaptive) {
        (_, Some(_)) => {
            let units = read_i64(mem, "code object ob_size", add(addr, OB_SIZE)?)?;
            byte_len("bytecode", units, 2)?
        }
        (Some(co_code), None) => {
            let bytes = read_u64(mem, "co_code", add(addr, co_code)?)?;
            let len = read_i64(mem, "co_code ob_size", add(bytes, OB_SIZE)?)?;
            byte_len("bytecode", len, 1)?
        }
        (None, None) => unreachable!("every layout has co_code or co_code_adaptive"),
    };
    // byte_len bounds it by MAX_CODE_BYTES, which fits in u32.
    let code_len = code_len as u32;

    Ok(Code {
        name,
        file,
        first_line,
        code_len,
        instr: layout.instr,
        code_adaptive: layout.co_code_adaptive.unwrap_or(0) as u32,
        format: layout.line_format,
        line_table,
        cut,
    })
}

/// A line table's bytes, and whether they were cut short (a copy that
/// holds fewer than the table has).
fn read_table(mem: &impl Memory, addr: u64) -> Result<(Vec<u8>, bool), CodeError> {
    let what = "co_linetable";
    let Some(held) = mem.copied(addr) else {
        return Ok((read_bytes(mem, what, addr, MAX_LINE_TABLE_BYTES)?, false));
    };
    let len = read_i64(mem, what, add(addr, OB_SIZE)?)?;
    let len = u64::try_from(len).map_err(|_| CodeError::Invalid { what, value: len })?;
    let fits = len.min(held.saturating_sub(OB_SVAL));
    let bytes = read_vec(mem, what, add(addr, OB_SVAL)?, fits, MAX_LINE_TABLE_BYTES)?;
    Ok((bytes, fits < len))
}

/// `base + offset`, or an error if that wraps (a garbage pointer).
fn add(base: u64, offset: u64) -> Result<u64, CodeError> {
    base.checked_add(offset).ok_or(CodeError::Invalid {
        what: "address",
        value: base as i64,
    })
}

fn read_exact<const N: usize>(
    mem: &impl Memory,
    what: &'static str,
    addr: u64,
) -> Result<[u8; N], CodeError> {
    let mut buf = [0u8; N];
    mem.read(addr, &mut buf)
        .map_err(|source| CodeError::Read { what, addr, source })?;
    Ok(buf)
}

fn read_u64(mem: &impl Memory, what: &'static str, addr: u64) -> Result<u64, CodeError> {
    read_exact::<8>(mem, what, addr).map(u64::from_le_bytes)
}

fn read_i64(mem: &impl Memory, what: &'static str, addr: u64) -> Result<i64, CodeError> {
    read_exact::<8>(mem, what, addr).map(i64::from_le_bytes)
}

fn read_i32(mem: &impl Memory, what: &'static str, addr: u64) -> Result<i32, CodeError> {
    read_exact::<4>(mem, what, addr).map(i32::from_le_bytes)
}

/// Reads `len` bytes after checking `len <= max`: the allocation is bounded
/// by `max`, whatever the target's memory says.
fn read_vec(
    mem: &impl Memory,
    what: &'static str,
    addr: u64,
    len: u64,
    max: usize,
) -> Result<Vec<u8>, CodeError> {
    if len > max as u64 {
        return Err(CodeError::TooLong {
            what,
            len,
            max: max as u64,
        });
    }
    let mut buf = vec![0u8; len as usize];
    mem.read(addr, &mut buf)
        .map_err(|source| CodeError::Read { what, addr, source })?;
    Ok(buf)
}

/// `count * unit` bytes for a count read from the target (`Py_ssize_t`):
/// negative or beyond [`MAX_CODE_BYTES`] is an error.
fn byte_len(what: &'static str, count: i64, unit: u64) -> Result<u64, CodeError> {
    let count = u64::try_from(count).map_err(|_| CodeError::Invalid { what, value: count })?;
    match count.checked_mul(unit) {
        Some(len) if len <= MAX_CODE_BYTES => Ok(len),
        _ => Err(CodeError::TooLong {
            what,
            len: count.saturating_mul(unit),
            max: MAX_CODE_BYTES,
        }),
    }
}

/// Checks that the object at `addr` has a type whose `tp_name` is `name`
/// (NUL included).
fn check_type_name(mem: &impl Memory, addr: u64, name: &[u8]) -> Result<(), CodeError> {
    let ty = read_u64(mem, "ob_type", add(addr, OB_TYPE)?)?;
    let tp_name = read_u64(mem, "tp_name", add(ty, TP_NAME)?)?;
    let mut buf = [0u8; 16];
    let buf = &mut buf[..name.len()];
    mem.read(tp_name, buf).map_err(|source| CodeError::Read {
        what: "tp_name",
        addr: tp_name,
        source,
    })?;
    if buf != name {
        return Err(CodeError::NotCode { addr });
    }
    Ok(())
}

/// A `bytes` object's contents, at most `max` bytes.
fn read_bytes(
    mem: &impl Memory,
    what: &'static str,
    addr: u64,
    max: usize,
) -> Result<Vec<u8>, CodeError> {
    let len = read_i64(mem, what, add(addr, OB_SIZE)?)?;
    let len = u64::try_from(len).map_err(|_| CodeError::Invalid { what, value: len })?;
    read_vec(mem, what, add(addr, OB_SVAL)?, len, max)
}

/// A `str` object's contents, at most `max` bytes of its data (1, 2 or 4
/// bytes a code point). Code points that are not Unicode scalar values (lone
/// surrogates, e.g. from undecodable file names) become U+FFFD.
fn read_str(
    mem: &impl Memory,
    layout: &UnicodeLayout,
    what: &'static str,
    addr: u64,
    max: usize,
) -> Result<String, CodeError> {
    let length = read_i64(mem, what, add(addr, layout.length)?)?;
    let state = u32::from_le_bytes(read_exact::<4>(mem, what, add(addr, layout.state)?)?);
    let kind = (state >> 2) & 7;
    let compact = state & (1 << 5) != 0;
    let ascii = state & (1 << 6) != 0;
    let invalid = |value: i64| CodeError::Invalid { what, value };
    if !matches!(kind, 1 | 2 | 4) || (ascii && kind != 1) {
        return Err(invalid(state.into()));
    }
    if layout.has_ready_bit && state & (1 << 7) == 0 {
        // A legacy string that only has its wchar_t form.
        return Err(invalid(state.into()));
    }
    let length = u64::try_from(length).map_err(|_| invalid(length))?;
    let len = length.checked_mul(kind.into()).ok_or(CodeError::TooLong {
        what,
        len: u64::MAX,
        max: max as u64,
    })?;
    let data = match (compact, ascii) {
        (true, true) => add(addr, layout.ascii_data)?,
        (true, false) => add(addr, layout.compact_data)?,
        (false, _) => read_u64(mem, what, add(addr, layout.compact_data)?)?,
    };
    let bytes = read_vec(mem, what, data, len, max)?;
    Ok(match kind {
        1 if ascii => String::from_utf8_lossy(&bytes).into_owned(),
        // Latin-1: the code point is the byte.
        1 => bytes.iter().map(|&b| char::from(b)).collect(),
        2 => bytes
            .chunks_exact(2)
            .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
            .map(|c| char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER))
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .map(|c| char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER))
            .collect(),
    })
}

#[cfg(test)]
mod tests;
