//! Python frames named: the code objects a process's stacks hold, read from
//! its memory while they live (told by the programs' notices, and by the
//! walks the tracer finishes), then put in place of the interpreter's
//! eval-loop frames when the stacks are symbolized.

use std::{collections::HashMap, sync::Arc};

use tracer_common::{py_code_check, PY_CODE_MASK, PY_CUT_MARK, PY_CUT_MORE, PY_ENTRY, PY_FRAME};

use super::{
    code::{self, Code, CodeLayout, Memory, ProcessMemory},
    state::{self, State},
};
use crate::profile::Frame;

/// Code objects named for other processes kept at most (per interpreter
/// version; past it, each process names its own).
const SHARED_KEPT: usize = 65_536;

/// The native function whose every frame is a run of the eval loop.
const EVAL_LOOP: &str = "_PyEval_EvalFrameDefault";

/// The code objects of one process, by address and the first line the
/// probe read there.
pub struct Names {
    /// The process's memory (`None`: it could not be opened, or the
    /// process was gone before it was looked at).
    mem: Option<ProcessMemory>,
    /// How its interpreter lays out code objects (`None`: not known).
    layout: Option<&'static CodeLayout>,
    /// The interpreter's minor version (3.X).
    pub minor: u8,
    /// `None`: not readable, or another code object by then.
    known: HashMap<(u64, u32), Option<Arc<Code>>>,
    /// Code objects that could not be named.
    pub unnamed: u64,
    /// The interpreter's state, not judged yet ([`state::check`]): its
    /// layout and what the report calls the interpreter.
    pending: Option<(tracer_common::PythonLayout, String)>,
    /// The line that says the interpreter's state could not be read.
    unreadable: Option<String>,
    /// Code objects the kernel copied whose line table the copy cut
    /// short: read from memory first, from here if that fails.
    copies: HashMap<(u64, u32), Arc<Code>>,
}

/// One Python frame of a stack, as the probe stored it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PyWord {
    code: u64,
    entry: bool,
    instr: u32,
    check: u32,
}

/// One pair of a stack's Python words: a frame, or the mark of a cut
/// (`left` frames left out for want of room, `more` past them not read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PyItem {
    Frame(PyWord),
    Cut { left: u32, more: bool },
}

/// The Python frames among a stack's words (pairs, the first marked
/// [`PY_FRAME`]), innermost first.
fn py_items(words: &[u64]) -> impl Iterator<Item = PyItem> + '_ {
    words
        .chunks_exact(2)
        .filter(|p| p[0] & PY_FRAME != 0)
        .map(|p| {
            if p[0] & PY_CUT_MARK != 0 {
                PyItem::Cut {
                    left: p[1] as u32,
                    more: p[1] & PY_CUT_MORE != 0,
                }
            } else {
                PyItem::Frame(PyWord {
                    code: p[0] & PY_CODE_MASK,
                    entry: p[0] & PY_ENTRY != 0,
                    instr: p[1] as u32,
                    check: (p[1] >> 32) as u32,
                })
            }
        })
}

/// The Python frames alone of a stack's words.
fn py_words(words: &[u64]) -> impl Iterator<Item = PyWord> + '_ {
    py_items(words).filter_map(|i| match i {
        PyItem::Frame(w) => Some(w),
        PyItem::Cut { .. } => None,
    })
}

/// The frame a cut shows where the stack's Python frames stop:
/// `[N Python frames not read]`, `[more than N Python frames not read]`,
/// or without a count `[Python frames not read]`.
fn cut_frame(left: u32, more: bool) -> Frame {
    let function = match (left, more) {
        (0, _) => "[Python frames not read]".to_string(),
        (1, false) => "[1 Python frame not read]".to_string(),
        (n, false) => format!("[{n} Python frames not read]"),
        (n, true) => format!("[more than {n} Python frames not read]"),
    };
    Frame {
        function,
        ..Frame::default()
    }
}

/// [`py_code_check`] of the code object read at `addr`.
fn check(mem: &ProcessMemory, layout: &CodeLayout, addr: u64, c: &Code) -> Option<u32> {
    let mut b = [0u8; 16];
    mem.read(addr + layout.co_filename, &mut b).ok()?;
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    Some(py_code_check(c.first_line, word(0), word(8)))
}

/// Whether `native` (a stack's frames, symbolized) runs the eval loop:
/// Python code was running at the call.
pub fn runs_eval_loop(native: &[Arc<Frame>]) -> bool {
    native.iter().any(|f| f.function == EVAL_LOOP && !f.inlined)
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
    /// `pending`: the interpreter's state still to judge ([`Names::judge`]),
    /// with what the report calls the interpreter.
    pub fn new(
        pid: u32,
        minor: u8,
        pending: Option<(tracer_common::PythonLayout, String)>,
    ) -> Option<Names> {
        Some(Names {
            mem: ProcessMemory::open(pid).ok(),
            layout: Some(CodeLayout::for_minor(minor as u32)?),
            minor,
            known: HashMap::new(),
            unnamed: 0,
            pending,
            unreadable: None,
            copies: HashMap::new(),
        })
    }

    /// The code objects of a process gone before its interpreter was
    /// looked at: none can be named, each is counted unnamed and shown by
    /// its address (`minor` 0: no other process's names apply).
    pub fn gone() -> Names {
        Names {
            mem: None,
            layout: None,
            minor: 0,
            known: HashMap::new(),
            unnamed: 0,
            pending: None,
            unreadable: None,
            copies: HashMap::new(),
        }
    }

    /// Whether these are [`Names::gone`]'s.
    pub fn is_gone(&self) -> bool {
        self.layout.is_none()
    }

    /// The line that says the interpreter's state could not be read, once
    /// it is judged so: judged at the first look that finds an interpreter
    /// with a thread (the process may not have started one at attach).
    pub fn judge(&mut self) -> Option<&str> {
        if let (Some((layout, who)), Some(mem)) = (&self.pending, &self.mem) {
            match state::settled(mem, layout) {
                State::NotYet => {}
                State::Readable => self.pending = None,
                State::Unreadable(why) => {
                    self.unreadable = Some(state::unreadable_line(who, &why));
                    self.pending = None;
                }
            }
        }
        self.unreadable.as_deref()
    }

    /// Reads the code objects of `words` (a stack's Python words) not read
    /// yet, while the process lives.
    pub fn learn(&mut self, words: &[u64]) {
        self.learn_with(words, &mut HashMap::new());
    }

    /// [`Names::learn`], with the code objects other processes of the same
    /// interpreter version named (`shared`, by address and check; those
    /// named here go in too): one at the same address, whose check (first
    /// line, file and name objects' addresses) agrees, is the same code
    /// (the interpreter's own, frozen in its file at a fixed address, or
    /// a process forked from another), and is taken from there instead of
    /// read, also once this process is gone.
    pub fn learn_with(&mut self, words: &[u64], shared: &mut HashMap<(u64, u32), Arc<Code>>) {
        for w in py_words(words) {
            let key = (w.code, w.check);
            if self.known.contains_key(&key) {
                continue;
            }
            if let Some(code) = shared.get(&key) {
                self.known.insert(key, Some(code.clone()));
                continue;
            }
            let (Some(mem), Some(layout)) = (&self.mem, self.layout) else {
                if let Some(code) = self.copies.remove(&key) {
                    self.known.insert(key, Some(code));
                    continue;
                }
                self.unnamed += 1;
                self.known.insert(key, None);
                continue;
            };
            let code = match code::read_code(mem, layout, w.code) {
                // Another code object at the address since: not this one.
                Ok(c) if check(mem, layout, w.code, &c) == Some(w.check) => Some(Arc::new(c)),
                Ok(_) => None,
                Err(e) => {
                    log::debug!("python: code object {:#x} unreadable: {e}", w.code);
                    None
                }
            };
            // The kernel's copy, where memory no longer holds the object.
            let copy = self.copies.remove(&key);
            let code = code.or(copy);
            match &code {
                Some(c) if shared.len() < SHARED_KEPT => {
                    shared.insert(key, c.clone());
                }
                Some(_) => {}
                None => self.unnamed += 1,
            }
            self.known.insert(key, code);
        }
    }

    /// Takes the kernel's copy of a code object (`snap`), read with the
    /// layout of its interpreter's version: it names the object whether
    /// or not it still lives, also one counted unnamed before. A copy that
    /// cut the object's line table short names it only if memory cannot.
    pub fn copied(
        &mut self,
        snap: &tracer_common::PyCodeSnap,
        shared: &mut HashMap<(u64, u32), Arc<Code>>,
    ) {
        let key = (snap.code, snap.check);
        if matches!(self.known.get(&key), Some(Some(_))) {
            return;
        }
        let Some(code) = super::snap::read(snap) else {
            return;
        };
        let code = Arc::new(code);
        if code.lines_cut() && !self.known.contains_key(&key) {
            self.copies.insert(key, code);
            return;
        }
        if let Some(None) = self.known.insert(key, Some(code.clone())) {
            self.unnamed = self.unnamed.saturating_sub(1);
        }
        if shared.len() < SHARED_KEPT {
            shared.insert(key, code);
        }
    }

    /// Takes over what `old` (the names of the same process before its
    /// interpreter was found) named.
    pub fn adopt(&mut self, old: Names) {
        for (key, code) in old.known {
            if let Some(code) = code {
                self.known.entry(key).or_insert(Some(code));
            }
        }
        for (key, code) in old.copies {
            self.copies.entry(key).or_insert(code);
        }
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
    /// stack's Python words), the mark of a cut after the last frame kept.
    /// Runs the native walk did not reach go at the end; eval-loop frames
    /// without Python frames stay.
    pub fn splice(&self, native: Vec<Arc<Frame>>, words: &[u64]) -> Vec<Arc<Frame>> {
        let mut runs: Vec<Vec<Arc<Frame>>> = Vec::new();
        let mut run = Vec::new();
        for item in py_items(words) {
            match item {
                PyItem::Frame(w) => {
                    run.push(Arc::new(self.frame(w)));
                    if w.entry {
                        runs.push(std::mem::take(&mut run));
                    }
                }
                // The cut follows the last frame kept, in its run (the
                // eval-loop frames of the runs left out stay as they are).
                PyItem::Cut { left, more } => match runs.last_mut() {
                    Some(last) if run.is_empty() => last.push(Arc::new(cut_frame(left, more))),
                    _ => run.push(Arc::new(cut_frame(left, more))),
                },
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
    use tracer_common::{py_cut_words, py_frame_words};

    fn native(name: &str) -> Arc<Frame> {
        Arc::new(Frame {
            function: name.into(),
            ..Frame::default()
        })
    }

    /// Native frames with two runs of the eval loop.
    fn two_runs() -> Vec<Arc<Frame>> {
        vec![
            native("PyUnicode_New"),
            native(EVAL_LOOP),
            native("PyObject_Call"),
            native(EVAL_LOOP),
            native("main"),
        ]
    }

    fn unread() -> Names {
        Names {
            mem: None,
            layout: CodeLayout::for_minor(11),
            minor: 11,
            known: HashMap::new(),
            unnamed: 0,
            pending: None,
            unreadable: None,
            copies: HashMap::new(),
        }
    }

    /// The mark of a cut follows the last frame kept, in its run: the
    /// eval-loop frames of the runs not kept stay.
    #[test]
    fn a_cut_shows_where_the_frames_stop() {
        let names = unread();
        let got = |words: Vec<u64>| -> Vec<String> {
            names
                .splice(two_runs(), &words)
                .into_iter()
                .map(|f| f.function.clone())
                .collect()
        };
        // A run cut short (3.11: no entry frame read); each frame a run
        // (3.10), the mark staying with the last one.
        for (entry, left, more, mark) in [
            (false, 0, true, "[Python frames not read]"),
            (true, 7, false, "[7 Python frames not read]"),
        ] {
            let mut words = py_frame_words(0x10, entry, 4, 1).to_vec();
            words.extend(py_cut_words(left, more));
            assert_eq!(
                got(words),
                [
                    "PyUnicode_New",
                    "[python code 0x10]",
                    mark,
                    "PyObject_Call",
                    EVAL_LOOP,
                    "main"
                ]
            );
        }
        assert_eq!(cut_frame(1, false).function, "[1 Python frame not read]");
        assert_eq!(
            cut_frame(3, true).function,
            "[more than 3 Python frames not read]"
        );
    }

    #[test]
    fn runs_replace_eval_loop_frames_in_order() {
        let names = unread();
        // Two runs: (0x10, 0x20 entry), (0x30 entry).
        let mut words = vec![0x401000u64, 0x402000];
        for (code, entry) in [(0x10, false), (0x20, true), (0x30, true)] {
            words.extend(py_frame_words(code, entry, 4, 1));
        }
        let (n, py) = split(&words);
        assert_eq!(n.len(), 2);
        let frames = names.splice(two_runs(), py);
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
