//! Golden files for tests: an output compared with its file, or written
//! there when `MTRACE_BLESS` is set (`MTRACE_BLESS=1 cargo test ...`), so
//! that an intended change shows as a diff in the commit.
//!
//! Only the tests use it: it is behind the `golden` feature, which the
//! workspace's crates enable for their tests alone (dev-dependencies).

use std::path::Path;

/// Compares `actual` with the file `dir/name`, or writes it there when
/// `MTRACE_BLESS` is set. A missing file or a difference panics with a
/// unified diff of the file against `actual`, located at the caller.
#[track_caller]
pub fn check(dir: &Path, name: &str, actual: &str) {
    let path = dir.join(name);
    if std::env::var_os("MTRACE_BLESS").is_some() {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (MTRACE_BLESS=1 writes it)", path.display()));
    if expected != actual {
        let diff = similar::TextDiff::from_lines(&expected, actual)
            .unified_diff()
            .header(&path.display().to_string(), "actual")
            .to_string();
        panic!("{name} differs from its golden file (MTRACE_BLESS=1 to accept):\n{diff}");
    }
}
