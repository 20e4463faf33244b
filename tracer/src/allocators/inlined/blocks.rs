//! Where a copy of malloc's (calloc's) block is, for live mode: where
//! the copy's paths meet the call through the pointer's, or the end of
//! pymalloc's fast path.

use std::collections::HashSet;

use super::{BlockAt, MAX_FIXED};
use crate::asm::{
    arg_code,
    flow::{call_path, read_first, Step, MAX_FOLLOW},
    jump_target, kernel_emulates, writes, FlowControl, Instruction, InstructionInfoFactory,
    Mnemonic, OpKind, Register, Sections,
};

/// Most instructions a copy's own paths may take before they meet the
/// call's path (pymalloc's fast path, its slow paths and their failures):
/// a copy that looks bigger met it somewhere not followed.
const MAX_COPY: usize = 400;

/// Where a copy of malloc's block is known: each place where one of the
/// copy's own paths (from `start`) meets the path of the call through the
/// pointer (which returns to `ret`), and where the block is there. At
/// such a place the block is where the call's path keeps the call's
/// result: the register of those that the code there reads first; or,
/// when no register says, the one memory slot it was stored to (a place
/// with neither is left out). The copy's paths are followed for at most
/// [`MAX_COPY`] instructions.
fn merges_of(code: &Sections, start: u64, guard: u64, ret: u64) -> Vec<(u64, Held)> {
    let path = call_path(code, ret, MAX_FIXED);
    let mut seen = HashSet::new();
    let mut met = Vec::new();
    let mut todo = vec![start];
    while let Some(mut ip) = todo.pop() {
        loop {
            if let Some(at) = path.iter().position(|step| step.ip == ip) {
                if !met.contains(&at) {
                    met.push(at);
                }
                break;
            }
            if ip == guard || !seen.insert(ip) {
                break;
            }
            if seen.len() > MAX_COPY {
                todo.clear();
                break;
            }
            let Some(insn) = code.decode_at(ip) else {
                break;
            };
            if let Some(to) = jump_target(&insn) {
                ip = to;
                continue;
            }
            match insn.flow_control() {
                FlowControl::ConditionalBranch => todo.push(insn.near_branch_target()),
                FlowControl::Next | FlowControl::Call | FlowControl::IndirectCall => {}
                _ => break,
            }
            ip = insn.next_ip();
        }
    }
    met.sort_unstable();
    met.into_iter()
        .filter_map(|at| {
            let Step { ip, held, slots } = &path[at];
            let h = match (read_first(code, *ip, held.clone()), slots.as_slice()) {
                (Some(r), _) => Held::Reg(r),
                (None, [(base, disp)]) => Held::Mem(*base, *disp),
                _ => return None,
            };
            Some((*ip, h))
        })
        .collect()
}
/// Most instructions of a copy's fast path looked at.
const MAX_FAST: usize = 64;

/// The copy's fast path from `start`: each branch not taken (the layout a
/// compiler gives the likely way), jumps followed, up to a return, an
/// indirect jump, a call, its guard's branch at `guard` or [`MAX_FAST`]
/// instructions.
fn fast_path(code: &Sections, start: u64, guard: u64) -> Vec<Instruction> {
    let mut out: Vec<Instruction> = Vec::new();
    let mut ip = start;
    while out.len() < MAX_FAST && ip != guard && out.iter().all(|i| i.ip() != ip) {
        let Some(insn) = code.decode_at(ip) else {
            break;
        };
        out.push(insn);
        match insn.flow_control() {
            FlowControl::UnconditionalBranch if insn.op0_kind() == OpKind::NearBranch64 => {
                ip = insn.near_branch_target();
            }
            FlowControl::Next | FlowControl::ConditionalBranch => ip = insn.next_ip(),
            _ => break,
        }
    }
    out
}

/// Where pymalloc's fast path has its block, on a copy's fast path that
/// never meets the call's (the code after it duplicated on each side):
/// past `bp = pool->freeblock` (`mov disp(%pool), %R`), `next = *bp`
/// (`mov (%R), %X`), and the test of `next` for NULL (`test %X, %X; je`),
/// where its slow paths come back, with the block still in `R`.
fn fast_exit(fast: &[Instruction]) -> Option<(u64, Register)> {
    let mut info = InstructionInfoFactory::new();
    let mut bp: Option<Register> = None;
    let mut next: Option<Register> = None;
    let mut tested = false;
    for insn in fast {
        let dst = (insn.op0_kind() == OpKind::Register && insn.op0_register().is_gpr64())
            .then(|| insn.op0_register());
        if tested {
            return (insn.mnemonic() == Mnemonic::Je)
                .then_some(bp)
                .flatten()
                .map(|r| (insn.next_ip(), r));
        }
        let load = insn.mnemonic() == Mnemonic::Mov
            && insn.op1_kind() == OpKind::Memory
            && insn.memory_index() == Register::None;
        let (was_bp, was_next) = (bp, next);
        for u in info.info(insn).used_registers() {
            if writes(u.access()) {
                let r = u.register().full_register();
                if bp == Some(r) {
                    bp = None;
                }
                if next == Some(r) {
                    next = None;
                }
            }
        }
        match dst {
            Some(d)
                if load
                    && insn.memory_displacement64() == 0
                    && Some(insn.memory_base()) == was_bp =>
            {
                bp = was_bp;
                next = Some(d);
            }
            Some(d) if load && insn.memory_displacement64() != 0 && was_next.is_none() => {
                bp = Some(d);
            }
            _ => {}
        }
        tested = insn.mnemonic() == Mnemonic::Test
            && next.is_some()
            && insn.op0_kind() == OpKind::Register
            && insn.op1_kind() == OpKind::Register
            && Some(insn.op0_register()) == next
            && Some(insn.op1_register()) == next;
    }
    None
}

/// [`merges_of`] as probe places, and where a fast path that meets none
/// of them has its block ([`fast_exit`]); none when not found.
pub(super) fn blocks_of(code: &Sections, start: u64, guard: u64, ret: u64) -> Vec<BlockAt> {
    let mut merges = merges_of(code, start, guard, ret);
    let fast = fast_path(code, start, guard);
    if !fast
        .iter()
        .any(|i| merges.iter().any(|(at, _)| *at == i.ip()))
    {
        merges.extend(fast_exit(&fast).map(|(at, r)| (at, Held::Reg(r))));
    }
    // All the places or none: a copy with a place not probed would leave
    // its calls there unfinished.
    merges
        .into_iter()
        .map(|(at, h)| {
            let (reg, at_disp) = match h {
                Held::Reg(r) => (arg_code(r)?, 0),
                Held::Mem(Register::RSP, d) => (0, d + 1),
                Held::Mem(base, d) => (arg_code(base)?, d + 1),
            };
            let probe = emulated_from(code, at, h);
            Some(BlockAt {
                vaddr: probe,
                file_offset: code.file_offset(probe)?,
                met: at,
                reg,
                at_disp,
            })
        })
        .collect::<Option<Vec<_>>>()
        .unwrap_or_default()
}

/// The first instruction from `at` the kernel emulates, reached over
/// plain instructions (no branch) that write neither the block's register
/// nor its slot's base nor its slot: a probe there reads the same block
/// for one trap, where one at `at` may be single-stepped. `at` itself
/// when there is none within [`MAX_FOLLOW`] instructions.
fn emulated_from(code: &Sections, at: u64, h: Held) -> u64 {
    let mut info = InstructionInfoFactory::new();
    let base = match h {
        Held::Reg(r) | Held::Mem(r, _) => r,
    };
    let mut ip = at;
    for _ in 0..MAX_FOLLOW {
        let Some((insn, bytes)) = code.decode_bytes_at(ip) else {
            break;
        };
        if kernel_emulates(&insn, bytes) {
            return ip;
        }
        if insn.flow_control() != FlowControl::Next {
            break;
        }
        let moves = info
            .info(&insn)
            .used_registers()
            .iter()
            .any(|u| u.register().full_register() == base && writes(u.access()));
        let over = matches!(h, Held::Mem(b, d) if insn.op0_kind() == OpKind::Memory
            && insn.memory_base() == b
            && insn.memory_displacement64() == d);
        if moves || over {
            break;
        }
        ip = insn.next_ip();
    }
    at
}
/// Where a block is: a register, or memory at a register plus a
/// displacement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    Reg(Register),
    Mem(Register, u64),
}
