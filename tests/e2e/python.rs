//! Python frames in the stacks: every CPython this machine kind has
//! (Debian's stripped python3.11 with libpython linked in, pyenv's 3.8 to
//! 3.13 with a shared libpython), traced from launch and by pid. The
//! script allocates a known number of blocks from a known Python line
//! through a known chain of Python calls; the stacks must name those
//! functions and lines, in order, with the exact count.
//!
//! This file holds the chain across versions, by launch and by pid, and
//! what is said of an interpreter whose frames cannot be read;
//! `stacks` holds threads and a stack too deep to keep, `objects`
//! `--python-objects` and live mode, `oracles` memray and py-spy, `host`
//! the host engine (`--file-wide --`, `--all`). The
//! scripts are tests/fixtures/python/*.py; the helpers they share are
//! support/python.rs.

mod host;
mod objects;
mod oracles;
mod stacks;

use std::path::PathBuf;

use crate::support::{
    python::{available, run_named, script, script_chains, stderr_lines_with, Chain, N},
    require, run_profiled, trace_by_pid, FixtureProc, Profile,
};

/// Each Python frame of the chain, innermost first: (name, line) where
/// 3.11+ names methods by qualified name.
fn expected(minor: u8) -> Chain {
    let run = if minor >= 11 { "Outer.run" } else { "run" };
    vec![
        ("leaf".into(), 3),
        ("mid".into(), 5),
        (run.into(), 10),
        ("<module>".into(), 15),
    ]
}

/// The interpreters to try: (path, minor version).
fn interpreters() -> Vec<(PathBuf, u8)> {
    let mut out = vec![(PathBuf::from("/usr/bin/python3.11"), 11)];
    for (v, minor) in [
        ("3.8.18", 8),
        ("3.9.18", 9),
        ("3.10.13", 10),
        ("3.11.7", 11),
        ("3.12.1", 12),
        ("3.13.0", 13),
    ] {
        out.push((
            PathBuf::from(format!("/root/.pyenv/versions/{v}/bin/python3")),
            minor,
        ));
    }
    out
}

/// The chain from `leaf` has exactly `N` calls of 4001 bytes, with the
/// expected frames, and no stack names the script with a wrong line.
fn assert_chain(p: &Profile, script: &str, minor: u8, what: &str) {
    let chains = script_chains(p, script);
    let want = expected(minor);
    let leaf: Vec<_> = chains
        .iter()
        .filter(|(c, _, _)| c.first().is_some_and(|f| f.0 == "leaf"))
        .collect();
    assert_eq!(
        leaf.len(),
        1,
        "{what}: one stack through leaf expected, got {chains:#?}"
    );
    let (chain, calls, bytes) = leaf[0];
    assert_eq!(chain, &want, "{what}: Python frames");
    assert_eq!((*calls, *bytes), (N, N * 4001), "{what}: calls and bytes");
    // The report counts them among the stacks that carry Python frames.
    let py = &p.doc["stack_quality"]["python"];
    let with = py["with_frames"].as_u64().expect("stack_quality.python");
    assert!(with >= N, "{what}: {py}");
    // Python frames take the eval loop's place: none is left where the
    // script's frames are.
    for s in p.allocs() {
        if s.frames.iter().any(|f| f.function == "leaf") {
            let names = s.names();
            let at = names.iter().position(|n| *n == "leaf").unwrap();
            assert!(
                names[..at].iter().all(|n| *n != "_PyEval_EvalFrameDefault"),
                "{what}: an eval-loop frame inside leaf: {names:?}"
            );
        }
    }
}

#[test]
fn python_frames_from_launch_every_version() {
    let dir = bpf_tempdir!();
    let path = script(dir.path());
    let script = path.to_str().unwrap();
    let n = N.to_string();
    for (python, minor) in available(interpreters()) {
        let py = python.to_str().unwrap();
        let (out, p) = run_named(&["--", py, script, &n]);
        out.assert_exit(0);
        assert_chain(
            &p,
            script,
            minor,
            &format!("{py} from launch\n{}", out.describe()),
        );
    }
}

#[test]
fn python_frames_by_pid() {
    let dir = bpf_tempdir!();
    let path = script(dir.path());
    let script = path.to_str().unwrap();
    let n = N.to_string();
    for (python, minor) in available(vec![
        (PathBuf::from("/usr/bin/python3.11"), 11),
        (
            PathBuf::from("/root/.pyenv/versions/3.12.1/bin/python3"),
            12,
        ),
        (PathBuf::from("/root/.pyenv/versions/3.9.18/bin/python3"), 9),
    ]) {
        let mut fx = FixtureProc::start(&python, &[script, &n, "wait"]);
        let (out, p) = trace_by_pid(&mut fx, &[]);
        assert_chain(
            &p,
            script,
            minor,
            &format!("{} by pid\n{}", python.display(), out.describe()),
        );
    }
}

/// An interpreter stripped of its own symbols, with no debug file where
/// debuggers look (Debian's python3.11 without python3.11-dbg, here a
/// copy without its build id and debug link, so that no installed debug
/// file can match it): its Python frames are read all the same, and the
/// report says why its C frames are addresses and what names them. One
/// with symbols (pyenv's) says nothing of the kind.
#[test]
fn stripped_python_says_what_names_its_frames() {
    let dir = bpf_tempdir!();
    let path = script(dir.path());
    let script = path.to_str().unwrap();
    let n = N.to_string();
    let debian = std::path::Path::new("/usr/bin/python3.11");
    let pyenv = std::path::Path::new("/root/.pyenv/versions/3.11.7/bin/python3");
    if !require(debian.exists(), "Debian's python3.11 is missing")
        || !require(pyenv.exists(), "pyenv's 3.11.7 is missing")
    {
        return;
    }
    let copy = dir.path().join("python3.11");
    let objcopy = std::process::Command::new("objcopy")
        .args(["--remove-section", ".note.gnu.build-id"])
        .args(["--remove-section", ".gnu_debuglink"])
        .arg(debian)
        .arg(&copy)
        .status()
        .expect("objcopy (binutils)");
    assert!(objcopy.success());
    let said = |p: &Profile| p.doc["meta"]["python"].as_str().unwrap_or("").to_string();

    let (out, p) = run_named(&["--", copy.to_str().unwrap(), script, &n]);
    out.assert_exit(0);
    assert_chain(
        &p,
        script,
        11,
        &format!("stripped copy\n{}", out.describe()),
    );
    let line = said(&p);
    assert!(
        line.contains("stripped, no debug file installed")
            && line.contains("python3.11-dbg of the same version names them"),
        "{line}"
    );
    assert!(out.stdout.contains(&line), "{}", out.describe());

    let (out, p) = run_named(&["--", pyenv.to_str().unwrap(), script, &n]);
    out.assert_exit(0);
    let line = said(&p);
    assert!(line.starts_with("CPython 3.11 in "), "{line}");
    assert!(!line.contains("stripped"), "{line}");
}

/// An interpreter whose frames mtrace does not know: one line says so, the
/// stacks are native, the counts exact.
#[test]
fn unknown_python_version_says_so_and_keeps_native_stacks() {
    let dir = bpf_tempdir!();
    let path = script(dir.path());
    let script = path.to_str().unwrap();
    let python = "/root/.pyenv/versions/3.7.16/bin/python3";
    if !require(
        std::path::Path::new(python).exists(),
        "pyenv's 3.7 is missing",
    ) {
        return;
    }
    let n = N.to_string();
    let (out, p) = run_named(&["--", python, script, &n]);
    out.assert_exit(0);
    let said: Vec<_> = out
        .stderr
        .iter()
        .filter(|l| l.contains("Python 3.7") && l.contains("native frames only"))
        .collect();
    assert_eq!(said.len(), 1, "{}", out.describe());
    assert!(script_chains(&p, script).is_empty(), "{}", out.describe());
    // The blocks are all there, under the eval loop's frames.
    let calls: u64 = p
        .allocs()
        .filter(|s| s.bytes == s.calls * 4001)
        .map(|s| s.calls)
        .sum();
    assert!(calls >= N, "{}", out.describe());
}

/// A program that defines `_PyRuntime` and `Py_Version` (3.11) but is no
/// Python: what its `_PyRuntime` holds is not an interpreter's state
/// (bytes of 0x41 from launch, written after mtrace attached; its own
/// address in every word by pid, written before), on both engines. One
/// line says so, the report's header says the same, no stack is counted
/// as "not a Python thread", and the calls are counted exactly, natively.
#[test]
fn a_python_runtime_that_cannot_be_read_is_said_once() {
    let dir = host_tempdir!();
    let built = crate::support::fixtures::compile_c(
        "fakepython",
        "fakepython",
        &["-O2", "-fno-omit-frame-pointer", "-g"],
        &[],
    );
    let fake = crate::support::fixtures::copy_executable(&built, dir.path(), "python3.11");
    let check = |out: &crate::support::mtrace::Finished, p: &Profile, how: &str| {
        let d = format!("{how}\n{}", out.describe());
        let said = stderr_lines_with(out, &["could not be read", "_PyRuntime"]);
        assert_eq!(said, 1, "{d}");
        let header = p.doc["meta"]["python"].as_str().unwrap_or("");
        assert!(
            header.starts_with("CPython 3.11 in ")
                && header.contains("its interpreter state (_PyRuntime) could not be read (")
                && header.ends_with("): native frames only"),
            "{header}\n{d}"
        );
        assert!(out.stdout.contains(&format!("python: {header}")), "{d}");
        assert!(!out.stdout.contains("not a Python thread"), "{d}");
        assert!(p.doc["stack_quality"].get("python").is_none(), "{d}");
        let calls: u64 = p
            .allocs()
            .filter(|s| s.bytes == s.calls * 777)
            .map(|s| s.calls)
            .sum();
        assert_eq!(calls, 1000, "{d}");
        assert!(
            p.allocs()
                .filter(|s| s.bytes == s.calls * 777)
                .all(|s| s.names().contains(&"alloc_one")),
            "{d}"
        );
    };
    let (out, p) = run_profiled(&["--", fake.to_str().unwrap(), "junk"]);
    out.assert_exit(0);
    check(&out, &p, "from launch, 0x41 throughout");
    // The host engine: judged while the program is held at its exit.
    let (out, p) = run_profiled(&["--file-wide", "--", fake.to_str().unwrap(), "junk"]);
    out.assert_exit(0);
    check(&out, &p, "--file-wide from launch, 0x41 throughout");
    let mut fx = FixtureProc::start(&fake, &["self", "wait"]);
    let (out, p) = trace_by_pid(&mut fx, &[]);
    check(&out, &p, "by pid, its own address throughout");
}
