//! The sweep of an object's code for guards, and what each one's probe
//! reads.

use std::collections::{HashMap, HashSet};

use super::{
    blocks::blocks_of,
    guard::{guard_compare, is_guard_branch},
    size::size_of,
    text::library_calls,
    InlineSite, Inlined, Kind, SizeAt, Target, Text, MAX_FIXED,
};
use crate::asm::{
    flow::loaded_from, flow::passed_at_call, instructions, Instruction, Mnemonic, Register,
};
use tracer_common::PYMALLOC_MAX;

/// The guarded copies in `code` of each target, outside the functions in
/// `probed` (vaddr, size: their calls are counted at their entry).
pub fn find(code: &Text, targets: &[Target], probed: &[(u64, u64)]) -> Inlined {
    let mut out = Inlined::default();
    let inside = |ip: u64| probed.iter().any(|(v, n)| ip >= *v && ip - *v < *n);
    for s in code.sections.iter() {
        let mut recent: Vec<Instruction> = Vec::with_capacity(16);
        // The guard's compare just decoded: its register, slot, function.
        let mut guard: Option<(Register, Option<u64>, u64)> = None;
        for insn in instructions(s.data, s.address) {
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
                            let args = passed_at_call(
                                &code.sections,
                                other,
                                reg,
                                [Register::RSI, Register::RDX],
                            );
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
                                            blocks_of(&code.sections, copy, guard, ret)
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
    settle_blocks(code, &mut out);
    out
}

/// A probe on a guard's branch is the guard's, and one probe reads one
/// place: a place moved onto a guard, or onto a place that reads the
/// block elsewhere, stays where the paths met; one that met on a guard
/// is not probed (its calls counted unfinished).
fn settle_blocks(code: &Text, out: &mut Inlined) {
    let guards: HashSet<u64> = out.sites.iter().map(|(_, s)| s.vaddr).collect();
    let mut reads: HashMap<u64, (u64, u64)> = HashMap::new();
    let mut clash = HashSet::new();
    for b in out.sites.iter().flat_map(|(_, s)| &s.blocks) {
        if *reads.entry(b.vaddr).or_insert((b.reg, b.at_disp)) != (b.reg, b.at_disp) {
            clash.insert(b.vaddr);
        }
    }
    for (_, site) in &mut out.sites {
        site.blocks.retain_mut(|b| {
            let moved = b.vaddr != b.met;
            if moved && (guards.contains(&b.vaddr) || clash.contains(&b.vaddr)) {
                if let Some(offset) = code.sections.file_offset(b.met) {
                    (b.vaddr, b.file_offset) = (b.met, offset);
                }
            }
            !guards.contains(&b.vaddr)
        });
    }
}

/// How many guards in `code`, outside the functions in `probed`, compare
/// with `function` (the copies of a function not probed, to say how
/// many).
pub fn guards_of(code: &Text, function: u64, probed: &[(u64, u64)]) -> usize {
    let mut n = 0;
    for s in code.sections.iter() {
        for insn in instructions(s.data, s.address) {
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
