//! Python frames named: the code objects a process's stacks hold, read from
//! its memory while they live (told by the programs' notices, and by the
//! walks the tracer finishes), then put in place of the interpreter's
//! eval-loop frames when the stacks are symbolized.

use std::{collections::HashMap, sync::Arc};

use tracer_common::{py_code_check, PY_CODE_MASK, PY_ENTRY, PY_FRAME};

use super::code::{self, Code, CodeLayout, Memory, ProcessMemory};
use crate::profile::Frame;

/// The native function whose every frame is a run of the eval loop.
const EVAL_LOOP: &str = "_PyEval_EvalFrameDefault";

/// The code objects of one process, by address and the first line the
/// probe read there.
pub struct Names {
    mem: Option<ProcessMemory>,
    layout: &'static CodeLayout,
    /// `None`: not readable, or another code object by then.
    known: HashMap<(u64, u32), Option<Arc<Code>>>,
    /// Code objects that could not be named.
    pub unnamed: u64,
}

/// One Python frame of a stack, as the probe stored it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PyWord {
    code: u64,
    entry: bool,
    instr: u32,
    check: u32,
}

/// The Python frames among a stack's words (pairs, the first marked
/// [`PY_FRAME`]), innermost first.
fn py_words(words: &[u64]) -> impl Iterator<Item = PyWord> + '_ {
    words
        .chunks_exact(2)
        .filter(|p| p[0] & PY_FRAME != 0)
        .map(|p| PyWord {
            code: p[0] & PY_CODE_MASK,
            entry: p[0] & PY_ENTRY != 0,
            instr: p[1] as u32,
            check: (p[1] >> 32) as u32,
        })
}

/// Where a stack's Python frames begin: the first word marked
/// [`PY_FRAME`] (no return address has the bit).
pub fn split(addrs: &[u64]) -> (&[u64], &[u64]) {
    let at = addrs
        .iter()
        .position(|&a| a & PY_FRAME != 0)
        .unwrap_or(addrs.len());
    addrs.split_at(at)
}

impl Names {
    pub fn new(pid: u32, minor: u8) -> Option<Names> {
        Some(Names {
            mem: ProcessMemory::open(pid).ok(),
            layout: CodeLayout::for_minor(minor as u32)?,
            known: HashMap::new(),
            unnamed: 0,
        })
    }

    /// Reads the code objects of `words` (a stack's Python words) not read
    /// yet, while the process lives.
    pub fn learn(&mut self, words: &[u64]) {
        for w in py_words(words) {
            let key = (w.code, w.check);
            if self.known.contains_key(&key) {
                continue;
            }
            let Some(mem) = &self.mem else {
                return;
            };
            let code = match code::read_code(mem, self.layout, w.code) {
                // Another code object at the address since: not this one.
                Ok(c) if self.check(mem, w.code, &c) == Some(w.check) => Some(Arc::new(c)),
                Ok(_) => None,
                Err(e) => {
                    log::debug!("python: code object {:#x} unreadable: {e}", w.code);
                    None
                }
            };
            if code.is_none() {
                self.unnamed += 1;
            }
            self.known.insert(key, code);
        }
    }

    /// [`py_code_check`] of the code object read at `addr`.
    fn check(&self, mem: &ProcessMemory, addr: u64, c: &Code) -> Option<u32> {
        let mut b = [0u8; 16];
        mem.read(addr + self.layout.co_filename, &mut b).ok()?;
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Some(py_code_check(c.first_line, word(0), word(8)))
    }

    fn frame(&self, w: PyWord) -> Frame {
        match self.known.get(&(w.code, w.check)) {
            Some(Some(c)) => Frame {
                function: c.name.clone(),
                file: Some(c.file.clone()),
                // An instruction the compiler gave no line (cleanup code):
                // the function's first.
                line: c.line(w.instr).or(Some(c.first_line)),
                addr: w.code,
                ..Frame::default()
            },
            _ => Frame {
                function: format!("[python code {:#x}]", w.code),
                addr: w.code,
                ..Frame::default()
            },
        }
    }

    /// `native` (symbolized, innermost first) with each eval-loop frame
    /// replaced by the Python frames its run executed (`words`: the
    /// stack's Python words). Runs the native walk did not reach go at
    /// the end; eval-loop frames without Python frames stay.
    pub fn splice(&self, native: Vec<Arc<Frame>>, words: &[u64]) -> Vec<Arc<Frame>> {
        let mut runs: Vec<Vec<Arc<Frame>>> = Vec::new();
        let mut run = Vec::new();
        for w in py_words(words) {
            run.push(Arc::new(self.frame(w)));
            if w.entry {
                runs.push(std::mem::take(&mut run));
            }
        }
        if !run.is_empty() {
            runs.push(run);
        }
        let mut runs = runs.into_iter();
        let mut out = Vec::with_capacity(native.len() + words.len() / 2);
        for f in native {
            if f.function == EVAL_LOOP && !f.inlined {
                if let Some(r) = runs.next() {
                    out.extend(r);
                    continue;
                }
            }
            out.push(f);
        }
        out.extend(runs.flatten());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracer_common::py_frame_words;

    fn native(name: &str) -> Arc<Frame> {
        Arc::new(Frame {
            function: name.into(),
            ..Frame::default()
        })
    }

    #[test]
    fn runs_replace_eval_loop_frames_in_order() {
        let names = Names {
            mem: None,
            layout: CodeLayout::for_minor(11).unwrap(),
            known: HashMap::new(),
            unnamed: 0,
        };
        // Two runs: (0x10, 0x20 entry), (0x30 entry).
        let mut words = vec![0x401000u64, 0x402000];
        for (code, entry) in [(0x10, false), (0x20, true), (0x30, true)] {
            words.extend(py_frame_words(code, entry, 4, 1));
        }
        let (n, py) = split(&words);
        assert_eq!(n.len(), 2);
        let frames = names.splice(
            vec![
                native("PyUnicode_New"),
                native(EVAL_LOOP),
                native("PyObject_Call"),
                native(EVAL_LOOP),
                native("main"),
            ],
            py,
        );
        let got: Vec<&str> = frames.iter().map(|f| f.function.as_str()).collect();
        assert_eq!(
            got,
            [
                "PyUnicode_New",
                "[python code 0x10]",
                "[python code 0x20]",
                "PyObject_Call",
                "[python code 0x30]",
                "main"
            ]
        );
    }
}
