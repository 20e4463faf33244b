//! Registers: which an instruction writes, which a call keeps, and how
//! the attach cookie names them.

use iced_x86::{Instruction, InstructionInfoFactory, OpAccess, Register};

/// Does an operand with this access change what it names?
pub fn writes(access: OpAccess) -> bool {
    matches!(
        access,
        OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
    )
}

/// The full registers `insn` writes (a write of `eax` is one of `rax`).
pub fn written(info: &mut InstructionInfoFactory, insn: &Instruction) -> Vec<Register> {
    info.info(insn)
        .used_registers()
        .iter()
        .filter(|u| writes(u.access()))
        .map(|u| u.register().full_register())
        .collect()
}

/// Registers a call leaves as they were (the System V ABI's
/// callee-saved general registers, besides the stack pointer).
pub fn callee_saved(r: Register) -> bool {
    matches!(
        r,
        Register::RBX
            | Register::RBP
            | Register::R12
            | Register::R13
            | Register::R14
            | Register::R15
    )
}

/// `r`'s code in `tracer_common::ARG_REGS` (from 1), as the attach
/// cookie's argument bits carry it; none for a register the BPF
/// programs do not read.
pub fn arg_code(r: Register) -> Option<u64> {
    use tracer_common::ArgReg;
    let a = match r {
        Register::RDI => ArgReg::Rdi,
        Register::RSI => ArgReg::Rsi,
        Register::RDX => ArgReg::Rdx,
        Register::RCX => ArgReg::Rcx,
        Register::R8 => ArgReg::R8,
        Register::R9 => ArgReg::R9,
        Register::RAX => ArgReg::Rax,
        Register::R10 => ArgReg::R10,
        Register::R11 => ArgReg::R11,
        Register::RBX => ArgReg::Rbx,
        Register::RBP => ArgReg::Rbp,
        Register::R12 => ArgReg::R12,
        Register::R13 => ArgReg::R13,
        Register::R14 => ArgReg::R14,
        Register::R15 => ArgReg::R15,
        _ => return None,
    };
    tracer_common::ARG_REGS
        .iter()
        .position(|x| *x == a)
        .map(|i| i as u64 + 1)
}
