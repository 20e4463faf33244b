//! An object's executable code, addressed by virtual address.

use iced_x86::Instruction;
use object::{Object, ObjectSection, SectionKind};

/// An executable section: its address, where it is in the file, and its
/// bytes.
pub struct Section<'a> {
    pub address: u64,
    pub file_offset: u64,
    pub data: &'a [u8],
}

/// The executable sections of an object file.
pub struct Sections<'a>(Vec<Section<'a>>);

impl<'a> Sections<'a> {
    pub fn of(file: &object::File<'a>) -> Sections<'a> {
        Sections(
            file.sections()
                .filter(|s| s.kind() == SectionKind::Text)
                .filter_map(|s| {
                    Some(Section {
                        address: s.address(),
                        file_offset: s.file_range()?.0,
                        data: s.data().ok()?,
                    })
                })
                .collect(),
        )
    }

    /// Each section, for a linear sweep of its instructions.
    pub fn iter(&self) -> impl Iterator<Item = &Section<'a>> {
        self.0.iter()
    }

    /// The file offset of the code at `vaddr`.
    pub fn file_offset(&self, vaddr: u64) -> Option<u64> {
        let (s, at) = self.at(vaddr)?;
        Some(s.file_offset + at as u64)
    }

    /// The section holding `vaddr`, and where in its bytes.
    fn at(&self, vaddr: u64) -> Option<(&Section<'a>, usize)> {
        let s = self
            .0
            .iter()
            .find(|s| vaddr >= s.address && vaddr - s.address < s.data.len() as u64)?;
        Some((s, (vaddr - s.address) as usize))
    }

    /// The valid instruction at `ip`.
    pub fn decode_at(&self, ip: u64) -> Option<Instruction> {
        let (s, at) = self.at(ip)?;
        super::first(&s.data[at..], ip)
    }

    /// The valid instruction at `ip` and its bytes.
    pub fn decode_bytes_at(&self, ip: u64) -> Option<(Instruction, &'a [u8])> {
        let insn = self.decode_at(ip)?;
        let (s, at) = self.at(ip)?;
        Some((insn, s.data.get(at..at + insn.len())?))
    }
}
