use super::{symbols::definitions, *};

#[test]
fn finds_this_machines_libc_malloc() {
    // Debian's libc: the machines mtrace is built and tested on.
    let data = fs::read("/lib/x86_64-linux-gnu/libc.so.6").expect("Debian's libc");
    let (defs, _) = definitions(&data, false);
    let malloc = defs.iter().find(|d| d.entry.symbol == "malloc").unwrap();
    assert!(malloc.size > 0);
    assert!(defs.iter().any(|d| d.entry.role == Role::Free));
}

/// CPython's entry points only when asked for (`--python-objects`).
#[test]
fn python_entry_points_only_when_asked() {
    let data = fs::read("/usr/bin/python3.11").expect("Debian's python3.11");
    let names = |python| -> Vec<&str> {
        let (defs, _) = definitions(&data, python);
        defs.iter().map(|d| d.entry.symbol).collect()
    };
    assert!(!names(false).iter().any(|n| n.starts_with("PyObject_")));
    let asked = names(true);
    for f in ["PyObject_Malloc", "PyObject_Free", "PyMem_Realloc"] {
        assert!(asked.contains(&f), "{f} in {asked:?}");
    }
}
