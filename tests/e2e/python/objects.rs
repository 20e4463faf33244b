//! Python's small objects (`--python-objects`) and live mode by line:
//! a leak by line; objects counted as tracemalloc counts them, on
//! pyenv's interpreters and on Debian's 3.11, whose inlined copies of
//! pymalloc are probed at their guards, counted and live.

use std::path::PathBuf;

use crate::support::{
    mtrace::mtrace_command,
    python::{
        available, chain_of, run_named, script_chains, stderr_lines_with, write_script, Chain,
        DEBIAN_PYTHON,
    },
    require, trace_by_pid, FixtureProc, Mtrace, Profile,
};

/// Live mode: a leak by Python line. `leak` keeps one block in ten, `temp`
/// frees each at once (`os._exit`: no finalization frees the kept ones
/// at the end); the module's code is named as the script's own (on
/// Debian's 3.11, the code object of a `<string>` module run at start-up,
/// freed, lay at the same address with the same first line: its name
/// must not stick).
const LEAK_SCRIPT: &str = include_str!("../../fixtures/python/leaky.py");

#[test]
fn python_leaks_by_line_in_live_mode() {
    let dir = bpf_tempdir!();
    let path = write_script(dir.path(), "leaky.py", LEAK_SCRIPT);
    let script = path.to_str().unwrap();
    for (python, minor) in available(vec![
        (PathBuf::from("/usr/bin/python3.11"), 11),
        (
            PathBuf::from("/root/.pyenv/versions/3.12.1/bin/python3"),
            12,
        ),
    ]) {
        let py = python.to_str().unwrap();
        let (out, p) = run_named(&["--live", "--", py, script, "12340"]);
        out.assert_exit(0);
        let d = format!("3.{minor}\n{}", out.describe());
        // Every stack under the function's Python chain whose blocks are
        // all of its size: one whole stack, and under load perhaps more
        // whose native frames were cut short (a walk handed to the tracer
        // that found its ring full: counted as `copy_lost`, shown).
        let at = |func: &str, line: u64, size: u64| {
            let want: Chain = vec![
                (func.into(), if func == "leak" { 4 } else { 6 }),
                ("main".into(), line),
                ("<module>".into(), 12),
            ];
            let stacks: Vec<_> = p
                .allocs()
                .filter(|s| s.bytes == s.calls * size && chain_of(s, script) == want)
                .collect();
            assert!(
                stacks.iter().filter(|s| !s.truncated).count() == 1
                    && stacks.iter().filter(|s| s.truncated).count()
                        <= p.doc["stack_quality"]["truncated"]["copy_lost"]
                            .as_u64()
                            .unwrap_or(0) as usize,
                "{func}: {:#?}\n{d}",
                script_chains(&p, script)
            );
            let sum = |field: &str| -> u64 {
                stacks
                    .iter()
                    .map(|s| {
                        s.live.as_ref().expect("live statistics")[field]
                            .as_u64()
                            .unwrap()
                    })
                    .sum()
            };
            (sum("allocations"), sum("outstanding"))
        };
        assert_eq!(at("leak", 11, 2001), (1234, 1234), "{d}");
        assert_eq!(at("temp", 9, 3001), (12340, 0), "{d}");
    }
}

/// `--python-objects`: objects of up to 512 bytes, which never reach
/// malloc, counted by Python line. `make_objs` makes 1000 objects of a
/// class with no `__dict__` (one PyObject_Malloc each; `repeat` makes no
/// int objects), `big_buffers` 37 bytearrays of 100000 bytes (the object,
/// then its buffer of 100001 bytes through PyObject_Realloc, which falls
/// through to malloc: counted once), `grow` a list by 5000 appends (its
/// resizes at line 11, through PyMem_Realloc). Run with `oracle`, the script counts
/// the same blocks with tracemalloc and prints them, and an object's size;
/// with `wait`, it says `ready` and waits for a byte on stdin first; with
/// `exit`, it ends without freeing what it keeps (`os._exit`).
const OBJECTS_SCRIPT: &str = include_str!("../../fixtures/python/objects.py");

/// What tracemalloc counts running the script in its oracle mode: Obj
/// blocks at line 5, buffers at line 7, and an Obj block's size.
fn tracemalloc_counts(py: &str, script: &str) -> Vec<u64> {
    let oracle = std::process::Command::new(py)
        .args([script, "oracle"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&oracle.stdout);
    let counts: Vec<u64> = said
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(counts[..2], [1000, 37], "tracemalloc under {py}: {said}");
    counts
}

/// Calls of `func` (any allocator function when empty) whose innermost
/// frame in the script is at `line`, with `size` bytes each when given:
/// of the stack with most of them (the line's iterator, say, is one more
/// block of an object's size, made once through another stack).
fn calls_at(p: &Profile, script: &str, func: &str, line: u64, size: Option<u64>) -> u64 {
    p.allocs()
        .filter(|s| func.is_empty() || s.function == func)
        .filter(|s| size.is_none_or(|n| s.bytes == s.calls * n))
        .filter(|s| chain_of(s, script).first().is_some_and(|f| f.1 == line))
        .map(|s| s.calls)
        .max()
        .unwrap_or(0)
}

/// Resizing calls (`PyObject_Realloc`, `PyMem_Realloc`, `realloc`) whose
/// innermost frame in the script is at `line`, over every stack.
fn resizes_at(p: &Profile, script: &str, line: u64) -> u64 {
    p.allocs()
        .filter(|s| s.function.ends_with("Realloc") || s.function == "realloc")
        .filter(|s| chain_of(s, script).first().is_some_and(|f| f.1 == line))
        .map(|s| s.calls)
        .sum()
}

#[test]
fn python_objects_counted_by_line_as_tracemalloc_counts_them() {
    let dir = bpf_tempdir!();
    let path = write_script(dir.path(), "objects.py", OBJECTS_SCRIPT);
    let script = path.to_str().unwrap();
    let pyenv = |v: &str| PathBuf::from(format!("/root/.pyenv/versions/{v}/bin/python3"));
    for (python, v) in available(vec![(pyenv("3.12.1"), 12), (pyenv("3.9.18"), 9)]) {
        let py = python.to_str().unwrap();
        let counts = tracemalloc_counts(py, script);
        let (out, p) = run_named(&["--python-objects", "--", py, script]);
        out.assert_exit(0);
        let d = format!("3.{v}\n{}", out.describe());
        assert_eq!(
            calls_at(&p, script, "PyObject_Malloc", 5, Some(counts[2])),
            counts[0],
            "{d}"
        );
        // The buffers once each, under PyObject_Realloc, never again as the
        // malloc it made.
        assert_eq!(calls_at(&p, script, "", 7, Some(100_001)), counts[1], "{d}");
        assert_eq!(
            calls_at(&p, script, "PyObject_Realloc", 7, Some(100_001)),
            counts[1],
            "{d}"
        );
    }
}

/// The objects script in `dir` and what tracemalloc counts of it under
/// [`DEBIAN_PYTHON`] (`None`: that interpreter is missing, outside CI).
fn debian_objects_script(dir: &std::path::Path) -> Option<(PathBuf, Vec<u64>)> {
    let path = write_script(dir, "objects.py", OBJECTS_SCRIPT);
    if !require(
        std::path::Path::new(DEBIAN_PYTHON).exists(),
        "Debian's python3.11 is missing",
    ) {
        return None;
    }
    let counts = tracemalloc_counts(DEBIAN_PYTHON, path.to_str().unwrap());
    Some((path, counts))
}

/// Debian's python3.11 (PGO and LTO, stripped) copies pymalloc into its
/// callers behind a guard on the allocator's function pointer: with
/// `--python-objects` the copies are probed at their guards, and the
/// objects are counted by line as tracemalloc counts them, from launch
/// and by pid (a process started before mtrace, without flags); the
/// buffers over 512 bytes once each, as the malloc they make; the list's
/// resizes (copies of `_PyObject_Realloc`, whose calls of `realloc` are
/// their own) as many as `PYTHONMALLOC=malloc` makes of `realloc` there.
/// One line says what is still not seen. Under `PYTHONMALLOC=malloc`
/// every object goes through malloc and is counted by line without the
/// flag.
#[test]
fn debian_python_objects_in_inlined_copies() {
    let dir = bpf_tempdir!();
    let Some((path, counts)) = debian_objects_script(dir.path()) else {
        return;
    };
    let (script, py) = (path.to_str().unwrap(), DEBIAN_PYTHON);
    let json = dir.path().join("m.json");
    let mut cmd = mtrace_command(&["-o", json.to_str().unwrap(), "--", py, script]);
    cmd.env("PYTHONMALLOC", "malloc");
    let out = Mtrace::spawn(&mut cmd).finish();
    let through_malloc = Profile::load(&json);
    out.assert_exit(0);
    let d = out.describe();
    assert_eq!(
        calls_at(&through_malloc, script, "malloc", 5, Some(counts[2])),
        counts[0],
        "{d}"
    );
    assert_eq!(
        calls_at(&through_malloc, script, "", 7, Some(100_001)),
        counts[1],
        "{d}"
    );
    let resizes = resizes_at(&through_malloc, script, 11);
    assert!(resizes > 10, "{d}");
    let check = |out: &crate::support::mtrace::Finished, p: &Profile, how: &str| {
        let d = format!("{how}\n{}", out.describe());
        let said = stderr_lines_with(out, &["--python-objects", "copies probed at their guards"]);
        assert_eq!(said, 1, "{d}");
        assert_eq!(
            calls_at(p, script, "PyObject_Malloc", 5, Some(counts[2])),
            counts[0],
            "{d}"
        );
        assert_eq!(calls_at(p, script, "", 7, Some(100_001)), counts[1], "{d}");
        assert_eq!(resizes_at(p, script, 11), resizes, "{d}");
    };
    let (out, p) = run_named(&["--python-objects", "--", py, script]);
    out.assert_exit(0);
    check(&out, &p, "from launch");
    let mut fx = FixtureProc::start(std::path::Path::new(py), &[script, "wait"]);
    let (out, p) = trace_by_pid(&mut fx, &["--python-objects"]);
    check(&out, &p, "by pid");
}

/// Live statistics (allocations, outstanding) over the stacks of `func`
/// (any: "") whose innermost frame in the script is at `line` and whose
/// blocks are all of `size` bytes (any size: `None`).
fn live_at(p: &Profile, script: &str, func: &str, line: u64, size: Option<u64>) -> (u64, u64) {
    p.allocs()
        .filter(|s| func.is_empty() || s.function == func)
        .filter(|s| size.is_none_or(|n| s.bytes == s.calls * n))
        .filter(|s| chain_of(s, script).first().is_some_and(|f| f.1 == line))
        .map(|s| {
            let live = s.live.as_ref().expect("live statistics");
            let n = |f: &str| live[f].as_u64().unwrap();
            (n("allocations"), n("outstanding"))
        })
        .fold((0, 0), |(a, o), (x, y)| (a + x, o + y))
}

/// Live mode with `--python-objects` on Debian's python3.11, whose copies
/// of pymalloc in their callers have no return to probe: each copy's
/// block is taken where its code meets the path of the call through the
/// pointer it guards, its frees at the guards of the copies of free, and
/// its resizes where pymalloc moves a block. From launch and by pid (a
/// process started before mtrace, without flags), the 1,000 objects are
/// outstanding at their line as tracemalloc counts them, the 37 buffers
/// once each, and of the list grown at line 11 its last array alone
/// (every array it outgrew seen released). From launch, no free is of a
/// block not seen allocated, none missed, no copy's call left unfinished.
#[test]
fn debian_python_objects_live_by_line() {
    let dir = bpf_tempdir!();
    let Some((path, counts)) = debian_objects_script(dir.path()) else {
        return;
    };
    let (script, py) = (path.to_str().unwrap(), DEBIAN_PYTHON);
    let check = |out: &crate::support::mtrace::Finished, p: &Profile, launched: bool| {
        let d = format!("launched {launched}\n{}", out.describe());
        let said = stderr_lines_with(
            out,
            &["--python-objects", "followed to where their block is known"],
        );
        assert_eq!(said, 1, "{d}");
        assert_eq!(
            live_at(p, script, "PyObject_Malloc", 5, Some(counts[2])),
            (counts[0], counts[0]),
            "{d}"
        );
        assert_eq!(
            live_at(p, script, "", 7, Some(100_001)),
            (counts[1], counts[1]),
            "{d}"
        );
        let (grown, kept) = live_at(p, script, "", 11, None);
        assert!(grown > 10 && kept == 1, "{grown} {kept}\n{d}");
        let live = &p.doc["live"];
        let n = |f: &str| live[f].as_u64().unwrap_or(u64::MAX);
        assert_eq!((n("stale"), n("inline_unfinished")), (0, 0), "{d}");
        if launched {
            assert_eq!(n("frees_unknown"), 0, "{d}");
        }
    };
    let (out, p) = run_named(&["--live", "--python-objects", "--", py, script, "exit"]);
    out.assert_exit(0);
    check(&out, &p, true);
    let mut fx = FixtureProc::start(std::path::Path::new(py), &[script, "wait", "exit"]);
    let (out, p) = trace_by_pid(&mut fx, &["--live", "--python-objects"]);
    check(&out, &p, false);
}
