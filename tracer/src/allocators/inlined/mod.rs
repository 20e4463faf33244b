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
use object::{
    Object, ObjectSection, ObjectSymbol, ObjectSymbolTable, RelocationTarget, SectionKind,
};
use tracer_common::{
    Role, COOKIE_ARGS_SHIFT, COOKIE_INLINE_SIZE_SHIFT, COOKIE_ROLE_SHIFT, PYMALLOC_MAX,
};

/// Where an inlined copy's size is when its guard's branch is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizeAt {
    /// In a register: its code in `tracer_common::ARG_REGS` (from 1).
    Reg(u64),
    /// A constant the compiler folded into the copy.
    Const(u64),
    /// The product of two registers (a copy of calloc: count and size).
    Product(u64, u64),
    /// A copy of realloc: the block's register (0: not known; count mode
    /// does not read it) and the new size's, or the size as a constant.
    Resize { ptr: u64, size: u64, fixed: u64 },
    /// A copy of free: the block's register.
    Block(u64),
    /// A copy of free: the block is in the stack, this many bytes above
    /// the stack pointer at the guard (in the cookie plus one, as
    /// `args::block_arg` reads it).
    StackBlock(u64),
}

/// Where a copy of malloc's (calloc's) block is, for live mode: the first address
/// its path shares with the call through the pointer's, and the register
/// (its code in `tracer_common::ARG_REGS`) that holds the block there on
/// both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockAt {
    /// Where the probe goes: the meeting place, or past it the first
    /// instruction the kernel emulates before anything moves the block
    /// (a single-stepped probe costs a second trap, a debug exception).
    pub vaddr: u64,
    pub file_offset: u64,
    /// The meeting place itself.
    pub met: u64,
    pub reg: u64,
    /// Not 0: the block is in memory, this less 1 bytes past the register
    /// `reg` names (0: the stack pointer).
    pub at_disp: u64,
}

/// One guard's branch, to probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InlineSite {
    pub vaddr: u64,
    pub file_offset: u64,
    pub size: SizeAt,
    /// A copy of malloc or calloc: where its block is known, on each of
    /// its ways (none found: empty).
    pub blocks: Vec<BlockAt>,
}

impl SizeAt {
    /// A copy of free's (its block's place, not a size).
    pub fn frees(&self) -> bool {
        matches!(self, SizeAt::Block(_) | SizeAt::StackBlock(_))
    }
}

impl InlineSite {
    /// The attach cookie's bits that say where the size is and the role
    /// that reads it (the function's index is the row's).
    pub fn cookie_bits(&self) -> u64 {
        let size = (Role::Size as u64) << COOKIE_ROLE_SHIFT;
        match self.size {
            SizeAt::Reg(code) => code << COOKIE_ARGS_SHIFT | size,
            SizeAt::Const(n) => n << COOKIE_INLINE_SIZE_SHIFT | size,
            SizeAt::Product(a, b) => {
                (a | b << 4) << COOKIE_ARGS_SHIFT | (Role::CountSize as u64) << COOKIE_ROLE_SHIFT
            }
            SizeAt::Resize { ptr, size, fixed } => {
                (ptr | size << 4) << COOKIE_ARGS_SHIFT
                    | fixed << COOKIE_INLINE_SIZE_SHIFT
                    | (Role::Resize as u64) << COOKIE_ROLE_SHIFT
            }
            SizeAt::Block(code) => {
                code << COOKIE_ARGS_SHIFT | (Role::Free as u64) << COOKIE_ROLE_SHIFT
            }
            SizeAt::StackBlock(offset) => {
                (offset + 1) << COOKIE_INLINE_SIZE_SHIFT | (Role::Free as u64) << COOKIE_ROLE_SHIFT
            }
        }
    }
}

/// The copies of one exported function to look for: the static function
/// its guards compare with and the slot they load the pointer from.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// The probe site (row) the copies are counted as.
    pub row: usize,
    pub function: u64,
    pub slot: u64,
    pub kind: Kind,
}

/// Which function a target copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Malloc,
    /// The size is count times size.
    Calloc,
    /// `(ptr, size)`: counted at its guard whatever the size, the calls
    /// the copy makes to the C library's allocator (and those the static
    /// `_PyObject_Malloc` it calls makes) being the same call (see
    /// [`Inlined::nested`]).
    Realloc,
    /// `(ptr)`: live mode's frees (and count mode's when frees are
    /// counted).
    Free,
}

/// The guards found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inlined {
    /// Each with the row of the [`Target`] it copies.
    pub sites: Vec<(usize, InlineSite)>,
    /// Guards on a target's slot not probed: their size could not be
    /// followed.
    pub missed: usize,
    /// Guards on a pointer read from elsewhere, not probed: a hook's call
    /// of the allocator it wraps (tracemalloc's, the debug hooks'), which
    /// would count again a call counted at an exported function's entry.
    pub hooks: usize,
    /// Where calls made inside the copies of realloc return to: calls of
    /// the C library's allocator (through its PLT), which are the copy's
    /// own call.
    pub nested: Vec<u64>,
    /// The same for the copies of free: their calls of the C library's
    /// `free` free the block the copy was called for.
    pub nested_frees: Vec<u64>,
}

/// The first guard in the function at `vaddr` (an exported
/// `PyObject_Malloc`: its own copy's guard names the static function):
/// the function it compares with and the slot the pointer came from.
pub fn guard_of(code: &Text, vaddr: u64) -> Option<(u64, u64)> {
    let mut recent: Vec<Instruction> = Vec::new();
    let mut ip = vaddr;
    for _ in 0..32 {
        let insn = decode_at(code, ip)?;
        if let Some((target, reg)) = guard_compare(&insn) {
            let next = decode_at(code, insn.next_ip())?;
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

/// An object's code: its executable sections, and the GOT slots through
/// which its PLT calls the C library's allocator functions.
pub struct Text<'a>(Vec<Section<'a>>, Vec<u64>);

impl<'a> Text<'a> {
    pub fn of(file: &object::File<'a>) -> Text<'a> {
        let sections = file
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
                    .is_some_and(|n| super::families::lookup(n).is_some())
            })
            .map(|(got, _)| got)
            .collect();
        Text(sections, slots)
    }

    /// The file offset of the code at `vaddr`.
    fn file_offset(&self, vaddr: u64) -> Option<u64> {
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

    /// Is `target` a PLT stub that jumps to an allocator function of
    /// another object (`jmp *slot(%rip)`, after an `endbr64`)?
    fn allocator_stub(&self, target: u64) -> bool {
        let mut ip = target;
        for _ in 0..2 {
            let Some(insn) = decode_at(self, ip) else {
                return false;
            };
            if insn.mnemonic() == Mnemonic::Endbr64 {
                ip = insn.next_ip();
                continue;
            }
            return insn.mnemonic() == Mnemonic::Jmp
                && insn.is_ip_rel_memory_operand()
                && self.1.contains(&insn.ip_rel_memory_address());
        }
        false
    }
}

/// The largest number the cookie's bits 40 to 51 hold (the copy's number
/// is above them): a copy of realloc's constant new size, or a block's
/// displacement plus one.
const MAX_FIXED: u64 = 0xfff;

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
fn library_calls(code: &Text, from: u64, guard: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut todo = vec![from];
    while let Some(mut ip) = todo.pop() {
        while seen.len() < MAX_REGION {
            if ip < from || ip > from + REGION_SPAN || ip == guard || seen.contains(&ip) {
                break;
            }
            seen.insert(ip);
            let Some(insn) = decode_at(code, ip) else {
                break;
            };
            match insn.flow_control() {
                FlowControl::Return | FlowControl::IndirectBranch | FlowControl::Exception => break,
                FlowControl::UnconditionalBranch if insn.op0_kind() == OpKind::NearBranch64 => {
                    ip = insn.near_branch_target();
                    continue;
                }
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

/// The instruction at `ip` and its bytes.
fn decode_bytes_at<'a>(code: &Text<'a>, ip: u64) -> Option<(Instruction, &'a [u8])> {
    let insn = decode_at(code, ip)?;
    let (s, at) = code.at(ip)?;
    Some((insn, s.data.get(at..at + insn.len())?))
}

fn decode_at(code: &Text, ip: u64) -> Option<Instruction> {
    let (s, at) = code.at(ip)?;
    let bytes = &s.data[at..];
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
    /// The 8 bytes at this offset from the stack pointer.
    Stack(u64),
    Unknown,
}

/// Most instructions followed from a branch to its indirect call.
const MAX_FOLLOW: usize = 24;

/// Most instructions of the call's path followed from its return.
const MAX_CALL_PATH: usize = 96;

/// Most instructions a copy's own paths may take before they meet the
/// call's path (pymalloc's fast path, its slow paths and their failures):
/// a copy that looks bigger met it somewhere not followed.
const MAX_COPY: usize = 400;

/// Where the call's result is at one address of its paths.
struct Step {
    ip: u64,
    held: Vec<Register>,
    slots: Vec<(Register, u64)>,
}

/// The call through the pointer's paths from its return at `ret`, each
/// address with where the call's result is there (registers, and memory
/// at a register plus a displacement: a stack slot, a structure's field):
/// moves and stores followed; past a test of the result for NULL, the
/// non-NULL way; past other branches, both; over calls (keeping the
/// callee-saved registers and the stack slots); up to a return, an
/// indirect jump or [`MAX_CALL_PATH`] addresses in all.
fn call_path(code: &Text, ret: u64) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::new();
    let mut info = InstructionInfoFactory::new();
    let mut todo = std::collections::VecDeque::from([(ret, vec![Register::RAX], Vec::new())]);
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
            let Some(insn) = decode_at(code, ip) else {
                break;
            };
            match insn.flow_control() {
                FlowControl::UnconditionalBranch if insn.op0_kind() == OpKind::NearBranch64 => {
                    ip = insn.near_branch_target();
                    continue;
                }
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
                && insn.memory_displacement64() < MAX_FIXED
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

/// Registers a call leaves as they were.
fn callee_saved(r: Register) -> bool {
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

/// Where a copy of malloc's block is known: each place where one of the
/// copy's own paths (from `start`) meets the path of the call through the
/// pointer (which returns to `ret`), and where the block is there. At
/// such a place the block is where the call's path keeps the call's
/// result: the register of those that the code there reads first; or,
/// when no register says, the one memory slot it was stored to (a place
/// with neither is left out). The copy's paths are followed for at most
/// [`MAX_COPY`] instructions.
fn merges_of(code: &Text, start: u64, guard: u64, ret: u64) -> Vec<(u64, Held)> {
    let path = call_path(code, ret);
    let mut seen = std::collections::HashSet::new();
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
            let Some(insn) = decode_at(code, ip) else {
                break;
            };
            match insn.flow_control() {
                FlowControl::UnconditionalBranch if insn.op0_kind() == OpKind::NearBranch64 => {
                    ip = insn.near_branch_target();
                    continue;
                }
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
fn fast_path(code: &Text, start: u64, guard: u64) -> Vec<Instruction> {
    let mut out: Vec<Instruction> = Vec::new();
    let mut ip = start;
    while out.len() < MAX_FAST && ip != guard && out.iter().all(|i| i.ip() != ip) {
        let Some(insn) = decode_at(code, ip) else {
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
fn blocks_of(code: &Text, start: u64, guard: u64, ret: u64) -> Vec<BlockAt> {
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
                Held::Reg(r) => (reg_code(r)?, 0),
                Held::Mem(Register::RSP, d) => (0, d + 1),
                Held::Mem(base, d) => (reg_code(base)?, d + 1),
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
fn emulated_from(code: &Text, at: u64, h: Held) -> u64 {
    let mut info = InstructionInfoFactory::new();
    let base = match h {
        Held::Reg(r) | Held::Mem(r, _) => r,
    };
    let mut ip = at;
    for _ in 0..MAX_FOLLOW {
        let Some((insn, bytes)) = decode_bytes_at(code, ip) else {
            break;
        };
        if super::placement::kernel_emulates(&insn, bytes) {
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

/// Which of `held` the code from `at` reads before it writes it (the
/// value there on every path that meets at `at`), following jumps, calls
/// (which leave only the callee-saved registers) and the fall-through of
/// branches; or, when it reads none, the only one it does not overwrite
/// (the call's path moved the block there for the code after `at`).
fn read_first(code: &Text, at: u64, mut held: Vec<Register>) -> Option<Register> {
    let mut info = InstructionInfoFactory::new();
    let only = |held: &[Register]| match held {
        [r] => Some(*r),
        _ => None,
    };
    let mut ip = at;
    for _ in 0..MAX_FOLLOW {
        let Some(insn) = decode_at(code, ip) else {
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
        match insn.flow_control() {
            FlowControl::UnconditionalBranch if insn.op0_kind() == OpKind::NearBranch64 => {
                ip = insn.near_branch_target();
                continue;
            }
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

/// What the call through the pointer passes (`rsi`, `rdx`: the size, or
/// count and size), in terms of the registers at the branch, and where it
/// returns (none for a `jmp`): follows the path that calls through the
/// pointer (starting at `from`) to its `call *%reg` or `jmp *%reg`,
/// tracking register moves.
fn args_at(code: &Text, from: u64, reg: Register) -> Option<([Value; 2], Option<u64>)> {
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
        let insn = decode_at(code, ip)?;
        match insn.flow_control() {
            FlowControl::IndirectCall | FlowControl::IndirectBranch => {
                let ret =
                    (insn.flow_control() == FlowControl::IndirectCall).then(|| insn.next_ip());
                return (insn.op0_kind() == OpKind::Register && insn.op0_register() == reg).then(
                    || {
                        let args = [value(&values, Register::RSI), value(&values, Register::RDX)];
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
                // branch's.
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

/// Where a copy's size is, from what the call through the pointer passes
/// (`None`: nowhere the probe can read it).
fn size_of(args: [Value; 2], kind: Kind) -> Option<SizeAt> {
    let reg = |v: Value| match v {
        Value::Reg(r) => reg_code(r),
        _ => None,
    };
    if kind == Kind::Malloc {
        return match args[0] {
            Value::Const(n) => Some(SizeAt::Const(n)),
            v => reg(v).map(SizeAt::Reg),
        };
    }
    if kind == Kind::Free {
        return match args[0] {
            Value::Stack(d) if d < MAX_FIXED => Some(SizeAt::StackBlock(d)),
            v => reg(v).map(SizeAt::Block),
        };
    }
    if kind == Kind::Realloc {
        let ptr = reg(args[0]).unwrap_or(0);
        return match args[1] {
            // 0 is "no constant": a size of 0 read from a register.
            Value::Const(0) => None,
            Value::Const(fixed) => Some(SizeAt::Resize {
                ptr,
                size: 0,
                fixed,
            }),
            v => Some(SizeAt::Resize {
                ptr,
                size: reg(v)?,
                fixed: 0,
            }),
        };
    }
    match args {
        [Value::Const(n), Value::Const(m)] => Some(SizeAt::Const(n.saturating_mul(m))),
        [Value::Const(1), v] | [v, Value::Const(1)] => reg(v).map(SizeAt::Reg),
        [a, b] => Some(SizeAt::Product(reg(a)?, reg(b)?)),
    }
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

/// The guarded copies in `code` of each target, outside the functions in
/// `probed` (vaddr, size: their calls are counted at their entry).
pub fn find(code: &Text, targets: &[Target], probed: &[(u64, u64)]) -> Inlined {
    let mut out = Inlined::default();
    let inside = |ip: u64| probed.iter().any(|(v, n)| ip >= *v && ip - *v < *n);
    for s in &code.0 {
        let mut decoder = Decoder::with_ip(64, s.data, s.address, DecoderOptions::NONE);
        let mut recent: Vec<Instruction> = Vec::with_capacity(16);
        let mut insn = Instruction::default();
        // The guard's compare just decoded: its register, slot, function.
        let mut guard: Option<(Register, Option<u64>, u64)> = None;
        while decoder.can_decode() {
            decoder.decode_out(&mut insn);
            if insn.is_invalid() {
                recent.clear();
                guard = None;
                continue;
            }
            if let Some((reg, slot, function)) = guard.take() {
                if is_guard_branch(&insn) && !inside(insn.ip()) {
                    let (copy, other) = if insn.mnemonic() == Mnemonic::Jne {
                        (insn.next_ip(), insn.near_branch_target())
                    } else {
                        (insn.near_branch_target(), insn.next_ip())
                    };
                    let target = targets
                        .iter()
                        .find(|t| t.function == function && Some(t.slot) == slot);
                    match target {
                        None => out.hooks += 1,
                        Some(t) => {
                            let args = args_at(code, other, reg);
                            match args.and_then(|(a, _)| size_of(a, t.kind)) {
                                None => out.missed += 1,
                                // Never served by pymalloc: malloc counts it.
                                Some(SizeAt::Const(n)) if n == 0 || n > PYMALLOC_MAX => {}
                                // (The constant's bits in the cookie.)
                                Some(SizeAt::Resize { fixed, .. }) if fixed > MAX_FIXED => {
                                    out.missed += 1
                                }
                                Some(size) => {
                                    let guard = insn.ip();
                                    match t.kind {
                                        Kind::Realloc => {
                                            out.nested.extend(library_calls(code, copy, guard))
                                        }
                                        Kind::Free => out
                                            .nested_frees
                                            .extend(library_calls(code, copy, guard)),
                                        _ => {}
                                    }
                                    let blocks = match (t.kind, args.and_then(|(_, r)| r)) {
                                        (Kind::Malloc | Kind::Calloc, Some(ret)) => {
                                            blocks_of(code, copy, guard, ret)
                                        }
                                        _ => Vec::new(),
                                    };
                                    out.sites.push((
                                        t.row,
                                        InlineSite {
                                            vaddr: guard,
                                            file_offset: s.file_offset + (guard - s.address),
                                            size,
                                            blocks,
                                        },
                                    ));
                                }
                            }
                        }
                    }
                }
            }
            if let Some((function, reg)) = guard_compare(&insn) {
                if targets.iter().any(|t| t.function == function) {
                    guard = Some((reg, loaded_from(&recent, reg), function));
                }
            }
            if recent.len() == 16 {
                recent.remove(0);
            }
            recent.push(insn);
        }
    }
    // A probe on a guard's branch is the guard's, and one probe reads one
    // place: a place moved onto a guard, or onto a place that reads the
    // block elsewhere, stays where the paths met; one that met on a guard
    // is not probed (its calls counted unfinished).
    let guards: std::collections::HashSet<u64> = out.sites.iter().map(|(_, s)| s.vaddr).collect();
    let mut reads: std::collections::HashMap<u64, (u64, u64)> = std::collections::HashMap::new();
    let mut clash = std::collections::HashSet::new();
    for b in out.sites.iter().flat_map(|(_, s)| &s.blocks) {
        if *reads.entry(b.vaddr).or_insert((b.reg, b.at_disp)) != (b.reg, b.at_disp) {
            clash.insert(b.vaddr);
        }
    }
    for (_, site) in &mut out.sites {
        site.blocks.retain_mut(|b| {
            let moved = b.vaddr != b.met;
            if moved && (guards.contains(&b.vaddr) || clash.contains(&b.vaddr)) {
                if let Some(offset) = code.file_offset(b.met) {
                    (b.vaddr, b.file_offset) = (b.met, offset);
                }
            }
            !guards.contains(&b.vaddr)
        });
    }
    out
}

/// How many guards in `code`, outside the functions in `probed`, compare
/// with `function` (the copies of a function not probed, to say how
/// many).
pub fn guards_of(code: &Text, function: u64, probed: &[(u64, u64)]) -> usize {
    let mut n = 0;
    for s in &code.0 {
        let mut decoder = Decoder::with_ip(64, s.data, s.address, DecoderOptions::NONE);
        let mut insn = Instruction::default();
        while decoder.can_decode() {
            decoder.decode_out(&mut insn);
            let inside = probed
                .iter()
                .any(|(v, n)| insn.ip() >= *v && insn.ip() - *v < *n);
            if !inside && guard_compare(&insn).is_some_and(|(t, _)| t == function) {
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
        let (mc, mc_size) = sym("PyMem_Calloc").unwrap();
        let code = Text::of(&file);
        let exported = Exported {
            object_malloc: (0, om),
            mem_malloc: Some((1, mm)),
            object_calloc: Some(2),
            mem_calloc: Some((3, mc)),
            object_realloc: sym("PyObject_Realloc").map(|(v, _)| (4, v)),
            mem_realloc: sym("PyMem_Realloc").map(|(v, _)| (5, v)),
            object_free: sym("PyObject_Free").map(|(v, _)| (6, v)),
            mem_free: sym("PyMem_Free").map(|(v, _)| (7, v)),
        };
        let targets = targets(&code, &exported);
        assert_eq!(targets.len(), 8, "{targets:?}");
        let probed = [(om, om_size), (mm, mm_size), (mc, mc_size)];
        let found = find(&code, &targets, &probed);
        let n = found.sites.len();
        let rows = |row| found.sites.iter().filter(|(r, _)| *r == row).count();
        assert!(rows(0) > 100 && rows(1) > 0 && rows(3) > 0, "{found:?}");
        assert!(
            rows(4) + rows(5) > 5 && !found.nested.is_empty(),
            "{found:?}"
        );
        assert!(found.missed < n / 20, "{found:?}");
        // Live mode's places: every copy of malloc or calloc has one; the
        // copies of free are found with their block (one in the stack).
        let mallocs: Vec<&InlineSite> = found
            .sites
            .iter()
            .filter(|(r, _)| *r <= 3)
            .map(|(_, s)| s)
            .collect();
        let placed = mallocs.iter().filter(|s| !s.blocks.is_empty()).count();
        assert!(
            placed * 100 >= mallocs.len() * 98,
            "{placed} of {}",
            mallocs.len()
        );
        // Most places are probed past where the paths meet, on an
        // instruction the kernel emulates.
        let places: Vec<&BlockAt> = mallocs.iter().flat_map(|s| &s.blocks).collect();
        let moved = places.iter().filter(|b| b.vaddr != b.met).count();
        assert!(moved * 2 > places.len(), "{moved} of {}", places.len());
        assert!(rows(6) + rows(7) > 40 && !found.nested_frees.is_empty());
        assert!(found
            .sites
            .iter()
            .any(|(_, s)| matches!(s.size, SizeAt::StackBlock(_))));
    }
}
