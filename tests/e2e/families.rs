//! Allocator families: the counts fixture under Debian's jemalloc,
//! tcmalloc and mimalloc (preloaded), by pid and in launch mode: every
//! site exact, the family and the object named. By pid the allocator is
//! mapped above libc, so only the link map (not the lowest address) finds
//! it. (C++ operator new and Rust's __rust_alloc: tests/e2e/unwind.rs.)

use crate::{
    support::counts::assert_counts_sites,
    support::fixtures::JEMALLOC,
    support::mtrace::trace_through_env,
    support::{
        fixtures::{compile_c, rustjem},
        run_profiled, trace_by_pid, Fixture, FixtureProc, Profile,
    },
};

/// Debian's other allocators (installed by `cargo xtask setup`).
const TCMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4";
const MIMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2";

const PRELOADED: [(&str, &str); 3] = [
    (JEMALLOC, "jemalloc"),
    (TCMALLOC, "tcmalloc"),
    (MIMALLOC, "mimalloc"),
];

/// The object the profile names, and that it is `library` (the file the
/// symbolic link points to, as the target maps it).
fn assert_object(object: &serde_json::Value, library: &str, d: &str) {
    let real = std::fs::canonicalize(library).unwrap();
    assert_eq!(object.as_str(), real.to_str(), "{d}");
}

/// The counts fixture under `library`: preloaded, or linked (`-l`, so that
/// the dynamic linker finds it before libc through the executable's own
/// list of libraries).
#[derive(Clone, Copy, Debug)]
enum Under {
    Preloaded,
    Linked,
}

/// Traces the counts fixture by pid under `library`, each way.
fn by_pid(library: &str, under: Under) -> (crate::support::Finished, crate::support::Profile) {
    let (program, env) = match under {
        Under::Preloaded => (
            Fixture::Counts.path().to_path_buf(),
            vec![("LD_PRELOAD", library)],
        ),
        Under::Linked => {
            let family = library
                .rsplit('/')
                .next()
                .unwrap()
                .split('.')
                .next()
                .unwrap();
            let name = format!("counts-linked-{family}");
            (
                compile_c(&name, "counts", &["-O2", "-g"], &[library]),
                vec![],
            )
        }
    };
    let mut fx = FixtureProc::start_env(&program, &["--wait"], &env);
    trace_by_pid(&mut fx, &["--top", "0"])
}

#[test]
fn preloaded_and_linked_allocators_by_pid() {
    need_bpf!();
    for under in [Under::Preloaded, Under::Linked] {
        for (library, family) in PRELOADED {
            let (out, p) = by_pid(library, under);
            let d = format!("{library} ({under:?})\n{}", out.describe());
            assert_counts_sites(&p, &d);
            assert_eq!(p.doc["meta"]["allocator_family"], family, "{d}");
            assert_object(&p.doc["meta"]["allocator_object"], library, &d);
            // jemalloc and gperftools state their version (mimalloc does
            // not, in its bytes).
            let version = p.doc["meta"]["allocator_version"].as_str().unwrap_or("");
            let stated =
                !version.is_empty() && version.chars().all(|c| c.is_ascii_digit() || c == '.');
            assert_eq!(stated, family != "mimalloc", "version {version:?}\n{d}");
        }
    }
}

#[test]
fn preloaded_allocators_launch_mode() {
    need_bpf!();
    for (library, family) in PRELOADED {
        let preload = format!("LD_PRELOAD={library}");
        let (out, p) = trace_through_env(&[], &[&preload], Fixture::Counts);
        let d = format!("{library}\n{}", out.describe());
        assert_counts_sites(&p, &d);
        assert_eq!(p.doc["meta"]["allocator_family"], family, "{d}");
        assert_object(&p.doc["meta"]["allocator_object"], library, &d);
        // Count mode: no probe on any free function.
        let probes = p.doc["meta"]["probes"].as_array().unwrap();
        assert!(
            !probes.iter().any(|pr| {
                let f = pr["function"].as_str().unwrap();
                f.contains("free") || f.contains("delete") || f.contains("dallocx")
            }),
            "a release function probed in count mode\n{d}"
        );
    }
}

/// A prefixed allocator API in the program (tikv-jemallocator's
/// `_rjem_malloc`) does not hide libc's `malloc`.
#[test]
fn a_prefixed_allocator_does_not_hide_libc() {
    need_bpf!();
    prefixed_beside_libc(&[]);
}

/// The same on the host engine (`--file-wide`), whose trace names the
/// families of the allocator functions its processes called.
#[test]
fn a_prefixed_allocator_does_not_hide_libc_file_wide() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    prefixed_beside_libc(&["--file-wide"]);
}

fn prefixed_beside_libc(engine: &[&str]) {
    let program = compile_c("prefixed", "prefixed", &["-O2", "-g", "-rdynamic"], &[]);
    let mut args = engine.to_vec();
    args.extend(["--top", "0", "--", program.to_str().unwrap()]);
    let (out, p) = run_profiled(&args);
    out.assert_exit(0);
    let d = out.describe();
    assert_eq!(p.site("malloc", "c_site"), (7, 168), "{d}");
    assert_eq!(p.doc["meta"]["allocator_family"], "glibc", "{d}");
}

/// Calls and bytes of `func` whose stack passes through `site`.
fn through(p: &Profile, func: &str, site: &str) -> (u64, u64) {
    p.allocs()
        .filter(|s| s.function == func && s.names().contains(&site))
        .fold((0, 0), |(c, b), s| (c + s.calls, b + s.bytes))
}

/// A Rust program whose global allocator is tikv-jemallocator: jemalloc
/// linked into the executable with its API prefixed `_rjem_`, beside
/// glibc's malloc (which C code and the Rust runtime's libc calls still
/// reach). Every call of the program's three sites is counted under the
/// jemalloc entry it reaches (Rust inlines `__rust_alloc` into its
/// callers), by pid and in launch mode, and the header names both.
#[test]
fn a_rust_program_with_jemalloc_from_crates_io() {
    need_bpf!();
    rust_with_jemalloc(&[Run::ByPid, Run::Launch]);
}

/// The same on the host's engine (`--file-wide`, alone).
#[test]
fn a_rust_program_with_jemalloc_from_crates_io_file_wide() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    rust_with_jemalloc(&[Run::FileWide]);
}

/// How [`rust_with_jemalloc`] traces the program.
#[derive(Debug, Clone, Copy)]
enum Run {
    ByPid,
    Launch,
    FileWide,
}

/// The Rust program with jemalloc, traced each way of `runs`.
fn rust_with_jemalloc(runs: &[Run]) {
    let program = rustjem();
    for &run in runs {
        let path = program.to_str().unwrap();
        let (out, p) = match run {
            Run::ByPid => {
                let mut fx = FixtureProc::start(program, &["--wait"]);
                trace_by_pid(&mut fx, &["--top", "0"])
            }
            Run::Launch => run_profiled(&["--top", "0", "--", path]),
            Run::FileWide => run_profiled(&["--file-wide", "--top", "0", "--", path]),
        };
        out.assert_exit(0);
        let d = format!("{run:?}\n{}", out.describe());
        assert_eq!(
            through(&p, "_rjem_malloc", "rustjem::box_site"),
            (100, 4000),
            "{d}"
        );
        assert_eq!(
            through(&p, "_rjem_malloc", "rustjem::vec_site"),
            (50, 50_000),
            "{d}"
        );
        assert_eq!(
            through(&p, "_rjem_calloc", "rustjem::zeroed_site"),
            (20, 6000),
            "{d}"
        );
        assert_eq!(p.doc["meta"]["allocator_family"], "glibc", "{d}");
        let real = std::fs::canonicalize(program).unwrap();
        assert_eq!(
            p.doc["meta"]["allocator_beside"].as_str(),
            Some(format!("jemalloc (_rjem_) in {}", real.display()).as_str()),
            "{d}"
        );
        assert_eq!(
            out.report().probes_also,
            Some(format!("jemalloc (_rjem_) in {}", real.display())),
            "{d}"
        );
        // Count mode: no release function probed, jemalloc's included.
        let probes = p.doc["meta"]["probes"].as_array().unwrap();
        assert!(
            !probes.iter().any(|pr| {
                let f = pr["function"].as_str().unwrap();
                f.contains("free") || f.contains("dallocx") || f.contains("dealloc")
            }),
            "{d}"
        );
    }
}
