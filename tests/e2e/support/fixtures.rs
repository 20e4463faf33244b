//! The fixture programs (tests/fixtures/*.c), compiled once per test run,
//! and copies of them.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

/// The C programs in tests/fixtures.
#[derive(Clone, Copy, Debug)]
pub enum Fixture {
    Counts,
    Threads,
    Longrun,
    Exit7,
    NoMalloc,
    /// counts.c with 20% more allocations at alloc_small (1200).
    CountsPlus20,
    Live,
    Sampled,
    ManyStacks,
    /// A process tree (tree.c): run with two programs to start.
    Tree,
    /// counts.c, statically linked.
    CountsStatic,
    /// A server-like tree to trace by pid (workers.c).
    Workers,
    /// Allocates while two threads map and unmap pages (mapchurn.c).
    MapChurn,
}

const N_FIXTURES: usize = 13;

/// `cc -O2 -fno-omit-frame-pointer -g -o OUT SRC`: frame pointers for the
/// kernel's stack walk, debug info for file:line.
const FRAME_FLAGS: &[&str] = &["-O2", "-fno-omit-frame-pointer", "-g"];

impl Fixture {
    fn name(self) -> &'static str {
        match self {
            Fixture::Counts => "counts",
            Fixture::Threads => "threads",
            Fixture::Longrun => "longrun",
            Fixture::Exit7 => "exit7",
            Fixture::NoMalloc => "nomalloc",
            Fixture::CountsPlus20 => "counts-plus20",
            Fixture::Live => "live",
            Fixture::Sampled => "sampled",
            Fixture::ManyStacks => "manystacks",
            Fixture::Tree => "tree",
            Fixture::CountsStatic => "counts-static",
            Fixture::Workers => "workers",
            Fixture::MapChurn => "mapchurn",
        }
    }

    /// The source file in tests/fixtures.
    fn source(self) -> &'static str {
        match self {
            Fixture::CountsPlus20 | Fixture::CountsStatic => "counts",
            other => other.name(),
        }
    }

    /// Flags before `-o OUT SRC`, and after.
    fn flags(self) -> (&'static [&'static str], &'static [&'static str]) {
        match self {
            Fixture::Threads | Fixture::Live | Fixture::MapChurn => (FRAME_FLAGS, &["-pthread"]),
            Fixture::CountsPlus20 => (FRAME_FLAGS, &["-DSMALL_N=1200", "-DPAD_FUNCTIONS"]),
            Fixture::NoMalloc => (&["-O2", "-static", "-nostdlib"], &[]),
            Fixture::CountsStatic => (FRAME_FLAGS, &["-static"]),
            _ => (FRAME_FLAGS, &[]),
        }
    }

    /// The compiled program; compiled on first use in this test run.
    pub fn path(self) -> &'static Path {
        static BUILT: [OnceLock<PathBuf>; N_FIXTURES] = [const { OnceLock::new() }; N_FIXTURES];
        BUILT[self as usize].get_or_init(|| compile(self))
    }

    pub fn path_str(self) -> &'static str {
        self.path().to_str().expect("fixture path not UTF-8")
    }
}

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn compile(fixture: Fixture) -> PathBuf {
    let (before, after) = fixture.flags();
    compile_c(fixture.name(), fixture.source(), before, after)
}

/// Runs `cmd`, which builds the fixture `what`; its output, once it has
/// succeeded (else the test fails with the builder's stderr).
pub fn build_fixture(cmd: &mut Command, what: &str) -> std::process::Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("building {what}: running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "building {what} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `cc BEFORE -o NAME tests/fixtures/SOURCE.c AFTER`, into the tests'
/// fixture directory.
pub fn compile_c(name: &str, source: &str, before: &[&str], after: &[&str]) -> PathBuf {
    let src = fixtures_dir().join(format!("{source}.c"));
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-fixtures");
    fs::create_dir_all(&dir).unwrap();
    let out = dir.join(name);
    // Compile to a private name and rename: a concurrent run of the tests
    // may be executing the previous binary.
    let tmp = dir.join(format!("{name}.{}.tmp", std::process::id()));
    let output = Command::new("cc")
        .args(before)
        .arg("-o")
        .arg(&tmp)
        .arg(&src)
        .args(after)
        .output()
        .expect("running cc (a C compiler is needed for the fixtures)");
    assert!(
        output.status.success(),
        "compiling {} failed ({}):\n{}",
        src.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    fs::rename(&tmp, &out).unwrap();
    out
}

/// Copies `src` into `dir` as an executable file.
pub fn copy_executable(src: &Path, dir: &Path, name: &str) -> PathBuf {
    let dst = dir.join(name);
    fs::copy(src, &dst).unwrap();
    fs::set_permissions(&dst, fs::Permissions::from_mode(0o755)).unwrap();
    dst
}

/// Debian's jemalloc (installed by `cargo xtask setup`).
pub const JEMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";

/// tests/fixtures/rustjem (a cargo project: tikv-jemallocator from
/// crates.io, pinned by its Cargo.lock), built once in release mode with
/// the cargo that runs the tests.
pub fn rustjem() -> &'static std::path::Path {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("rustjem");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        build_fixture(
            std::process::Command::new(cargo)
                .args(["build", "--release", "--locked", "--manifest-path"])
                .arg(fixtures_dir().join("rustjem/Cargo.toml"))
                .arg("--target-dir")
                .arg(&target),
            "tests/fixtures/rustjem",
        );
        target.join("release/rustjem")
    })
}
