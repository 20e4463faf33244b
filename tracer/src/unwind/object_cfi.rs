//! Call frame information of one ELF object, parsed lazily.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use anyhow::{bail, Context, Result};
use gimli::{
    BaseAddresses, CfaRule, DebugFrame, EhFrame, EhFrameHdr, EndianSlice, FrameDescriptionEntry,
    LittleEndian, RegisterRule, UnwindContext, UnwindSection, UnwindTableRow, X86_64,
};
use memmap2::Mmap;
use object::{Object, ObjectSection, ObjectSegment};

use super::Rule;
use crate::tracee::{FileId, Kept};

/// Objects loaded, by file and debug directory: a tree's processes map
/// the same few dozen files (one that gives way stays with the processes
/// that use it).
static LOADED: Kept<(FileId, PathBuf), Arc<ObjectCfi>> = Kept::new(64);

type Slice<'a> = EndianSlice<'a, LittleEndian>;

/// A section located in the mapped file.
#[derive(Clone, Debug)]
struct Sect {
    /// Byte range inside the file.
    file: Range<usize>,
    /// Stated virtual address (sh_addr); used as pc-relative pointer base.
    addr: u64,
}

/// A `PT_LOAD` segment, to translate file offsets to stated addresses.
#[derive(Clone, Copy, Debug)]
struct Load {
    offset: u64,
    filesz: u64,
    vaddr: u64,
}

/// One FDE in a sorted address index, for sections without a search table
/// (`.debug_frame` always, `.eh_frame` when there is no `.eh_frame_hdr`).
#[derive(Clone, Copy, Debug)]
struct IndexEntry {
    start: u64,
    end: u64,
    /// Offset of the FDE inside its section.
    fde: usize,
}

/// A `.debug_frame` section, in the object itself or in its debug file.
struct DebugFrameSrc {
    /// `None` means the section is in the object's own mapping.
    file: Option<Mmap>,
    sect: Sect,
    index: OnceLock<Vec<IndexEntry>>,
}

/// The unwind information of one ELF object (executable, shared library).
///
/// Loading only maps the file and reads the ELF headers; the CFI itself is
/// parsed on each lookup (binary search through `.eh_frame_hdr`, then one FDE
/// and its CIE). Sections without a search table get a sorted index built on
/// first use. The file stays mapped for the lifetime of the value.
///
/// Lookup order: `.eh_frame` (what the C++ runtime itself relies on, so it is
/// complete for all code built with asynchronous unwind tables, the default
/// on x86-64), then `.debug_frame` of the object or, if it has none, of its
/// separate debug file found by build id.
pub struct ObjectCfi {
    path: PathBuf,
    data: Mmap,
    eh_frame: Option<Sect>,
    eh_frame_hdr: Option<Sect>,
    /// Bases for `DW_EH_PE_textrel`/`datarel` pointers (rare on x86-64).
    text: u64,
    got: u64,
    eh_index: OnceLock<Vec<IndexEntry>>,
    debug_frame: Option<DebugFrameSrc>,
    loads: Vec<Load>,
    /// The ELF entry point (stated address), 0 when there is none.
    entry: u64,
}

/// Return addresses this close after an object's entry point that no CFI
/// covers are in its entry code (`_start`: the dynamic linker's runs the
/// libraries' constructors from it, and has no CFI): the thread's
/// outermost frame, as gdb shows it.
const ENTRY_CODE: u64 = 64;

impl std::fmt::Debug for ObjectCfi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectCfi")
            .field("path", &self.path)
            .field("eh_frame", &self.eh_frame.is_some())
            .field("eh_frame_hdr", &self.eh_frame_hdr.is_some())
            .field(
                "debug_frame",
                &self.debug_frame.as_ref().map(|d| d.file.is_some()),
            )
            .finish()
    }
}

/// Map a file read-only.
fn map(path: &Path) -> Result<Mmap> {
    let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
    // SAFETY: the mapping is read-only (PROT_READ) and only ever read as
    // bytes. If another process truncates or rewrites the file while it is
    // mapped, reads may fault (SIGBUS) or see new bytes (garbage rules):
    // the same caveat every ELF reader using mmap (gdb, perf, blazesym)
    // accepts, and shared objects in use are normally replaced by rename, not
    // rewritten in place.
    unsafe { Mmap::map(&file) }.with_context(|| format!("mmap {}", path.display()))
}

/// Locate an uncompressed section with file contents.
fn section<'d>(elf: &object::File<'d>, name: &str, len: usize) -> Option<Sect> {
    let s = elf.section_by_name(name)?;
    // Compressed (SHF_COMPRESSED) sections would need zlib/zstd; mtrace
    // deliberately builds `object` without the compression feature, and
    // `.eh_frame` is never compressed (the runtime reads it in place).
    let range = s.compressed_file_range().ok()?;
    if range.format != object::CompressionFormat::None {
        return None;
    }
    // NOBITS sections (e.g. `.eh_frame` inside a stripped-out debug file)
    // have no file range.
    let (off, size) = s.file_range()?;
    let start = usize::try_from(off).ok()?;
    let end = start.checked_add(usize::try_from(size).ok()?)?;
    (end <= len && size > 0).then(|| Sect {
        file: start..end,
        addr: s.address(),
    })
}

fn parse_elf<'d>(data: &'d [u8], path: &Path) -> Result<object::File<'d>> {
    let elf = object::File::parse(data).with_context(|| format!("parse {}", path.display()))?;
    if elf.architecture() != object::Architecture::X86_64 || !matches!(elf, object::File::Elf64(_))
    {
        bail!("{}: not an x86-64 ELF object", path.display());
    }
    Ok(elf)
}

impl ObjectCfi {
    /// Maps `path` and locates its CFI sections (cheap: no CFI is parsed
    /// here), looking for the separate debug file (only used
    /// when the object has no `.debug_frame`) in
    /// `debug_dir/.build-id/xx/yyyy.debug`. For a process in another mount
    /// namespace, pass `/proc/PID/root/usr/lib/debug` (and open the object
    /// itself through `/proc/PID/root` or `/proc/PID/map_files`).
    /// [`ObjectCfi::load_with_debug_dir`], shared: every process of a
    /// tree that maps the same file (and looks for debug files in the same
    /// place) uses the one loaded first, its indexes built (and a separate
    /// debug file inflated) once. The file is `id` (as its open
    /// descriptor says), read from `path` if not loaded yet.
    pub fn shared(id: FileId, path: &Path, debug_dir: &Path) -> Result<Arc<ObjectCfi>> {
        let key = (id, debug_dir.to_owned());
        if let Some(o) = LOADED.get(&key) {
            return Ok(o);
        }
        let o = Arc::new(ObjectCfi::load_with_debug_dir(path, debug_dir)?);
        LOADED.put(key, o.clone());
        Ok(o)
    }

    pub fn load_with_debug_dir(path: &Path, debug_dir: &Path) -> Result<ObjectCfi> {
        let data = map(path)?;
        let elf = parse_elf(&data, path)?;
        let len = data.len();
        let eh_frame = section(&elf, ".eh_frame", len);
        let eh_frame_hdr = section(&elf, ".eh_frame_hdr", len);
        let text = elf.section_by_name(".text").map_or(0, |s| s.address());
        let got = elf.section_by_name(".got").map_or(0, |s| s.address());
        let loads = elf
            .segments()
            .map(|s| {
                let (offset, filesz) = s.file_range();
                Load {
                    offset,
                    filesz,
                    vaddr: s.address(),
                }
            })
            .collect();
        let debug_frame = match section(&elf, ".debug_frame", len) {
            Some(sect) => Some(DebugFrameSrc {
                file: None,
                sect,
                index: OnceLock::new(),
            }),
            None => match elf.build_id() {
                Ok(Some(id)) => separate_debug_frame(debug_dir, id),
                _ => None,
            },
        };
        let entry = elf.entry();
        drop(elf);
        Ok(ObjectCfi {
            entry,
            path: path.to_owned(),
            data,
            eh_frame,
            eh_frame_hdr,
            text,
            got,
            eh_index: OnceLock::new(),
            debug_frame,
            loads,
        })
    }

    /// Translate a runtime address inside a mapping of this file to a stated
    /// virtual address (what [`rule_for_ra`](Self::rule_for_ra) takes).
    ///
    /// `map_start` and `map_offset` are the start address and file offset of
    /// the mapping containing `addr`, as in `/proc/PID/maps`. Going through
    /// the file offset and the `PT_LOAD` headers handles the load bias of PIE
    /// executables and shared objects as well as non-PIE executables, without
    /// assuming anything about how the loader laid out the segments.
    pub fn svma_for(&self, map_start: u64, map_offset: u64, addr: u64) -> Option<u64> {
        let file_off = addr.checked_sub(map_start)?.checked_add(map_offset)?;
        self.loads
            .iter()
            .find(|l| file_off >= l.offset && file_off - l.offset < l.filesz)
            .map(|l| l.vaddr + (file_off - l.offset))
    }

    /// The rule that holds in the caller at return address `ra` (a stated
    /// virtual address): the CFI row of the call instruction, looked up at
    /// `ra - 1`.
    pub fn rule_for_ra(&self, ra: u64) -> Rule {
        match ra.checked_sub(1) {
            Some(pc) => self.rule_at(pc),
            None => Rule::unsupported(),
        }
    }

    /// The rule of the CFI row containing `pc` (a stated virtual address).
    /// Use [`rule_for_ra`](Self::rule_for_ra) for return addresses.
    pub fn rule_at(&self, pc: u64) -> Rule {
        // A parse error in one section must not hide the other one, and is
        // reported as "unsupported": the walk stops, nothing worse happens.
        if let Some(rule) = self.eh_frame_rule(pc) {
            return rule;
        }
        if let Some(rule) = self.debug_frame_rule(pc) {
            return rule;
        }
        if self.entry != 0 && pc >= self.entry && pc - self.entry < ENTRY_CODE {
            return Rule::end();
        }
        Rule::unsupported()
    }

    fn bases(&self) -> BaseAddresses {
        let mut b = BaseAddresses::default()
            .set_text(self.text)
            .set_got(self.got);
        if let Some(s) = &self.eh_frame {
            b = b.set_eh_frame(s.addr);
        }
        if let Some(s) = &self.eh_frame_hdr {
            b = b.set_eh_frame_hdr(s.addr);
        }
        b
    }

    /// `None`: no FDE in `.eh_frame` covers `pc` (or it is unreadable).
    fn eh_frame_rule(&self, pc: u64) -> Option<Rule> {
        let sect = self.eh_frame.as_ref()?;
        let mut eh = EhFrame::new(&self.data[sect.file.clone()], LittleEndian);
        eh.set_address_size(8);
        let bases = self.bases();
        // Fast path: the binary search table of `.eh_frame_hdr`. Re-parsing
        // its header per lookup costs a few bytes of reading and avoids a
        // self-referential struct.
        let hdr = self.eh_frame_hdr.as_ref().and_then(|hdr| {
            EhFrameHdr::new(&self.data[hdr.file.clone()], LittleEndian)
                .parse(&bases, 8)
                .ok()
        });
        if let Some(table) = hdr.as_ref().and_then(|hdr| hdr.table()) {
            let fde = table
                .fde_for_address(&eh, &bases, pc, EhFrame::cie_from_offset)
                .ok()?;
            return fde_rule(&eh, &bases, &fde, pc);
        }
        // No usable search table: sorted index built on first use.
        let index = self.eh_index.get_or_init(|| build_index(&eh, &bases));
        rule_from_index(&eh, &bases, index, pc)
    }

    fn debug_frame_rule(&self, pc: u64) -> Option<Rule> {
        let src = self.debug_frame.as_ref()?;
        let bytes: &[u8] = src.file.as_deref().unwrap_or(&self.data);
        let mut df = DebugFrame::new(&bytes[src.sect.file.clone()], LittleEndian);
        df.set_address_size(8);
        let bases = BaseAddresses::default();
        let index = src.index.get_or_init(|| build_index(&df, &bases));
        rule_from_index(&df, &bases, index, pc)
    }
}

/// Find `.debug_frame` in `debug_dir/.build-id/xx/yyyy.debug`.
fn separate_debug_frame(debug_dir: &Path, build_id: &[u8]) -> Option<DebugFrameSrc> {
    let (first, rest) = build_id.split_first()?;
    let hex: String = rest.iter().map(|b| format!("{b:02x}")).collect();
    let path = debug_dir.join(format!(".build-id/{first:02x}/{hex}.debug"));
    let data = map(&path).ok()?;
    let elf = parse_elf(&data, &path).ok()?;
    let sect = section(&elf, ".debug_frame", data.len())?;
    drop(elf);
    Some(DebugFrameSrc {
        file: Some(data),
        sect,
        index: OnceLock::new(),
    })
}

/// Sorted `[start, end) -> FDE offset` table of every FDE in `section`.
/// Unparseable entries end the scan: what was read so far stays usable.
fn build_index<'a, S>(section: &S, bases: &BaseAddresses) -> Vec<IndexEntry>
where
    S: UnwindSection<Slice<'a>>,
    S::Offset: gimli::UnwindOffset<usize>,
{
    let mut out = Vec::new();
    let mut entries = section.entries(bases);
    while let Ok(Some(entry)) = entries.next() {
        let gimli::CieOrFde::Fde(partial) = entry else {
            continue;
        };
        match partial.parse(S::cie_from_offset) {
            Ok(fde) if fde.len() > 0 => out.push(IndexEntry {
                start: fde.initial_address(),
                end: fde.end_address(),
                fde: fde.offset(),
            }),
            _ => {}
        }
    }
    out.sort_unstable_by_key(|e| e.start);
    out
}

fn rule_from_index<'a, S>(
    section: &S,
    bases: &BaseAddresses,
    index: &[IndexEntry],
    pc: u64,
) -> Option<Rule>
where
    S: UnwindSection<Slice<'a>>,
    S::Offset: gimli::UnwindOffset<usize>,
{
    // Last FDE starting at or before pc. FDEs do not overlap in practice;
    // if they did, the one starting closest to pc is the most specific.
    let i = index.partition_point(|e| e.start <= pc).checked_sub(1)?;
    let e = index[i];
    if pc >= e.end {
        return None;
    }
    let fde = section
        .fde_from_offset(bases, S::Offset::from(e.fde), S::cie_from_offset)
        .ok()?;
    fde_rule(section, bases, &fde, pc)
}

/// Run the CFA program of `fde` up to `pc` and compile the row.
fn fde_rule<'a, S>(
    section: &S,
    bases: &BaseAddresses,
    fde: &FrameDescriptionEntry<Slice<'a>>,
    pc: u64,
) -> Option<Rule>
where
    S: UnwindSection<Slice<'a>>,
{
    if fde.is_signal_trampoline() {
        return Some(Rule::signal());
    }
    // A fresh context per lookup: a small allocation, noise next to the
    // BPF map update each new rule costs; it keeps `rule_at` `&self`.
    let mut ctx = UnwindContext::new();
    fde.unwind_info_for_address(section, bases, &mut ctx, pc)
        .ok()
        .map(row_to_rule)
}

/// Compile one CFI row into a [`Rule`].
fn row_to_rule(row: &UnwindTableRow<usize>) -> Rule {
    // The return address column first: "undefined" marks the outermost frame
    // (glibc's `_start` and `clone`/`clone3` thread entry use
    // `cfi_undefined (rip)`), whatever the CFA rule says.
    match row.register(X86_64::RA) {
        Some(RegisterRule::Undefined) => return Rule::end(),
        Some(RegisterRule::Offset(-8)) => {}
        _ => return Rule::unsupported(),
    }
    let (kind, offset) = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => {
            let kind = match *register {
                X86_64::RSP => Rule::CFA_RSP,
                X86_64::RBP => Rule::CFA_RBP,
                _ => return Rule::unsupported(),
            };
            (kind, *offset)
        }
        // Expressions: PLT stubs, stack realignment, signal frames.
        CfaRule::Expression(_) => return Rule::unsupported(),
    };
    let Ok(cfa_off) = i32::try_from(offset) else {
        return Rule::unsupported();
    };
    let (rbp, rbp_off) = rbp_rule(row.register(X86_64::RBP));
    Rule {
        kind,
        rbp,
        rbp_off,
        cfa_off,
    }
}

fn rbp_rule(rule: Option<RegisterRule<usize>>) -> (u8, i16) {
    match rule {
        // Not mentioned: callee-saved registers default to "same value".
        None | Some(RegisterRule::SameValue) => (Rule::RBP_SAME, 0),
        Some(RegisterRule::Offset(off)) => match i16::try_from(off) {
            Ok(off) => (Rule::RBP_AT, off),
            Err(_) => (Rule::RBP_UNDEF, 0),
        },
        Some(_) => (Rule::RBP_UNDEF, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian's dynamic linker runs the libraries' constructors from its
    /// entry code, which has no CFI: a return address there is the end of
    /// the stack; one a little further on is not covered by anything.
    #[test]
    fn the_dynamic_linkers_entry_code_is_the_outermost_frame() {
        let ld = Path::new("/lib64/ld-linux-x86-64.so.2");
        let cfi = ObjectCfi::load_with_debug_dir(ld, Path::new("/nonexistent")).unwrap();
        assert_ne!(cfi.entry, 0);
        assert_eq!(cfi.rule_for_ra(cfi.entry + 0x30), Rule::end());
        assert_eq!(cfi.rule_for_ra(cfi.entry + 1), Rule::end());
    }
}
