//! What a uprobe costs on an instruction.

use iced_x86::{Code, FlowControl, Instruction, Mnemonic, OpKind};

/// Instructions arch/x86/kernel/uprobes.c emulates without a single-step:
/// nops, relative jumps and calls, conditional jumps, and pushes of a
/// general register (with at most a REX.B prefix). `bytes` are the
/// instruction's own.
pub fn kernel_emulates(insn: &Instruction, bytes: &[u8]) -> bool {
    // The kernel refuses branches with an operand-size prefix.
    if bytes.first() == Some(&0x66) && insn.mnemonic() != Mnemonic::Nop {
        return false;
    }
    match insn.mnemonic() {
        Mnemonic::Nop => true,
        Mnemonic::Push => {
            insn.op0_kind() == OpKind::Register
                && insn.op0_register().is_gpr64()
                && insn.len() <= 2
                && !matches!(insn.code(), Code::Push_rm64)
        }
        Mnemonic::Jmp | Mnemonic::Call => matches!(
            insn.op0_kind(),
            OpKind::NearBranch64 | OpKind::NearBranch32 | OpKind::NearBranch16
        ),
        _ => {
            insn.flow_control() == FlowControl::ConditionalBranch
                && insn.op0_kind() == OpKind::NearBranch64
                && !matches!(
                    insn.mnemonic(),
                    Mnemonic::Jrcxz
                        | Mnemonic::Jecxz
                        | Mnemonic::Loop
                        | Mnemonic::Loope
                        | Mnemonic::Loopne
                )
        }
    }
}
