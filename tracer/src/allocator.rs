//! Finding the allocator in the target and choosing where to probe it.
//!
//! The allocator is the first object the target maps (main executable
//! first, then libraries in load order) that defines `malloc`: that is the
//! one the dynamic linker binds `malloc` calls to. Each entry point is
//! probed where the kernel can emulate the instruction instead of
//! single-stepping it (about 0.65 µs against 20 µs a hit here): at the
//! function's first instruction when that is a push, jump, call or nop, else
//! at the first such instruction reached after only flag-setting or
//! scratch-register instructions, so every call still passes the probe with
//! its arguments and return address untouched.

use std::{fs, path::PathBuf};

use anyhow::Result;
use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic,
    OpAccess, OpKind, Register,
};
use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};
use tracer_common::{AllocFn, BodyRange, MAX_BODY_RANGES};

use crate::{
    target::{path_in_target, Mapping},
    user_error,
};

/// One probe: an address in the allocator object, with every allocator
/// name that resolves to it (glibc's `aligned_alloc` and `memalign` are one
/// function).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeSite {
    /// The first is the BPF program used; all are shown as the name.
    pub funcs: Vec<AllocFn>,
    /// Symbol value (virtual address in the object).
    pub vaddr: u64,
    pub size: u64,
    /// File offset of the function's first byte.
    pub file_offset: u64,
    /// Bytes into the function where the probe sits.
    pub probe_offset: u64,
    /// Whether the kernel emulates the probed instruction.
    pub emulated: bool,
    /// The probed instruction, for `--verbose` and the report's metadata.
    pub instruction: String,
}

impl ProbeSite {
    /// `aligned_alloc/memalign`.
    pub fn display_name(&self) -> String {
        self.funcs
            .iter()
            .map(|f| f.name())
            .collect::<Vec<_>>()
            .join("/")
    }
}

#[derive(Clone, Debug)]
pub struct AllocatorObject {
    /// Path as the target sees it.
    pub path: String,
    /// Path we open and attach to (through /proc/PID/root).
    pub open_path: PathBuf,
    pub sites: Vec<ProbeSite>,
}

impl AllocatorObject {
    /// Runtime address ranges of the probed functions in the target, for the
    /// BPF nesting check.
    pub fn body_ranges(&self, maps: &[Mapping]) -> Vec<BodyRange> {
        let mut out = Vec::new();
        for site in &self.sites {
            if site.size == 0 {
                continue;
            }
            let m = maps.iter().find(|m| {
                m.path == self.path
                    && m.perms.contains('x')
                    && site.file_offset >= m.offset
                    && site.file_offset < m.offset + (m.end - m.start)
            });
            if let Some(m) = m {
                let start = m.start + (site.file_offset - m.offset);
                out.push(BodyRange {
                    start,
                    end: start + site.size,
                });
            }
        }
        out.truncate(MAX_BODY_RANGES);
        out
    }
}

/// Looks through the objects `pid` maps for the allocator.
pub fn find_in_process(pid: u32, maps: &[Mapping]) -> Result<AllocatorObject> {
    let mut seen: Vec<&str> = Vec::new();
    // Only objects mapped executable: the dynamic linker first maps a whole
    // library read-only, then its code where it belongs.
    for m in maps.iter().filter(|m| m.is_file() && m.perms.contains('x')) {
        if seen.contains(&m.path.as_str()) {
            continue;
        }
        seen.push(&m.path);
        if m.path.ends_with(" (deleted)") || is_dynamic_linker(&m.path) {
            continue;
        }
        let open_path = path_in_target(pid, &m.path);
        let Ok(data) = fs::read(&open_path) else {
            continue;
        };
        if let Some(sites) = probe_sites(&data)? {
            return Ok(AllocatorObject {
                path: m.path.clone(),
                open_path,
                sites,
            });
        }
    }
    Err(user_error!(
        "no malloc found in any of the {} objects pid {pid} maps (is it statically linked without symbols, or not using a malloc-compatible allocator?)",
        seen.len()
    ))
}

fn is_dynamic_linker(path: &str) -> bool {
    let base = path.rsplit('/').next().unwrap_or(path);
    base.starts_with("ld-linux") || base.starts_with("ld64.so") || base.starts_with("ld-musl")
}

/// The probe sites of an ELF object, or `None` when it defines no `malloc`.
pub fn probe_sites(data: &[u8]) -> Result<Option<Vec<ProbeSite>>> {
    let Ok(file) = object::File::parse(data) else {
        return Ok(None);
    };
    // Dynamic symbols first (what callers bind to), then the full symbol
    // table (statically linked programs).
    let mut found: Vec<(AllocFn, u64, u64)> = Vec::new();
    for sym in file.dynamic_symbols().chain(file.symbols()) {
        if sym.kind() != SymbolKind::Text || !sym.is_definition() || sym.address() == 0 {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        let name = name.split('@').next().unwrap_or(name);
        if let Some(f) = AllocFn::ALL.iter().find(|f| f.name() == name) {
            if !found.iter().any(|(g, _, _)| g == f) {
                found.push((*f, sym.address(), sym.size()));
            }
        }
    }
    if !found.iter().any(|(f, _, _)| *f == AllocFn::Malloc) {
        return Ok(None);
    }
    found.sort_by_key(|(f, _, _)| *f);
    let mut sites: Vec<ProbeSite> = Vec::new();
    for (func, vaddr, size) in found {
        if let Some(site) = sites.iter_mut().find(|s| s.vaddr == vaddr) {
            site.funcs.push(func);
            continue;
        }
        let Some(file_offset) = vaddr_to_file_offset(&file, vaddr) else {
            continue;
        };
        let code_len = if size > 0 { size.min(64) } else { 64 } as usize;
        let start = file_offset as usize;
        let code = data
            .get(start..(start + code_len).min(data.len()))
            .unwrap_or(&[]);
        let placement = place_probe(code, vaddr);
        sites.push(ProbeSite {
            funcs: vec![func],
            vaddr,
            size,
            file_offset,
            probe_offset: placement.offset,
            emulated: placement.emulated,
            instruction: placement.instruction,
        });
    }
    Ok(Some(sites))
}

fn vaddr_to_file_offset(file: &object::File, vaddr: u64) -> Option<u64> {
    file.segments().find_map(|seg| {
        let (off, size) = seg.file_range();
        let addr = seg.address();
        (vaddr >= addr && vaddr < addr + size).then(|| vaddr - addr + off)
    })
}

#[derive(Debug, PartialEq, Eq)]
pub struct Placement {
    pub offset: u64,
    pub emulated: bool,
    pub instruction: String,
}

/// How many instructions we look past the entry for an emulated one.
const MAX_SCAN: usize = 8;

/// Chooses the probe offset inside a function from its first bytes.
pub fn place_probe(code: &[u8], ip: u64) -> Placement {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut insn = Instruction::default();
    let mut first = None;
    for _ in 0..MAX_SCAN {
        if !decoder.can_decode() {
            break;
        }
        decoder.decode_out(&mut insn);
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
            };
        }
        if !harmless(&insn, &mut info) {
            break;
        }
    }
    Placement {
        offset: 0,
        emulated: false,
        instruction: first.unwrap_or_else(|| "?".into()),
    }
}

/// Instructions arch/x86/kernel/uprobes.c emulates without a single-step:
/// nops, relative jumps and calls, conditional jumps, and pushes of a
/// general register (with at most a REX.B prefix).
fn kernel_emulates(insn: &Instruction, bytes: &[u8]) -> bool {
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

/// Registers that hold what the BPF program reads at the probe: the
/// argument registers and the stack pointer (the return address is at
/// `[rsp]`).
const PRESERVED: [Register; 7] = [
    Register::RSP,
    Register::RDI,
    Register::RSI,
    Register::RDX,
    Register::RCX,
    Register::R8,
    Register::R9,
];

/// Can the probe move past this instruction? Only if it neither branches
/// nor writes memory, an argument register or the stack pointer.
fn harmless(insn: &Instruction, info: &mut InstructionInfoFactory) -> bool {
    if insn.flow_control() != FlowControl::Next {
        return false;
    }
    let used = info.info(insn);
    let writes = |a: OpAccess| {
        matches!(
            a,
            OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
        )
    };
    if used.used_memory().iter().any(|m| writes(m.access())) {
        return false;
    }
    !used
        .used_registers()
        .iter()
        .any(|r| writes(r.access()) && PRESERVED.contains(&r.register().full_register()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_at_entry_is_probed_at_entry() {
        // push %r12; push %rbp
        let p = place_probe(&[0x41, 0x54, 0x55], 0x1000);
        assert_eq!(p.offset, 0);
        assert!(p.emulated);
    }

    #[test]
    fn glibc_free_is_probed_at_the_null_check_branch() {
        // test %rdi,%rdi; je +0xc5; push %rbp
        let code = [0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0x00, 0x00, 0x00, 0x55];
        let p = place_probe(&code, 0x98ef0);
        assert_eq!(p.offset, 3);
        assert!(p.emulated);
    }

    #[test]
    fn glibc_posix_memalign_skips_the_cmpb() {
        // cmpb $0x0,0x140201(%rip); push %r12
        let code = [0x80, 0x3d, 0x01, 0x02, 0x14, 0x00, 0x00, 0x41, 0x54];
        let p = place_probe(&code, 0x9a280);
        assert_eq!(p.offset, 7);
        assert!(p.emulated);
    }

    #[test]
    fn argument_clobber_stops_the_scan() {
        // mov %rsi,%rax; mul %rdx (writes rdx); mov %rax,%rsi; jo
        let code = [
            0x48, 0x89, 0xf0, 0x48, 0xf7, 0xe2, 0x48, 0x89, 0xc6, 0x70, 0x05,
        ];
        let p = place_probe(&code, 0x9a7e0);
        assert_eq!(p.offset, 0);
        assert!(!p.emulated);
    }

    #[test]
    fn endbr64_then_push_rbp() {
        let code = [0xf3, 0x0f, 0x1e, 0xfa, 0x55];
        let p = place_probe(&code, 0);
        // endbr64 writes nothing: the push after it is emulated.
        assert_eq!(p.offset, 4);
    }

    #[test]
    fn finds_this_machines_libc_malloc() {
        let Ok(data) = fs::read("/lib/x86_64-linux-gnu/libc.so.6") else {
            return;
        };
        let sites = probe_sites(&data).unwrap().expect("libc defines malloc");
        let malloc = sites
            .iter()
            .find(|s| s.funcs[0] == AllocFn::Malloc)
            .unwrap();
        assert!(malloc.size > 0);
        assert!(sites.iter().any(|s| s.funcs.contains(&AllocFn::Free)));
    }
}
