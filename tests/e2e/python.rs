//! Python frames in the stacks: every CPython this machine kind has
//! (Debian's stripped python3.11 with libpython linked in, pyenv's 3.8 to
//! 3.13 with a shared libpython), traced from launch and by pid. The
//! script allocates a known number of blocks from a known Python line
//! through a known chain of Python calls; the stacks must name those
//! functions and lines, in order, with the exact count.

use std::{fs, path::PathBuf};

use crate::support::{
    mtrace::mtrace_command, profile::Stack, require, run_profiled, trace_by_pid, FixtureProc,
    Mtrace, Profile,
};

/// The script: `leaf` allocates a 4000-byte bytearray (one malloc of
/// 4001 bytes, past pymalloc's 512) `N` times, called from `mid`, from
/// `Outer.run`, from the module. With `wait`, it says `ready` and waits
/// for a byte on stdin first (to be attached by pid).
const SCRIPT: &str = "\
import sys
def leaf():
    return bytearray(4000)
def mid(i):
    return leaf()
class Outer:
    def run(self, n):
        keep = []
        for i in range(n):
            keep.append(mid(i))
        return keep
if len(sys.argv) > 2:
    print('ready', flush=True)
    sys.stdin.read(1)
Outer().run(int(sys.argv[1]))
";

const N: u64 = 1234;

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

/// A launch of a short script, run again (twice at most) when its report
/// counts code objects it could not name: the tracer names a stack's code
/// objects as the stack first appears, on a thread of its own; one starved
/// of CPU (the tests beside it) for as long as the script runs finds them
/// freed by the interpreter's finalization, and says so (`python: code
/// unnamed N`). Naming itself is what the tests check, not the race.
fn run_named(args: &[&str]) -> (crate::support::mtrace::Finished, Profile) {
    let unnamed = |p: &Profile| {
        p.doc["stack_quality"]["python"]["unnamed"]
            .as_u64()
            .unwrap_or(0)
    };
    let mut run = run_profiled(args);
    for _ in 0..2 {
        if unnamed(&run.1) == 0 {
            break;
        }
        eprintln!(
            "{args:?}: {} code objects unnamed, run again",
            unnamed(&run.1)
        );
        run = run_profiled(args);
    }
    run
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

/// Those of `list` (path, minor version) this machine has; a missing one
/// is skipped, or under CI a failure.
fn available(list: Vec<(PathBuf, u8)>) -> Vec<(PathBuf, u8)> {
    list.into_iter()
        .filter(|(python, _)| require(python.exists(), &format!("{} is missing", python.display())))
        .collect()
}

fn script(dir: &std::path::Path) -> PathBuf {
    write_script(dir, "alloc_chain.py", SCRIPT)
}

/// `text` written to `dir/name`.
fn write_script(dir: &std::path::Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, text).unwrap();
    path
}

/// A stack's frames in the script, as (function, line), innermost first.
type Chain = Vec<(String, u64)>;

/// A stack's frames in `script`.
fn chain_of(s: &Stack, script: &str) -> Chain {
    s.frames
        .iter()
        .filter(|f| f.file.as_deref() == Some(script))
        .map(|f| (f.function.clone(), f.line.unwrap_or(0)))
        .collect()
}

/// The Python frames of the stacks that pass through the script, with
/// the calls and bytes under them summed.
fn script_chains(p: &Profile, script: &str) -> Vec<(Chain, u64, u64)> {
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

/// Three threads allocate at once, each from its own function: each
/// call is under its own thread's Python frames (the thread state is
/// found by thread id: 3.11+ its native id, before that its pthread).
const THREADS_SCRIPT: &str = "\
import threading
def alloc_a(n):
    return [bytearray(3000) for _ in range(n)]
def alloc_b(n):
    return [bytearray(5000) for _ in range(n)]
def alloc_c(n):
    return [bytearray(7000) for _ in range(n)]
def worker(f, n, barrier):
    barrier.wait()
    for _ in range(10):
        f(n)
b = threading.Barrier(3)
ts = [threading.Thread(target=worker, args=(f, n, b))
      for f, n in ((alloc_a, 100), (alloc_b, 200), (alloc_c, 300))]
for t in ts:
    t.start()
for t in ts:
    t.join()
";

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
const MANY_THREADS_SCRIPT: &str = "\
import sys, threading
def work(n):
    keep = []
    for _ in range(n):
        keep.append(bytearray(6000))
    return keep
def old(n, ready, more):
    ready.wait()
    work(n)
    more.wait()
    work(n)
def new(n):
    work(n)
t, n = int(sys.argv[1]), int(sys.argv[2])
ready = threading.Barrier(t)
more = threading.Event()
olds = [threading.Thread(target=old, args=(n, ready, more)) for _ in range(t)]
for th in olds:
    th.start()
news = [threading.Thread(target=new, args=(n,)) for _ in range(t // 4)]
for th in news:
    th.start()
for th in news:
    th.join()
more.set()
for th in olds:
    th.join()
";

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
const DEEP_SCRIPT: &str = "\
import sys
def leaf(n):
    keep = []
    for _ in range(n):
        keep.append(bytearray(5000))
    return keep
def down(d, n):
    if d == 0:
        return leaf(n)
    return down(d - 1, n)
down(900, int(sys.argv[1]))
";

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

/// A program that defines `_PyRuntime` and `Py_Version` (3.11) but is no
/// Python: what its `_PyRuntime` holds is not an interpreter's state
/// (bytes of 0x41 from launch, written after mtrace attached; its own
/// address in every word by pid, written before). One line says so, the
/// report's header says the same, no stack is counted as "not a Python
/// thread", and the calls are counted exactly, natively.
#[test]
fn a_python_runtime_that_cannot_be_read_is_said_once() {
    let dir = bpf_tempdir!();
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
    let mut fx = FixtureProc::start(&fake, &["self", "wait"]);
    let (out, p) = trace_by_pid(&mut fx, &[]);
    check(&out, &p, "by pid, its own address throughout");
}

/// Live mode: a leak by Python line. `leak` keeps one block in ten, `temp`
/// frees each at once (`os._exit`: no finalization frees the kept ones
/// at the end); the module's code is named as the script's own (on
/// Debian's 3.11, the code object of a `<string>` module run at start-up,
/// freed, lay at the same address with the same first line: its name
/// must not stick).
const LEAK_SCRIPT: &str = "\
import os, sys
kept = []
def leak():
    kept.append(bytearray(2000))
def temp():
    return bytearray(3000)
def main(n):
    for i in range(n):
        temp()
        if i % 10 == 0:
            leak()
main(int(sys.argv[1]))
os._exit(0)
";

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
const OBJECTS_SCRIPT: &str = "\
import os, sys, itertools
class Obj:
    __slots__ = ()
def make_objs(n):
    return [Obj() for _ in itertools.repeat(None, n)]
def big_buffers(n):
    return [bytearray(100000) for _ in itertools.repeat(None, n)]
def grow(n):
    keep = []
    for i in itertools.repeat(None, n):
        keep.append(i)
    return keep
oracle = sys.argv[1:] == ['oracle']
if 'wait' in sys.argv:
    print('ready', flush=True)
    sys.stdin.read(1)
if oracle:
    import tracemalloc
    tracemalloc.start()
a = make_objs(1000)
b = big_buffers(37)
c = grow(5000)
if oracle:
    snap = tracemalloc.take_snapshot()
    def count(line, size):
        return sum(1 for t in snap.traces
                   if t.traceback[0].filename == __file__
                   and t.traceback[0].lineno == line and t.size == size)
    print(count(5, sys.getsizeof(Obj())), count(7, 100001), sys.getsizeof(Obj()))
if 'exit' in sys.argv:
    os._exit(0)
";

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

/// How many lines mtrace wrote on stderr that contain every one of
/// `words`.
fn stderr_lines_with(out: &crate::support::mtrace::Finished, words: &[&str]) -> usize {
    out.stderr
        .iter()
        .filter(|l| words.iter().all(|w| l.contains(w)))
        .count()
}

/// Debian's python3.11 (stripped, PGO and LTO: its allocator copied
/// into its callers).
const DEBIAN_PYTHON: &str = "/usr/bin/python3.11";

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

/// memray as the oracle: `memray run` and `memray stats` on the chain
/// script give, per Python location of the script, the allocations and
/// bytes made there (innermost Python frame); mtrace's stacks, summed by
/// their innermost frame in the script, must give the same numbers
/// (leaf's bytearrays, Outer.run's list growing, the class statement).
#[test]
fn python_lines_agree_with_memray() {
    let dir = bpf_tempdir!();
    let path = script(dir.path());
    let script = path.to_str().unwrap();
    let py = "/usr/bin/python3.11";
    let memray_ok = std::process::Command::new(py)
        .args(["-c", "import memray"])
        .status()
        .is_ok_and(|s| s.success());
    if !require(
        memray_ok,
        "memray is missing (cargo xtask setup installs it)",
    ) {
        return;
    }
    let n = N.to_string();
    let bin = dir.path().join("run.bin");
    let stats = dir.path().join("stats.json");
    let run = std::process::Command::new(py)
        .args([
            "-m",
            "memray",
            "run",
            "-q",
            "-o",
            bin.to_str().unwrap(),
            script,
            &n,
        ])
        .output()
        .unwrap();
    assert!(run.status.success(), "memray run: {run:?}");
    let out = std::process::Command::new(py)
        .args(["-m", "memray", "stats", "--json", "-n", "1000", "-f"])
        .args(["-o", stats.to_str().unwrap(), bin.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "memray stats: {out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&fs::read(&stats).unwrap()).unwrap();
    // "function:file:line" -> (count, size), for the script's locations.
    let mut memray: std::collections::BTreeMap<(String, u64), (u64, u64)> = Default::default();
    let suffix = format!(":{script}:");
    for (list, field) in [
        ("top_allocations_by_count", "count"),
        ("top_allocations_by_size", "size"),
    ] {
        for e in doc[list].as_array().expect(list) {
            let loc = e["location"].as_str().unwrap();
            let Some(at) = loc.find(&suffix) else {
                continue;
            };
            let key = (
                loc[..at].to_string(),
                loc[at + suffix.len()..].parse().unwrap(),
            );
            let v = memray.entry(key).or_default();
            let n = e[field].as_u64().unwrap();
            if field == "count" {
                v.0 = n
            } else {
                v.1 = n
            }
        }
    }
    assert!(
        memray.len() >= 2,
        "memray's locations in the script: {memray:?}"
    );
    let (out, p) = run_named(&["--", py, script, &n]);
    out.assert_exit(0);
    let mut ours: std::collections::BTreeMap<(String, u64), (u64, u64)> = Default::default();
    for s in p.allocs() {
        let Some((f, line)) = chain_of(s, script).into_iter().next() else {
            continue;
        };
        // memray names a function by co_name: `run`, not `Outer.run`.
        let name = f.rsplit('.').next().unwrap().to_string();
        let v = ours.entry((name, line)).or_default();
        v.0 += s.calls;
        v.1 += s.bytes;
    }
    assert_eq!(
        ours,
        memray,
        "mtrace (left) and memray (right) by Python line\n{}",
        out.describe()
    );
}

/// py-spy as the oracle of the frame chain: a process started before
/// mtrace, traced by pid, allocates in leaf and then waits there; py-spy
/// dump of it at that point names the same functions, in the same order,
/// at the same lines above leaf.
const PAUSE_SCRIPT: &str = "\
import sys
def leaf(n):
    keep = [bytearray(4000) for _ in range(n)]
    print('allocated', flush=True)
    sys.stdin.read(1)
    return keep
def mid(n):
    return leaf(n)
print('ready', flush=True)
sys.stdin.read(1)
mid(int(sys.argv[1]))
";

#[test]
fn python_frames_agree_with_py_spy() {
    let dir = bpf_tempdir!();
    let path = write_script(dir.path(), "pause.py", PAUSE_SCRIPT);
    let script = path.to_str().unwrap();
    let py = "/usr/bin/python3.11";
    let spy_ok = std::process::Command::new("py-spy")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !require(spy_ok, "py-spy is missing (cargo xtask setup installs it)") {
        return;
    }
    let n = N.to_string();
    let mut fx = FixtureProc::start(std::path::Path::new(py), &[script, &n]);
    fx.wait_ready();
    let pid = fx.pid().to_string();
    let mut m = Mtrace::start_profiled(&["--pid", &pid]);
    m.wait_tracing();
    fx.release();
    fx.stdout
        .wait_for(|l| l == "allocated", crate::support::LINE_TIMEOUT);
    // Without pausing it (mtrace's exit hold has it under ptrace, which
    // py-spy's pause would need): it waits in leaf anyway.
    let dump = std::process::Command::new("py-spy")
        .args(["dump", "--nonblocking", "--pid", &pid])
        .output()
        .unwrap();
    let dump = format!(
        "{}{}",
        String::from_utf8_lossy(&dump.stdout),
        String::from_utf8_lossy(&dump.stderr)
    );
    fx.release();
    let status = fx.proc.wait_timeout(crate::support::EXIT_TIMEOUT);
    assert!(status.success(), "the script failed: {status}");
    let (out, p) = m.finish();
    out.assert_exit(0);
    // `    leaf (pause.py:5)`, innermost first.
    let spied: Chain = dump
        .lines()
        .filter_map(|l| {
            let (func, rest) = l.trim().rsplit_once(" (")?;
            let (file, line) = rest.strip_suffix(')')?.rsplit_once(':')?;
            let ours = file == script || script.ends_with(&format!("/{file}"));
            ours.then_some((func.to_string(), line.parse().ok()?))
        })
        .filter(|(f, _)| ["leaf", "mid", "<module>"].contains(&f.as_str()))
        .collect();
    assert_eq!(
        spied.iter().map(|f| f.0.as_str()).collect::<Vec<_>>(),
        ["leaf", "mid", "<module>"],
        "py-spy dump:\n{dump}"
    );
    let ours: Vec<Chain> = p
        .allocs()
        .filter(|s| s.bytes == s.calls * 4001)
        .map(|s| chain_of(s, script))
        .collect();
    assert_eq!(ours.len(), 1, "{ours:?}\n{}", out.describe());
    let chain = &ours[0];
    let names: Vec<&str> = chain.iter().map(|f| f.0.as_str()).collect();
    // 3.11 names the comprehension a frame of its own, inside leaf.
    let names: Vec<&str> = names
        .into_iter()
        .filter(|n| !n.contains("<listcomp>"))
        .collect();
    assert_eq!(names, ["leaf", "mid", "<module>"], "{chain:?}");
    // Above leaf (whose line is the allocation's for mtrace, the wait's
    // for py-spy), the same lines.
    let outer = |c: &Chain| -> Vec<(String, u64)> {
        c.iter()
            .filter(|f| f.0 != "leaf" && !f.0.contains("<listcomp>"))
            .cloned()
            .collect()
    };
    assert_eq!(
        outer(chain),
        outer(&spied),
        "mtrace {chain:?}, py-spy:\n{dump}"
    );
}
