//! Go programs' own heap, read, not probed.
//!
//! Go's heap is not malloc: `new`, `make` and the rest are the runtime's
//! own allocator, which no uprobe on malloc sees. But every Go program
//! keeps a sampled profile of it (one allocation per
//! `runtime.MemProfileRate` bytes, 512 KiB by default), by stack, and
//! updates it at every garbage collection whether anyone reads it or
//! not. mtrace reads it out of the program's memory at each reading of
//! the trace (its end, a snapshot, an agent's request; the program's exit
//! when held there), never writes into it, and shows it as rows of the
//! allocator [`GO_HEAP_FUNC`] beside the malloc rows: estimates, scaled
//! as Go's own pprof scales them ([`heap::scale`]).
//!
//! The executable ([`binary`]) gives the version, the addresses of the
//! profile and of its rate, and the function table that names the stacks
//! ([`pclntab`]). [`unseen`] says what heaps cannot be seen at all.

pub mod binary;
pub mod heap;
pub mod pclntab;
pub mod unseen;

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    sync::Mutex,
};

use crate::{
    profile::{Counts, Frame, GoHeap, Profile, StackEntry, Unseen, GO_HEAP_FUNC},
    tracee::{self, Mapping, Mem},
};

use self::{binary::GoBinary, heap::Walk, pclntab::FrameCache};

/// A Go program whose heap profile mtrace reads.
pub struct GoProcess {
    pub pid: u32,
    /// Its command name when found.
    pub name: String,
    binary: GoBinary,
    /// Its executable as it sees it (the frames' module).
    exe: String,
    /// What its addresses are moved by (a position-independent
    /// executable's load address; 0 otherwise).
    bias: u64,
    /// What each bucket had counted (allocations, bytes) when mtrace came:
    /// the rows count from there. Empty for a program that had recorded
    /// nothing (launched by mtrace).
    baseline: HashMap<u64, (u64, u64)>,
    names: Mutex<FrameCache>,
    /// The reading made while it was held at its exit (`exit`), or the
    /// last one made before it ended (`last`, see [`GoProcess::ended`]).
    at_exit: Option<(Reading, &'static str)>,
    /// The last reading made while it ran.
    last: Mutex<Option<Reading>>,
}

/// One reading of the profile.
#[derive(Clone, Debug)]
pub struct Reading {
    pub rate: u64,
    pub walk: Walk,
}

/// What a process is, as far as its Go heap goes.
pub enum Found {
    /// Not a Go program.
    None,
    /// A Go program whose profile is read.
    Go(Box<GoProcess>),
    /// A Go program whose profile cannot be read: why, in one line.
    Unreadable(Unseen),
}

/// The load bias of `exe` in `maps`: where its first file page is mapped,
/// less where its first loadable segment asks to be.
fn load_bias(maps: &[Mapping], exe: &str, binary: &GoBinary) -> u64 {
    if !binary.pie {
        return 0;
    }
    let lowest = binary
        .segments
        .iter()
        .filter(|(_, offset, _)| *offset == 0)
        .map(|(addr, _, _)| *addr & !0xfff)
        .min()
        .unwrap_or(0);
    maps.iter()
        .find(|m| m.path == exe && m.offset == 0)
        .map_or(0, |m| m.start.wrapping_sub(lowest))
}

/// `pid`'s Go heap, if it is a Go program (`maps` its mappings now).
/// Reads the profile once: what it had counted before mtrace came is the
/// baseline its rows count from.
pub fn detect(pid: u32, maps: &[Mapping]) -> Found {
    let exe_link = format!("/proc/{pid}/exe");
    if !binary::is_go(Path::new(&exe_link)) {
        return Found::None;
    }
    let name = tracee::comm(pid);
    let unreadable = |why: String| {
        Found::Unreadable(Unseen {
            pid,
            name: name.clone(),
            heap: "go heap".into(),
            why,
        })
    };
    let binary = match GoBinary::open(Path::new(&exe_link)) {
        Ok(b) => b,
        Err(e) => return unreadable(format!("{e:#}")),
    };
    let exe = tracee::executable(pid);
    let bias = load_bias(maps, &exe, &binary);
    let mut go = GoProcess {
        pid,
        name,
        binary,
        exe,
        bias,
        baseline: HashMap::new(),
        names: Mutex::new(FrameCache::default()),
        at_exit: None,
        last: Mutex::new(None),
    };
    if let Some(r) = go.read() {
        go.baseline = r
            .walk
            .buckets
            .iter()
            .map(|b| (b.addr, (b.allocs, b.alloc_bytes)))
            .collect();
    }
    log::debug!(
        "pid {pid}: {} ({} found by {}), {} buckets before the trace",
        go.binary.version,
        "its heap profile",
        go.binary.found_by,
        go.baseline.len()
    );
    Found::Go(Box::new(go))
}

impl GoProcess {
    /// The profile now, from its memory; `None` when it cannot be read
    /// (the process is gone).
    pub fn read(&self) -> Option<Reading> {
        let mem = Mem::open(self.pid)?;
        let rate = mem.u64(self.binary.rate + self.bias)?;
        let walk = heap::walk(
            &mem,
            self.binary.mbuckets + self.bias,
            self.binary.max_stack(),
        )?;
        Some(Reading { rate, walk })
    }

    /// It is held at its exit, its memory still there: the reading is
    /// made now and stands for every later one.
    pub fn keep_exit_reading(&mut self) {
        if self.at_exit.is_none() {
            self.at_exit = self.read().map(|r| (r, "exit"));
        }
    }

    /// Reads the profile now and keeps it as the last reading (what
    /// stands once it has ended, [`GoProcess::ended`]).
    pub fn refresh(&self) {
        if let Some(r) = self.read() {
            *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        }
    }

    /// Whether a reading stands for it once it has ended.
    pub fn has_reading(&self) -> bool {
        self.at_exit.is_some()
    }

    /// It started after mtrace came: its rows count every allocation
    /// since its start, none of them left out as counted before.
    pub fn count_from_start(&mut self) {
        self.baseline.clear();
    }

    /// It has ended, or exec'd another program (its memory is gone or
    /// another's): the last reading made while it ran stands for every
    /// later one.
    pub fn ended(&mut self) {
        if self.at_exit.is_none() {
            self.at_exit = self
                .last
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .map(|r| (r, "last"));
        }
    }

    pub fn version(&self) -> &str {
        &self.binary.version
    }

    /// Its rows and record (or why it has none) added to `profile`.
    pub fn add_to(&self, profile: &mut Profile) {
        let (reading, read_at) = match &self.at_exit {
            Some((r, at)) => (Some(r.clone()), *at),
            None => (self.read(), "running"),
        };
        if let (Some(r), None) = (&reading, &self.at_exit) {
            *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(r.clone());
        }
        let Some(reading) = reading else {
            profile.unseen.push(self.unseen(
                "its memory could not be read (gone before its heap was read at its exit or before)"
                    .into(),
            ));
            return;
        };
        if reading.rate == 0 {
            profile.unseen.push(self.unseen(format!(
                "{}: runtime.MemProfileRate is 0, its runtime samples no allocation (a program that never links runtime.MemProfile, through runtime/pprof or net/http/pprof, has it 0; mtrace does not write into it)",
                self.binary.version
            )));
            return;
        }
        let (rows, record) = self.rows(&reading, read_at);
        profile.stacks.extend(rows);
        profile.go_heaps.push(record);
    }

    fn unseen(&self, why: String) -> Unseen {
        Unseen {
            pid: self.pid,
            name: self.name.clone(),
            heap: "go heap".into(),
            why,
        }
    }

    /// The frame of return address `ret`.
    fn frame(&self, table: Option<&pclntab::Pclntab<'_>>, ret: u64) -> Frame {
        let linked = ret.wrapping_sub(self.bias);
        let file_offset = self
            .binary
            .segments
            .iter()
            .find(|(start, _, size)| linked >= *start && linked < start + size)
            .map(|(start, offset, _)| linked - start + offset);
        let named = table.and_then(|t| {
            let mut cache = self.names.lock().unwrap_or_else(|e| e.into_inner());
            cache.frame(t, linked).cloned()
        });
        match named {
            Some(g) => Frame {
                function: g.function,
                file: g.file,
                line: g.line,
                module: Some(self.exe.clone()),
                build_id: None,
                file_offset,
                addr: ret,
                inlined: g.inlined,
                mapping: None,
                symbol_offset: None,
            },
            None => Frame {
                function: format!(
                    "{}+{:#x}",
                    crate::profile::short_path(&self.exe),
                    file_offset.unwrap_or(linked)
                ),
                module: Some(self.exe.clone()),
                file_offset,
                addr: ret,
                ..Frame::default()
            },
        }
    }

    /// The rows of `reading`: one per bucket (a stack and an object
    /// size, as Go's pprof has one sample per bucket), scaled as Go's
    /// pprof scales it; the runtime's own frames above the first of the
    /// program left out, as Go's pprof leaves them out (two buckets whose
    /// stacks differ there only are joined).
    fn rows(&self, reading: &Reading, read_at: &str) -> (Vec<StackEntry>, GoHeap) {
        let table = self.binary.pclntab();
        let mut rows: BTreeMap<(Vec<Frame>, u64), (Counts, Counts)> = BTreeMap::new();
        let mut record = GoHeap {
            pid: self.pid,
            name: self.name.clone(),
            version: self.binary.version.clone(),
            rate: reading.rate,
            since: if self.baseline.is_empty() {
                "start"
            } else {
                "attach"
            }
            .into(),
            read_at: read_at.into(),
            buckets: reading.walk.buckets.len() as u64,
            unreadable: reading.walk.unreadable,
            inconsistent: reading.walk.inconsistent,
            cut: reading.walk.cut,
            ..GoHeap::default()
        };
        for b in &reading.walk.buckets {
            let (base_allocs, base_bytes) = self.baseline.get(&b.addr).copied().unwrap_or((0, 0));
            let (allocs, bytes) = heap::scale(
                b.allocs.saturating_sub(base_allocs),
                b.alloc_bytes.saturating_sub(base_bytes),
                reading.rate,
            );
            let (in_use, in_use_bytes) = heap::scale(
                b.allocs - b.frees,
                b.alloc_bytes - b.free_bytes,
                reading.rate,
            );
            if allocs == 0 && in_use == 0 {
                continue;
            }
            let mut frames: Vec<Frame> = b
                .stack
                .iter()
                .map(|&pc| self.frame(table.as_ref(), pc))
                .collect();
            if let Some(first) = frames
                .iter()
                .position(|f| !f.function.starts_with("runtime."))
            {
                frames.drain(..first);
            }
            let row = rows.entry((frames, b.size)).or_default();
            row.0.add(Counts {
                calls: allocs,
                bytes,
            });
            row.1.add(Counts {
                calls: in_use,
                bytes: in_use_bytes,
            });
        }
        let entries = rows
            .into_iter()
            .map(|((frames, size), (allocated, in_use))| {
                record.allocated.add(allocated);
                record.in_use.add(in_use);
                StackEntry {
                    func: GO_HEAP_FUNC.into(),
                    frames: frames.into_iter().map(std::sync::Arc::new).collect(),
                    counts: allocated,
                    in_use: Some(in_use),
                    object_size: Some(size),
                    ..StackEntry::default()
                }
            })
            .collect();
        (entries, record)
    }
}
