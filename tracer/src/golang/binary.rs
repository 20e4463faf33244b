//! A Go executable as mtrace reads it: its Go version (`.go.buildinfo`),
//! its function table ([`super::pclntab`]), and the addresses of the
//! runtime's heap profile (`runtime.mbuckets`, the head of the list of
//! every memory-profile bucket) and of its sampling rate
//! (`runtime.MemProfileRate`).
//!
//! The addresses come from the symbol table; a program stripped of it
//! (`-ldflags=-s`, `strip`) has them found in the code of the runtime
//! functions that read them, named by the function table: the first load
//! from a fixed address in `runtime.mProf_FlushLocked` is of `mbuckets`,
//! the first in `runtime.allocmcache` of `MemProfileRate` (in
//! `nextSample`, inlined there). Each address found that way must lie in
//! the program's own variables (`moduledata`'s data and bss sections), or
//! it is not used.

use std::{fs::File, path::Path};

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};

use super::pclntab::{Layout, Pclntab};

/// Go releases whose heap profile and function table mtrace reads: the
/// layouts were checked in their source (bucket header, `memRecord`,
/// `moduledata`, `_func`, inline trees) for Go 1.18 to 1.26.
pub const OLDEST: (u32, u32) = (1, 18);
pub const NEWEST: (u32, u32) = (1, 26);

/// An executable's loadable segments: (address, file offset, size in
/// the file).
pub type Segments = Vec<(u64, u64, u64)>;

/// What is read from a Go executable once.
pub struct GoBinary {
    pub map: Mmap,
    pub segments: Segments,
    /// `go1.19.8`.
    pub version: String,
    /// (major, minor) of `version`.
    pub release: (u32, u32),
    pub layout: Layout,
    /// `runtime.mbuckets` and `runtime.MemProfileRate`, as linked (before
    /// a position-independent executable's load bias).
    pub mbuckets: u64,
    pub rate: u64,
    /// How the two were found: `symbols` or `code` (stripped).
    pub found_by: &'static str,
    /// A position-independent executable (its addresses move by the load
    /// bias).
    pub pie: bool,
}

/// Whether the ELF file at `path` is a Go program (it has Go's build
/// information): cheap, its section headers only.
pub fn is_go(path: &Path) -> bool {
    let Ok(file) = File::open(path) else {
        return false;
    };
    // SAFETY: a read-only private map; a file changed under it gives
    // wrong bytes, never memory unsafety in safe code reading a slice.
    let Ok(map) = (unsafe { Mmap::map(&file) }) else {
        return false;
    };
    object::File::parse(&*map).is_ok_and(|f| f.section_by_name(".go.buildinfo").is_some())
}

/// The Go version the build information says (`go1.19.8`).
fn version(elf: &object::File<'_>) -> Option<String> {
    let data = elf.section_by_name(".go.buildinfo")?.data().ok()?;
    if data.get(..14)? != b"\xff Go buildinf:" {
        return None;
    }
    // Go 1.18 on: the version inline after the 32-byte header, its length
    // a varint before it.
    if data.get(15)? & 2 == 0 {
        return None;
    }
    let mut len = 0usize;
    let mut at = 32;
    for shift in (0..35).step_by(7) {
        let b = *data.get(at)?;
        at += 1;
        len |= usize::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            break;
        }
    }
    let v = std::str::from_utf8(data.get(at..at + len)?).ok()?;
    Some(v.to_string())
}

/// (major, minor) of `go1.19.8` or `devel go1.23-abc`.
pub fn release(version: &str) -> Option<(u32, u32)> {
    let rest = &version[version.find("go")? + 2..];
    let mut parts = rest.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

fn symbol(elf: &object::File<'_>, name: &str) -> Option<u64> {
    elf.symbols()
        .find(|s| s.name() == Ok(name))
        .map(|s| s.address())
}

fn read_u64(map: &[u8], segments: &Segments, addr: u64) -> Option<u64> {
    let (start, offset, _) = segments
        .iter()
        .find(|(start, _, size)| addr >= *start && addr + 8 <= start + size)?;
    let at = usize::try_from(addr - start + offset).ok()?;
    Some(u64::from_le_bytes(map.get(at..at + 8)?.try_into().ok()?))
}

/// `moduledata`'s offsets of the fields read here, by release.
struct ModuleFields {
    text: u64,
    noptrdata: u64,
    gofunc: u64,
}

fn module_fields(release: (u32, u32)) -> ModuleFields {
    // Go 1.20 added `covctrs, ecovctrs` before `end`, moving `gofunc`.
    ModuleFields {
        text: 176,
        noptrdata: 192,
        gofunc: if release >= (1, 20) { 320 } else { 304 },
    }
}

/// `runtime.firstmoduledata`: by its symbol, else the word in the data
/// that points at the function table's header and whose `text` agrees.
fn moduledata(
    elf: &object::File<'_>,
    map: &[u8],
    segments: &Segments,
    header_addr: u64,
) -> Option<u64> {
    if let Some(a) = symbol(elf, "runtime.firstmoduledata") {
        return Some(a);
    }
    let want = header_addr.to_le_bytes();
    for name in [".noptrdata", ".data"] {
        let Some(section) = elf.section_by_name(name) else {
            continue;
        };
        let Ok(data) = section.data() else {
            continue;
        };
        for (i, chunk) in data.chunks_exact(8).enumerate() {
            if chunk == want {
                let addr = section.address() + 8 * i as u64;
                // Its `ftab` slice has a length: a pointer and two words.
                if read_u64(map, segments, addr + 136).is_some_and(|n| n > 0) {
                    return Some(addr);
                }
            }
        }
    }
    None
}

/// The address a function's first load from a RIP-relative address reads
/// (`mov reg, [rip+disp]` or `cmp [rip+disp], imm`), in its first bytes.
fn first_load(map: &[u8], segments: &Segments, entry: u64) -> Option<u64> {
    use crate::asm::{instructions, Mnemonic, OpKind, Register};
    let (start, offset, size) = segments
        .iter()
        .find(|(start, _, size)| entry >= *start && entry < start + size)?;
    let at = usize::try_from(entry - start + offset).ok()?;
    let end = usize::try_from(start + size - entry).ok()?.min(512) + at;
    let code = map.get(at..end)?;
    for ins in instructions(code, entry) {
        if ins.is_invalid() || ins.mnemonic() == Mnemonic::Ret {
            return None;
        }
        let loads = (0..ins.op_count()).any(|i| ins.op_kind(i) == OpKind::Memory)
            && ins.is_ip_rel_memory_operand()
            && ins.memory_base() == Register::RIP
            && ins.mnemonic() != Mnemonic::Lea;
        if loads {
            return Some(ins.ip_rel_memory_address());
        }
    }
    None
}

impl GoBinary {
    /// Reads the executable at `path` (a process's `/proc/PID/exe`).
    pub fn open(path: &Path) -> Result<GoBinary> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: as in `is_go`.
        let map = unsafe { Mmap::map(&file) }?;
        let elf = object::File::parse(&*map).context("not an ELF file")?;
        if elf.architecture() != object::Architecture::X86_64 {
            bail!(
                "a Go program for {:?}: mtrace reads x86-64 only",
                elf.architecture()
            );
        }
        let version = version(&elf).ok_or_else(|| anyhow!("no Go build information"))?;
        let release =
            release(&version).ok_or_else(|| anyhow!("Go version {version:?} not understood"))?;
        if release < OLDEST || release > NEWEST {
            bail!(
                "{version}: its heap profile's layout is not known to this mtrace (it reads Go {}.{} to {}.{})",
                OLDEST.0,
                OLDEST.1,
                NEWEST.0,
                NEWEST.1
            );
        }
        let segments: Segments = elf
            .segments()
            .map(|s| {
                let (offset, size) = s.file_range();
                (s.address(), offset, size)
            })
            .collect();
        let pie = elf.kind() == object::ObjectKind::Dynamic;
        let section = elf
            .section_by_name(".gopclntab")
            .ok_or_else(|| anyhow!("{version}: no .gopclntab section"))?;
        let (header_off, _) = section
            .file_range()
            .ok_or_else(|| anyhow!("{version}: .gopclntab has no bytes"))?;
        let header = usize::try_from(header_off)?;
        let module = moduledata(&elf, &map, &segments, section.address());
        let fields = module_fields(release);
        let field = |off: u64| module.and_then(|m| read_u64(&map, &segments, m + off));
        let text = symbol(&elf, "runtime.text")
            .or_else(|| Pclntab::header_text(&map, header).filter(|&t| t != 0))
            .or_else(|| field(fields.text))
            .ok_or_else(|| anyhow!("{version}: where its code starts is not known (no runtime.text, no moduledata)"))?;
        let gofunc = symbol(
            &elf,
            if release >= (1, 20) {
                "go:func.*"
            } else {
                "go.func.*"
            },
        )
        .or_else(|| field(fields.gofunc));
        let layout = Layout {
            header,
            text,
            gofunc,
        };
        let syms = (
            symbol(&elf, "runtime.mbuckets"),
            symbol(&elf, "runtime.MemProfileRate"),
        );
        let (mbuckets, rate, found_by) = match syms {
            (Some(m), Some(r)) => (m, r, "symbols"),
            _ => {
                let table = Pclntab::new(&map, segments.clone(), &layout).ok_or_else(|| {
                    anyhow!("{version}: its .gopclntab is not Go 1.18's or later")
                })?;
                let load = |func: &str| {
                    table
                        .entry_of(func)
                        .and_then(|e| first_load(&map, &segments, e))
                };
                // noptrdata, data, bss and noptrbss: four (start, end)
                // pairs in a row.
                let in_variables = |addr: u64| -> bool {
                    (0..4).any(|i| {
                        let from = fields.noptrdata + 16 * i;
                        matches!((field(from), field(from + 8)),
                            (Some(s), Some(e)) if addr >= s && addr + 8 <= e)
                    })
                };
                let mbuckets = load("runtime.mProf_FlushLocked").filter(|&a| in_variables(a));
                let rate = load("runtime.allocmcache").filter(|&a| in_variables(a));
                match (mbuckets, rate) {
                    (Some(m), Some(r)) => (m, r, "code"),
                    _ => bail!(
                        "{version}, stripped: the heap profile's address was not found in the runtime's code"
                    ),
                }
            }
        };
        Ok(GoBinary {
            map,
            segments,
            version,
            release,
            layout,
            mbuckets,
            rate,
            found_by,
            pie,
        })
    }

    /// The function table.
    pub fn pclntab(&self) -> Option<Pclntab<'_>> {
        Pclntab::new(&self.map, self.segments.clone(), &self.layout)
    }

    /// The deepest stack a bucket may hold: 32 frames before Go 1.23,
    /// `debug.profstackdepth` (at most 1024) from then on.
    pub fn max_stack(&self) -> u64 {
        if self.release >= (1, 23) {
            1024
        } else {
            32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases() {
        assert_eq!(release("go1.19.8"), Some((1, 19)));
        assert_eq!(release("go1.22rc1"), Some((1, 22)));
        assert_eq!(release("devel go1.23-abc123 Tue"), Some((1, 23)));
        assert_eq!(release("gccgo"), None);
    }
}
