//! Probe placement: where in an allocator function the uprobe goes.
//!
//! A uprobe costs a trap when the kernel emulates the probed instruction
//! and many times that when it must single-step it out of line
//! (docs/placement.md). Each
//! entry point is probed at its first instruction when that is a push,
//! jump, call or nop, else at the first such instruction reached after only
//! flag-setting or scratch-register instructions, so every call still
//! passes the probe with its arguments and return address untouched (or,
//! for `reallocarray`, with the product `n * size` its prologue made in
//! place of the two: glibc's is `mov %rsi,%rax; mul %rdx; mov %rax,%rsi;
//! jo`).

use tracer_common::Role;

use crate::asm::{
    self, arg_code, kernel_emulates, FlowControl, Instruction, InstructionInfoFactory, Mnemonic,
    OpKind, Register,
};

#[derive(Debug, PartialEq, Eq)]
pub struct Placement {
    pub offset: u64,
    pub emulated: bool,
    pub instruction: String,
    /// Where the probe finds the arguments it reads, when the prologue
    /// before it moved them: four bits per argument, as the attach cookie
    /// carries them (`tracer_common::COOKIE_ARGS_SHIFT`); 0 when every one
    /// is in its own register.
    pub args: u64,
    /// A `reallocarray` probed past the multiply of its `n` and `size`:
    /// the probe finds the product where `size` would be for `realloc`
    /// (second argument, as `args` says), and serves as `realloc`'s role.
    pub multiplied: bool,
}

/// The argument registers, in argument order.
const ARGS: [Register; 4] = [Register::RDI, Register::RSI, Register::RDX, Register::RCX];

/// The code of a scratch register an entry probe's prologue can move an
/// argument to (a callee-saved one it would save on the stack first).
fn arg_reg_code(reg: Register) -> Option<u64> {
    arg_code(reg).filter(|c| *c <= 9)
}

/// Where each argument a probe reads is at a point of the prologue: every
/// register that still holds it.
struct Holders {
    /// (the argument's own register, the registers holding it now).
    args: Vec<(Register, Vec<Register>)>,
    /// `reallocarray`'s `n * size` (its `rsi` and `rdx`), once a `mul` of
    /// one by the other made it: the registers holding it now. The two
    /// arguments are then no longer needed.
    product: Option<Vec<Register>>,
}

impl Holders {
    fn new(reads: &[Register]) -> Holders {
        Holders {
            args: reads.iter().map(|r| (*r, vec![*r])).collect(),
            product: None,
        }
    }

    fn held(&self, own: Register) -> Option<&Vec<Register>> {
        self.args.iter().find(|(r, _)| *r == own).map(|(_, h)| h)
    }

    /// `mul r64` of `rax` by `r` where one holds `n` (`rsi`) and the other
    /// `size` (`rdx`), the arguments of a `reallocarray`: its low half, in
    /// `rax`, is the size asked for (the high half, in `rdx`, is nonzero
    /// only for a request that overflows, which fails).
    fn multiplies_n_by_size(&self, insn: &Instruction) -> bool {
        if insn.mnemonic() != Mnemonic::Mul
            || insn.op_count() != 1
            || insn.op0_kind() != OpKind::Register
            || !insn.op0_register().is_gpr64()
            || self.product.is_some()
        {
            return false;
        }
        let (Some(n), Some(size)) = (self.held(Register::RSI), self.held(Register::RDX)) else {
            return false;
        };
        let by = insn.op0_register();
        (n.contains(&Register::RAX) && size.contains(&by))
            || (size.contains(&Register::RAX) && n.contains(&by))
    }

    /// Follows one instruction that writes `written` (full registers); a
    /// 64-bit register-to-register `mov` copies what its source holds.
    /// False when an argument is held nowhere any more.
    fn step(&mut self, insn: &Instruction, written: &[Register]) -> bool {
        let copy = (insn.mnemonic() == Mnemonic::Mov
            && insn.op_count() == 2
            && insn.op0_kind() == OpKind::Register
            && insn.op1_kind() == OpKind::Register
            && insn.op0_register().is_gpr64()
            && insn.op1_register().is_gpr64())
        .then(|| (insn.op1_register(), insn.op0_register()));
        if self.multiplies_n_by_size(insn) {
            self.args
                .retain(|(own, _)| *own != Register::RSI && *own != Register::RDX);
            self.product = Some(vec![Register::RAX]);
            return self.args.iter().all(|(_, held)| !held.is_empty());
        }
        for held in self
            .args
            .iter_mut()
            .map(|(_, held)| held)
            .chain(self.product.as_mut())
        {
            let gains =
                copy.is_some_and(|(src, dst)| held.contains(&src) && arg_reg_code(dst).is_some());
            held.retain(|r| !written.contains(r));
            if let (true, Some((_, dst))) = (gains, copy) {
                held.push(dst);
            }
        }
        self.args.iter().all(|(_, held)| !held.is_empty())
            && self.product.as_ref().is_none_or(|held| !held.is_empty())
    }

    /// The cookie's argument bits: for each argument no longer in its own
    /// register, the code of one that holds it.
    fn cookie_bits(&self) -> u64 {
        let mut bits = 0;
        for (own, held) in &self.args {
            if held.contains(own) {
                continue;
            }
            let n = ARGS.iter().position(|a| a == own).unwrap_or(0);
            if let Some(code) = held.iter().find_map(|r| arg_reg_code(*r)) {
                bits |= code << (4 * n);
            }
        }
        // The product, as `realloc`'s size: its second argument.
        if let Some(held) = &self.product {
            if !held.contains(&Register::RSI) {
                if let Some(code) = held.iter().find_map(|r| arg_reg_code(*r)) {
                    bits |= code << 4;
                }
            }
        }
        bits
    }
}

/// How many instructions we look past the entry for an emulated one.
const MAX_SCAN: usize = 16;

/// The registers a probe of `role` reads at entry, besides the stack
/// pointer (the return address is at `[rsp]`): only these must be intact
/// where the probe sits.
pub fn reads(role: Role) -> &'static [Register] {
    match role {
        Role::Size | Role::Free => &[Register::RDI],
        Role::CountSize | Role::Resize => &[Register::RDI, Register::RSI],
        Role::AlignSize | Role::ResizeInPlace => &[Register::RSI],
        Role::ResizeArray => &[Register::RDI, Register::RSI, Register::RDX],
        Role::PosixMemalign => &[Register::RDI, Register::RDX],
        Role::ResizeRust => &[Register::RDI, Register::RCX],
    }
}

/// Chooses the probe offset inside a function from its code (`code`
/// starts at the function's first byte, at address `ip`, and holds as
/// much of its body as is known): the first instruction the kernel
/// emulates, reached through instructions that write neither memory nor
/// the stack pointer nor a register in `reads`. Never past an address
/// some branch of the function jumps to (that path would miss the probe,
/// or pass it twice).
pub fn place_probe(code: &[u8], ip: u64, reads: &[Register]) -> Placement {
    let placement = scan(code, ip, reads);
    if placement.offset > 0 && jumped_into(code, ip, placement.offset) {
        // The first instruction: `scan` found it is not emulated.
        return scan(&code[..0], ip, reads).with_instruction(first_mnemonic(code, ip));
    }
    placement
}

impl Placement {
    fn with_instruction(self, instruction: Option<String>) -> Placement {
        Placement {
            instruction: instruction.unwrap_or(self.instruction),
            ..self
        }
    }
}

/// The first instruction's mnemonic.
fn first_mnemonic(code: &[u8], ip: u64) -> Option<String> {
    asm::first(code, ip).map(|insn| format!("{:?}", insn.mnemonic()).to_lowercase())
}

/// Does a branch in `code` target `(ip, ip + offset]`?
fn jumped_into(code: &[u8], ip: u64, offset: u64) -> bool {
    for insn in asm::instructions(code, ip) {
        if insn.is_invalid() {
            continue;
        }
        if matches!(
            insn.flow_control(),
            FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch
        ) && matches!(
            insn.op0_kind(),
            OpKind::NearBranch64 | OpKind::NearBranch32 | OpKind::NearBranch16
        ) {
            let target = insn.near_branch_target();
            if target > ip && target <= ip + offset {
                return true;
            }
        }
    }
    false
}

fn scan(code: &[u8], ip: u64, reads: &[Register]) -> Placement {
    let mut info = InstructionInfoFactory::new();
    let mut first = None;
    let mut holders = Holders::new(reads);
    for insn in asm::instructions(code, ip).take(MAX_SCAN) {
        if insn.is_invalid() {
            break;
        }
        let offset = insn.ip() - ip;
        let text = format!("{:?}", insn.mnemonic()).to_lowercase();
        if first.is_none() {
            first = Some(text.clone());
        }
        let bytes = &code[offset as usize..offset as usize + insn.len()];
        if kernel_emulates(&insn, bytes) {
            return Placement {
                offset,
                emulated: true,
                instruction: text,
                args: holders.cookie_bits(),
                multiplied: holders.product.is_some(),
            };
        }
        match harmless(&insn, &mut info) {
            Some(written) if holders.step(&insn, &written) => {}
            _ => break,
        }
    }
    Placement {
        offset: 0,
        emulated: false,
        instruction: first.unwrap_or_else(|| "?".into()),
        args: 0,
        multiplied: false,
    }
}

/// Can the probe move past this instruction? Only if it neither branches
/// nor writes memory or the stack pointer: loads (`mov`, `lea`, `%fs:`
/// reads), compares, register moves and scratch arithmetic are fine, as
/// long as the arguments the probe reads are still held somewhere
/// ([`Holders`]). Returns the full registers it writes.
fn harmless(insn: &Instruction, info: &mut InstructionInfoFactory) -> Option<Vec<Register>> {
    if insn.flow_control() != FlowControl::Next {
        return None;
    }
    if info
        .info(insn)
        .used_memory()
        .iter()
        .any(|m| asm::writes(m.access()))
    {
        return None;
    }
    let written = asm::written(info, insn);
    (!written.contains(&Register::RSP)).then_some(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_at_entry_is_probed_at_entry() {
        // push %r12; push %rbp
        let p = place_probe(&[0x41, 0x54, 0x55], 0x1000, reads(Role::Size));
        assert_eq!(p.offset, 0);
        assert!(p.emulated);
    }

    #[test]
    fn glibc_free_is_probed_at_the_null_check_branch() {
        // test %rdi,%rdi; je +0xc5; push %rbp
        let code = [0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0x00, 0x00, 0x00, 0x55];
        let p = place_probe(&code, 0x98ef0, reads(Role::Free));
        assert_eq!(p.offset, 3);
        assert!(p.emulated);
    }

    #[test]
    fn glibc_posix_memalign_skips_the_cmpb() {
        // cmpb $0x0,0x140201(%rip); push %r12
        let code = [0x80, 0x3d, 0x01, 0x02, 0x14, 0x00, 0x00, 0x41, 0x54];
        let p = place_probe(&code, 0x9a280, reads(Role::PosixMemalign));
        assert_eq!(p.offset, 7);
        assert!(p.emulated);
    }

    #[test]
    fn glibc_reallocarray_is_probed_past_its_multiply() {
        // mov %rsi,%rax; mul %rdx (writes rdx); mov %rax,%rsi; jo: at the
        // jo, rsi holds n * size, where realloc's size is.
        let code = [
            0x48, 0x89, 0xf0, 0x48, 0xf7, 0xe2, 0x48, 0x89, 0xc6, 0x70, 0x05,
        ];
        let p = place_probe(&code, 0x9a7e0, reads(Role::ResizeArray));
        assert_eq!(
            (p.offset, p.emulated, p.multiplied, p.args),
            (9, true, true, 0)
        );
        // Cut before the copy back to rsi: the product is read from rax.
        let code = [0x48, 0x89, 0xf0, 0x48, 0xf7, 0xe2, 0x70, 0x05];
        let p = place_probe(&code, 0x9a7e0, reads(Role::ResizeArray));
        let rax = tracer_common::ARG_REGS
            .iter()
            .position(|a| *a == tracer_common::ArgReg::Rax)
            .unwrap() as u64
            + 1;
        assert_eq!((p.offset, p.multiplied, p.args), (6, true, rax << 4));
    }

    #[test]
    fn argument_clobber_stops_the_scan() {
        // mov %rsi,%rax; mul %rcx (rcx holds no argument); jo: the size
        // (rdx) is lost, and rax holds no product of the arguments.
        let code = [0x48, 0x89, 0xf0, 0x48, 0xf7, 0xe1, 0x70, 0x05];
        let p = place_probe(&code, 0x9a7e0, reads(Role::ResizeArray));
        assert_eq!((p.offset, p.emulated, p.multiplied), (0, false, false));
        // In a function that is no reallocarray a multiply is scratch
        // arithmetic: no product is taken for the size.
        let code = [0x48, 0x89, 0xf8, 0x48, 0xf7, 0xe2, 0x70, 0x05];
        let p = place_probe(&code, 0, reads(Role::Size));
        assert_eq!((p.offset, p.multiplied, p.args), (6, false, 0));
    }

    #[test]
    fn registers_the_role_does_not_read_may_be_written() {
        // jemalloc's rallocx(ptr, size, flags): xor %ecx,%ecx; jmp. A
        // resize reads rdi and rsi only.
        let code = [0x31, 0xc9, 0xe9, 0xe9, 0x1c, 0xff, 0xff];
        let p = place_probe(&code, 0x2bdc0, reads(Role::Resize));
        assert_eq!((p.offset, p.emulated), (2, true));
        // tcmalloc's memalign(align, size): mov %rdi,%r8; cmp $0x2000,%rdi;
        // ja: the size (rsi) is untouched.
        let code = [
            0x49, 0x89, 0xf8, 0x48, 0x81, 0xff, 0x00, 0x20, 0x00, 0x00, 0x0f, 0x87, 0xe8, 0x00,
            0x00, 0x00,
        ];
        let p = place_probe(&code, 0x1ee40, reads(Role::AlignSize));
        assert_eq!((p.offset, p.emulated), (10, true));
    }

    #[test]
    fn arguments_moved_by_the_prologue_are_read_where_they_went() {
        use tracer_common::{ArgReg, ARG_REGS};
        let code_of = |r: ArgReg| ARG_REGS.iter().position(|a| *a == r).unwrap() as u64 + 1;
        // mimalloc's malloc: mov 0xb449(%rip),%rax; mov %rdi,%rsi;
        // mov %fs:(%rax),%rdi; cmp $0x400,%rsi; ja: the size is in rsi.
        let code = [
            0x48, 0x8b, 0x05, 0x49, 0xb4, 0x00, 0x00, 0x48, 0x89, 0xfe, 0x64, 0x48, 0x8b, 0x38,
            0x48, 0x81, 0xfe, 0x00, 0x04, 0x00, 0x00, 0x77, 0x29,
        ];
        let p = place_probe(&code, 0x10b70, reads(Role::Size));
        assert_eq!((p.offset, p.emulated), (21, true));
        assert_eq!(p.args, code_of(ArgReg::Rsi));
        // mimalloc's calloc(n, size): mov ..(%rip),%rdx; mov %rdi,%rax;
        // mov %fs:(%rdx),%rdi; cmp $0x1,%rax; je: n in rax, size in rsi.
        let code = [
            0x48, 0x8b, 0x15, 0xc9, 0xad, 0x00, 0x00, 0x48, 0x89, 0xf8, 0x64, 0x48, 0x8b, 0x3a,
            0x48, 0x83, 0xf8, 0x01, 0x74, 0x08,
        ];
        let p = place_probe(&code, 0x111f0, reads(Role::CountSize));
        assert_eq!((p.offset, p.emulated), (18, true));
        assert_eq!(p.args, code_of(ArgReg::Rax));
        // Untouched arguments need no bits.
        let p = place_probe(&[0x48, 0x85, 0xff, 0x74, 0x05], 0, reads(Role::Free));
        assert_eq!((p.offset, p.args), (3, 0));
    }

    #[test]
    fn never_past_a_branch_target() {
        // cmp $0,%rdi (3 bytes at +0); je +0 (at +3, jumps to +5); jmp -7
        // (at +5, back to +0... no: to +3, the je itself).
        // test %rdi,%rdi; nop; je back to the nop: probing the je would
        // be passed twice by that loop.
        let code = [0x48, 0x85, 0xff, 0x90, 0x74, 0xfd];
        let p = place_probe(&code, 0x1000, reads(Role::Free));
        assert_eq!(p.offset, 0);
    }

    #[test]
    fn endbr64_then_push_rbp() {
        let code = [0xf3, 0x0f, 0x1e, 0xfa, 0x55];
        let p = place_probe(&code, 0, reads(Role::Size));
        // endbr64 writes nothing: the push after it is emulated.
        assert_eq!(p.offset, 4);
    }
}
