use object::Object;

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
