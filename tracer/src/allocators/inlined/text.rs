//! An object's code, and the calls in it of the C library's allocator.

use std::collections::HashSet;

use crate::asm::{jump_target, FlowControl, Mnemonic, OpKind, Sections};
use object::{Object, ObjectSection, ObjectSymbol, ObjectSymbolTable, RelocationTarget};

/// An object's code: its executable sections, and the GOT slots through
/// which its PLT calls the C library's allocator functions.
pub struct Text<'a> {
    pub sections: Sections<'a>,
    slots: Vec<u64>,
}

impl<'a> Text<'a> {
    pub fn of(file: &object::File<'a>) -> Text<'a> {
        let symbols = file.dynamic_symbol_table();
        let slots = file
            .dynamic_relocations()
            .into_iter()
            .flatten()
            .filter(|(_, r)| {
                let RelocationTarget::Symbol(i) = r.target() else {
                    return false;
                };
                symbols
                    .as_ref()
                    .and_then(|t| t.symbol_by_index(i).ok())
                    .and_then(|s| s.name().ok())
                    .is_some_and(|n| super::super::families::lookup(n).is_some())
            })
            .map(|(got, _)| got)
            .collect();
        Text {
            sections: Sections::of(file),
            slots,
        }
    }

    /// Is `target` a PLT stub that jumps to an allocator function of
    /// another object (`jmp *slot(%rip)`, after an `endbr64`)?
    fn allocator_stub(&self, target: u64) -> bool {
        let mut ip = target;
        for _ in 0..2 {
            let Some(insn) = self.sections.decode_at(ip) else {
                return false;
            };
            if insn.mnemonic() == Mnemonic::Endbr64 {
                ip = insn.next_ip();
                continue;
            }
            return insn.mnemonic() == Mnemonic::Jmp
                && insn.is_ip_rel_memory_operand()
                && self.slots.contains(&insn.ip_rel_memory_address());
        }
        false
    }
}

/// Most instructions looked at from a copy of realloc for its calls.
const MAX_REGION: usize = 1024;
/// How far past its guard a copy's code is looked for.
const REGION_SPAN: u64 = 0x800;

/// The return addresses of the calls of the C library's allocator made
/// in the copy that starts at `from` (its guard's branch at `guard`):
/// every path from there, both ways at each branch, up to a return, an
/// indirect jump, the guard, a jump back before the copy's start or
/// [`REGION_SPAN`] past it. The host function's code after the copy is in that region too: a
/// call of `malloc` of its own there would be taken for the copy's.
pub(super) fn library_calls(code: &Text, from: u64, guard: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut todo = vec![from];
    while let Some(mut ip) = todo.pop() {
        while seen.len() < MAX_REGION {
            if ip < from || ip > from + REGION_SPAN || ip == guard || seen.contains(&ip) {
                break;
            }
            seen.insert(ip);
            let Some(insn) = code.sections.decode_at(ip) else {
                break;
            };
            if let Some(to) = jump_target(&insn) {
                ip = to;
                continue;
            }
            match insn.flow_control() {
                FlowControl::Return | FlowControl::IndirectBranch | FlowControl::Exception => break,
                FlowControl::UnconditionalBranch => break,
                FlowControl::ConditionalBranch => todo.push(insn.near_branch_target()),
                FlowControl::Call
                    if insn.op0_kind() == OpKind::NearBranch64
                        && code.allocator_stub(insn.near_branch_target()) =>
                {
                    out.push(insn.next_ip());
                }
                _ => {}
            }
            ip = insn.next_ip();
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The extent (start, length) of the function containing `addr`, by its
/// call-frame information (`.eh_frame`): a stripped object names none.
pub fn function_extent(file: &object::File, addr: u64) -> Option<(u64, u64)> {
    use gimli::{BaseAddresses, CieOrFde, EhFrame, LittleEndian, UnwindSection};
    let section = file.section_by_name(".eh_frame")?;
    let data = section.data().ok()?;
    let eh = EhFrame::new(data, LittleEndian);
    let mut bases = BaseAddresses::default().set_eh_frame(section.address());
    if let Some(text) = file.section_by_name(".text") {
        bases = bases.set_text(text.address());
    }
    let mut entries = eh.entries(&bases);
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let Ok(fde) = partial.parse(EhFrame::cie_from_offset) else {
            continue;
        };
        if addr >= fde.initial_address() && addr - fde.initial_address() < fde.len() {
            return Some((fde.initial_address(), fde.len()));
        }
    }
    None
}
