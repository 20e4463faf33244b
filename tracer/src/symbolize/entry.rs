//! A program's entry point named where no symbol names it: the frame of
//! `_start` in a stripped program, as gdb and perf name it. The entry
//! point is the ELF header's `e_entry`; the code that belongs to it is the
//! range of the call-frame information (`.eh_frame`) that covers it, which
//! a stripped program keeps (the unwinder walks it too).

use std::{cell::RefCell, collections::HashMap, fs::File, ops::Range};

use gimli::{BaseAddresses, EhFrame, RunTimeEndian, UnwindSection};
use object::{
    elf,
    read::elf::{Dyn, ElfFile64, FileHeader, ProgramHeader},
    Object, ObjectSection, ObjectSegment,
};

use crate::tracee::FileId;

thread_local! {
    /// The entry point's code of each file asked about, by identity.
    static ENTRIES: RefCell<HashMap<FileId, Option<Range<u64>>>> =
        RefCell::new(HashMap::new());
}

/// The file offsets of the code of `file`'s entry point, when `file` is a
/// program (`ET_EXEC`, or `ET_DYN` flagged `DF_1_PIE`: a shared library's
/// entry point is no `_start`) whose `.eh_frame` covers its entry point;
/// looked up once per file identity `id`.
pub fn entry_code(file: &File, id: Option<FileId>) -> Option<Range<u64>> {
    super::once_per_file(&ENTRIES, id, || find(file))
}

fn find(file: &File) -> Option<Range<u64>> {
    let cache = object::read::ReadCache::new(file);
    let obj = ElfFile64::<object::Endianness, _>::parse(&cache).ok()?;
    let endian = obj.endian();
    let program = match obj.elf_header().e_type(endian) {
        elf::ET_EXEC => true,
        elf::ET_DYN => is_pie(&obj),
        _ => false,
    };
    let entry = obj.entry();
    if !program || entry == 0 {
        return None;
    }
    let section = obj.section_by_name(".eh_frame")?;
    let data = section.data().ok()?;
    let order = if obj.is_little_endian() {
        RunTimeEndian::Little
    } else {
        RunTimeEndian::Big
    };
    let mut eh_frame = EhFrame::new(data, order);
    eh_frame.set_address_size(8);
    let mut bases = BaseAddresses::default().set_eh_frame(section.address());
    if let Some(text) = obj.section_by_name(".text") {
        bases = bases.set_text(text.address());
    }
    let fde = eh_frame
        .fde_for_address(&bases, entry, EhFrame::cie_from_offset)
        .ok()?;
    let code = fde.initial_address()..fde.end_address();
    // The same code as file offsets, through the loaded segment that holds it.
    obj.segments().find_map(|s| {
        let (offset, size) = s.file_range();
        let start = s.address();
        (code.start >= start && code.end <= start + size)
            .then(|| code.start - start + offset..code.end - start + offset)
    })
}

/// Whether the dynamic section says position-independent executable.
fn is_pie<'d, R: object::ReadRef<'d>>(obj: &ElfFile64<'d, object::Endianness, R>) -> bool {
    let endian = obj.endian();
    obj.elf_program_headers().iter().any(|ph| {
        ph.p_type(endian) == elf::PT_DYNAMIC
            && ph
                .dynamic(endian, obj.data())
                .ok()
                .flatten()
                .is_some_and(|entries| {
                    entries.iter().any(|d| {
                        d.tag32(endian) == Some(elf::DT_FLAGS_1)
                            && d.d_val(endian) & u64::from(elf::DF_1_PIE) != 0
                    })
                })
    })
}
