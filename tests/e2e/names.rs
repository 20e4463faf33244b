//! Names the traced process chooses (its executable's name, its
//! arguments, its threads' names) cannot drive the terminal of whoever
//! runs mtrace: every character a terminal acts on reaches stdout and
//! stderr escaped (`\u{1b}`), while the JSON profile keeps the names as
//! they were, with the counts exact. A C function's name is its own,
//! never demangled as if it were a C++ type code.

use crate::support::{
    fixtures::{compile_c, copy_executable},
    run_profiled,
};

/// What a terminal acts on: escape, bell, carriage return.
const ACTIVE: [char; 3] = ['\x1b', '\x07', '\r'];

#[test]
fn escape_sequences_from_the_target_are_printed_escaped() {
    let dir = host_tempdir!();
    let built = compile_c("names", "names", &["-O1", "-g", "-pthread"], &[]);
    // A title-setting sequence in the executable's name (its comm).
    let program = copy_executable(&built, dir.path(), "n\x1b]0;pwned\x07");
    let program = program.to_str().unwrap();
    // Both engines: the process's own probes, and the host engine's.
    for engine in [&[][..], &["--file-wide"][..]] {
        let mut args = engine.to_vec();
        args.extend([
            "--per-thread",
            "--top",
            "0",
            "--",
            program,
            "\x1b[2J\rclear",
        ]);
        let (out, p) = run_profiled(&args);
        out.assert_exit(0);
        let d = format!("{engine:?}\n{}", out.describe());
        let stderr = out.stderr.join("\n");
        for c in ACTIVE {
            assert!(!out.stdout.contains(c), "{c:?} on stdout\n{d}");
            assert!(!stderr.contains(c), "{c:?} on stderr\n{d}");
        }
        // What the terminal shows instead: the escapes, legibly.
        assert!(
            out.stdout.contains(r"\u{1b}]0;t\u{7}\u{d}"),
            "the thread's name, escaped\n{d}"
        );
        assert!(
            out.stdout.contains(r"\u{1b}[2J\u{d}clear"),
            "the argument, escaped\n{d}"
        );
        assert!(
            stderr.contains(r"(n\u{1b}]0;pwned\u{7}"),
            "the command name on the tracing line, escaped\n{d}"
        );
        // The profile keeps the names as the target set them, counts exact.
        assert_eq!(p.site("malloc", "thread_site"), (7, 7 * 48), "{d}");
        assert_eq!(p.site("malloc", "main_site"), (5, 5 * 40), "{d}");
        let thread = p.stacks_at("malloc", "thread_site")[0]
            .thread
            .clone()
            .expect("per thread");
        assert_eq!(thread.name, "\x1b]0;t\x07\r", "{d}");
    }
}

/// A program run through a symbolic link beside it (as Debian's
/// `redis-server` -> `redis-check-rdb`) is named as the command named it:
/// its frames' object is the link, not the file the link points to.
#[test]
fn a_program_run_through_a_symlink_is_named_by_the_link() {
    let dir = bpf_tempdir!();
    let real = crate::support::copy_executable(
        crate::support::Fixture::Counts.path(),
        dir.path(),
        "counts-real",
    );
    let link = dir.path().join("counts-alias");
    std::os::unix::fs::symlink("counts-real", &link).unwrap();
    let (out, p) = crate::support::run_profiled(&["--", link.to_str().unwrap()]);
    out.assert_exit(0);
    let modules: std::collections::BTreeSet<&str> = p
        .allocs()
        .flat_map(|s| s.frames.iter())
        .filter_map(|f| f.module.as_deref())
        .filter(|m| m.starts_with(dir.path().to_str().unwrap()))
        .collect();
    assert_eq!(
        modules.into_iter().collect::<Vec<_>>(),
        [link.to_str().unwrap()],
        "{}",
        out.describe()
    );
    assert!(real.exists());
}

/// C functions named `a`, `b`, `d`, `i` and `v` (C++'s codes of signed
/// char, bool, double, int and void) are named so in the profile, and
/// no frame is named as a type, each with its one malloc
/// (tests/fixtures/shortnames.c).
#[test]
fn c_functions_named_like_cxx_type_codes_keep_their_names() {
    need_bpf!();
    let program = compile_c("shortnames", "shortnames", &["-O2", "-g"], &[]);
    let (out, p) = run_profiled(&["--", program.to_str().unwrap()]);
    out.assert_exit(0);
    let d = format!("{}\n{}", out.describe(), p.dump());
    for (name, size) in [("a", 10), ("b", 20), ("d", 30), ("i", 40), ("v", 50)] {
        assert_eq!(p.site("malloc", name), (1, size), "{name}\n{d}");
    }
    for s in p.allocs() {
        for wrong in ["signed char", "bool", "double", "int", "void"] {
            assert!(!s.names().contains(&wrong), "{wrong} as a frame\n{d}");
        }
    }
}
