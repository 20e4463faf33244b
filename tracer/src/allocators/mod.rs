//! Finding the allocator in the target and choosing where to probe it.
//!
//! The allocator is the first object the target maps (main executable
//! first, then libraries in load order) that defines `malloc`: that is the
//! one the dynamic linker binds `malloc` calls to. Which symbols are entry
//! points, and what each reads, is [`families`]; where in each function
//! the probe goes is [`placement`].

pub mod families;
pub mod placement;

use std::{fs, path::PathBuf};

use anyhow::Result;
use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};
use tracer_common::{BodyRange, Role, MAX_BODY_RANGES};

use self::families::Entry;
use self::placement::place_probe;

use crate::{
    target::{path_in_target, Mapping},
    user_error,
};

/// One probe: an address in the allocator object, with every allocator
/// name that resolves to it (glibc's `aligned_alloc` and `memalign` are one
/// function).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeSite {
    /// The first one's role picks the BPF program; all are shown as the
    /// name.
    pub funcs: Vec<&'static Entry>,
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
            .map(|f| f.display)
            .collect::<Vec<_>>()
            .join("/")
    }

    pub fn role(&self) -> Role {
        self.funcs[0].role
    }
}

/// A row of the run's function table: one per probe site. Its index is the
/// probe's attach cookie, `CountKey::func` in the kernel maps and
/// `RawStack::func` in the raw profile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FuncInfo {
    pub name: String,
    pub role: Role,
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

/// Looks through the objects `pid` maps for the allocator; `None` when no
/// object it maps (yet) defines `malloc`.
pub fn find_in_process(pid: u32, maps: &[Mapping]) -> Result<Option<AllocatorObject>> {
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
            return Ok(Some(AllocatorObject {
                path: m.path.clone(),
                open_path,
                sites,
            }));
        }
    }
    Ok(None)
}

/// [`find_in_process`] for a process that must have its allocator mapped
/// already (tracing by pid).
pub fn require_in_process(pid: u32, maps: &[Mapping]) -> Result<AllocatorObject> {
    find_in_process(pid, maps)?.ok_or_else(|| {
        let objects = maps
            .iter()
            .filter(|m| m.is_file() && m.perms.contains('x'))
            .map(|m| m.path.as_str())
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        user_error!(
            "no malloc found in any of the {objects} objects pid {pid} maps (is it statically linked without symbols, or not using a malloc-compatible allocator?)"
        )
    })
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
    let mut found: Vec<(usize, &'static Entry, u64, u64)> = Vec::new();
    for sym in file.dynamic_symbols().chain(file.symbols()) {
        if sym.kind() != SymbolKind::Text || !sym.is_definition() || sym.address() == 0 {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        if let Some((order, entry)) = families::lookup(name) {
            if !found.iter().any(|(o, ..)| *o == order) {
                found.push((order, entry, sym.address(), sym.size()));
            }
        }
    }
    if !found.iter().any(|(order, ..)| *order == 0) {
        return Ok(None);
    }
    found.sort_by_key(|(order, ..)| *order);
    let mut sites: Vec<ProbeSite> = Vec::new();
    for (_, func, vaddr, size) in found {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_this_machines_libc_malloc() {
        let Ok(data) = fs::read("/lib/x86_64-linux-gnu/libc.so.6") else {
            return;
        };
        let sites = probe_sites(&data).unwrap().expect("libc defines malloc");
        let malloc = sites
            .iter()
            .find(|s| s.funcs[0].symbol == "malloc")
            .unwrap();
        assert!(malloc.size > 0);
        assert!(sites.iter().any(|s| s.role() == Role::Free));
    }
}
