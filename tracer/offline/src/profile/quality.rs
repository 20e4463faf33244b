//! How whole the stacks are and how well their frames were named: the
//! stack-quality counters of a profile (native, Python, perf maps, symbols).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::meta::is_zero;

/// How whole the stacks are: of the calls counted under a stack, how many
/// reached the thread's outermost frame (`_start`, or the thread's start
/// routine), and why the others stopped short.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StackQuality {
    /// Calls counted under a stack.
    pub calls: u64,
    /// Of those, calls whose stack is whole.
    pub whole: u64,
    /// Calls whose stack stopped short, by cause: `no_cfi` (code without
    /// call-frame information), `max_frames`, `bad_frame` (a corrupt stack
    /// or a wrong rule), `read_failed` (the stack could not be read),
    /// `copy_lost` (a walk for the tracer to finish found its ring full),
    /// `rules_full` (the kernel's map of unwind rules was full), `unknown`
    /// (the stack map was full: see `losses`).
    pub truncated: BTreeMap<String, u64>,
    /// Walks the BPF side handed to the tracer for want of an unwind rule
    /// (finished there, not a loss).
    #[serde(default)]
    pub finished_by_tracer: u64,
    /// Stacks the BPF side walked frame by frame; the other calls' stacks
    /// came from a remembered walk from the same place whose stack words
    /// were all still there (or from the tracer). Not a loss: how much
    /// walking the kernel did. Absent in older profiles.
    #[serde(default)]
    pub walked_in_kernel: u64,
    /// Launch mode: times a thread was held (stopped) until the tracer had
    /// finished the walks it had handed over, their ring a quarter full; so
    /// that its next walks found room. Not a loss: the program waited.
    /// Absent when none was (or in older profiles).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held_for_tracer: u64,
    /// Launch mode: times a walk's copy found that ring a quarter full in
    /// a thread that blocks the signal that holds it (SIGURG), as a
    /// program that takes its signals with sigwait or a signalfd does:
    /// the thread was sent none (the program would take it as its own)
    /// and not held, so its later copies may find the ring full
    /// (`copy_lost`). Absent when none did.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub not_held: u64,
    /// `--max-stack N`: the walk kept at most N frames above the direct
    /// caller (0: the caller only); a stack cut there counts under
    /// `max_frames`. Absent without a limit (or in older profiles).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame_limit: Option<u32>,
    /// A Python process's frames: what could not be read or named.
    /// Absent where no CPython interpreter was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<PythonQuality>,
    /// JIT code's names from the runtime's perf map: what could not be
    /// kept or read. Absent where no perf map was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perf_map: Option<PerfMapQuality>,
    /// Stripped files' debug information, looked up by build id. Absent
    /// where no stripped file was met.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symbols: Option<SymbolsQuality>,
}

/// Debug information for the stripped files of a run (each counted once
/// per build id, for the whole run): found on the machine, fetched from a
/// debuginfod server, or not found, its frames left as addresses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SymbolsQuality {
    /// Files without symbols or debug information met, by build id.
    #[serde(default)]
    pub stripped_files: u64,
    /// Their debug files found on this machine: in a debug directory's
    /// `.build-id` tree or in the debuginfod client's cache.
    #[serde(default)]
    pub local: u64,
    /// Fetched from a server of `DEBUGINFOD_URLS`.
    #[serde(default)]
    pub fetched: u64,
    /// On no server asked (or none was asked: no `DEBUGINFOD_URLS`, or
    /// `--no-debuginfod`).
    #[serde(default)]
    pub not_on_servers: u64,
    /// Not fetched because a server failed (a timeout, an error).
    #[serde(default)]
    pub not_fetched: u64,
}

impl SymbolsQuality {
    /// Each count the larger of the two: both are of the same run, one
    /// later than the other.
    pub fn latest(self, o: SymbolsQuality) -> SymbolsQuality {
        SymbolsQuality {
            stripped_files: self.stripped_files.max(o.stripped_files),
            local: self.local.max(o.local),
            fetched: self.fetched.max(o.fetched),
            not_on_servers: self.not_on_servers.max(o.not_on_servers),
            not_fetched: self.not_fetched.max(o.not_fetched),
        }
    }
}

/// How whole a Python process's Python frames are. Each count is of
/// stacks' frames, not of calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PythonQuality {
    /// Stacks walked in the process: with Python frames; before the
    /// interpreter started (or after it ended); in a thread without a
    /// thread state (not a Python thread); in a Python thread running no
    /// Python code (in C only). Walks, not calls: sampled, the samples.
    #[serde(default)]
    pub with_frames: u64,
    #[serde(default)]
    pub no_interpreter: u64,
    #[serde(default)]
    pub no_thread_state: u64,
    #[serde(default)]
    pub no_code_running: u64,
    /// Stacks walked in a thread whose thread state, if it has one, lies
    /// past the first 4096 of the interpreter's list (not searched).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub threads_beyond: u64,
    /// Python frames left out for want of room (the stack's native frames
    /// took most of the 127 slots, or more than 47 Python frames): the
    /// stack shows `[N Python frames not read]` where they are missing.
    pub cut: u64,
    /// Walks whose Python frames ended at a frame that could not be read.
    pub unreadable: u64,
    /// Code objects that could not be named (gone or replaced before the
    /// tracer read them): shown as `[python code 0x...]`.
    pub unnamed: u64,
    /// Notices of new stacks and copies of new code objects that found
    /// the ring to the tracer full: those code objects were named later
    /// from the process, if they still lived, else shown unnamed.
    pub notices_lost: u64,
    /// Calls whose stack runs the eval loop with no Python frame read:
    /// the process was not known to run an interpreter at the call (one
    /// not found in its mappings, an embedding program's say; on the host
    /// engine also one gone before the tracer looked at it, or before its
    /// libpython was known); their stacks show the eval loop's frames.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub not_known: u64,
}

/// A JIT's perf map (`/tmp/perf-PID.map`) as mtrace read it, summed over
/// the processes that had one. The names are kept within a ceiling per
/// process, the oldest evicted first; each count is of lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PerfMapQuality {
    /// Lines read that named code.
    #[serde(default)]
    pub lines: u64,
    /// Pieces of code named when the profile was made.
    #[serde(default)]
    pub kept: u64,
    /// Names evicted to stay within the ceiling: their code's frames read
    /// `[anonymous code 0x...]`.
    #[serde(default)]
    pub evicted: u64,
    /// Names longer than the longest kept, cut.
    #[serde(default)]
    pub names_cut: u64,
    /// Lines that are not `START SIZE NAME`, skipped.
    #[serde(default)]
    pub bad_lines: u64,
    /// Bytes of the map not read yet when the profile was made.
    #[serde(default)]
    pub unread_bytes: u64,
    /// Times the map was read again from its start: another file at its
    /// path, or the file truncated or rewritten.
    #[serde(default)]
    pub rereads: u64,
}

impl PerfMapQuality {
    /// Both maps' counts added (two processes', or two images').
    pub fn plus(self, o: PerfMapQuality) -> PerfMapQuality {
        PerfMapQuality {
            lines: self.lines + o.lines,
            kept: self.kept + o.kept,
            evicted: self.evicted + o.evicted,
            names_cut: self.names_cut + o.names_cut,
            bad_lines: self.bad_lines + o.bad_lines,
            unread_bytes: self.unread_bytes + o.unread_bytes,
            rereads: self.rereads + o.rereads,
        }
    }
}

impl StackQuality {
    /// The share of calls with a whole stack, in percent (100 without calls).
    pub fn whole_pct(&self) -> f64 {
        if self.calls == 0 {
            100.0
        } else {
            self.whole as f64 * 100.0 / self.calls as f64
        }
    }
}
