//! The guards: `cmp $function, %reg; jne|je`, the pointer in `%reg`
//! loaded from an allocator's slot, and the targets they name.

use super::{Kind, Target, Text};
use crate::asm::{flow::loaded_from, Code, FlowControl, Instruction, Mnemonic, OpKind, Register};

/// The first guard in the function at `vaddr` (an exported
/// `PyObject_Malloc`: its own copy's guard names the static function):
/// the function it compares with and the slot the pointer came from.
pub fn guard_of(code: &Text, vaddr: u64) -> Option<(u64, u64)> {
    let mut recent: Vec<Instruction> = Vec::new();
    let mut ip = vaddr;
    for _ in 0..32 {
        let insn = code.sections.decode_at(ip)?;
        if let Some((target, reg)) = guard_compare(&insn) {
            let next = code.sections.decode_at(insn.next_ip())?;
            if is_guard_branch(&next) {
                return Some((target, loaded_from(&recent, reg)?));
            }
        }
        if !matches!(
            insn.flow_control(),
            FlowControl::Next | FlowControl::ConditionalBranch
        ) {
            return None;
        }
        recent.push(insn);
        ip = insn.next_ip();
    }
    None
}
/// `cmp $imm32, %r64`: the immediate (sign-extended) and the register.
pub(super) fn guard_compare(insn: &Instruction) -> Option<(u64, Register)> {
    (matches!(insn.code(), Code::Cmp_rm64_imm32 | Code::Cmp_RAX_imm32)
        && insn.op0_kind() == OpKind::Register)
        .then(|| (insn.immediate32to64() as u64, insn.op0_register()))
}
/// `jne` or `je` to an address.
pub(super) fn is_guard_branch(insn: &Instruction) -> bool {
    matches!(insn.mnemonic(), Mnemonic::Jne | Mnemonic::Je)
        && matches!(insn.op0_kind(), OpKind::NearBranch64)
}
/// The exported functions whose copies to look for, each as (its probe
/// site's row, its address): `PyObject_Malloc`'s guard names the static
/// `_PyObject_Malloc` and the slot of `_PyObject`; `PyMem_Malloc`'s the
/// same function and `_PyMem`'s slot; `PyMem_Calloc`'s the static
/// `_PyObject_Calloc`, in the slot after `_PyMem`'s malloc (a
/// `PyMemAllocatorEx` is ctx, malloc, calloc, realloc, free), so
/// `PyObject_Calloc`'s copies load the slot after `_PyObject`'s malloc;
/// `PyObject_Realloc`'s and `PyMem_Realloc`'s guards name the static
/// `_PyObject_Realloc`, in the slots after the callocs, and
/// `PyObject_Free`'s and `PyMem_Free`'s the static `_PyObject_Free`, in
/// the slots after those.
pub struct Exported {
    pub object_malloc: (usize, u64),
    pub mem_malloc: Option<(usize, u64)>,
    pub object_calloc: Option<usize>,
    pub mem_calloc: Option<(usize, u64)>,
    pub object_realloc: Option<(usize, u64)>,
    pub mem_realloc: Option<(usize, u64)>,
    pub object_free: Option<(usize, u64)>,
    pub mem_free: Option<(usize, u64)>,
}

/// The [`Target`]s of CPython's allocator in `code`.
pub fn targets(code: &Text, e: &Exported) -> Vec<Target> {
    let Some((malloc, object_slot)) = guard_of(code, e.object_malloc.1) else {
        return Vec::new();
    };
    let mut out = vec![Target {
        row: e.object_malloc.0,
        function: malloc,
        slot: object_slot,
        kind: Kind::Malloc,
    }];
    let Some((row, mem_slot)) = e.mem_malloc.and_then(|(row, vaddr)| {
        let (function, slot) = guard_of(code, vaddr)?;
        (function == malloc).then_some((row, slot))
    }) else {
        return out;
    };
    out.push(Target {
        row,
        function: malloc,
        slot: mem_slot,
        kind: Kind::Malloc,
    });
    for (row, vaddr, slot, kind) in [
        e.object_realloc
            .map(|(r, v)| (r, v, object_slot + 16, Kind::Realloc)),
        e.mem_realloc
            .map(|(r, v)| (r, v, mem_slot + 16, Kind::Realloc)),
        e.object_free
            .map(|(r, v)| (r, v, object_slot + 24, Kind::Free)),
        e.mem_free.map(|(r, v)| (r, v, mem_slot + 24, Kind::Free)),
    ]
    .into_iter()
    .flatten()
    {
        if let Some((function, at)) = guard_of(code, vaddr) {
            if at == slot {
                out.push(Target {
                    row,
                    function,
                    slot,
                    kind,
                });
            }
        }
    }
    if let Some((row, (calloc, slot))) = e
        .mem_calloc
        .and_then(|(row, vaddr)| Some((row, guard_of(code, vaddr)?)))
        .filter(|(_, (_, slot))| *slot == mem_slot + 8)
    {
        out.push(Target {
            row,
            function: calloc,
            slot,
            kind: Kind::Calloc,
        });
        if let Some(row) = e.object_calloc {
            out.push(Target {
                row,
                function: calloc,
                slot: object_slot + 8,
                kind: Kind::Calloc,
            });
        }
    }
    out
}
