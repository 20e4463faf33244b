//! The thread's symbolizer, bounded: blazesym keeps every file it parsed
//! (mapped, with its symbol tables and DWARF indexes) for as long as the
//! symbolizer lives, and a trace that runs for weeks on a host that keeps
//! building new programs meets new files without end.

use std::{cell::RefCell, collections::HashSet, os::unix::fs::MetadataExt, path::Path};

use blazesym::symbolize::Symbolizer;

/// Files the symbolizer keeps parsed, at most: past it, it starts over.
pub(super) const FILES_KEPT: usize = 128;

/// Bytes of files the symbolizer keeps parsed, at most (their sizes on
/// disk: what it maps, and about what its tables grow with): past it, it
/// starts over.
const BYTES_KEPT: u64 = 1 << 30;

/// A file's identity as the symbolizer's cache takes it: device, inode,
/// size and modification time.
type Key = (u64, u64, u64, i64, i64);

/// The thread's symbolizer and the files it has parsed since it was made.
struct Parsed {
    symbolizer: Symbolizer,
    files: HashSet<Key>,
    bytes: u64,
}

fn symbolizer() -> Symbolizer {
    Symbolizer::builder()
        .enable_code_info(true)
        .enable_inlined_fns(true)
        // Names are demangled here (`demangled`): blazesym's demangling
        // takes a C function's name for a C++ type code when the unit's
        // language is not C++ or Rust (`a` -> `signed char`, `d` ->
        // `double`).
        .enable_demangling(false)
        .build()
}

thread_local! {
    /// One symbolizer for the whole trace, per thread (blazesym's is not
    /// `Sync`). It keeps every file it parsed, keyed by device, inode,
    /// size and modification time (not by path, so the same library
    /// through each process's `/proc/self/fd/N` is parsed once, and a
    /// reused descriptor number never finds another file's symbols): in a
    /// tree of 63 short programs, inflating libc's compressed debug
    /// sections again for each took a third of mtrace's time. A file that
    /// would take it past [`FILES_KEPT`] files or [`BYTES_KEPT`] bytes
    /// makes a new one, which parses again what it is asked about.
    static PARSED: RefCell<Parsed> = RefCell::new(Parsed {
        symbolizer: symbolizer(),
        files: HashSet::new(),
        bytes: 0,
    });
}

/// `f` with the thread's symbolizer, which is about to read the file at
/// `path` (which it stats as the symbolizer will, following a
/// `/proc/self/fd/N` link). `f` must not symbolize another file.
pub(super) fn with_symbolizer<T>(path: &Path, f: impl FnOnce(&Symbolizer) -> T) -> T {
    let key = std::fs::metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()));
    PARSED.with(|p| {
        let mut p = p.borrow_mut();
        if let Some(key) = key.filter(|k| !p.files.contains(k)) {
            if p.files.len() >= FILES_KEPT || p.bytes.saturating_add(key.2) > BYTES_KEPT {
                log::debug!(
                    "symbolizer: {} files ({} bytes) parsed, starting over",
                    p.files.len(),
                    p.bytes
                );
                p.symbolizer = symbolizer();
                p.files.clear();
                p.bytes = 0;
            }
            p.files.insert(key);
            p.bytes += key.2;
        }
        f(&p.symbolizer)
    })
}

#[cfg(test)]
mod tests {
    use super::FILES_KEPT;

    /// Files under `dir` that this process maps.
    fn mapped_under(dir: &std::path::Path) -> usize {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let dir = dir.to_string_lossy();
        let files: std::collections::HashSet<&str> = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .filter(|p| p.starts_with(&*dir))
            .collect();
        files.len()
    }

    /// A trace that meets new programs without end (a host that keeps
    /// building them) keeps a bounded number of them parsed: the
    /// symbolizer maps every file it parses, and let none go before.
    #[test]
    fn the_symbolizer_keeps_a_bounded_number_of_files() {
        let dir = tempfile::tempdir().unwrap();
        let small = std::fs::read("/bin/true").unwrap();
        for i in 0..FILES_KEPT + 40 {
            // Each a file of its own (its own inode), as each build of a
            // program is.
            let path = dir.path().join(format!("prog{i}"));
            std::fs::write(&path, &small).unwrap();
            let file = std::fs::File::open(&path).unwrap();
            // An offset inside the file: the symbolizer parses it to look.
            let _ = super::super::returns_in_file(&file, "prog", &[0x1000]);
        }
        let mapped = mapped_under(dir.path());
        assert!(mapped > 0, "the symbolizer mapped none of the files");
        assert!(
            mapped <= FILES_KEPT,
            "{mapped} of {} files parsed are still mapped (at most {FILES_KEPT})",
            FILES_KEPT + 40
        );
    }
}
