//! What an ELF object defines: the allocator's entry points and
//! internals, and the family its names say.

use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

use super::families::{self, Entry};

/// An entry point an object defines.
#[derive(Clone, Copy, Debug)]
pub(super) struct Def {
    /// Its row in [`families::ENTRIES`].
    pub(super) order: usize,
    pub(super) entry: &'static Entry,
    pub(super) vaddr: u64,
    pub(super) size: u64,
    pub(super) file_offset: u64,
    /// Defined under a prefix (`_rjem_malloc`): the API of an allocator
    /// linked in beside the C library's, which it does not replace.
    pub(super) prefix: Option<&'static str>,
}

/// An allocator internal an object defines: (file offset, size, whether
/// it frees).
pub(super) type Internal0 = (u64, u64, bool);

/// The entry points an ELF object defines, and the allocator internals it
/// defines (with `python`, CPython's entry points and internals too).
pub(super) fn definitions(data: &[u8], python: bool) -> (Vec<Def>, Vec<Internal0>) {
    let Ok(file) = object::File::parse(data) else {
        return (Vec::new(), Vec::new());
    };
    let mut defs: Vec<Def> = Vec::new();
    let mut internals = Vec::new();
    // Dynamic symbols first (what callers bind to), then the full symbol
    // table (statically linked programs, Rust's shims).
    for sym in file.dynamic_symbols().chain(file.symbols()) {
        if sym.kind() != SymbolKind::Text || !sym.is_definition() || sym.address() == 0 {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        let Some(file_offset) = vaddr_to_file_offset(&file, sym.address()) else {
            continue;
        };
        if let Some((order, entry)) = families::lookup(name) {
            if families::is_python(entry) && !python {
                continue;
            }
            if !defs.iter().any(|d| d.order == order) {
                defs.push(Def {
                    order,
                    entry,
                    vaddr: sym.address(),
                    size: sym.size(),
                    file_offset,
                    prefix: families::prefix_of(name, entry),
                });
            }
        } else if families::is_internal(name) {
            internals.push((file_offset, sym.size(), false));
        } else if python && families::PYTHON_INTERNALS.contains(&families::plain_name(name)) {
            internals.push((file_offset, sym.size(), families::is_python_free(name)));
        }
    }
    (defs, internals)
}

/// Every text symbol an object defines (for telling families apart).
/// The allocator family of the object at `path`, whose bytes are `data`.
pub(super) fn family_of(path: &str, data: &[u8]) -> &'static str {
    let names = defined_names(data);
    families::family(
        |n| names.iter().any(|d| d == n),
        |bytes| memchr::memmem::find(data, bytes).is_some(),
        path,
    )
}

fn defined_names(data: &[u8]) -> Vec<String> {
    let Ok(file) = object::File::parse(data) else {
        return Vec::new();
    };
    file.dynamic_symbols()
        .filter(|s| s.kind() == SymbolKind::Text && s.is_definition())
        .filter_map(|s| {
            s.name()
                .ok()
                .map(|n| n.split('@').next().unwrap_or(n).to_string())
        })
        .collect()
}

pub(super) fn vaddr_to_file_offset(file: &object::File, vaddr: u64) -> Option<u64> {
    file.segments().find_map(|seg| {
        let (off, size) = seg.file_range();
        let addr = seg.address();
        (vaddr >= addr && vaddr < addr + size).then(|| vaddr - addr + off)
    })
}
