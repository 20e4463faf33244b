//! Bytes into instructions.

use iced_x86::{Decoder, DecoderOptions, FlowControl, Instruction, OpKind};

/// The instruction `bytes` start with, at address `ip`; none when the
/// bytes are empty or do not start with a valid instruction.
pub fn first(bytes: &[u8], ip: u64) -> Option<Instruction> {
    let mut decoder = Decoder::with_ip(64, bytes, ip, DecoderOptions::NONE);
    let insn = decoder.can_decode().then(|| decoder.decode())?;
    (!insn.is_invalid()).then_some(insn)
}

/// Every instruction in `bytes`, the first at address `ip`, one after
/// the other (a linear sweep). An undecodable byte yields an invalid
/// instruction one byte long, and the sweep goes on after it.
pub fn instructions(bytes: &[u8], ip: u64) -> impl Iterator<Item = Instruction> + '_ {
    Decoder::with_ip(64, bytes, ip, DecoderOptions::NONE).into_iter()
}

/// Is `insn` a call, direct or indirect?
pub fn is_call(insn: &Instruction) -> bool {
    matches!(
        insn.flow_control(),
        FlowControl::Call | FlowControl::IndirectCall
    )
}

/// Where a direct unconditional jump (`jmp rel`) goes; none for any
/// other instruction. A walk of a function's paths follows it as if the
/// code at its target came next.
pub fn jump_target(insn: &Instruction) -> Option<u64> {
    (insn.flow_control() == FlowControl::UnconditionalBranch
        && insn.op0_kind() == OpKind::NearBranch64)
        .then(|| insn.near_branch_target())
}
