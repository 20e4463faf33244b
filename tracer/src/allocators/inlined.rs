//! Copies of CPython's object allocator that the compiler inlined into
//! their callers.
//!
//! A build with profile-guided optimisation (Debian's python3.11) turns
//! `_PyObject.malloc(_PyObject.ctx, size)`, a call through the allocator's
//! function pointer, into a guard and a copy of pymalloc: `cmp
//! $_PyObject_Malloc, %reg; jne <call *%reg>`, then the allocator's body
//! in place. Most object allocations of such an interpreter run those
//! copies and never enter a probed function. Each guard is found here by
//! its immediate (the address of the static `_PyObject_Malloc`, read from
//! the guard in the exported `PyObject_Malloc`), and probed on its branch
//! (an emulated instruction): the BPF program counts the call when the zero
//! flag says the copy runs. The size is where the call through the pointer
//! would pass it: the register or constant that ends up in `rsi` on the
//! branch's other path, followed from the branch to the indirect call.

use super::placement::reg_code;
use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic,
    OpAccess, OpKind, Register,
};
use object::{Object, ObjectSection, SectionKind};
use tracer_common::{COOKIE_ARGS_SHIFT, COOKIE_INLINE_SIZE_SHIFT, PYMALLOC_MAX};

/// Where an inlined copy's size is when its guard's branch is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizeAt {
    /// In a register: its code in `tracer_common::ARG_REGS` (from 1).
    Reg(u64),
    /// A constant the compiler folded into the copy.
    Const(u64),
}

/// One guard's branch, to probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InlineSite {
    pub vaddr: u64,
    pub file_offset: u64,
    pub size: SizeAt,
}

impl InlineSite {
    /// The attach cookie's bits that say where the size is (the function's
    /// index and role are the row's).
    pub fn cookie_bits(&self) -> u64 {
        match self.size {
            SizeAt::Reg(code) => code << COOKIE_ARGS_SHIFT,
            SizeAt::Const(n) => n << COOKIE_INLINE_SIZE_SHIFT,
        }
    }
}

/// The guards of one object, by the allocator slot they load.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inlined {
    /// Guards on `_PyObject.malloc` (what `PyObject_Malloc` calls).
    pub object: Vec<InlineSite>,
    /// Guards on `_PyMem.malloc` (`PyMem_Malloc`).
    pub mem: Vec<InlineSite>,
    /// Guards on either slot not probed: their size could not be followed.
    pub missed: usize,
    /// Guards on a pointer read from elsewhere, not probed: a hook's call
    /// of the allocator it wraps (tracemalloc's, the debug hooks'), which
    /// would count again a call counted at an exported function's entry.
    pub hooks: usize,
}

/// A guard: `cmp $target, %reg` and the allocator slot `reg` was loaded
/// from (a RIP-relative load a few instructions before).
struct Guard {
    target: u64,
    slot: Option<u64>,
}

/// The first guard in the function at `vaddr` (an exported
/// `PyObject_Malloc`: its own copy's guard names the static function).
fn guard_in(code: &[Section], vaddr: u64) -> Option<Guard> {
    let mut recent: Vec<Instruction> = Vec::new();
    let mut ip = vaddr;
    for _ in 0..32 {
        let insn = decode_at(code, ip)?;
        if let Some((target, reg)) = guard_compare(&insn) {
            let next = decode_at(code, insn.next_ip())?;
            if is_guard_branch(&next) {
                return Some(Guard {
                    target,
                    slot: loaded_from(&recent, reg),
                });
            }
        }
        if insn.flow_control() != FlowControl::Next
            && insn.flow_control() != FlowControl::ConditionalBranch
        {
            return None;
        }
        recent.push(insn);
        ip = insn.next_ip();
    }
    None
}

/// `cmp $imm32, %r64`: the immediate (sign-extended) and the register.
fn guard_compare(insn: &Instruction) -> Option<(u64, Register)> {
    (matches!(insn.code(), Code::Cmp_rm64_imm32 | Code::Cmp_RAX_imm32)
        && insn.op0_kind() == OpKind::Register)
        .then(|| (insn.immediate32to64() as u64, insn.op0_register()))
}

fn is_guard_branch(insn: &Instruction) -> bool {
    matches!(insn.mnemonic(), Mnemonic::Jne | Mnemonic::Je)
        && matches!(insn.op0_kind(), OpKind::NearBranch64)
}

/// The RIP-relative slot the last of `recent` that wrote `reg` loaded it
/// from, if that is what wrote it.
fn loaded_from(recent: &[Instruction], reg: Register) -> Option<u64> {
    let mut info = InstructionInfoFactory::new();
    for insn in recent.iter().rev().take(12) {
        let writes = info
            .info(insn)
            .used_registers()
            .iter()
            .any(|u| u.register().full_register() == reg && writes(u.access()));
        if writes {
            return (insn.mnemonic() == Mnemonic::Mov
                && insn.op0_kind() == OpKind::Register
                && insn.op0_register() == reg
                && insn.is_ip_rel_memory_operand())
            .then(|| insn.ip_rel_memory_address());
        }
    }
    None
}

fn writes(access: OpAccess) -> bool {
    matches!(
        access,
        OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
    )
}

/// An executable section: its address and bytes.
struct Section<'a> {
    address: u64,
    file_offset: u64,
    data: &'a [u8],
}

fn decode_at(code: &[Section], ip: u64) -> Option<Instruction> {
    let s = code
        .iter()
        .find(|s| ip >= s.address && ip - s.address < s.data.len() as u64)?;
    let bytes = &s.data[(ip - s.address) as usize..];
    let mut decoder = Decoder::with_ip(64, bytes, ip, DecoderOptions::NONE);
    let insn = decoder.can_decode().then(|| decoder.decode())?;
    (!insn.is_invalid()).then_some(insn)
}

/// What a register holds on the guard's other path, in terms of the
/// registers at the branch.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Value {
    Reg(Register),
    Const(u64),
    Unknown,
}

/// Most instructions followed from a branch to its indirect call.
const MAX_FOLLOW: usize = 24;

/// Where the size is at the branch: follows the path that calls through
/// the pointer (starting at `from`) to its `call *%reg` or `jmp *%reg`,
/// tracking register moves, and reads what `rsi` holds there.
fn size_at(code: &[Section], from: u64, reg: Register) -> Option<SizeAt> {
    let mut info = InstructionInfoFactory::new();
    let mut values: Vec<(Register, Value)> = Vec::new();
    let value = |values: &[(Register, Value)], r: Register| {
        values
            .iter()
            .rev()
            .find(|(k, _)| *k == r)
            .map_or(Value::Reg(r), |(_, v)| *v)
    };
    let mut ip = from;
    for _ in 0..MAX_FOLLOW {
        let insn = decode_at(code, ip)?;
        match insn.flow_control() {
            FlowControl::IndirectCall | FlowControl::IndirectBranch => {
                if insn.op0_kind() == OpKind::Register && insn.op0_register() == reg {
                    return match value(&values, Register::RSI) {
                        Value::Reg(r) => reg_code(r).map(SizeAt::Reg),
                        Value::Const(n) => Some(SizeAt::Const(n)),
                        Value::Unknown => None,
                    };
                }
                return None;
            }
            FlowControl::UnconditionalBranch if insn.op0_kind() == OpKind::NearBranch64 => {
                ip = insn.near_branch_target();
                continue;
            }
            FlowControl::Next => {}
            _ => return None,
        }
        let dst = (insn.op0_kind() == OpKind::Register).then(|| insn.op0_register());
        let moved = match (insn.mnemonic(), dst) {
            (Mnemonic::Mov, Some(d)) if d.is_gpr64() || d.is_gpr32() => match insn.op1_kind() {
                OpKind::Register
                    if insn.op1_register().is_gpr64() || insn.op1_register().is_gpr32() =>
                {
                    Some((
                        d.full_register(),
                        value(&values, insn.op1_register().full_register()),
                    ))
                }
                OpKind::Immediate32 | OpKind::Immediate64 | OpKind::Immediate32to64 => {
                    Some((d.full_register(), Value::Const(insn.immediate(1))))
                }
                _ => None,
            },
            _ => None,
        };
        let written: Vec<Register> = info
            .info(&insn)
            .used_registers()
            .iter()
            .filter(|u| writes(u.access()))
            .map(|u| u.register().full_register())
            .collect();
        for r in written {
            values.push((r, Value::Unknown));
        }
        if let Some((d, v)) = moved {
            values.push((d, v));
        }
        ip = insn.next_ip();
    }
    None
}

/// The guarded copies in `file` of the allocator that the exported
/// `PyObject_Malloc` at `object_malloc` guards for, outside the functions
/// in `probed` (vaddr, size: their calls are counted at their entry).
/// `mem_malloc` is the exported `PyMem_Malloc`, whose slot tells its
/// copies apart.
pub fn find(
    file: &object::File,
    object_malloc: u64,
    mem_malloc: Option<u64>,
    probed: &[(u64, u64)],
) -> Inlined {
    let code: Vec<Section> = file
        .sections()
        .filter(|s| s.kind() == SectionKind::Text)
        .filter_map(|s| {
            let (file_offset, _) = s.file_range()?;
            Some(Section {
                address: s.address(),
                file_offset,
                data: s.data().ok()?,
            })
        })
        .collect();
    let mut out = Inlined::default();
    let Some(object) = guard_in(&code, object_malloc) else {
        return out;
    };
    let Some(object_slot) = object.slot else {
        return out;
    };
    let mem_slot = mem_malloc
        .and_then(|m| guard_in(&code, m))
        .filter(|g| g.target == object.target)
        .and_then(|g| g.slot);
    let inside = |ip: u64| probed.iter().any(|(v, n)| ip >= *v && ip - *v < *n);
    for s in &code {
        let mut decoder = Decoder::with_ip(64, s.data, s.address, DecoderOptions::NONE);
        let mut recent: Vec<Instruction> = Vec::with_capacity(16);
        let mut insn = Instruction::default();
        let mut guard: Option<(Register, Option<u64>)> = None;
        while decoder.can_decode() {
            decoder.decode_out(&mut insn);
            if insn.is_invalid() {
                recent.clear();
                guard = None;
                continue;
            }
            if let Some((reg, slot)) = guard.take() {
                if is_guard_branch(&insn) && !inside(insn.ip()) {
                    let other = if insn.mnemonic() == Mnemonic::Jne {
                        insn.near_branch_target()
                    } else {
                        insn.next_ip()
                    };
                    let row = if slot == Some(object_slot) {
                        Some(&mut out.object)
                    } else if slot.is_some() && slot == mem_slot {
                        Some(&mut out.mem)
                    } else {
                        None
                    };
                    match (row, size_at(&code, other, reg)) {
                        (Some(row), Some(size)) => {
                            let probed = match size {
                                SizeAt::Const(n) => n > 0 && n <= PYMALLOC_MAX,
                                SizeAt::Reg(_) => true,
                            };
                            if probed {
                                row.push(InlineSite {
                                    vaddr: insn.ip(),
                                    file_offset: s.file_offset + (insn.ip() - s.address),
                                    size,
                                });
                            }
                        }
                        (Some(_), None) => out.missed += 1,
                        (None, _) => out.hooks += 1,
                    }
                }
            }
            if let Some((target, reg)) = guard_compare(&insn) {
                if target == object.target {
                    guard = Some((reg, loaded_from(&recent, reg)));
                }
            }
            if recent.len() == 16 {
                recent.remove(0);
            }
            recent.push(insn);
        }
    }
    out
}

/// How many guards in `file`, outside the functions in `probed`, guard
/// for the function the one in `function` guards for (the copies of a
/// function not probed, to say how many).
pub fn guards_of(file: &object::File, function: u64, probed: &[(u64, u64)]) -> usize {
    let code: Vec<Section> = file
        .sections()
        .filter(|s| s.kind() == SectionKind::Text)
        .filter_map(|s| {
            Some(Section {
                address: s.address(),
                file_offset: s.file_range()?.0,
                data: s.data().ok()?,
            })
        })
        .collect();
    let Some(g) = guard_in(&code, function) else {
        return 0;
    };
    let mut n = 0;
    for s in &code {
        let mut decoder = Decoder::with_ip(64, s.data, s.address, DecoderOptions::NONE);
        let mut insn = Instruction::default();
        while decoder.can_decode() {
            decoder.decode_out(&mut insn);
            let inside = probed
                .iter()
                .any(|(v, n)| insn.ip() >= *v && insn.ip() - *v < *n);
            if !inside && guard_compare(&insn).is_some_and(|(t, _)| t == g.target) {
                n += 1;
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian's python3.11 (PGO, LTO, stripped): its copies of pymalloc are
    /// found, nearly all with their size.
    #[test]
    fn finds_debian_python_copies_of_pymalloc() {
        let Ok(data) = std::fs::read("/usr/bin/python3.11") else {
            return;
        };
        let file = object::File::parse(&*data).unwrap();
        let sym = |name: &str| {
            file.dynamic_symbols()
                .find(|s| s.name() == Ok(name))
                .map(|s| (s.address(), s.size()))
        };
        use object::ObjectSymbol;
        let (om, om_size) = sym("PyObject_Malloc").unwrap();
        let (mm, mm_size) = sym("PyMem_Malloc").unwrap();
        let found = find(&file, om, Some(mm), &[(om, om_size), (mm, mm_size)]);
        let n = found.object.len() + found.mem.len();
        assert!(n > 100, "{found:?}");
        assert!(!found.mem.is_empty());
        assert!(found.missed < n / 20, "{found:?}");
        assert!(found
            .object
            .iter()
            .chain(&found.mem)
            .all(|s| s.vaddr < om || s.vaddr >= om + om_size));
    }
}
