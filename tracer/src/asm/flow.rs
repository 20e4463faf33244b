//! The register data flow: where a value goes along a function's paths,
//! through register moves, stack slots and calls. Each question is asked
//! of an object's [`Sections`] from one address, and each follows a
//! bounded number of instructions.

use std::collections::VecDeque;

use super::{callee_saved, jump_target, writes, Sections};
use iced_x86::{
    FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess, OpKind, Register,
};

/// Most instructions followed from a branch to its indirect call, and
/// from a place to the first read of a value there.
pub const MAX_FOLLOW: usize = 24;

/// Most instructions of a call's path followed from its return.
const MAX_CALL_PATH: usize = 96;

/// The RIP-relative slot the last of `recent` that wrote `reg` loaded it
/// from, if that is what wrote it.
pub fn loaded_from(recent: &[Instruction], reg: Register) -> Option<u64> {
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

/// What a register holds at some place, in terms of the registers where
/// the following started ([`passed_at_call`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Value {
    Reg(Register),
    Const(u64),
    /// The 8 bytes at this offset from the stack pointer.
    Stack(u64),
    Unknown,
}

/// Where the call's result is at one address of its paths.
pub struct Step {
    pub ip: u64,
    /// The registers that hold it.
    pub held: Vec<Register>,
    /// The memory that holds it: a base register and a displacement.
    pub slots: Vec<(Register, u64)>,
}

/// A call's paths from its return at `ret`, each address with where the
/// call's result (`rax` at `ret`) is there (registers, and memory
/// at a register plus a displacement: a stack slot, a structure's field):
/// moves and stores followed; past a test of the result for NULL, the
/// non-NULL way; past other branches, both; over calls (keeping the
/// callee-saved registers and the stack slots); up to a return, an
/// indirect jump or [`MAX_CALL_PATH`] addresses in all. Only stores at a
/// displacement below `max_disp` are followed.
pub fn call_path(code: &Sections, ret: u64, max_disp: u64) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::new();
    let mut info = InstructionInfoFactory::new();
    let mut todo = VecDeque::from([(ret, vec![Register::RAX], Vec::new())]);
    while let Some((mut ip, mut held, mut slots)) = todo.pop_front() {
        let mut tested = false;
        while out.len() < MAX_CALL_PATH && out.iter().all(|s| s.ip != ip) {
            if held.is_empty() && slots.is_empty() {
                break;
            }
            out.push(Step {
                ip,
                held: held.clone(),
                slots: slots.clone(),
            });
            let Some(insn) = code.decode_at(ip) else {
                break;
            };
            if let Some(to) = jump_target(&insn) {
                ip = to;
                continue;
            }
            match insn.flow_control() {
                FlowControl::ConditionalBranch if tested => {
                    ip = match insn.mnemonic() {
                        Mnemonic::Jne => insn.near_branch_target(),
                        Mnemonic::Je => insn.next_ip(),
                        _ => break,
                    };
                    tested = false;
                    continue;
                }
                FlowControl::ConditionalBranch => {
                    todo.push_back((insn.near_branch_target(), held.clone(), slots.clone()));
                    ip = insn.next_ip();
                    continue;
                }
                FlowControl::Call | FlowControl::IndirectCall => {
                    held.retain(|r| callee_saved(*r));
                    slots.retain(|(base, _)| *base == Register::RSP);
                    tested = false;
                    ip = insn.next_ip();
                    continue;
                }
                FlowControl::Next => {}
                _ => break,
            }
            let reg = |i: u32| {
                (insn.op_kind(i) == OpKind::Register && insn.op_register(i).is_gpr64())
                    .then(|| insn.op_register(i))
            };
            if insn.rflags_modified() != 0 {
                tested = insn.mnemonic() == Mnemonic::Test
                    && reg(0).is_some_and(|r| reg(1) == Some(r) && held.contains(&r));
            }
            let copied = (insn.mnemonic() == Mnemonic::Mov)
                .then(|| (reg(0), reg(1)))
                .and_then(|(d, s)| Some((d?, s?)))
                .filter(|(_, s)| held.contains(s))
                .map(|(d, _)| d);
            // `mov %reg, disp(%base)` of the block: a slot holding it.
            let stored = (insn.mnemonic() == Mnemonic::Mov
                && insn.op0_kind() == OpKind::Memory
                && insn.memory_base().is_gpr64()
                && insn.memory_index() == Register::None
                && insn.memory_displacement64() < max_disp
                && reg(1).is_some_and(|r| held.contains(&r)))
            .then(|| (insn.memory_base(), insn.memory_displacement64()));
            for u in info.info(&insn).used_registers() {
                if writes(u.access()) {
                    let r = u.register().full_register();
                    held.retain(|h| *h != r);
                    slots.retain(|(base, _)| *base != r);
                }
            }
            // A store over a slot, of anything else, ends it.
            if insn.op0_kind() == OpKind::Memory && stored.is_none() {
                slots.retain(|s| *s != (insn.memory_base(), insn.memory_displacement64()));
            }
            held.extend(copied);
            slots.extend(stored);
            ip = insn.next_ip();
        }
    }
    out
}

/// Which of `held` the code from `at` reads before it writes it (the
/// value there on every path that meets at `at`), following jumps, calls
/// (which leave only the callee-saved registers) and the fall-through of
/// branches; or, when it reads none, the only one it does not overwrite
/// (a path into `at` moved the value there for the code after it).
pub fn read_first(code: &Sections, at: u64, mut held: Vec<Register>) -> Option<Register> {
    let mut info = InstructionInfoFactory::new();
    let only = |held: &[Register]| match held {
        [r] => Some(*r),
        _ => None,
    };
    let mut ip = at;
    for _ in 0..MAX_FOLLOW {
        let Some(insn) = code.decode_at(ip) else {
            return only(&held);
        };
        let used = info.info(&insn).used_registers();
        let read: Vec<Register> = used
            .iter()
            .filter(|u| !matches!(u.access(), OpAccess::Write | OpAccess::CondWrite))
            .map(|u| u.register().full_register())
            .filter(|r| held.contains(r))
            .collect();
        match read.as_slice() {
            [] => {}
            [r] => return Some(*r),
            _ => return None,
        }
        for u in used {
            if writes(u.access()) {
                held.retain(|r| *r != u.register().full_register());
            }
        }
        if held.is_empty() {
            return None;
        }
        if let Some(to) = jump_target(&insn) {
            ip = to;
            continue;
        }
        match insn.flow_control() {
            FlowControl::Call | FlowControl::IndirectCall => held.retain(|r| callee_saved(*r)),
            FlowControl::Next | FlowControl::ConditionalBranch => {}
            _ => return only(&held),
        }
        if held.is_empty() {
            return None;
        }
        ip = insn.next_ip();
    }
    only(&held)
}

/// What a call through the pointer in `reg` passes in the registers
/// `args`, in terms of the registers at `from`, and where it returns
/// (none for a `jmp`): follows the path from `from` to its `call *%reg`
/// or `jmp *%reg`, tracking register moves, constants and loads from the
/// stack; none when the path goes elsewhere first.
pub fn passed_at_call<const N: usize>(
    code: &Sections,
    from: u64,
    reg: Register,
    args: [Register; N],
) -> Option<([Value; N], Option<u64>)> {
    let mut info = InstructionInfoFactory::new();
    let mut values: Vec<(Register, Value)> = Vec::new();
    let value = |values: &[(Register, Value)], r: Register| {
        values
            .iter()
            .rev()
            .find(|(k, _)| *k == r)
            .map_or(Value::Reg(r), |(_, v)| *v)
    };
    let mut stack_moved = false;
    let mut ip = from;
    for _ in 0..MAX_FOLLOW {
        let insn = code.decode_at(ip)?;
        match insn.flow_control() {
            FlowControl::IndirectCall | FlowControl::IndirectBranch => {
                let ret =
                    (insn.flow_control() == FlowControl::IndirectCall).then(|| insn.next_ip());
                return (insn.op0_kind() == OpKind::Register && insn.op0_register() == reg).then(
                    || {
                        let args = args.map(|a| value(&values, a));
                        (args, ret)
                    },
                );
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
                // A load from the stack, while the stack pointer is the
                // one at `from`.
                OpKind::Memory
                    if d.is_gpr64()
                        && insn.memory_base() == Register::RSP
                        && insn.memory_index() == Register::None
                        && !stack_moved =>
                {
                    Some((d, Value::Stack(insn.memory_displacement64())))
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
            stack_moved |= r == Register::RSP;
            values.push((r, Value::Unknown));
        }
        if let Some((d, v)) = moved {
            values.push((d, v));
        }
        ip = insn.next_ip();
    }
    None
}
