//! Allocator families: which symbols are allocator entry points, the role
//! each plays (what its probe reads, [`Role`]) and the name a report shows.
//!
//! A family is a table, not code: adding `mallocx` or `operator new` is a
//! row here, with no change to the BPF programs or the report.

use tracer_common::Role;

/// One entry point as an object exports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The ELF symbol (without a version suffix).
    pub symbol: &'static str,
    pub role: Role,
    /// The name reports show.
    pub display: &'static str,
}

const fn entry(symbol: &'static str, role: Role) -> Entry {
    Entry {
        symbol,
        role,
        display: symbol,
    }
}

/// glibc's and musl's malloc family (also what jemalloc, tcmalloc and
/// mimalloc export under the same names). The first entry is the one whose
/// presence makes an object an allocator.
pub const LIBC: &[Entry] = &[
    entry("malloc", Role::Size),
    entry("calloc", Role::CountSize),
    entry("realloc", Role::Resize),
    entry("reallocarray", Role::ResizeArray),
    entry("posix_memalign", Role::PosixMemalign),
    entry("aligned_alloc", Role::AlignSize),
    entry("memalign", Role::AlignSize),
    entry("valloc", Role::Size),
    entry("pvalloc", Role::Size),
    entry("free", Role::Free),
];

/// The table row of `symbol` (a version suffix such as `@@GLIBC_2.2.5`
/// is ignored), and its position in the table (the order reports list
/// functions in).
pub fn lookup(symbol: &str) -> Option<(usize, &'static Entry)> {
    let name = symbol.split('@').next().unwrap_or(symbol);
    LIBC.iter().enumerate().find(|(_, e)| e.symbol == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versioned_symbols_resolve() {
        let (i, e) = lookup("malloc@@GLIBC_2.2.5").unwrap();
        assert_eq!((i, e.role, e.display), (0, Role::Size, "malloc"));
        assert_eq!(lookup("free").unwrap().1.role, Role::Free);
        assert!(lookup("mallocx").is_none());
    }

    #[test]
    fn every_role_has_a_program() {
        for e in LIBC {
            assert!(!e.role.program().is_empty());
            assert_eq!(e.role.return_program().is_none(), e.role == Role::Free);
        }
    }
}
