//! Python scripts the tests run (tests/fixtures/python/*.py) and their
//! frames in a profile: the chain script and its count, the interpreters
//! of a list this machine has, a launch run again when code objects went
//! unnamed.

use std::{
    fs,
    path::{Path, PathBuf},
};

use super::{mtrace::Finished, profile::Stack, require, run_profiled, Profile};

/// The script: `leaf` allocates a 4000-byte bytearray (one malloc of
/// 4001 bytes, past pymalloc's 512) `N` times, called from `mid`, from
/// `Outer.run`, from the module. With `wait`, it says `ready` and waits
/// for a byte on stdin first (to be attached by pid).
const SCRIPT: &str = include_str!("../../fixtures/python/alloc_chain.py");

/// How many times the chain script's `leaf` allocates.
pub const N: u64 = 1234;

/// Code objects of the scripts among `args` (words ending in `.py`) that
/// a profile could not name: the `[python code 0x...]` frames of the
/// stacks that hold a frame of one of them.
pub fn unnamed_in_scripts(p: &Profile, args: &[&str]) -> usize {
    let scripts: Vec<&str> = args
        .iter()
        .flat_map(|a| a.split_whitespace())
        .filter(|w| w.ends_with(".py"))
        .collect();
    p.stacks
        .iter()
        .filter(|s| {
            s.frames.iter().any(|f| {
                f.file
                    .as_deref()
                    .is_some_and(|file| scripts.contains(&file))
            })
        })
        .flat_map(|s| &s.frames)
        .filter(|f| f.function.starts_with("[python code "))
        .count()
}

/// A launch of a short script, run again (five times at most) when a
/// stack of the script holds a code object the tracer could not name:
/// the tracer names a stack's code objects as the stack first appears,
/// on a thread of its own; one starved of CPU (the tests beside it) for
/// as long as the script runs finds them freed, and says so (`python:
/// code unnamed N`). Naming itself is what the tests check, not the race.
/// (The interpreter's own short-lived code, a module's body run once at
/// its import, is freed within microseconds; its frames unnamed are
/// counted, and are not the script's.)
pub fn run_named(args: &[&str]) -> (Finished, Profile) {
    let mut run = run_profiled(args);
    for _ in 0..5 {
        let unnamed = unnamed_in_scripts(&run.1, args);
        if unnamed == 0 {
            break;
        }
        eprintln!("{args:?}: {unnamed} frames of the script unnamed, run again");
        run = run_profiled(args);
    }
    run
}

/// Those of `list` (path, minor version) this machine has; a missing one
/// is skipped, or under CI a failure.
pub fn available(list: Vec<(PathBuf, u8)>) -> Vec<(PathBuf, u8)> {
    list.into_iter()
        .filter(|(python, _)| require(python.exists(), &format!("{} is missing", python.display())))
        .collect()
}

/// The chain script ([`SCRIPT`]) written to `dir`.
pub fn script(dir: &Path) -> PathBuf {
    write_script(dir, "alloc_chain.py", SCRIPT)
}

/// `text` written to `dir/name`.
pub fn write_script(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, text).unwrap();
    path
}

/// A stack's frames in the script, as (function, line), innermost first.
pub type Chain = Vec<(String, u64)>;

/// A stack's frames in `script`.
pub fn chain_of(s: &Stack, script: &str) -> Chain {
    s.frames
        .iter()
        .filter(|f| f.file.as_deref() == Some(script))
        .map(|f| (f.function.clone(), f.line.unwrap_or(0)))
        .collect()
}

/// The Python frames of the stacks that pass through the script, with
/// the calls and bytes under them summed.
pub fn script_chains(p: &Profile, script: &str) -> Vec<(Chain, u64, u64)> {
    let mut out: Vec<(Chain, u64, u64)> = Vec::new();
    for s in p.allocs() {
        let chain = chain_of(s, script);
        if chain.is_empty() {
            continue;
        }
        match out.iter_mut().find(|(c, _, _)| *c == chain) {
            Some(e) => {
                e.1 += s.calls;
                e.2 += s.bytes;
            }
            None => out.push((chain, s.calls, s.bytes)),
        }
    }
    out
}

/// How many lines mtrace wrote on stderr that contain every one of
/// `words`.
pub fn stderr_lines_with(out: &Finished, words: &[&str]) -> usize {
    out.stderr
        .iter()
        .filter(|l| words.iter().all(|w| l.contains(w)))
        .count()
}

/// Debian's python3.11 (stripped, PGO and LTO: its allocator copied
/// into its callers).
pub const DEBIAN_PYTHON: &str = "/usr/bin/python3.11";
