//! The fixture programs of tests/fixtures/unwind (built without frame
//! pointers, each in a directory of its own), shared by the unwinding
//! tests and the host scope's.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, OnceLock},
};

use super::fixtures::fixtures_dir;

/// A fixture program of tests/fixtures/unwind, by name, built in a
/// directory of its own (so that it finds its libraries next to it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Program(&'static str);

pub const CHAINS: Program = Program("chains");
pub const CXX: Program = Program("cxx");
pub const RUST: Program = Program("rust");
pub const NO_CFI: Program = Program("nocfi");
pub const MIXED: Program = Program("mixed");
pub const DLOPEN: Program = Program("dlopen");
pub const JIT: Program = Program("jit");
pub const MEMO: Program = Program("memo");
pub const DEEP: Program = Program("deep");
/// deep.c under a frame of 400 KiB: deeper than the largest stack copy.
pub const DEEPER: Program = Program("deeper");

const NO_FP: &[&str] = &["-O2", "-fomit-frame-pointer", "-g"];

impl Program {
    pub fn name(self) -> &'static str {
        self.0
    }

    /// Each step: the tool and its arguments (sources relative to
    /// tests/fixtures/unwind, outputs to the build directory).
    fn steps(self) -> Vec<Vec<&'static str>> {
        let cc = |extra: &[&'static str]| {
            let mut v = vec!["cc"];
            v.extend(NO_FP);
            v.extend(extra);
            v
        };
        match self {
            CHAINS => vec![cc(&[
                "-pthread",
                "-fno-stack-clash-protection",
                "-o",
                "chains",
                "chains.c",
            ])],
            CXX => vec![[&["c++"], NO_FP, &["-o", "cxx", "cxx.cpp"]].concat()],
            RUST => vec![vec![
                "rustc",
                "-C",
                "opt-level=2",
                "-C",
                "force-frame-pointers=no",
                "-g",
                "-o",
                "rust",
                "rust.rs",
            ]],
            NO_CFI => vec![cc(&["-o", "nocfi", "nocfi.c", "nocfi_part.S"])],
            MIXED => vec![
                vec![
                    "cc",
                    "-O2",
                    "-fno-omit-frame-pointer",
                    "-g",
                    "-shared",
                    "-fPIC",
                    "-DFP",
                    "-o",
                    "libmixed_fp.so",
                    "mixed_lib.c",
                ],
                cc(&["-shared", "-fPIC", "-o", "libmixed_nofp.so", "mixed_lib.c"]),
                cc(&[
                    "-o",
                    "mixed",
                    "mixed.c",
                    "-L@",
                    "-lmixed_fp",
                    "-lmixed_nofp",
                    "-Wl,-rpath,$ORIGIN",
                ]),
            ],
            JIT => vec![cc(&["-o", "jit", "jit.c"])],
            MEMO => vec![cc(&["-o", "memo", "memo.c"])],
            DEEP => vec![cc(&["-o", "deep", "deep.c"])],
            DEEPER => vec![cc(&["-DTOP_FRAME=409600", "-o", "deeper", "deep.c"])],
            DLOPEN => vec![
                cc(&["-shared", "-fPIC", "-o", "plugin.so", "plugin.c"]),
                cc(&["-o", "dlopen", "dlopen.c", "-ldl"]),
            ],
            other => panic!("no fixture {other:?}"),
        }
    }

    /// The built program, and its libraries; built once per test run.
    pub fn objects(self) -> Vec<PathBuf> {
        static BUILT: OnceLock<Mutex<HashMap<Program, PathBuf>>> = OnceLock::new();
        let mut built = BUILT.get_or_init(Default::default).lock().unwrap();
        let dir = built.entry(self).or_insert_with(|| build(self)).clone();
        let mut objects = vec![dir.join(self.name())];
        for lib in ["libmixed_fp.so", "libmixed_nofp.so", "plugin.so"] {
            if dir.join(lib).exists() {
                objects.push(dir.join(lib));
            }
        }
        objects
    }
}

fn build(program: Program) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("e2e-unwind")
        .join(program.name());
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixtures_dir().join("unwind");
    for step in program.steps() {
        let mut cmd = Command::new(step[0]);
        for arg in &step[1..] {
            if arg.ends_with(".c")
                || arg.ends_with(".cpp")
                || arg.ends_with(".S")
                || arg.ends_with(".rs")
            {
                cmd.arg(src.join(arg));
            } else if let Some(rest) = arg.strip_prefix("-L@") {
                cmd.arg(format!("-L{}{rest}", dir.display()));
            } else {
                cmd.arg(arg);
            }
        }
        let out = cmd
            .current_dir(&dir)
            .output()
            .expect("running the compiler");
        assert!(
            out.status.success(),
            "{step:?} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    dir
}
