//! Python threads, each call under its own thread's frames (200 of them
//! too), a stack too deep to keep, marked where its frames are cut, and
//! code freed as soon as it ran, named all the same.

use std::{fs, path::PathBuf};

use crate::support::python::{
    available, chain_of, run_named, script_chains, write_script, Chain, DEBIAN_PYTHON,
};

/// Three threads allocate at once, each from its own function: each
/// call is under its own thread's Python frames (the thread state is
/// found by thread id: 3.11+ its native id, before that its pthread).
const THREADS_SCRIPT: &str = include_str!("../../fixtures/python/threads.py");

#[test]
fn python_threads_each_under_their_own_frames() {
    let dir = bpf_tempdir!();
    let path = write_script(dir.path(), "threads.py", THREADS_SCRIPT);
    let script = path.to_str().unwrap();
    for (python, minor) in available(vec![
        (PathBuf::from("/usr/bin/python3.11"), 11),
        (PathBuf::from("/root/.pyenv/versions/3.9.18/bin/python3"), 9),
        (
            PathBuf::from("/root/.pyenv/versions/3.13.0/bin/python3"),
            13,
        ),
    ]) {
        let py = python.to_str().unwrap();
        let (out, p) = run_named(&["--", py, script]);
        out.assert_exit(0);
        for (func, line, size, calls) in [
            ("alloc_a", 3, 3001, 1000),
            ("alloc_b", 5, 5001, 2000),
            ("alloc_c", 7, 7001, 3000),
        ] {
            // The comprehension is a frame of its own before 3.12.
            let outer: Chain = vec![(func.into(), line), ("worker".into(), 11)];
            // The blocks of that size (the lists holding them grow too).
            let sum = p
                .allocs()
                .filter(|s| s.bytes == s.calls * size)
                .filter(|s| chain_of(s, script).ends_with(&outer))
                .fold((0, 0), |(c, b), s| (c + s.calls, b + s.bytes));
            assert_eq!(
                sum,
                (calls, calls * size),
                "3.{minor}: {func}'s blocks under its own frames: {:#?}\n{}",
                script_chains(&p, script),
                out.describe()
            );
        }
    }
}

/// More threads than the interpreter's first 64 thread states (the programs
/// once searched no further, and a new thread's state goes first): `old`'s
/// 200 threads allocate in `work` once all of them run, the oldest furthest
/// down the list; 50 `new` threads come and go; then the old ones allocate
/// again, each finding its state again past the ones made since. Every
/// call is under its own thread's Python frames.
const MANY_THREADS_SCRIPT: &str = include_str!("../../fixtures/python/many_threads.py");

#[test]
fn every_one_of_200_python_threads_is_under_its_own_frames() {
    let dir = bpf_tempdir!();
    let path = write_script(dir.path(), "many_threads.py", MANY_THREADS_SCRIPT);
    let script = path.to_str().unwrap();
    let (threads, n) = (200u64, 10u64);
    for (python, minor) in available(vec![
        (PathBuf::from(DEBIAN_PYTHON), 11),
        (PathBuf::from("/root/.pyenv/versions/3.9.18/bin/python3"), 9),
        (
            PathBuf::from("/root/.pyenv/versions/3.13.0/bin/python3"),
            13,
        ),
    ]) {
        let py = python.to_str().unwrap();
        let (out, p) = run_named(&["--", py, script, &threads.to_string(), &n.to_string()]);
        out.assert_exit(0);
        let d = format!("3.{minor}\n{}", out.describe());
        // The blocks of 6001 bytes, by the two innermost Python frames.
        let mut by_chain: std::collections::BTreeMap<Chain, u64> = Default::default();
        for s in p.allocs().filter(|s| s.bytes == s.calls * 6001) {
            let chain: Chain = chain_of(s, script).into_iter().take(2).collect();
            *by_chain.entry(chain).or_default() += s.calls;
        }
        let want: std::collections::BTreeMap<Chain, u64> = [
            (vec![("work".into(), 5), ("old".into(), 9)], threads * n),
            (vec![("work".into(), 5), ("old".into(), 11)], threads * n),
            (
                vec![("work".into(), 5), ("new".into(), 13)],
                threads / 4 * n,
            ),
        ]
        .into_iter()
        .collect();
        assert_eq!(by_chain, want, "{d}");
        let py_q = &p.doc["stack_quality"]["python"];
        assert_eq!(py_q.get("threads_beyond"), None, "{d}");
    }
}

/// A recursion 900 calls deep allocates at its bottom: the stack keeps its
/// 47 innermost Python frames and marks where the others are missing, in
/// the report, the profile and the folded stacks, on 3.11 (few native
/// frames) and 3.9 (an eval loop's native frames per Python call, more
/// than a stack keeps: the Python frames take the place of the outermost).
const DEEP_SCRIPT: &str = include_str!("../../fixtures/python/deep.py");

#[test]
fn a_deep_python_stack_marks_where_its_frames_are_cut() {
    let dir = bpf_tempdir!();
    let path = write_script(dir.path(), "deep.py", DEEP_SCRIPT);
    let script = path.to_str().unwrap();
    let mark = "[Python frames not read]";
    for (python, minor) in available(vec![
        (PathBuf::from(DEBIAN_PYTHON), 11),
        (PathBuf::from("/root/.pyenv/versions/3.9.18/bin/python3"), 9),
    ]) {
        let py = python.to_str().unwrap();
        let folded = dir.path().join(format!("deep-{minor}.folded"));
        let (out, p) = run_named(&[
            "--folded",
            folded.to_str().unwrap(),
            "--",
            py,
            script,
            "321",
        ]);
        out.assert_exit(0);
        let d = format!("3.{minor}\n{}", out.describe());
        let deep: Vec<_> = p.allocs().filter(|s| s.bytes == s.calls * 5001).collect();
        assert_eq!(deep.iter().map(|s| s.calls).sum::<u64>(), 321, "{d}");
        for s in &deep {
            let names = s.names();
            // leaf, 46 of down's frames, then the mark.
            let at = names.iter().position(|n| *n == mark);
            let chain = chain_of(s, script);
            assert_eq!(chain.len(), 47, "{names:?}\n{d}");
            assert_eq!(chain[0], ("leaf".into(), 5), "{d}");
            assert_eq!(chain[1], ("down".into(), 9), "{d}");
            assert!(chain[1..].iter().all(|f| f.0 == "down"), "{chain:?}");
            let last = names.iter().rposition(|n| *n == "down").unwrap();
            assert_eq!(
                at,
                Some(last + 1),
                "the mark right after the frames kept: {names:?}"
            );
        }
        assert!(out.stdout.contains(&format!("    {mark}\n")), "{d}");
        let folded = fs::read_to_string(&folded).unwrap();
        let marked: u64 = folded
            .lines()
            .filter(|l| l.contains(&format!("{mark};down;")) && l.contains(";leaf;"))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok())
            .sum();
        assert!(marked >= 321, "folded stacks:\n{folded}");
        let cut = p.doc["stack_quality"]["python"]["cut"].as_u64().unwrap();
        assert!(cut >= 321, "{d}");
    }
}

/// A module's body runs once, at its import, and its code object is
/// freed as the import ends; the compiles after it take its memory. The
/// kernel copies a code object as it first stores a stack holding it, so
/// the module's frame is named on both engines however late the tracer
/// reads: its 777 blocks (3,001 bytes each) under `<module>` at line 3 of
/// the module, called from line 3 of the script that imports it.
#[test]
fn code_freed_at_once_is_named_from_the_kernels_copy() {
    let dir = host_tempdir!();
    let module = write_script(dir.path(), "shortlived.py", SHORTLIVED);
    let main = write_script(dir.path(), "imports_shortlived.py", IMPORTS_SHORTLIVED);
    let (module, main) = (module.to_str().unwrap(), main.to_str().unwrap());
    let d = dir.path().to_str().unwrap();
    for (python, _) in available(vec![
        (PathBuf::from(DEBIAN_PYTHON), 11),
        (PathBuf::from("/root/.pyenv/versions/3.9.18/bin/python3"), 9),
        (
            PathBuf::from("/root/.pyenv/versions/3.12.1/bin/python3"),
            12,
        ),
    ]) {
        let py = python.to_str().unwrap();
        for engine in [&[][..], &["--file-wide"][..]] {
            let mut args = engine.to_vec();
            args.extend(["--", py, main, d]);
            let (out, p) = crate::support::run_profiled(&args);
            out.assert_exit(0);
            let what = format!("{args:?}\n{}", out.describe());
            let blocks: Vec<_> = p
                .allocs()
                .filter(|s| s.bytes == s.calls * 3001 && s.calls > 0)
                .collect();
            let named: u64 = blocks
                .iter()
                .filter(|s| {
                    chain_of(s, module) == vec![("<module>".to_string(), 3)]
                        && chain_of(s, main) == vec![("<module>".to_string(), 3)]
                })
                .map(|s| s.calls)
                .sum();
            assert_eq!(named, 777, "{what}\n{blocks:#?}");
        }
    }
}

const SHORTLIVED: &str = include_str!("../../fixtures/python/shortlived.py");
const IMPORTS_SHORTLIVED: &str = include_str!("../../fixtures/python/imports_shortlived.py");
