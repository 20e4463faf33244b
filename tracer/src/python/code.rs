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
    CodeLayout {
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
    },
    CodeLayout {
        minor: 12,
        co_firstlineno: 68,
        co_name: 120,
        co_qualname: Some(128),
        co_filename: 112,
        co_linetable: 136,
        line_format: Format::Locations,
        co_code: None,
        co_code_adaptive: Some(192),
        instr: InstrForm::FromCodeObject,
        unicode: UNICODE_3_12,
    },
    CodeLayout {
        minor: 13,
        co_firstlineno: 68,
        co_name: 120,
        co_qualname: Some(128),
        co_filename: 112,
        co_linetable: 136,
        line_format: Format::Locations,
        co_code: None,
        co_code_adaptive: Some(200),
        instr: InstrForm::FromCodeObject,
        unicode: UNICODE_3_12,
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
        // first_line came from a C int.
        linetable::line(
            self.format,
            &self.line_table,
            self.first_line as i32,
            offset,
        )
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
    check_type_name(mem, addr, b"code\0")?;

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
    let line_table = read_bytes(mem, "co_linetable", table_ptr, MAX_LINE_TABLE_BYTES)?;

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
    })
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
mod tests {
    //! Real interpreters: a script defines a variety of functions and prints,
    //! for every code object, its address and what Python says of it (name,
    //! file, first line, the line of every bytecode byte offset); the test
    //! reads each one out of the live process and compares. Plus garbage
    //! addresses, and made-up objects with absurd fields.

    use super::*;
    use std::{
        collections::{BTreeMap, BTreeSet, HashMap},
        io::{BufRead, BufReader},
        path::Path,
        process::{Child, Command, Stdio},
    };

    /// The functions whose code objects are checked. `#GAP n` lines become
    /// n empty lines and `WIDE` a 200-term sum (many bytes of bytecode on one
    /// line), so that the tables need their multi-entry and long forms.
    const PAYLOAD: &str = r##""""Code objects for the out-of-process reader to name and map to lines."""
import sys


def mark(depth):
    # Records the frame `depth` levels up while it is in the middle of a call.
    f = sys._getframe(depth)
    MARKS.append({"code": id(f.f_code), "lasti": f.f_lasti, "line": f.f_lineno})


MARKS = []


def top_level(a, b):
    c = a + b
    return c * 2


class Outer:
    def method(self, x):
        return x + 1

    class Inner:
        def deep(self):
            def closure():
                return 42

            return closure

    @staticmethod
    def static():
        return [i * i for i in range(3)]

    @property
    def prop(self):
        return self.method(1)


square = lambda v: v * v


def comprehensions(n):
    a = [i for i in range(n)]
    b = {i: i for i in range(n)}
    c = {i for i in range(n)}
    d = list(i for i in range(n))
    return a, b, c, d


def café_crème():
    return 1


def функция():
    return 2


def 𠀀𠀁():
    return 3


def backwards(n):
    total = 0
    i = 0
    while i < n:
        total += i
#GAP 200
        i += 1
    for j in range(n):
        if j % 2:
            continue
        total -= j
    return total


def handlers(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        return str(e)
    finally:
        top_level(1, 2)


async def coro():
    return 1


def gen():
    yield 1
    yield from range(2)


def gaps(n):
    x = n
#GAP 130
    y = x + 1
#GAP 300
    z = (x +
#GAP 140
         y)
#GAP 700
    w = (WIDE)
    mark(1)
    very_long_name_so_that_columns_exceed_one_hundred_and_twenty_seven = top_level(x, y) + top_level(z, w) + top_level(1, 2)
    return very_long_name_so_that_columns_exceed_one_hundred_and_twenty_seven


def py_caller():
    mark(1)
    return 1


def kw_caller():
    mark(depth=1)
    return 2


def key_mark(v):
    mark(2)
    return v


def c_caller():
    return sorted([3, 1, 2], key=key_mark)


class Methods:
    def helper(self):
        mark(2)

    def calls_method(self):
        self.helper()
        return 3


def run():
    top_level(1, 2)
    Outer().prop
    Outer.Inner().deep()()
    Outer.static()
    square(3)
    comprehensions(3)
    café_crème()
    функция()
    𠀀𠀁()
    backwards(3)
    handlers("/nonexistent")
    gaps(1)
    py_caller()
    kw_caller()
    c_caller()
    Methods().calls_method()
"##;

    /// A module in a file with a non-ASCII path (directory and name).
    const MODULE_DIR: &str = "dïr_文件";
    const MODULE_FILE: &str = "módulo_ñ.py";
    const MODULE: &str = r##"def élan(x):
    return x


class Ünïcode:
    def 方法(self):
        return élan(1)
"##;

    /// Loads both, runs them, prints one line of JSON and waits until its
    /// parent (the test) goes.
    const RUNNER: &str = r##"import dis, json, os, sys, time, types

here = os.path.dirname(os.path.abspath(__file__))


def load(path):
    with open(path, encoding="utf-8") as f:
        src = f.read()
    out = []
    for line in src.split("\n"):
        if line.startswith("#GAP "):
            out.extend([""] * int(line.split()[1]))
        else:
            out.append(line.replace("WIDE", " + ".join(["x"] * 200)))
    code = compile("\n".join(out), path, "exec")
    ns = {"__name__": os.path.basename(path)[:-3]}
    exec(code, ns)
    return code, ns


payload_code, payload = load(os.path.join(here, "payload.py"))
module_code, module = load(os.path.join(here, sys.argv[1], sys.argv[2]))
payload["run"]()
module["Ünïcode"]().方法()


def walk(code, out):
    out.append(code)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            walk(c, out)
    return out


def expected_lines(code):
    n = len(code.co_code)
    lines = [None] * n
    if hasattr(code, "co_lines"):
        for start, end, line in code.co_lines():
            for off in range(start, min(end, n)):
                lines[off] = line
    else:
        for addr, line in dis.findlinestarts(code):
            for off in range(addr, n):
                lines[off] = line
    return lines


codes = []
for code in walk(payload_code, []) + walk(module_code, []):
    codes.append({
        "addr": id(code),
        "name": getattr(code, "co_qualname", code.co_name),
        "file": code.co_filename,
        "first_line": code.co_firstlineno,
        "code_len": len(code.co_code),
        "lines": expected_lines(code),
        "instrs": [i.offset for i in dis.get_instructions(code)],
    })

print(json.dumps({
    "version": list(sys.version_info[:3]),
    "code_basicsize": types.CodeType.__basicsize__,
    "str_basicsize": str.__basicsize__,
    "ascii_sizeof_empty": sys.getsizeof(""),
    "codes": codes,
    "marks": payload["MARKS"],
    "not_code": [id(payload["run"]), id(payload["MARKS"]), id(here), id(payload)],
}), flush=True)
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.2)
"##;

    #[derive(serde::Deserialize)]
    struct Report {
        version: Vec<u32>,
        code_basicsize: u64,
        str_basicsize: u64,
        ascii_sizeof_empty: u64,
        codes: Vec<Expected>,
        marks: Vec<Mark>,
        not_code: Vec<u64>,
    }

    #[derive(serde::Deserialize)]
    struct Expected {
        addr: u64,
        name: String,
        file: String,
        first_line: u32,
        code_len: u32,
        /// The line of every bytecode byte offset.
        lines: Vec<Option<u32>>,
        /// The offsets where instructions start (caches are not instructions).
        instrs: Vec<u32>,
    }

    /// A frame in the middle of a call, as Python reports it.
    #[derive(serde::Deserialize)]
    struct Mark {
        code: u64,
        /// `frame.f_lasti`: a byte offset in every version.
        lasti: i64,
        line: u32,
    }

    /// The interpreter under test; killed when the test ends.
    struct Target(Child);

    impl Drop for Target {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// The value the BPF probe records for a frame at bytecode byte offset
    /// `off` (negative: not started), by version: the inverse of
    /// [`Code::byte_offset`].
    fn raw_for(layout: &CodeLayout, off: i64) -> u32 {
        match layout.instr {
            InstrForm::LastiBytes => off as i32 as u32,
            InstrForm::LastiUnits => (off.div_euclid(2)) as i32 as u32,
            InstrForm::FromCodeObject => (layout.co_code_adaptive.unwrap() as i64 + off) as u32,
        }
    }

    /// What a run covered.
    #[derive(Default)]
    struct Seen {
        codes: usize,
        offsets: usize,
        no_line: usize,
        /// Line table features: location codes (3.11+), or the kinds of
        /// pairs (3.8-3.10).
        features: BTreeSet<String>,
    }

    fn interpreter(path: &str) -> Option<&Path> {
        let p = Path::new(path);
        if p.exists() {
            return Some(p);
        }
        if std::env::var_os("CI").is_some() {
            panic!("{path} is missing (CI is set: every interpreter must be tested)");
        }
        eprintln!("skipping: no {path}");
        None
    }

    fn table_features(layout: &CodeLayout, table: &[u8], seen: &mut BTreeSet<String>) {
        match layout.line_format {
            Format::Locations => {
                for &b in table.iter().filter(|&&b| b & 0x80 != 0) {
                    seen.insert(format!("code {}", linetable::location_code(b)));
                }
            }
            Format::Linetable310 | Format::Lnotab => {
                for pair in table.chunks_exact(2) {
                    let (bytes, line) = (pair[0], pair[1] as i8);
                    if bytes == 0 {
                        seen.insert("zero bytes".into());
                    }
                    if bytes >= 254 {
                        seen.insert("split bytes".into());
                    }
                    if line == 127 {
                        seen.insert("split line forward".into());
                    }
                    if line == -128 {
                        seen.insert("-128".into());
                    }
                    if line < 0 {
                        seen.insert("line backwards".into());
                    }
                }
            }
        }
    }

    /// Runs `python` (3.`minor`) with `args` on the script and checks every
    /// code object it reports.
    fn check(python: &Path, minor: u32, args: &[&str], seen: &mut Seen) {
        let layout = CodeLayout::for_minor(minor).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("payload.py"), PAYLOAD).unwrap();
        std::fs::write(dir.path().join("runner.py"), RUNNER).unwrap();
        std::fs::create_dir(dir.path().join(MODULE_DIR)).unwrap();
        std::fs::write(dir.path().join(MODULE_DIR).join(MODULE_FILE), MODULE).unwrap();
        let child = Command::new(python)
            .args(args)
            .arg(dir.path().join("runner.py"))
            .args([MODULE_DIR, MODULE_FILE])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut target = Target(child);
        let mut line = String::new();
        BufReader::new(target.0.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(!line.is_empty(), "{} printed nothing", python.display());
        let report: Report = serde_json::from_str(&line).unwrap();
        assert_eq!(report.version[..2], [3, minor], "{}", python.display());

        // What the interpreter itself says of the layout.
        if let Some(adaptive) = layout.co_code_adaptive {
            assert_eq!(report.code_basicsize, adaptive, "co_code_adaptive");
        }
        assert_eq!(report.str_basicsize, layout.unicode.compact_data + 8);
        assert_eq!(report.ascii_sizeof_empty, layout.unicode.ascii_data + 1);

        let mem = ProcessMemory::open(target.0.id()).unwrap();
        let mut by_addr = HashMap::new();
        let mut names = BTreeSet::new();
        for e in &report.codes {
            let code = read_code(&mem, layout, e.addr)
                .unwrap_or_else(|err| panic!("{} at {:#x}: {err}", e.name, e.addr));
            assert_eq!(code.name, e.name);
            assert_eq!(code.file, e.file);
            assert_eq!(code.first_line, e.first_line, "{}", e.name);
            assert_eq!(code.code_len, e.code_len, "{}", e.name);
            assert_eq!(e.lines.len(), e.code_len as usize);
            for (off, &want) in e.lines.iter().enumerate() {
                assert_eq!(code.line_at_offset(off as u32), want, "{} +{off}", e.name);
                // 3.10's f_lasti counts code units: only even offsets.
                if layout.instr != InstrForm::LastiUnits || off % 2 == 0 {
                    let raw = raw_for(layout, off as i64);
                    assert_eq!(code.line(raw), want, "{} +{off} raw {raw}", e.name);
                }
                seen.no_line += usize::from(want.is_none());
            }
            // Every code unit of an instruction, its caches included, has the
            // instruction's line (what a frame in the middle of a call needs).
            let ends = e.instrs.iter().skip(1).copied().chain([e.code_len]);
            for (start, end) in e.instrs.iter().copied().zip(ends) {
                let want = e.lines[start as usize];
                for off in (start..end).step_by(2) {
                    assert_eq!(code.line(raw_for(layout, off.into())), want, "{}", e.name);
                }
            }
            // Not started: the first line. Past the end: none.
            assert_eq!(code.line(raw_for(layout, -2)), Some(e.first_line));
            assert_eq!(code.line(raw_for(layout, e.code_len.into())), None);
            table_features(layout, code.line_table(), &mut seen.features);
            seen.codes += 1;
            seen.offsets += e.lines.len();
            names.insert(code.name.clone());
            by_addr.insert(e.addr, (code, e));
        }
        // The variety the script is meant to have.
        for name in ["café_crème", "функция", "𠀀𠀁", "<lambda>", "gaps"] {
            assert!(names.contains(name), "{name} in {names:?}");
        }
        let file = dir.path().join(MODULE_DIR).join(MODULE_FILE);
        assert!(by_addr.values().any(|(c, _)| Path::new(&c.file) == file));
        if minor >= 11 {
            assert!(names.contains("Outer.Inner.deep.<locals>.closure"));
            assert!(names.contains("Ünïcode.方法"));
        }

        // Frames in the middle of a call, with the line Python gives them.
        assert!(report.marks.len() >= 5);
        let mut positions = BTreeMap::new();
        for m in &report.marks {
            let (code, e) = &by_addr[&m.code];
            let raw = match layout.instr {
                // Python's f_lasti is in bytes; 3.10 stores code units.
                InstrForm::LastiUnits => (m.lasti / 2) as u32,
                _ => raw_for(layout, m.lasti),
            };
            assert_eq!(
                code.line(raw),
                Some(m.line),
                "{} f_lasti {}",
                e.name,
                m.lasti
            );
            // Which code unit of its instruction the frame points at.
            let start = e.instrs.iter().rev().find(|&&s| i64::from(s) <= m.lasti);
            let unit = (m.lasti - i64::from(*start.unwrap())) / 2;
            *positions.entry(unit).or_insert(0) += 1;
        }
        eprintln!(
            "{} {args:?}: mid-call frames at code unit (0 = opcode) -> count: {positions:?}",
            python.display()
        );

        // Not code objects: errors, not panics.
        for &addr in &report.not_code {
            assert!(matches!(
                read_code(&mem, layout, addr),
                Err(CodeError::NotCode { .. })
            ));
        }
        // Inside a code object, not at its start, too.
        let inside = report.codes[0].addr + 8;
        for addr in [0, 0x10, u64::MAX - 4, inside] {
            assert!(read_code(&mem, layout, addr).is_err(), "{addr:#x}");
        }
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", target.0.id())).unwrap();
        let stack = maps.lines().find(|l| l.ends_with("[stack]")).unwrap();
        let (lo, hi) = stack
            .split_whitespace()
            .next()
            .unwrap()
            .split_once('-')
            .unwrap();
        let (lo, hi) = (
            u64::from_str_radix(lo, 16).unwrap(),
            u64::from_str_radix(hi, 16).unwrap(),
        );
        for addr in [hi - 64, hi - 4096, hi - 4096 + 8, lo, ((lo + hi) / 2) & !7] {
            assert!(read_code(&mem, layout, addr).is_err(), "stack {addr:#x}");
        }
    }

    fn check_interpreter(path: &str, minor: u32) {
        let Some(python) = interpreter(path) else {
            return;
        };
        let mut seen = Seen::default();
        check(python, minor, &[], &mut seen);
        if minor >= 11 {
            // Without column information, entries take the "no columns" form.
            check(python, minor, &["-X", "no_debug_ranges"], &mut seen);
        }
        eprintln!(
            "{path}: {} code objects, {} offsets ({} without a line), table features {:?}",
            seen.codes, seen.offsets, seen.no_line, seen.features
        );
        let want: &[&str] = match CodeLayout::for_minor(minor).unwrap().line_format {
            Format::Lnotab => &["split bytes", "split line forward", "line backwards"],
            Format::Linetable310 => &[
                "zero bytes",
                "split bytes",
                "split line forward",
                "line backwards",
                "-128",
            ],
            Format::Locations => &[
                "code 0", "code 10", "code 11", "code 12", "code 13", "code 14", "code 15",
            ],
        };
        for f in want {
            assert!(seen.features.contains(*f), "{path}: no {f}");
        }
    }

    #[test]
    fn python_3_8_pyenv() {
        check_interpreter("/root/.pyenv/versions/3.8.18/bin/python3.8", 8);
    }

    #[test]
    fn python_3_9_pyenv() {
        check_interpreter("/root/.pyenv/versions/3.9.18/bin/python3.9", 9);
    }

    #[test]
    fn python_3_10_pyenv() {
        check_interpreter("/root/.pyenv/versions/3.10.13/bin/python3.10", 10);
    }

    #[test]
    fn python_3_11_pyenv() {
        check_interpreter("/root/.pyenv/versions/3.11.7/bin/python3.11", 11);
    }

    #[test]
    fn python_3_11_debian() {
        check_interpreter("/usr/bin/python3.11", 11);
    }

    #[test]
    fn python_3_12_pyenv() {
        check_interpreter("/root/.pyenv/versions/3.12.1/bin/python3.12", 12);
    }

    #[test]
    fn python_3_13_pyenv() {
        check_interpreter("/root/.pyenv/versions/3.13.0/bin/python3.13", 13);
    }

    #[test]
    fn python_layouts_cover_3_8_to_3_13() {
        for minor in 8..=13 {
            let l = CodeLayout::for_minor(minor).unwrap();
            assert_eq!(l.minor, minor);
            assert_eq!(l.co_qualname.is_some(), minor >= 11);
            assert_eq!(l.co_code_adaptive.is_some(), minor >= 11);
            assert_eq!(l.co_code.is_some(), minor < 11);
        }
        assert!(CodeLayout::for_minor(7).is_none());
        assert!(CodeLayout::for_minor(14).is_none());
    }

    /// Memory made up of a few regions, for objects with chosen fields.
    #[derive(Default)]
    struct FakeMemory(Vec<(u64, Vec<u8>)>);

    impl FakeMemory {
        fn put(&mut self, addr: u64, bytes: &[u8]) {
            self.0.push((addr, bytes.to_vec()));
        }
        fn put_u32(&mut self, addr: u64, v: u32) {
            self.put(addr, &v.to_le_bytes());
        }
        fn put_u64(&mut self, addr: u64, v: u64) {
            self.put(addr, &v.to_le_bytes());
        }
    }

    impl Memory for FakeMemory {
        fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
            // The last region written that holds the whole range wins.
            for (start, bytes) in self.0.iter().rev() {
                let Some(from) = addr.checked_sub(*start) else {
                    continue;
                };
                let end = from.checked_add(buf.len() as u64);
                if end.is_some_and(|end| end <= bytes.len() as u64) {
                    buf.copy_from_slice(&bytes[from as usize..from as usize + buf.len()]);
                    return Ok(());
                }
            }
            Err(io::Error::from_raw_os_error(libc::EIO))
        }
    }

    const CODE: u64 = 0x1000;
    const TYPE: u64 = 0x2000;
    const TYPE_NAME: u64 = 0x3000;
    const NAME: u64 = 0x4000;
    const FILE: u64 = 0x5000;
    const TABLE: u64 = 0x6000;

    /// A 3.12 code object named by a UCS2 string, in a compact ASCII file,
    /// with a one-entry location table.
    fn fake_code() -> FakeMemory {
        let l = CodeLayout::for_minor(12).unwrap();
        let mut m = FakeMemory::default();
        m.put(CODE, &[0; 256]);
        m.put_u64(CODE + OB_TYPE, TYPE);
        m.put_u64(CODE + OB_SIZE, 1);
        m.put(CODE + l.co_firstlineno, &7i32.to_le_bytes());
        m.put_u64(CODE + l.co_qualname.unwrap(), NAME);
        m.put_u64(CODE + l.co_filename, FILE);
        m.put_u64(CODE + l.co_linetable, TABLE);
        m.put(TYPE, &[0; 64]);
        m.put_u64(TYPE + TP_NAME, TYPE_NAME);
        m.put(TYPE_NAME, b"code\0");
        // "f\u{e9}\u{d800}": compact, not ASCII, kind 2, with a lone surrogate.
        m.put(NAME, &[0; 64]);
        m.put_u64(NAME + 16, 3);
        m.put_u32(NAME + 32, (2 << 2) | (1 << 5));
        m.put(NAME + 56, &[b'f', 0, 0xe9, 0, 0x00, 0xd8]);
        m.put(FILE, &[0; 64]);
        m.put_u64(FILE + 16, 4);
        m.put_u32(FILE + 32, (1 << 2) | (1 << 5) | (1 << 6));
        m.put(FILE + 40, b"a.py");
        m.put(TABLE, &[0; 40]);
        m.put_u64(TABLE + OB_SIZE, 2);
        // One entry, one code unit, one-line form +1, columns 0 and 1.
        m.put(TABLE + OB_SVAL, &[0x80 | (11 << 3), 0, 1]);
        m
    }

    #[test]
    fn python_fake_code_object() {
        let l = CodeLayout::for_minor(12).unwrap();
        let code = read_code(&fake_code(), l, CODE).unwrap();
        assert_eq!(code.name, "f\u{e9}\u{fffd}");
        assert_eq!(code.file, "a.py");
        assert_eq!(code.first_line, 7);
        assert_eq!(code.code_len, 2);
        // The table has 2 bytes of ob_size: the third byte is not read, and
        // the entry is cut short; the line delta is in the first byte.
        assert_eq!(code.line(192), Some(8));
        assert_eq!(code.line(193), Some(8));
        assert_eq!(code.line(190), Some(7));
        assert_eq!(code.line(194), None);
        assert_eq!(code.line(u32::MAX), None);
    }

    #[test]
    fn python_absurd_fields_are_errors() {
        let l = CodeLayout::for_minor(12).unwrap();
        let with = |f: &dyn Fn(&mut FakeMemory)| {
            let mut m = fake_code();
            f(&mut m);
            read_code(&m, l, CODE)
        };
        let too_long = |r: Result<Code, CodeError>| matches!(r, Err(CodeError::TooLong { .. }));
        let invalid = |r: Result<Code, CodeError>| matches!(r, Err(CodeError::Invalid { .. }));
        assert!(too_long(with(&|m| m.put_u64(NAME + 16, 1 << 40))));
        assert!(too_long(with(&|m| m.put_u64(NAME + 16, i64::MAX as u64))));
        assert!(too_long(with(&|m| m.put_u64(NAME + 16, 513))));
        assert!(invalid(with(&|m| m.put_u64(NAME + 16, u64::MAX))));
        assert!(too_long(with(&|m| m.put_u64(FILE + 16, 4097))));
        assert!(too_long(with(
            &|m| m.put_u64(TABLE + OB_SIZE, (1 << 20) + 1)
        )));
        assert!(invalid(with(&|m| m.put_u64(TABLE + OB_SIZE, u64::MAX))));
        assert!(too_long(with(&|m| m.put_u64(CODE + OB_SIZE, 1 << 62))));
        assert!(invalid(with(&|m| m.put_u64(CODE + OB_SIZE, u64::MAX))));
        assert!(invalid(with(&|m| m.put(CODE + 68, &(-1i32).to_le_bytes()))));
        // Kind 3, and "ASCII" of kind 4.
        assert!(invalid(
            with(&|m| m.put_u32(NAME + 32, (3 << 2) | (1 << 5)))
        ));
        assert!(invalid(
            with(&|m| m.put_u32(FILE + 32, (4 << 2) | (3 << 5)))
        ));
        // Not a code object; pointers to nowhere.
        assert!(matches!(
            with(&|m| m.put(TYPE_NAME, b"cod\0\0")),
            Err(CodeError::NotCode { .. })
        ));
        let unreadable = |r: Result<Code, CodeError>| matches!(r, Err(CodeError::Read { .. }));
        assert!(unreadable(with(&|m| m.put_u64(CODE + OB_TYPE, 0x10))));
        // A pointer whose fields' addresses wrap around.
        let qualname = CODE + l.co_qualname.unwrap();
        assert!(invalid(with(&|m| m.put_u64(qualname, u64::MAX - 8))));
        assert!(unreadable(with(
            &|m| m.put_u64(CODE + l.co_filename, 0x9999)
        )));
        assert!(unreadable(with(&|m| m.put_u64(CODE + l.co_linetable, 0))));
        // A non-compact string whose data pointer goes nowhere.
        assert!(unreadable(with(
            &|m| m.put_u32(FILE + 32, (1 << 2) | (1 << 6))
        )));
        // 3.11: a string that is not ready.
        let l11 = CodeLayout::for_minor(11).unwrap();
        let mut m = FakeMemory::default();
        m.put(CODE, &[0; 256]);
        m.put_u64(CODE + OB_TYPE, TYPE);
        m.put_u64(CODE + l11.co_qualname.unwrap(), NAME);
        m.put(TYPE, &[0; 64]);
        m.put_u64(TYPE + TP_NAME, TYPE_NAME);
        m.put(TYPE_NAME, b"code\0");
        m.put(NAME, &[0; 80]);
        m.put_u32(NAME + 32, (1 << 2) | (1 << 5) | (1 << 6));
        assert!(invalid(read_code(&m, l11, CODE)));
    }
}
