//! The probe sites of the copies of CPython's object allocator that a
//! PGO build inlined into its callers ([`super::inlined`] finds them).

use std::path::PathBuf;

use super::{
    families, inlined, placement::place_probe, symbols::vaddr_to_file_offset, Internal, ProbeSite,
};

/// CPython's object allocator inlined into its callers (see [`inlined`]):
/// the copies found in the object of the probed `PyObject_Malloc` go to
/// the site of the function each copies (`PyObject_Malloc`,
/// `PyMem_Malloc`, `PyObject_Calloc`, `PyMem_Calloc`, `PyObject_Realloc`,
/// `PyMem_Realloc`). The calls a copy of realloc makes to the C library's
/// allocator, and those the static `_PyObject_Malloc` makes (a copy of
/// realloc calls it), are its own: they join `internals`. Returns the
/// copies not probed: guards not followed, and copies of
/// `_PyObject_Realloc` (when they could not be told apart).
pub(super) fn find_inlined(
    sites: &mut Vec<ProbeSite>,
    files: &[(String, PathBuf, memmap2::Mmap)],
    internals: &mut Vec<Internal>,
) -> (usize, usize) {
    let Some(om) = named(sites, "PyObject_Malloc", None) else {
        return (0, 0);
    };
    let path = sites[om].path.clone();
    let Some((_, _, data)) = files.iter().find(|(p, _, _)| *p == path) else {
        return (0, 0);
    };
    let Ok(file) = object::File::parse(&**data) else {
        return (0, 0);
    };
    let code = inlined::Text::of(&file);
    let at = |symbol| named(sites, symbol, Some(&path)).map(|i| (i, sites[i].vaddr));
    let exported = inlined::Exported {
        object_malloc: (om, sites[om].vaddr),
        mem_malloc: at("PyMem_Malloc"),
        object_calloc: at("PyObject_Calloc").map(|(i, _)| i),
        mem_calloc: at("PyMem_Calloc"),
        object_realloc: at("PyObject_Realloc"),
        mem_realloc: at("PyMem_Realloc"),
        object_free: at("PyObject_Free"),
        mem_free: at("PyMem_Free"),
    };
    let probed: Vec<(u64, u64)> = sites
        .iter()
        .filter(|s| s.path == path)
        .map(|s| (s.vaddr, s.size))
        .collect();
    let targets = inlined::targets(&code, &exported);
    let found = inlined::find(&code, &targets, &probed);
    let resizes = if targets.iter().any(|t| t.kind == inlined::Kind::Realloc) {
        0
    } else {
        at("PyObject_Realloc")
            .and_then(|(_, vaddr)| inlined::guard_of(&code, vaddr))
            .map_or(0, |(function, _)| {
                inlined::guards_of(&code, function, &probed)
            })
    };
    for (row, copy) in found.sites {
        sites[row].inlined.push(copy);
    }
    let own = |vaddr: u64, size: u64| {
        Some(Internal {
            path: path.clone(),
            file_offset: vaddr_to_file_offset(&file, vaddr)?,
            size,
            frees: false,
        })
    };
    let malloc = targets
        .iter()
        .find(|t| t.kind == inlined::Kind::Malloc)
        .and_then(|t| inlined::function_extent(&file, t.function));
    internals.extend(malloc.and_then(|(vaddr, size)| own(vaddr, size)));
    internals.extend(found.nested.iter().filter_map(|ra| own(*ra, 1)));
    // Live mode sees the copies of realloc through the static malloc and
    // free they call: probed there (their own calls are nested in them).
    if targets.iter().any(|t| t.kind == inlined::Kind::Realloc) {
        for (kind, entry) in [
            (inlined::Kind::Malloc, &families::PYMALLOC_STATIC[0]),
            (inlined::Kind::Free, &families::PYMALLOC_STATIC[1]),
        ] {
            let Some(t) = targets.iter().find(|t| t.kind == kind) else {
                continue;
            };
            let Some((vaddr, size)) = inlined::function_extent(&file, t.function) else {
                continue;
            };
            let Some(file_offset) = vaddr_to_file_offset(&file, vaddr) else {
                continue;
            };
            let start = file_offset as usize;
            let code = data
                .get(start..(start + size.min(16384) as usize).min(data.len()))
                .unwrap_or(&[]);
            // `(ctx, size)`, `(ctx, ptr)`: the probe reads argument 1 as
            // the role's argument 0 (from `rsi`, or where the code before
            // the probe moved it).
            let placement = place_probe(code, vaddr, &[crate::asm::Register::RSI]);
            let moved = placement.args >> 4 & 0xf;
            let args = if moved != 0 {
                moved
            } else {
                crate::asm::arg_code(crate::asm::Register::RSI).unwrap_or(0)
            };
            sites.push(ProbeSite {
                funcs: vec![entry],
                path: path.clone(),
                open_path: sites[om].open_path.clone(),
                vaddr,
                size,
                file_offset,
                probe_offset: placement.offset,
                emulated: placement.emulated,
                args,
                multiplied: false,
                instruction: placement.instruction,
                prefix: None,
                inlined: Vec::new(),
                live_only: true,
            });
        }
    }
    internals.extend(found.nested_frees.iter().filter_map(|ra| {
        let mut i = own(*ra, 1)?;
        i.frees = true;
        Some(i)
    }));
    (found.missed, resizes)
}

/// The probe site of `symbol` (in the object at `path`, when given).
pub(super) fn named(sites: &[ProbeSite], symbol: &str, path: Option<&str>) -> Option<usize> {
    sites.iter().position(|s| {
        s.funcs.iter().any(|f| f.symbol == symbol) && path.is_none_or(|p| s.path == p)
    })
}
