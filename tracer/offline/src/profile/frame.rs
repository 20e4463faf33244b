//! Frames: one source-level frame, where its file was mapped, and the order
//! frames are compared in.

use std::{borrow::Cow, sync::Arc};

use foldhash::HashMap;
use serde::{Deserialize, Serialize};

use super::StackEntry;

/// One source-level frame. An inlined function gets a frame of its own with
/// `inlined = true`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Frame {
    /// Demangled function name, or `[unknown]` / `module+0xoffset` when no
    /// symbol was found.
    pub function: String,
    pub file: Option<String>,
    pub line: Option<u32>,
    /// Path of the ELF object the address belongs to, as the target mapped it.
    pub module: Option<String>,
    /// GNU build id of that object, in hex.
    #[serde(default)]
    pub build_id: Option<String>,
    /// Offset of the address in that object's file.
    #[serde(default)]
    pub file_offset: Option<u64>,
    /// The address in the target (a return address for all but the
    /// innermost frame).
    #[serde(rename = "address")]
    pub addr: u64,
    pub inlined: bool,
    /// The target's mapping of the file the address is in, where the
    /// target's mappings were kept (not for a caller the host scope found
    /// by file offset, nor in files written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mapping: Option<FileMapping>,
    /// Where no line is known: the return address's offset from the
    /// start of its function's symbol, which tells apart rows whose
    /// frames would print the same (`deflateInit2_+0x7b`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symbol_offset: Option<u64>,
}

/// The name of the frame at a program's entry point (`e_entry` of its ELF
/// header) where no symbol names it, as gdb and perf name it.
pub const ENTRY_POINT: &str = "_start";

/// Where a target mapped part of a file (a line of `/proc/PID/maps`): the
/// addresses from `start` up to `limit` hold the file's bytes from
/// `offset` on, so an address `a` in it is at `a - start + offset` in the
/// file, as pprof's mappings and the backends that symbolize them count.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct FileMapping {
    pub start: u64,
    pub limit: u64,
    pub offset: u64,
}

impl Frame {
    /// `function (file:line)` or just `function`.
    pub fn describe(&self) -> String {
        format!("{}{}", self.function, self.place(Cow::Borrowed))
    }

    /// What [`Frame::describe`] writes after the function's name: ` (file:line)`,
    /// ` (file)`, ` [object]` for a frame no symbol names, or nothing.
    /// Each path is written as its last component passed through `shown`.
    pub fn place<'a>(&'a self, shown: impl Fn(&'a str) -> Cow<'a, str>) -> String {
        match (&self.file, self.line) {
            (Some(f), Some(l)) => format!(" ({}:{l})", shown(short_path(f))),
            (Some(f), None) => format!(" ({})", shown(short_path(f))),
            _ => match &self.module {
                Some(m) if self.function.starts_with('[') || self.function.contains("+0x") => {
                    format!(" [{}]", shown(short_path(m)))
                }
                _ => String::new(),
            },
        }
    }
}

/// Every distinct frame of some stacks numbered in the order of its
/// content: equal frames (one shared [`Arc`] or several) get one number,
/// and two stacks' numbers compare as their frames do. Each [`Arc`] is
/// looked at once, so grouping and ordering stacks by their numbers costs
/// a number per frame of a stack, however long the frames' names are.
pub struct FrameOrder {
    rank: HashMap<*const Frame, u32>,
}

impl FrameOrder {
    /// Numbers the frames of `stacks`.
    pub fn of<'a>(stacks: impl IntoIterator<Item = &'a StackEntry>) -> FrameOrder {
        let mut rank: HashMap<_, _> = HashMap::default();
        let mut distinct: Vec<&Arc<Frame>> = Vec::new();
        for f in stacks.into_iter().flat_map(|st| &st.frames) {
            rank.entry(Arc::as_ptr(f)).or_insert_with(|| {
                distinct.push(f);
                0
            });
        }
        distinct.sort_unstable();
        let mut n = 0;
        for (i, f) in distinct.iter().enumerate() {
            if i > 0 && distinct[i - 1] != *f {
                n += 1;
            }
            rank.insert(Arc::as_ptr(f), n);
        }
        FrameOrder { rank }
    }

    /// The numbers of `frames`, which must be frames of the stacks this
    /// was made of.
    pub fn ranks(&self, frames: &[Arc<Frame>]) -> Vec<u32> {
        frames.iter().map(|f| self.rank[&Arc::as_ptr(f)]).collect()
    }
}

/// Last path component.
pub fn short_path(p: &str) -> &str {
    p.rsplit('/').next().unwrap_or(p)
}
