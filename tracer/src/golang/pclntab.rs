//! A Go program's own table of functions, files and lines (`.gopclntab`),
//! read from its executable: what names a Go stack's return addresses,
//! stripped binaries included (the runtime needs the table for its own
//! tracebacks, so `-ldflags=-s -w` and `strip` leave it).
//!
//! Written by hand: the one crate that parses it (gobin) reads inline
//! trees in Go 1.20's layout only, not Go 1.18 and 1.19's (Debian's
//! toolchain here), and looks nothing up by address. What is read:
//!
//! - the header (`runtime.pcHeader`): magic `0xfffffff0` for Go 1.18 and
//!   1.19, `0xfffffff1` from Go 1.20 on; then the offsets of the
//!   function-name, compilation-unit, file, pc-value and function tables;
//! - the function table: `nfunc + 1` pairs (entry offset from
//!   `runtime.text`, offset of the function's `_func`), sorted by entry;
//! - a `_func`: its name, its file and line tables (pc-value tables,
//!   zig-zag varint deltas), its pcdata and funcdata offsets (9 words
//!   before its counts in Go 1.18 and 1.19, 10 from Go 1.20, which added
//!   `startLine`);
//! - its inline tree (`FUNCDATA_InlTree`, an offset from
//!   `moduledata.gofunc`): 20-byte records naming the function at offset
//!   12 in Go 1.18 and 1.19, 16-byte records naming it at offset 4 from
//!   Go 1.20; `PCDATA_InlTreeIndex` says which record a pc is in.
//!
//! A Go stack as the runtime records it (`runtime.Callers`, a heap
//! profile's bucket) holds one return address per logical frame, inlined
//! ones included: each names one frame, looked up at the address minus
//! one, as `runtime.CallersFrames` does.

use std::collections::HashMap;

/// Where the table and what it points into lie in the executable.
pub struct Layout {
    /// File offset of the header.
    pub header: usize,
    /// `runtime.text`: what function entries are offsets from.
    pub text: u64,
    /// `moduledata.gofunc`: what funcdata are offsets from (no inline
    /// trees without it).
    pub gofunc: Option<u64>,
}

/// The table, over the executable's bytes.
pub struct Pclntab<'a> {
    file: &'a [u8],
    /// Loadable segments: (address, file offset, size in the file).
    segments: Vec<(u64, u64, u64)>,
    new_layout: bool,
    quantum: u64,
    nfunc: usize,
    funcnames: usize,
    cutab: usize,
    filetab: usize,
    pctab: usize,
    /// The function table (and every `_func`, at offsets from it).
    functab: usize,
    text: u64,
    gofunc: Option<u64>,
}

/// One frame as the table names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoFrame {
    pub function: String,
    pub file: Option<String>,
    pub line: Option<u32>,
    /// Code of this function inlined into another's.
    pub inlined: bool,
}

const MAGIC_118: u32 = 0xffff_fff0;
const MAGIC_120: u32 = 0xffff_fff1;
const PCDATA_INL_TREE_INDEX: u32 = 2;
const FUNCDATA_INL_TREE: u32 = 3;

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(data.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(data: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(data.get(at..at + 8)?.try_into().ok()?))
}

fn c_string(data: &[u8], at: usize) -> Option<&str> {
    let rest = data.get(at..)?;
    let end = memchr::memchr(0, rest)?;
    std::str::from_utf8(&rest[..end]).ok()
}

/// A varint as the pc-value tables encode it, and the bytes it took.
fn varint(data: &[u8], at: usize) -> Option<(u32, usize)> {
    let mut v = 0u32;
    let mut shift = 0;
    for i in 0..5 {
        let b = *data.get(at + i)?;
        v |= u32::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some((v, i + 1));
        }
        shift += 7;
    }
    None
}

/// The pieces of a `_func` read here.
#[derive(Clone, Copy, Debug)]
struct Func {
    /// File offset of the `_func`.
    at: usize,
    entry: u64,
    name: u32,
    pcfile: u32,
    pcln: u32,
    npcdata: u32,
    cu: u32,
    nfuncdata: u8,
}

impl<'a> Pclntab<'a> {
    /// The table of `file` (an ELF executable's bytes, whose loadable
    /// segments are `segments`) at `layout`; `None` when the header is not
    /// one of Go 1.18's or later (said by the caller).
    pub fn new(file: &'a [u8], segments: Vec<(u64, u64, u64)>, layout: &Layout) -> Option<Self> {
        let h = layout.header;
        let magic = u32_at(file, h)?;
        let new_layout = match magic {
            MAGIC_118 => false,
            MAGIC_120 => true,
            _ => return None,
        };
        let (quantum, ptr) = (*file.get(h + 6)?, *file.get(h + 7)?);
        if ptr != 8 || quantum == 0 {
            return None;
        }
        let word = |i: usize| u64_at(file, h + 8 + 8 * i);
        let nfunc = usize::try_from(word(0)?).ok()?;
        let off = |i: usize| -> Option<usize> { h.checked_add(usize::try_from(word(i)?).ok()?) };
        let table = Pclntab {
            file,
            segments,
            new_layout,
            quantum: u64::from(quantum),
            nfunc,
            funcnames: off(3)?,
            cutab: off(4)?,
            filetab: off(5)?,
            pctab: off(6)?,
            functab: off(7)?,
            text: layout.text,
            gofunc: layout.gofunc,
        };
        // The function table's last entry (the end of the text) is there.
        u32_at(file, table.functab + 8 * nfunc + 4)?;
        Some(table)
    }

    /// The header's `textStart` (0 from Go 1.26, which stopped writing it).
    pub fn header_text(file: &[u8], header: usize) -> Option<u64> {
        u64_at(file, header + 24)
    }

    /// The address range the table covers.
    pub fn covers(&self, pc: u64) -> bool {
        let end = u32_at(self.file, self.functab + 8 * self.nfunc).map(u64::from);
        pc >= self.text && end.is_some_and(|e| pc < self.text + e)
    }

    /// The entry address of the function called `name` (for finding the
    /// runtime's own functions in a stripped program).
    pub fn entry_of(&self, name: &str) -> Option<u64> {
        (0..self.nfunc).find_map(|i| {
            let f = self.func(i)?;
            (self.func_name(f.name)? == name).then_some(f.entry)
        })
    }

    fn func(&self, i: usize) -> Option<Func> {
        let funcoff = u32_at(self.file, self.functab + 8 * i + 4)?;
        let at = self.functab.checked_add(funcoff as usize)?;
        let w = |k: usize| u32_at(self.file, at + 4 * k);
        let counts = if self.new_layout { 43 } else { 39 };
        Some(Func {
            at,
            entry: self.text + u64::from(w(0)?),
            name: w(1)?,
            pcfile: w(5)?,
            pcln: w(6)?,
            npcdata: w(7)?,
            cu: w(8)?,
            nfuncdata: *self.file.get(at + counts)?,
        })
    }

    /// The function whose code holds `pc` (binary search of the table).
    fn find(&self, pc: u64) -> Option<Func> {
        if !self.covers(pc) {
            return None;
        }
        let off = pc - self.text;
        let entry = |i: usize| u32_at(self.file, self.functab + 8 * i).map(u64::from);
        let (mut lo, mut hi) = (0usize, self.nfunc);
        // Invariant: entry(lo) <= off < entry(hi).
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if entry(mid)? <= off {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        self.func(lo)
    }

    fn func_name(&self, nameoff: u32) -> Option<&'a str> {
        c_string(self.file, self.funcnames.checked_add(nameoff as usize)?)
    }

    /// The value a pc-value table at `off` has at `pc` (-1 where it has
    /// none), as the runtime's `pcvalue` reads it.
    fn pcvalue(&self, f: &Func, off: u32, pc: u64) -> Option<i32> {
        if off == 0 {
            return None;
        }
        let mut at = self.pctab.checked_add(off as usize)?;
        let (mut val, mut cur) = (-1i32, f.entry);
        let mut first = true;
        // A table ends with a zero delta; a corrupt one is cut by the
        // bound on its length.
        for _ in 0..1_000_000 {
            let (uv, n) = varint(self.file, at)?;
            if uv == 0 && !first {
                return None;
            }
            first = false;
            at += n;
            val = val.wrapping_add((-((uv & 1) as i32)) ^ ((uv >> 1) as i32));
            let (pcdelta, n) = varint(self.file, at)?;
            at += n;
            cur += u64::from(pcdelta) * self.quantum;
            if pc < cur {
                return Some(val);
            }
        }
        None
    }

    fn pcdata(&self, f: &Func, table: u32, pc: u64) -> Option<i32> {
        if table >= f.npcdata {
            return None;
        }
        let base = if self.new_layout { 44 } else { 40 };
        let off = u32_at(self.file, f.at + base + 4 * table as usize)?;
        self.pcvalue(f, off, pc)
    }

    /// The address funcdata `i` of `f` points to.
    fn funcdata(&self, f: &Func, i: u32) -> Option<u64> {
        if i >= u32::from(f.nfuncdata) {
            return None;
        }
        let base = if self.new_layout { 44 } else { 40 };
        let off = u32_at(
            self.file,
            f.at + base + 4 * (f.npcdata as usize + i as usize),
        )?;
        if off == u32::MAX {
            return None;
        }
        Some(self.gofunc? + u64::from(off))
    }

    /// The file offset of address `addr`, in a loadable segment's bytes.
    fn file_offset(&self, addr: u64) -> Option<usize> {
        self.segments
            .iter()
            .find(|(start, _, size)| addr >= *start && addr < start + size)
            .and_then(|(start, offset, _)| usize::try_from(addr - start + offset).ok())
    }

    fn file_name(&self, f: &Func, pc: u64) -> Option<String> {
        let fileno = self.pcvalue(f, f.pcfile, pc)?;
        let fileno = u32::try_from(fileno).ok()?;
        let cu = self
            .cutab
            .checked_add(4 * (f.cu as usize + fileno as usize))?;
        let off = u32_at(self.file, cu)?;
        if off == u32::MAX {
            return None;
        }
        c_string(self.file, self.filetab.checked_add(off as usize)?).map(str::to_string)
    }

    /// The name of the function inlined at `pc` in `f`, if any.
    fn inlined_name(&self, f: &Func, pc: u64) -> Option<&'a str> {
        let ix = self.pcdata(f, PCDATA_INL_TREE_INDEX, pc)?;
        let ix = usize::try_from(ix).ok()?;
        let tree = self.file_offset(self.funcdata(f, FUNCDATA_INL_TREE)?)?;
        let (size, name_at) = if self.new_layout { (16, 4) } else { (20, 12) };
        let nameoff = u32_at(self.file, tree + ix * size + name_at)?;
        self.func_name(nameoff)
    }

    /// The frame return address `ret` names: the function (the inlined
    /// one when the call was inlined code), file and line of the call.
    pub fn frame(&self, ret: u64) -> Option<GoFrame> {
        let f = self.find(ret.checked_sub(1)?)?;
        // A return address is the instruction after the call; the call
        // is the byte before (an entry address is itself).
        let pc = if ret > f.entry { ret - 1 } else { ret };
        let inlined = self.inlined_name(&f, pc);
        let function = inlined.or_else(|| self.func_name(f.name))?.to_string();
        let line = self
            .pcvalue(&f, f.pcln, pc)
            .and_then(|l| u32::try_from(l).ok());
        Some(GoFrame {
            function,
            file: self.file_name(&f, pc),
            line,
            inlined: inlined.is_some(),
        })
    }
}

/// Frames named once per address.
#[derive(Default)]
pub struct FrameCache {
    named: HashMap<u64, Option<GoFrame>>,
}

impl FrameCache {
    /// The frame of `ret`, looked up in `table` on first sight.
    pub fn frame(&mut self, table: &Pclntab<'_>, ret: u64) -> Option<&GoFrame> {
        self.named
            .entry(ret)
            .or_insert_with(|| table.frame(ret))
            .as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_zigzag() {
        assert_eq!(varint(&[0x05], 0), Some((5, 1)));
        assert_eq!(varint(&[0x80, 0x01], 0), Some((128, 2)));
        assert_eq!(varint(&[0x80, 0x80], 0), None);
        // Zig-zag: 1 is -1, 2 is +1.
        let dec = |uv: u32| (-((uv & 1) as i32)) ^ ((uv >> 1) as i32);
        assert_eq!(dec(1), -1);
        assert_eq!(dec(2), 1);
        assert_eq!(dec(3), -2);
    }
}
