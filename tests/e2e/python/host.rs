//! Python frames on the host engine: a command's tree followed
//! file-wide (`--file-wide --`) and every process on the host (`--all`)
//! read the same Python frames a trace of the process alone reads, from
//! the interpreter's first allocation: its layout learned from its
//! mappings, or from its libpython found before the dynamic linker maps
//! it.

use std::path::PathBuf;

use crate::support::{
    python::{available, run_named, script, script_chains, unnamed_in_scripts},
    scopes::tally,
    FixtureProc, Mtrace, Profile,
};

use super::{assert_chain, interpreters};

/// The whole stack through `leaf` in `script`: every frame's name,
/// native and Python, innermost first. A walk the kernel could not hand
/// over (its ring full while a starved tracer fell behind) is cut where
/// it stopped: such stacks are counted among the cut (`stack_quality`),
/// and few.
fn leaf_stack(p: &Profile, script: &str) -> Vec<String> {
    let through_leaf = |s: &&crate::support::profile::Stack| {
        s.frames
            .iter()
            .any(|f| f.function == "leaf" && f.file.as_deref() == Some(script))
    };
    let names = |s: &crate::support::profile::Stack| -> Vec<String> {
        s.names().iter().map(|n| n.to_string()).collect()
    };
    let whole: Vec<Vec<String>> = p
        .allocs()
        .filter(through_leaf)
        .filter(|s| !s.truncated)
        .map(names)
        .collect();
    let cut: u64 = p
        .allocs()
        .filter(through_leaf)
        .filter(|s| s.truncated)
        .map(|s| s.calls)
        .sum();
    let counted: u64 = p.doc["stack_quality"]["truncated"]
        .as_object()
        .map_or(0, |m| m.values().filter_map(|v| v.as_u64()).sum());
    let all: Vec<Vec<String>> = p.allocs().filter(through_leaf).map(names).collect();
    assert_eq!(whole.len(), 1, "{all:#?}");
    assert!(
        cut <= counted && cut * 20 <= super::N,
        "{cut} calls through leaf cut, {counted} counted: {all:#?}"
    );
    whole[0].clone()
}

/// Every interpreter this machine has, launched through `env` (a program
/// that execs the interpreter at once): on the host engine the chain is
/// exact, its stack frame for frame the one a trace from launch on the
/// per-process engine gives (native frames and Python frames, to the
/// thread's first), as many calls carry Python frames (a libpython's
/// interpreter known before the dynamic linker maps it), and `env`'s own
/// stacks, walked by the tracer after
/// the process became the interpreter, are those it had (its program's
/// mappings, not the interpreter's).
#[test]
fn python_frames_on_the_host_engine_as_from_launch() {
    let dir = host_tempdir!();
    let path = script(dir.path());
    let script = path.to_str().unwrap();
    let n = super::N.to_string();
    for (python, minor) in available(interpreters()) {
        let py = python.to_str().unwrap();
        let argv = ["env", "PYTHONHASHSEED=0", py, script, &n];
        let traced = |engine: &[&str]| {
            let mut args = engine.to_vec();
            args.push("--");
            args.extend(argv);
            let (out, p) = run_named(&args);
            out.assert_exit(0);
            (out, p)
        };
        // Where each call stands in the interpreter's life, counted in
        // the kernel at the call: every call read the same way from the
        // interpreter's first one (its layout learned late, the first
        // calls would have none).
        let stands = |p: &Profile| {
            let q = &p.doc["stack_quality"]["python"];
            [
                "with_frames",
                "no_interpreter",
                "no_thread_state",
                "no_code_running",
            ]
            .map(|k| q[k].as_u64())
        };
        let run_both = || {
            let (out, host) = traced(&["--file-wide"]);
            let what = format!("{py} --file-wide\n{}", out.describe());
            let (out, alone) = traced(&[]);
            let what_alone = format!("{py} from launch\n{}", out.describe());
            (host, what, alone, what_alone)
        };
        // The interpreter's own count varies between runs: pyenv's 3.10
        // makes one call more with no code running in about one run of 30
        // by itself (the same engine, the same argv). A pair that differs
        // is run again before the difference is the engine's.
        let (mut host, mut what, mut alone, mut what_alone) = run_both();
        for _ in 0..3 {
            if stands(&host) == stands(&alone) {
                break;
            }
            eprintln!(
                "{py}: {:?} -> {:?}, run again",
                stands(&alone),
                stands(&host)
            );
            (host, what, alone, what_alone) = run_both();
        }
        assert_chain(&host, script, minor, &what);
        assert_eq!(host.doc["meta"]["scope"], "tree", "{what}");
        assert_chain(&alone, script, minor, &what_alone);
        assert_eq!(
            leaf_stack(&host, script),
            leaf_stack(&alone, script),
            "{what}\n{what_alone}"
        );
        assert_eq!(
            stands(&host),
            stands(&alone),
            "python categories, host then alone\n{what}\n{what_alone}"
        );
        // (The stripped `env`'s frames are its file and offset.)
        let env = |p: &Profile| {
            let all = tally(p, &|_, _| true);
            all.into_iter()
                .filter(|((_, stack), _)| stack.contains("env+0x"))
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        assert!(!env(&alone).is_empty(), "{what_alone}");
        assert_eq!(env(&host), env(&alone), "env's stacks\n{what}");
    }
}

/// `--all`: a Python process running before mtrace started (pyenv's
/// 3.12, libpython shared), one started after it (Debian's python3.11,
/// libpython linked in) and one more of the first one's interpreter
/// started after it, not waiting (known from its libpython's file at its
/// first walk): each one's chain exact, under its own pid, with its
/// Python frames.
#[test]
fn all_reads_the_python_frames_of_every_interpreter() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let shared = PathBuf::from("/root/.pyenv/versions/3.12.1/bin/python3");
    let linked = PathBuf::from("/usr/bin/python3.11");
    if available(vec![(shared.clone(), 12), (linked.clone(), 11)]).len() < 2 {
        return;
    }
    let n = super::N.to_string();
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let scripts: Vec<String> = dirs
        .iter()
        .map(|d| script(d.path()).to_str().unwrap().to_string())
        .collect();
    let attempt = || {
        let mut before = FixtureProc::start(&shared, &[&scripts[0], &n, "wait"]);
        before.wait_ready();
        let out_dir = tempfile::tempdir().unwrap();
        let json = out_dir.path().join("p.json");
        let mut m = Mtrace::start(&["--all", "-o", json.to_str().unwrap()]);
        m.wait_tracing();
        let mut after = FixtureProc::start(&linked, &[&scripts[1], &n, "wait"]);
        after.wait_ready();
        for fx in [&mut before, &mut after] {
            fx.release();
            assert!(fx.proc.wait_timeout(crate::support::EXIT_TIMEOUT).success());
        }
        let status = std::process::Command::new(&shared)
            .args([&scripts[2], &n])
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        std::thread::sleep(std::time::Duration::from_millis(300));
        m.proc.signal(libc::SIGINT);
        let out = m.finish();
        out.assert_exit(0);
        (out.describe(), Profile::load(&json))
    };
    // No process of `--all` is held, at its exec or its exit: one whose
    // script ends before the tracer, starved of CPU, reads its code
    // objects has them freed, counted as unnamed (see `run_named`); one
    // whose script runs before the tracer found its interpreter has those
    // calls counted as not read (`not_known`). Run again then. A stack
    // whose Python frames are all unnamed names no script, so a script
    // with no stack through its leaf is one such too.
    let script_args: Vec<&str> = scripts.iter().map(|s| s.as_str()).collect();
    let (mut d, mut p) = attempt();
    for _ in 0..5 {
        let unnamed = unnamed_in_scripts(&p, &script_args);
        let not_known = p.doc["stack_quality"]["python"]["not_known"]
            .as_u64()
            .unwrap_or(0);
        let leafless = scripts
            .iter()
            .filter(|s| {
                !script_chains(&p, s)
                    .iter()
                    .any(|(c, _, _)| c.first().is_some_and(|f| f.0 == "leaf"))
            })
            .count();
        if unnamed == 0 && not_known == 0 && leafless == 0 {
            break;
        }
        eprintln!(
            "--all: {unnamed} frames of the scripts unnamed, {not_known} calls not read, \
             {leafless} scripts with no stack named through leaf, run again"
        );
        (d, p) = attempt();
    }
    for (script, minor) in scripts.iter().zip([12, 11, 12]) {
        assert_chain(&p, script, minor, &format!("{script}\n{d}"));
    }
    let said = p.doc["meta"]["python"].as_str().unwrap_or("");
    assert!(
        said.contains("CPython 3.12 in ") && said.contains("CPython 3.11 in /usr/bin/python3.11"),
        "{said}\n{d}"
    );
}

/// Two runs of Debian's python3.11 (non-PIE, its frozen modules' code
/// objects at the same addresses in every process) in one tree traced
/// `--file-wide`: the kernel tells of a stack's code objects once for
/// the host, yet the second process's Python frames are named too, and
/// each run's chain is exact.
#[test]
fn a_second_interpreter_of_a_tree_has_its_frames_named() {
    let dir = host_tempdir!();
    let python = crate::support::python::DEBIAN_PYTHON;
    if available(vec![(PathBuf::from(python), 11)]).is_empty() {
        return;
    }
    let path = script(dir.path());
    let script = path.to_str().unwrap();
    let n = super::N.to_string();
    let twice = format!("{python} {script} {n} && {python} {script} {n}");
    // Every code object named, the frozen modules' of the second process
    // too (run again, as `run_named` does, when one was freed first).
    let unnamed = |p: &Profile| p.doc["stack_quality"]["python"]["unnamed"].as_u64();
    let args = ["--file-wide", "--", "sh", "-c", &twice];
    let (mut out, mut p) = run_named(&args);
    for _ in 0..3 {
        if unnamed(&p) == Some(0) {
            break;
        }
        eprintln!("{:?} code objects unnamed, run again", unnamed(&p));
        (out, p) = run_named(&args);
    }
    out.assert_exit(0);
    let d = out.describe();
    assert_eq!(unnamed(&p), Some(0), "{d}");
    let leaf: u64 = crate::support::python::script_chains(&p, script)
        .iter()
        .filter(|(c, _, _)| c.first().is_some_and(|f| f.0 == "leaf"))
        .map(|(_, calls, _)| calls)
        .sum();
    assert_eq!(leaf, 2 * super::N, "{d}");
}

/// `--all` with the tracer stopped while a Python process runs and ends
/// (Debian's python3.11, pyenv's 3.9 and 3.13, each one's file known from
/// one run before): the kernel read their Python frames, and their code
/// objects are gone before the tracer could read them. The kernel's
/// copies of them (taken as each stack was first stored or handed over)
/// name them all the same, in each version's layout: the chain exact,
/// line for line, no frame left as an address. And the figures the
/// kernel counts for the whole host are not summed again with each part
/// of processes gone: each call of a Python process is in one category
/// at most.
#[test]
fn python_frames_of_a_process_gone_before_the_tracer_looked_are_named() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let pythons = available(vec![
        (PathBuf::from(crate::support::python::DEBIAN_PYTHON), 11),
        (PathBuf::from("/root/.pyenv/versions/3.9.18/bin/python3"), 9),
        (
            PathBuf::from("/root/.pyenv/versions/3.13.0/bin/python3"),
            13,
        ),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let script = script(dir.path());
    let json = dir.path().join("p.json");
    let mut m = Mtrace::start(&["--all", "-o", json.to_str().unwrap()]);
    m.wait_tracing();
    let mut ran = Vec::new();
    for (python, minor) in &pythons {
        // Its file known to the kernel from this run's look on: the run
        // waits past the tracer's last look after its exec (500 ms).
        let mut first = FixtureProc::start(python, &[script.to_str().unwrap(), "10", "wait"]);
        first.wait_ready();
        std::thread::sleep(std::time::Duration::from_millis(700));
        first.release();
        assert!(first
            .proc
            .wait_timeout(crate::support::EXIT_TIMEOUT)
            .success());
        m.proc.signal(libc::SIGSTOP);
        let mut child = std::process::Command::new(python)
            .args([script.to_str().unwrap(), &super::N.to_string()])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        ran.push((child.id(), *minor));
        assert!(child.wait().unwrap().success());
        m.proc.signal(libc::SIGCONT);
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    m.proc.signal(libc::SIGINT);
    let out = m.finish();
    out.assert_exit(0);
    let d = out.describe();
    let p = Profile::load(&json);
    for (pid, minor) in ran {
        let blocks: Vec<_> = p
            .allocs()
            .filter(|s| s.process.as_ref().is_some_and(|r| r.pid == pid))
            .filter(|s| s.calls == super::N && s.bytes == super::N * 4001)
            .collect();
        assert_eq!(blocks.len(), 1, "3.{minor}, pid {pid}\n{d}");
        let names = blocks[0].names();
        assert_eq!(
            crate::support::python::chain_of(blocks[0], script.to_str().unwrap()),
            super::expected(minor),
            "3.{minor}: {names:#?}\n{d}"
        );
        assert!(
            !names.iter().any(|n| n.starts_with("[python code 0x")),
            "3.{minor}: {names:#?}\n{d}"
        );
    }
    let q = &p.doc["stack_quality"]["python"];
    let calls: u64 = p
        .allocs()
        .filter(|s| {
            s.process
                .as_ref()
                .is_some_and(|r| r.name.starts_with("python"))
        })
        .map(|s| s.calls)
        .sum();
    let categories: u64 = [
        "with_frames",
        "no_interpreter",
        "no_thread_state",
        "no_code_running",
    ]
    .iter()
    .filter_map(|k| q[*k].as_u64())
    .sum();
    // (The first runs' first calls may come before their looks.)
    assert!(
        categories <= calls && calls - categories < calls / 2,
        "{categories} calls in a category, of {calls}: {q}\n{d}"
    );
}

/// An interpreter mtrace does not find (Debian's python3.11 copied under
/// a name and a path that do not say Python, as an embedding program's
/// would be): on either engine its calls under the eval loop are counted
/// and said as running Python code whose frames were not read, not
/// passed over as if the program ran none.
#[test]
fn python_code_of_an_interpreter_not_found_is_said_unread() {
    let dir = host_tempdir!();
    let python = crate::support::python::DEBIAN_PYTHON;
    if available(vec![(PathBuf::from(python), 11)]).is_empty() {
        return;
    }
    let interp = dir.path().join("interp");
    std::fs::copy(python, &interp).unwrap();
    let path = script(dir.path());
    let n = super::N.to_string();
    let argv = [interp.to_str().unwrap(), path.to_str().unwrap(), &n];
    for engine in [&[][..], &["--file-wide"][..]] {
        let mut args = engine.to_vec();
        args.push("--");
        args.extend(argv);
        let (out, p) = crate::support::run_profiled(&args);
        out.assert_exit(0);
        let d = out.describe();
        let blocks: Vec<_> = p
            .allocs()
            .filter(|s| s.calls == super::N && s.bytes == super::N * 4001)
            .collect();
        assert_eq!(blocks.len(), 1, "{engine:?}\n{d}");
        let names = blocks[0].names();
        assert!(
            names.contains(&"_PyEval_EvalFrameDefault") && !names.contains(&"leaf"),
            "{engine:?}: {names:#?}\n{d}"
        );
        let q = &p.doc["stack_quality"]["python"];
        assert!(
            q["not_known"].as_u64().unwrap_or(0) >= super::N,
            "{engine:?}: {q}\n{d}"
        );
        assert!(
            d.contains("python: not read (no interpreter known) in "),
            "{engine:?}\n{d}"
        );
    }
}

/// `--all`: a Python process whose calls come before the tracer found its
/// interpreter (the tracer stopped, SIGSTOP, as the interpreter, a copy
/// of Debian's python3.11 no process ran before, starts and allocates)
/// has those calls counted as running Python code not read, although the
/// tracer finds the interpreter later: the same process's later calls
/// have their Python frames. (They were passed over as if read.)
#[test]
fn calls_before_the_interpreter_was_found_are_said_unread() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let python = crate::support::python::DEBIAN_PYTHON;
    if available(vec![(PathBuf::from(python), 11)]).is_empty() {
        return;
    }
    let dir = crate::support::public_tempdir();
    let interp = dir.path().join("python3.11");
    std::fs::copy(python, &interp).unwrap();
    let n = super::N;
    let script = crate::support::python::write_script(
        dir.path(),
        "two_phases.py",
        &format!(
            "import sys\ndef leaf():\n    return bytearray(4000)\n\
             def run(n):\n    return [leaf() for i in range(n)]\n\
             first = run({n})\nprint('ready', flush=True)\nsys.stdin.read(1)\n\
             second = run({n})\n"
        ),
    );
    let snapshots = tempfile::tempdir().unwrap();
    let mut m = Mtrace::start_profiled(&[
        "--all",
        "--snapshot-dir",
        snapshots.path().to_str().unwrap(),
    ]);
    m.wait_tracing();
    m.proc.signal(libc::SIGSTOP);
    let mut fx = FixtureProc::start(&interp, &[script.to_str().unwrap()]);
    fx.wait_ready();
    m.proc.signal(libc::SIGCONT);
    // Once a snapshot says the tracer found the interpreter, the second
    // phase runs.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        unsafe { libc::kill(m.proc.id() as i32, libc::SIGUSR1) };
        let line = m.stderr.wait_for(
            |l| l.starts_with("mtrace: wrote snapshot to "),
            crate::support::LINE_TIMEOUT,
        );
        // (Read as text: parsing the host's profile allocates, traced.)
        let said = std::fs::read_to_string(line.rsplit(' ').next().unwrap()).unwrap();
        if said.contains(&format!("CPython 3.11 in {}", interp.display())) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the interpreter was not found"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    fx.release();
    assert!(fx.proc.wait_timeout(crate::support::EXIT_TIMEOUT).success());
    std::thread::sleep(std::time::Duration::from_millis(300));
    m.proc.signal(libc::SIGINT);
    let (out, p) = m.finish();
    out.assert_exit(0);
    let d = out.describe();
    let blocks: Vec<_> = p
        .allocs()
        .filter(|s| s.bytes == s.calls * 4001)
        .filter(|s| s.process.as_ref().is_some_and(|r| r.pid == fx.proc.id()))
        .collect();
    let script = script.to_str().unwrap();
    let read: u64 = blocks
        .iter()
        .filter(|s| {
            s.frames
                .iter()
                .any(|f| f.function == "leaf" && f.file.as_deref() == Some(script))
        })
        .map(|s| s.calls)
        .sum();
    // Its calls before the tracer found the interpreter (those of its
    // start-up too, as it imports) are said not read; each runs the eval
    // loop, whose frames its stack shows. (Those of the first phase may
    // be cut short where the ring had no room for walks while the tracer
    // was stopped.)
    let eval_calls: u64 = p
        .allocs()
        .filter(|s| s.process.as_ref().is_some_and(|r| r.pid == fx.proc.id()))
        .filter(|s| s.names().contains(&"_PyEval_EvalFrameDefault"))
        .map(|s| s.calls)
        .sum();
    let q = &p.doc["stack_quality"]["python"];
    let not_known = q["not_known"].as_u64().unwrap_or(0);
    assert!(
        read == n && 0 < not_known && not_known <= eval_calls,
        "{read} {eval_calls} {q}\n{d}"
    );
    assert!(
        d.contains("python: not read (no interpreter known) in "),
        "{d}"
    );
}
