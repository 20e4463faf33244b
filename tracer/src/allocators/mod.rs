//! Finding the allocator in the target and choosing where to probe it.
//!
//! Each entry point is probed in the first object of the target's link map
//! (main executable first, then preloaded libraries, then the others) that
//! defines it: the one the dynamic linker binds calls to. The allocator is the object `malloc` binds to;
//! `operator new` may live in libstdc++ or in the allocator itself, Rust's
//! shims in the program. Which symbols are entry points, and what each
//! reads, is [`families`]; where in each function the probe goes is
//! [`placement`].

mod copies;
pub mod families;
mod found;
pub mod inlined;
pub mod placement;
mod symbols;
#[cfg(test)]
mod tests;

use std::{fs, path::PathBuf};

use anyhow::Result;
use tracer_common::{BodyRange, Role, MAX_BODY_RANGES, MAX_FREE_BODIES};

use self::{
    copies::find_inlined,
    families::Entry,
    placement::place_probe,
    symbols::{definitions, family_of, Def},
};

use crate::{
    tracee::{is_dynamic_linker, path_in_target, DynamicLinker, Mapping},
    user_error,
};

/// One probe: an address in an allocator object, with every entry point
/// that resolves to it (glibc's `aligned_alloc` and `memalign` are one
/// function).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeSite {
    /// The first one's role picks the BPF program; all are shown as the
    /// name.
    pub funcs: Vec<&'static Entry>,
    /// The object, as the target maps it, and the path we attach through
    /// (`/proc/PID/root`).
    pub path: String,
    pub open_path: PathBuf,
    /// Symbol value (virtual address in the object).
    pub vaddr: u64,
    pub size: u64,
    /// File offset of the function's first byte.
    pub file_offset: u64,
    /// Bytes into the function where the probe sits.
    pub probe_offset: u64,
    /// Whether the kernel emulates the probed instruction.
    pub emulated: bool,
    /// Where the probe finds arguments the prologue moved (the cookie's
    /// argument bits, see [`placement::Placement::args`]).
    pub args: u64,
    /// Probed past `reallocarray`'s multiply: served as `realloc` is
    /// ([`placement::Placement::multiplied`]).
    pub multiplied: bool,
    /// The probed instruction, for `--verbose` and the report's metadata.
    pub instruction: String,
    /// The prefix of an allocator API defined beside the C library's
    /// (`_rjem_`): part of the name reports show.
    pub prefix: Option<&'static str>,
    /// Copies of the function the compiler inlined into callers, each
    /// probed at its guard and counted as a call of this function
    /// (CPython's `PyObject_Malloc` in Debian's build: see [`inlined`]).
    pub inlined: Vec<inlined::InlineSite>,
    /// Probed in live mode only: CPython's static `_PyObject_Malloc` and
    /// `_PyObject_Free` where copies of realloc call them (count mode
    /// counts those copies at their guards).
    pub live_only: bool,
}

impl ProbeSite {
    /// `aligned_alloc/memalign`: every standard name of the function; a
    /// family's own aliases (`tc_malloc`, `mi_malloc` for `malloc`) only
    /// when it has no standard one.
    pub fn display_name(&self) -> String {
        let own = |f: &&&Entry| f.symbol.starts_with("tc_") || f.symbol.starts_with("mi_");
        let standard: Vec<&str> = self
            .funcs
            .iter()
            .filter(|f| !own(f))
            .map(|f| f.display)
            .collect();
        let name = if standard.is_empty() {
            self.funcs[0].display.to_string()
        } else {
            standard.join("/")
        };
        match self.prefix {
            Some(prefix) => format!("{prefix}{name}"),
            None => name,
        }
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

/// A function inside an allocator that is not probed (see
/// [`families::INTERNALS`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Internal {
    pub path: String,
    pub file_offset: u64,
    pub size: u64,
    /// A free made from inside it is the free it was called for.
    pub frees: bool,
}

/// What the target allocates through: the object its `malloc` binds to
/// and every other entry point, each in the object the dynamic linker
/// binds it to (`operator new` in libstdc++ unless the allocator defines
/// it, Rust's shims in the program).
#[derive(Clone, Debug)]
pub struct AllocatorObject {
    /// The object `malloc` binds to, as the target sees it.
    pub path: String,
    /// Its family: glibc, musl, jemalloc, tcmalloc, mimalloc.
    pub family: &'static str,
    /// Its version, when the object says it.
    pub version: Option<String>,
    pub sites: Vec<ProbeSite>,
    pub internals: Vec<Internal>,
    /// Other objects that define allocator entry points the target does
    /// not bind to (for the "nothing traced" note).
    pub shadowed: Vec<String>,
    /// A prefixed allocator API probed beside the bound one
    /// (`jemalloc (_rjem_) in PATH`).
    pub beside: Option<String>,
    /// Inlined copies of CPython's object allocator not probed (see
    /// [`inlined::Inlined`]): guards not followed, and copies of
    /// `_PyObject_Realloc`.
    pub inlined_missed: usize,
    pub inlined_resizes: usize,
}

impl AllocatorObject {
    /// The same allocator as another process of the same files sees it:
    /// attached through that process's root.
    fn for_pid(mut self, pid: u32) -> AllocatorObject {
        for site in &mut self.sites {
            site.open_path = path_in_target(pid, &site.path);
        }
        self
    }

    /// Runtime address ranges of the probed functions (and the internals)
    /// in the target, sorted, for the BPF nesting check.
    pub fn body_ranges(&self, maps: &[Mapping]) -> Vec<BodyRange> {
        // (Code that frees makes no allocating call of its own.)
        let ranges = self
            .sites
            .iter()
            .map(|s| (s.path.as_str(), s.file_offset, s.size))
            .chain(
                self.internals
                    .iter()
                    .filter(|i| !i.frees)
                    .map(|i| (i.path.as_str(), i.file_offset, i.size)),
            );
        capped(
            in_target(ranges, maps),
            MAX_BODY_RANGES,
            "allocator functions",
        )
    }

    /// Runtime address ranges of the functions whose own `free` is the
    /// free they were called for: CPython's `PyObject_Free` and `PyMem_Free`
    /// (and what they reach it through), probed themselves.
    pub fn free_body_ranges(&self, maps: &[Mapping]) -> Vec<BodyRange> {
        let frees = self
            .sites
            .iter()
            .filter(|s| s.role() == Role::Free && s.funcs.iter().any(|f| families::is_python(f)))
            .map(|s| (s.path.as_str(), s.file_offset, s.size))
            .chain(
                self.internals
                    .iter()
                    .filter(|i| i.frees)
                    .map(|i| (i.path.as_str(), i.file_offset, i.size)),
            );
        capped(
            in_target(frees, maps),
            MAX_FREE_BODIES,
            "releasing functions",
        )
    }
}

/// The first `max` of `ranges` (what the BPF program's table holds), with
/// a warning when there are more.
fn capped(mut ranges: Vec<BodyRange>, max: usize, what: &str) -> Vec<BodyRange> {
    if ranges.len() > max {
        log::warn!(
            "{} {what}: the nesting check covers the first {max}",
            ranges.len()
        );
        ranges.truncate(max);
    }
    ranges
}

/// Where functions given as (object, file offset, size) lie in the
/// target, sorted by address.
fn in_target<'a>(
    ranges: impl Iterator<Item = (&'a str, u64, u64)>,
    maps: &[Mapping],
) -> Vec<BodyRange> {
    let mut out = Vec::new();
    for (path, file_offset, size) in ranges {
        if size == 0 {
            continue;
        }
        let m = maps.iter().find(|m| {
            m.path == path
                && m.perms.contains('x')
                && file_offset >= m.offset
                && file_offset < m.offset + (m.end - m.start)
        });
        if let Some(m) = m {
            let start = m.start + (file_offset - m.offset);
            out.push(BodyRange {
                start,
                end: start + size,
            });
        }
    }
    out.sort_by_key(|r| r.start);
    out.dedup_by_key(|r| r.start);
    out
}

/// The objects `pid` maps executable, each once, in the order the dynamic
/// linker looks up symbols in them (its link map, read from the target),
/// then any it does not list (a statically linked program has no link
/// map) in address order.
fn objects(pid: u32, maps: &[Mapping]) -> Vec<String> {
    let mut seen: Vec<String> = DynamicLinker::find(pid, maps)
        .and_then(|ld| ld.objects(pid, maps))
        .unwrap_or_default();
    // Only objects mapped executable: the dynamic linker first maps a whole
    // library read-only, then its code where it belongs.
    let executable = |p: &str| maps.iter().any(|m| m.path == p && m.perms.contains('x'));
    seen.retain(|p| executable(p));
    for m in maps.iter().filter(|m| m.is_file() && m.perms.contains('x')) {
        if !seen.contains(&m.path) && !m.path.ends_with(" (deleted)") {
            seen.push(m.path.clone());
        }
    }
    seen
}

/// Looks through the objects `pid` maps for the allocator; `None` when no
/// object it maps (yet) defines `malloc`. Each entry point is taken from
/// the first object that defines it, as the dynamic linker binds it.
/// The same objects, unchanged, give the same answer: a process of a tree
/// that runs what another ran is answered from [`found::get`].
pub fn find_in_process(
    pid: u32,
    maps: &[Mapping],
    python: bool,
) -> Result<Option<AllocatorObject>> {
    let objects = objects(pid, maps);
    let key = found::Key::of(pid, &objects, python);
    if let Some(hit) = found::get(&key) {
        return Ok(hit.map(|a| a.for_pid(pid)));
    }
    let answer = find_among(pid, objects, python)?;
    found::put(key, answer.clone());
    Ok(answer)
}

fn find_among(pid: u32, objects: Vec<String>, python: bool) -> Result<Option<AllocatorObject>> {
    let mut chosen: Vec<Option<(usize, Def)>> = vec![None; families::ENTRIES.len()];
    // Prefixed definitions beside the bound ones (each probed as well).
    let mut beside: Vec<(usize, Def)> = Vec::new();
    let mut internals = Vec::new();
    let mut defining: Vec<String> = Vec::new();
    let mut files: Vec<(String, PathBuf, memmap2::Mmap)> = Vec::new();
    for path in objects {
        let path = path.as_str();
        if is_dynamic_linker(path) {
            continue;
        }
        let open_path = path_in_target(pid, path);
        let Ok(file) = fs::File::open(&open_path) else {
            continue;
        };
        // SAFETY: read-only mapping of a file the target maps executable;
        // it is only read as bytes (see unwind::object_cfi for the caveat).
        let Ok(data) = (unsafe { memmap2::Mmap::map(&file) }) else {
            continue;
        };
        let (defs, ints) = definitions(&data, python);
        if defs.is_empty() {
            continue;
        }
        let index = files.len();
        defining.push(path.to_string());
        for d in defs {
            // The first definition in the link map, but a prefixed one
            // (tikv-jemallocator's `_rjem_malloc` in a Rust program) gives
            // way to the real `malloc` of a later object: C code still
            // calls that. It is probed too: the program's own allocations
            // (Rust's global allocator) call it.
            match &chosen[d.order] {
                None => chosen[d.order] = Some((index, d)),
                Some((_, c)) if c.prefix.is_some() && d.prefix.is_none() => {
                    let displaced = chosen[d.order].replace((index, d));
                    beside.extend(displaced);
                }
                Some(_) if d.prefix.is_some() => beside.push((index, d)),
                Some(_) => {}
            }
        }
        for (file_offset, size, frees) in ints {
            internals.push(Internal {
                path: path.to_string(),
                file_offset,
                size,
                frees,
            });
        }
        files.push((path.to_string(), open_path, data));
    }
    let Some((primary, _)) = chosen[0] else {
        return Ok(None);
    };
    let mut sites: Vec<ProbeSite> = Vec::new();
    // Only a prefixed API beside a C library's allocator (with the prefix
    // of the same object as the bound one: `je_` names in libjemalloc
    // itself are aliases).
    beside.retain(|(i, d)| {
        chosen
            .iter()
            .flatten()
            .all(|(ci, c)| !(ci == i && c.order == d.order))
    });
    beside.sort_by_key(|(_, d)| d.order);
    for (index, d) in chosen.into_iter().flatten().chain(beside) {
        let (path, open_path, data) = &files[index];
        if let Some(site) = sites
            .iter_mut()
            .find(|s| s.path == *path && s.vaddr == d.vaddr)
        {
            site.funcs.push(d.entry);
            continue;
        }
        // The whole body (bounded) for the branch-target check.
        let code_len = if d.size > 0 { d.size.min(16384) } else { 64 } as usize;
        let start = d.file_offset as usize;
        let code = data
            .get(start..(start + code_len).min(data.len()))
            .unwrap_or(&[]);
        let placement = place_probe(code, d.vaddr, placement::reads(d.entry.role));
        sites.push(ProbeSite {
            funcs: vec![d.entry],
            path: path.clone(),
            open_path: open_path.clone(),
            vaddr: d.vaddr,
            size: d.size,
            file_offset: d.file_offset,
            probe_offset: placement.offset,
            emulated: placement.emulated,
            args: placement.args,
            multiplied: placement.multiplied,
            instruction: placement.instruction,
            prefix: d.prefix,
            inlined: Vec::new(),
            live_only: false,
        });
    }
    let (inlined_missed, inlined_resizes) = if python {
        find_inlined(&mut sites, &files, &mut internals)
    } else {
        (0, 0)
    };
    let primary_path = files[primary].0.clone();
    let family = family_of(&primary_path, &files[primary].2);
    let version = families::version(family, &files[primary].2);
    let beside = sites
        .iter()
        .find(|s| s.prefix.is_some() && s.path != primary_path)
        .and_then(|s| {
            let (_, _, data) = files.iter().find(|(p, _, _)| *p == s.path)?;
            let family = family_of(&s.path, data);
            Some(format!("{family} ({}) in {}", s.prefix?, s.path))
        });
    let bound: Vec<&str> = sites.iter().map(|s| s.path.as_str()).collect();
    let shadowed = defining
        .iter()
        .filter(|p| !bound.contains(&p.as_str()))
        .cloned()
        .collect();
    Ok(Some(AllocatorObject {
        path: primary_path,
        family,
        version,
        sites,
        internals,
        shadowed,
        beside,
        inlined_missed,
        inlined_resizes,
    }))
}

/// The allocator of a program that would map `paths` (in this order), as
/// they are on this host: for probes in files before any process maps
/// them (the host scope).
pub fn find_in_files(paths: Vec<String>) -> Result<Option<AllocatorObject>> {
    find_among(std::process::id(), paths, false)
}

/// [`find_in_process`] for a process that must have its allocator mapped
/// already (tracing by pid).
pub fn require_in_process(pid: u32, maps: &[Mapping], python: bool) -> Result<AllocatorObject> {
    find_in_process(pid, maps, python)?.ok_or_else(|| {
        let objects = objects(pid, maps).len();
        user_error!(
            "no malloc found in any of the {objects} objects pid {pid} maps (is it statically linked without symbols, or not using a malloc-compatible allocator?)"
        )
    })
}
