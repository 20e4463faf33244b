//! Allocator families: which symbols are allocator entry points, the role
//! each plays (what its probe reads, [`Role`]) and the name a report shows.
//!
//! A family is a table, not code: adding `mallocx` or `operator new` is a
//! row here, with no change to the BPF programs or the report.

use tracer_common::Role;

/// One entry point as an object exports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The ELF symbol (without a version suffix or a prefix).
    pub symbol: &'static str,
    pub role: Role,
    /// The name reports show.
    pub display: &'static str,
}

const fn e(symbol: &'static str, role: Role) -> Entry {
    Entry {
        symbol,
        role,
        display: symbol,
    }
}

const fn named(symbol: &'static str, role: Role, display: &'static str) -> Entry {
    Entry {
        symbol,
        role,
        display,
    }
}

/// Every entry point, in the order reports list them. The malloc family of
/// the C library comes first (glibc, musl, and what jemalloc, tcmalloc and
/// mimalloc export under the same names); an object that defines `malloc`
/// is an allocator.
pub const ENTRIES: &[Entry] = &[
    e("malloc", Role::Size),
    e("calloc", Role::CountSize),
    e("realloc", Role::Resize),
    e("reallocarray", Role::ResizeArray),
    e("posix_memalign", Role::PosixMemalign),
    e("aligned_alloc", Role::AlignSize),
    e("memalign", Role::AlignSize),
    e("valloc", Role::Size),
    e("pvalloc", Role::Size),
    e("free", Role::Free),
    // C++: operator new and delete, all variants (Itanium mangling).
    named("_Znwm", Role::Size, "operator new"),
    named("_Znam", Role::Size, "operator new[]"),
    named("_ZnwmRKSt9nothrow_t", Role::Size, "operator new(nothrow)"),
    named("_ZnamRKSt9nothrow_t", Role::Size, "operator new[](nothrow)"),
    named("_ZnwmSt11align_val_t", Role::Size, "operator new(align)"),
    named("_ZnamSt11align_val_t", Role::Size, "operator new[](align)"),
    named(
        "_ZnwmSt11align_val_tRKSt9nothrow_t",
        Role::Size,
        "operator new(align, nothrow)",
    ),
    named(
        "_ZnamSt11align_val_tRKSt9nothrow_t",
        Role::Size,
        "operator new[](align, nothrow)",
    ),
    named("_ZdlPv", Role::Free, "operator delete"),
    named("_ZdaPv", Role::Free, "operator delete[]"),
    named("_ZdlPvm", Role::Free, "operator delete(sized)"),
    named("_ZdaPvm", Role::Free, "operator delete[](sized)"),
    named(
        "_ZdlPvSt11align_val_t",
        Role::Free,
        "operator delete(align)",
    ),
    named(
        "_ZdaPvSt11align_val_t",
        Role::Free,
        "operator delete[](align)",
    ),
    named(
        "_ZdlPvmSt11align_val_t",
        Role::Free,
        "operator delete(sized, align)",
    ),
    named(
        "_ZdaPvmSt11align_val_t",
        Role::Free,
        "operator delete[](sized, align)",
    ),
    named(
        "_ZdlPvRKSt9nothrow_t",
        Role::Free,
        "operator delete(nothrow)",
    ),
    named(
        "_ZdaPvRKSt9nothrow_t",
        Role::Free,
        "operator delete[](nothrow)",
    ),
    // jemalloc's non-standard API.
    e("mallocx", Role::Size),
    e("rallocx", Role::Resize),
    e("xallocx", Role::ResizeInPlace),
    e("sdallocx", Role::Free),
    e("dallocx", Role::Free),
    // tcmalloc (gperftools).
    named("tc_malloc", Role::Size, "tc_malloc"),
    e("tc_calloc", Role::CountSize),
    e("tc_realloc", Role::Resize),
    e("tc_memalign", Role::AlignSize),
    e("tc_posix_memalign", Role::PosixMemalign),
    e("tc_valloc", Role::Size),
    e("tc_pvalloc", Role::Size),
    e("tc_new", Role::Size),
    e("tc_newarray", Role::Size),
    e("tc_new_nothrow", Role::Size),
    e("tc_newarray_nothrow", Role::Size),
    e("tc_free", Role::Free),
    e("tc_delete", Role::Free),
    e("tc_deletearray", Role::Free),
    e("tc_delete_nothrow", Role::Free),
    e("tc_deletearray_nothrow", Role::Free),
    // mimalloc.
    e("mi_malloc", Role::Size),
    e("mi_zalloc", Role::Size),
    e("mi_calloc", Role::CountSize),
    e("mi_realloc", Role::Resize),
    e("mi_malloc_aligned", Role::Size),
    // What mimalloc's own posix_memalign, aligned_alloc, ... jump to: as
    // entry points, the calls they make (mi_malloc_aligned) are nested.
    e("mi_posix_memalign", Role::PosixMemalign),
    e("mi_aligned_alloc", Role::AlignSize),
    e("mi_memalign", Role::AlignSize),
    e("mi_valloc", Role::Size),
    e("mi_pvalloc", Role::Size),
    e("mi_reallocarray", Role::ResizeArray),
    e("mi_zalloc_aligned", Role::Size),
    e("mi_new", Role::Size),
    e("mi_new_nothrow", Role::Size),
    e("mi_free", Role::Free),
    // Rust's global allocator shims (in the program, when it has symbols).
    e("__rust_alloc", Role::Size),
    e("__rust_alloc_zeroed", Role::Size),
    e("__rust_realloc", Role::ResizeRust),
    e("__rust_dealloc", Role::Free),
    // CPython's object and memory allocators (pymalloc), probed only with
    // `--python-objects` (see [`is_python`]): an object allocation that
    // falls through to malloc is nested in them.
    e("PyObject_Malloc", Role::Size),
    e("PyObject_Calloc", Role::CountSize),
    e("PyObject_Realloc", Role::Resize),
    e("PyObject_Free", Role::Free),
    e("PyMem_Malloc", Role::Size),
    e("PyMem_Calloc", Role::CountSize),
    e("PyMem_Realloc", Role::Resize),
    e("PyMem_Free", Role::Free),
];

/// CPython's entry points of [`ENTRIES`] (and [`PYMALLOC_STATIC`]):
/// probed only when asked for.
pub fn is_python(entry: &Entry) -> bool {
    entry.symbol.starts_with("PyObject_")
        || entry.symbol.starts_with("PyMem_")
        || entry.symbol.starts_with("_PyObject_")
}

/// CPython's static `_PyObject_Malloc` and `_PyObject_Free`, found by the
/// guards of a build that inlined its allocator (no symbol names them):
/// probed in live mode where its copies of realloc call them.
pub static PYMALLOC_STATIC: [Entry; 2] = [
    e("_PyObject_Malloc", Role::Size),
    e("_PyObject_Free", Role::Free),
];

/// What CPython's allocator entry points reach malloc through where the
/// build is not one function (pyenv's: `PyObject_Malloc` -> pointer ->
/// `_PyObject_Malloc` -> ... -> malloc): with `--python-objects`, a call
/// from inside one is nested. (`PyMem_RawMalloc` is not among them: C
/// code calls it directly, and its malloc is the only allocation then.)
pub const PYTHON_INTERNALS: &[&str] = &[
    "_PyObject_Malloc",
    "_PyObject_Calloc",
    "_PyObject_Realloc",
    "_PyObject_Free",
    "pymalloc_alloc",
    "pymalloc_realloc",
    "pymalloc_free",
];

/// The [`PYTHON_INTERNALS`] that free: a free made from inside one is the
/// same free as the probed function's.
pub fn is_python_free(symbol: &str) -> bool {
    matches!(plain_name(symbol), "_PyObject_Free" | "pymalloc_free")
}

/// Functions inside an allocator that are not probed but through which an
/// allocator calls another one (Rust's `__rust_alloc` -> `__rdl_alloc` ->
/// `malloc`): a call made from inside one is the allocator calling itself.
pub const INTERNALS: &[&str] = &[
    "__rdl_alloc",
    "__rdl_alloc_zeroed",
    "__rdl_realloc",
    "__rdl_dealloc",
    "__rg_alloc",
    "__rg_alloc_zeroed",
    "__rg_realloc",
    "__rg_dealloc",
];

/// Prefixes under which a statically linked allocator exports its API
/// (tikv-jemallocator's `_rjem_malloc`, jemalloc built with a `je_` prefix).
const PREFIXES: &[&str] = &["_rjem_", "je_"];

/// The table row of `symbol` (a version suffix such as `@@GLIBC_2.2.5`
/// and a prefix of [`PREFIXES`] are ignored), and its position in the
/// table (the order reports list functions in).
pub fn lookup(symbol: &str) -> Option<(usize, &'static Entry)> {
    let name = plain_name(symbol);
    let find = |n: &str| ENTRIES.iter().enumerate().find(|(_, e)| e.symbol == n);
    find(name).or_else(|| {
        PREFIXES
            .iter()
            .find_map(|p| name.strip_prefix(p))
            .and_then(find)
    })
}

/// The prefix of [`PREFIXES`] `symbol` carries in front of `entry`'s name,
/// if any.
pub fn prefix_of(symbol: &str, entry: &Entry) -> Option<&'static str> {
    let name = plain_name(symbol);
    PREFIXES
        .iter()
        .copied()
        .find(|p| name.strip_prefix(p) == Some(entry.symbol))
}

/// `symbol` without a version suffix (`@@GLIBC_2.2.5`), and a Rust
/// shim's name without the v0 mangling rustc gives it
/// (`_RNvCs..._7___rustc12___rust_alloc` is `__rust_alloc`).
pub fn plain_name(symbol: &str) -> &str {
    let name = symbol.split('@').next().unwrap_or(symbol);
    match name
        .strip_prefix("_R")
        .and_then(|m| m.split_once("___rustc"))
    {
        // <length>_<identifier>: v0 separates an identifier that starts
        // with `_` from its length by one more `_`.
        Some((_, rest)) => {
            let ident = rest.trim_start_matches(|c: char| c.is_ascii_digit());
            ident.strip_prefix('_').unwrap_or(ident)
        }
        None => name,
    }
}

/// Whether `symbol` is one of the [`INTERNALS`].
pub fn is_internal(symbol: &str) -> bool {
    INTERNALS.contains(&plain_name(symbol))
}

/// The allocator family an object belongs to, from what it defines.
///
/// `contains` says whether the object's bytes hold a string: an allocator
/// linked into a program with only the standard names exported (rustc's
/// jemalloc) still prints its name in its messages.
pub fn family(
    defines: impl Fn(&str) -> bool,
    contains: impl Fn(&[u8]) -> bool,
    path: &str,
) -> &'static str {
    let base = path.rsplit('/').next().unwrap_or(path);
    if defines("mallocx") || defines("_rjem_malloc") || base.starts_with("libjemalloc") {
        "jemalloc"
    } else if defines("tc_malloc") || base.starts_with("libtcmalloc") {
        "tcmalloc"
    } else if defines("mi_malloc") || base.starts_with("libmimalloc") {
        "mimalloc"
    } else if contains(b"<jemalloc>: ") {
        "jemalloc"
    } else if contains(b"mimalloc: ") {
        "mimalloc"
    } else if contains(b"tcmalloc: ") {
        "tcmalloc"
    } else if defines("__libc_malloc") {
        "glibc"
    } else if base.starts_with("ld-musl") || base.starts_with("libc.musl") {
        "musl"
    } else {
        "malloc"
    }
}

/// The version an allocator object states in its bytes: glibc's banner
/// (`... release version 2.36.`), jemalloc's version string
/// (`5.3.0-0-g54eaed1d...`), gperftools' (`gperftools 2.10`). `None` when
/// it says none (mimalloc only has a function for it).
pub fn version(family: &str, data: &[u8]) -> Option<String> {
    use memchr::memmem;
    let word_after = |marker: &[u8]| -> Option<String> {
        let at = memmem::find(data, marker)? + marker.len();
        let v: String = data[at..]
            .iter()
            .take(32)
            .take_while(|b| b.is_ascii_digit() || **b == b'.')
            .map(|b| *b as char)
            .collect();
        let v = v.trim_end_matches('.').to_string();
        (!v.is_empty()).then_some(v)
    };
    match family {
        "glibc" => word_after(b"stable release version "),
        "tcmalloc" => word_after(b"gperftools "),
        "jemalloc" => memmem::find_iter(data, b"-g").find_map(|at| {
            // N.N.N-N-g<40 hex digits>: the version is what precedes the
            // first `-`.
            let hash = data.get(at + 2..at + 42)?;
            if !hash.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            let start = data[..at]
                .iter()
                .rposition(|b| !(b.is_ascii_digit() || *b == b'.' || *b == b'-'))
                .map_or(0, |i| i + 1);
            let text = std::str::from_utf8(&data[start..at]).ok()?;
            let v = text.split('-').next()?;
            (v.split('.').count() == 3 && v.split('.').all(|p| !p.is_empty()))
                .then(|| v.to_string())
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_from_the_objects_bytes() {
        let banner = b"..GNU C Library (Debian GLIBC 2.36-9) stable release version 2.36.\n..";
        assert_eq!(version("glibc", banner).as_deref(), Some("2.36"));
        let je = b"\0x-g12\x005.3.0-0-g54eaed1d8b56b1aa528be3bdd1877e59c56fa90c\0";
        assert_eq!(version("jemalloc", je).as_deref(), Some("5.3.0"));
        assert_eq!(
            version("tcmalloc", b"\0gperftools 2.10\0").as_deref(),
            Some("2.10")
        );
        assert_eq!(version("mimalloc", b"mi_version"), None);
    }

    #[test]
    fn versioned_and_prefixed_symbols_resolve() {
        let (i, e) = lookup("malloc@@GLIBC_2.2.5").unwrap();
        assert_eq!((i, e.role, e.display), (0, Role::Size, "malloc"));
        assert_eq!(lookup("free").unwrap().1.role, Role::Free);
        assert_eq!(lookup("_rjem_mallocx").unwrap().1.symbol, "mallocx");
        assert_eq!(lookup("_Znwm").unwrap().1.display, "operator new");
        assert!(lookup("malloc_usable_size").is_none());
        // Rust 1.95's v0-mangled shims.
        let (_, e) = lookup("_RNvCsfLfy6EI15iL_7___rustc12___rust_alloc").unwrap();
        assert_eq!(e.symbol, "__rust_alloc");
        assert!(lookup("_RNvCsfLfy6EI15iL_7___rustc26___rust_alloc_error_handler").is_none());
        assert!(is_internal("_RNvCsfLfy6EI15iL_7___rustc11___rdl_alloc"));
    }

    #[test]
    fn every_role_has_a_program_and_symbols_are_unique() {
        for (i, e) in ENTRIES.iter().enumerate() {
            assert!(!e.role.program().is_empty());
            assert!(
                !ENTRIES[..i].iter().any(|o| o.symbol == e.symbol),
                "{} twice",
                e.symbol
            );
        }
    }
}
