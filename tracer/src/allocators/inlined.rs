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
}

/// One guard's branch, to probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InlineSite {
    pub vaddr: u64,
    pub file_offset: u64,
    pub size: SizeAt,
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

/// Most instructions looked at from a copy of realloc for its calls.
const MAX_REGION: usize = 1024;
/// How far past its guard a copy's code is looked for.
const REGION_SPAN: u64 = 0x800;

/// The return addresses of the calls of the C library's allocator made
/// in the copy that starts at `from` (its guard's branch at `guard`):
/// every path from there, both ways at each branch, up to a return, an
/// indirect jump, a jump back before the guard or [`REGION_SPAN`] past
/// it. The host function's code after the copy is in that region too: a
/// call of `malloc` of its own there would be taken for the copy's.
fn library_calls(code: &Text, from: u64, guard: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut todo = vec![from];
    while let Some(mut ip) = todo.pop() {
        while seen.len() < MAX_REGION {
            if ip < guard || ip > guard + REGION_SPAN || seen.contains(&ip) {
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

fn decode_at(code: &Text, ip: u64) -> Option<Instruction> {
    let s = code
        .0
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

/// What the call through the pointer passes (`rsi`, `rdx`: the size, or
/// count and size), in terms of the registers at the branch: follows the
/// path that calls through the pointer (starting at `from`) to its `call
/// *%reg` or `jmp *%reg`, tracking register moves.
fn args_at(code: &Text, from: u64, reg: Register) -> Option<[Value; 2]> {
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
                return (insn.op0_kind() == OpKind::Register && insn.op0_register() == reg)
                    .then(|| [value(&values, Register::RSI), value(&values, Register::RDX)]);
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
/// `_PyObject_Realloc`, in the slots after the callocs.
pub struct Exported {
    pub object_malloc: (usize, u64),
    pub mem_malloc: Option<(usize, u64)>,
    pub object_calloc: Option<usize>,
    pub mem_calloc: Option<(usize, u64)>,
    pub object_realloc: Option<(usize, u64)>,
    pub mem_realloc: Option<(usize, u64)>,
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
    for (row, vaddr, slot) in [
        e.object_realloc.map(|(r, v)| (r, v, object_slot + 16)),
        e.mem_realloc.map(|(r, v)| (r, v, mem_slot + 16)),
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
                    kind: Kind::Realloc,
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
                    let other = if insn.mnemonic() == Mnemonic::Jne {
                        insn.near_branch_target()
                    } else {
                        insn.next_ip()
                    };
                    let target = targets
                        .iter()
                        .find(|t| t.function == function && Some(t.slot) == slot);
                    match target {
                        None => out.hooks += 1,
                        Some(t) => {
                            match args_at(code, other, reg).and_then(|a| size_of(a, t.kind)) {
                                None => out.missed += 1,
                                // Never served by pymalloc: malloc counts it.
                                Some(SizeAt::Const(n)) if n == 0 || n > PYMALLOC_MAX => {}
                                Some(size) => {
                                    if t.kind == Kind::Realloc {
                                        let calls = library_calls(code, insn.next_ip(), insn.ip());
                                        out.nested.extend(calls);
                                    }
                                    out.sites.push((
                                        t.row,
                                        InlineSite {
                                            vaddr: insn.ip(),
                                            file_offset: s.file_offset + (insn.ip() - s.address),
                                            size,
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
        };
        let targets = targets(&code, &exported);
        assert_eq!(targets.len(), 6, "{targets:?}");
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
        assert!(found
            .sites
            .iter()
            .all(|(_, s)| probed.iter().all(|(v, n)| s.vaddr < *v || s.vaddr >= v + n)));
    }
}
