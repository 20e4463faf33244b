//! The host scope's Python processes: which processes run a CPython
//! interpreter mtrace reads (learned from their mappings when they are
//! first seen and again after an exec, once the dynamic linker has mapped
//! libpython), their layout put in the kernel's table (`HOST_PYTHON`) for
//! the walks to read Python frames by, and their code objects named while
//! they live (told by the kernel's notices and by the walks the tracer
//! finishes), for the stacks to show Python frames in place of the eval
//! loop's, as a traced process's do.

use std::collections::{HashMap, HashSet};

use anyhow::Result;
use aya::{
    maps::{HashMap as BpfHashMap, MapData},
    Ebpf,
};
use tracer_common::{maps, HostFileId, PyNotice, PythonLayout, PY_MAX_FRAMES};

use crate::{
    profile::Frame,
    python::{self, state::State, Found, Interpreter, Names},
};

/// The host scope's Python processes.
pub struct HostPython {
    map: BpfHashMap<MapData, u32, PythonLayout>,
    /// The kernel's table of interpreter files, by tag.
    files: BpfHashMap<MapData, u32, PythonLayout>,
    /// The kernel's counters, of which the tracer's part of the
    /// interpreter epoch (`HOST_NEXT_PY_EPOCH_TRACER`), raised after each
    /// entry put in `map` or `files`: a remembered walk of the epoch before
    /// serves no process that runs an interpreter.
    next: aya::maps::Array<MapData, u64>,
    /// That part's value.
    epoch: u64,
    /// Files put in it, by identity.
    files_known: HashSet<HostFileId>,
    /// Processes whose interpreter was found since their exec (read, or
    /// said to be unreadable), by process id.
    seen: HashSet<u32>,
    /// Processes looked at when their first Python frames came (once).
    late: HashSet<u32>,
    /// Processes whose interpreter state was judged unreadable.
    unreadable: HashSet<u32>,
    /// Each process's code objects, by process id and address space
    /// (0: learned before the kernel named its address space; taken by
    /// the first notice or walk that names it).
    names: HashMap<(u32, u64), Names>,
    /// Code objects named, by interpreter version, address and check:
    /// one a stack of another process of the same interpreter holds (a
    /// frozen module's, at the same address in every process of the
    /// file) is named from here. The kernel tells of a stack's code
    /// objects once for all processes (the stack map is the host's), so
    /// a later process's are known only from here once it is gone.
    shared: HashMap<u8, HashMap<(u64, u32), std::sync::Arc<python::code::Code>>>,
    /// What the report says of the interpreters found, one line each.
    pub said: Vec<String>,
    /// Python processes the kernel's table had no room for (their stacks
    /// have native frames only).
    pub full: u64,
    /// Code objects not named in processes forgotten since (their names
    /// go with them; the count stays).
    unnamed_gone: u64,
    /// Stacks are walked (no Python frames without a walk).
    walking: bool,
}

/// Lines of [`HostPython::said`] kept.
const SAID_KEPT: usize = 16;

impl HostPython {
    pub fn new(ebpf: &Ebpf, walking: bool) -> Result<HostPython> {
        let map = crate::probes::pool::map_copy(ebpf, maps::HOST_PYTHON)?;
        let files = crate::probes::pool::map_copy(ebpf, maps::HOST_PY_FILES)?;
        let next = crate::probes::pool::map_copy(ebpf, maps::HOST_NEXT)?;
        Ok(HostPython {
            map: BpfHashMap::try_from(map)?,
            files: BpfHashMap::try_from(files)?,
            next: aya::maps::Array::try_from(next)?,
            epoch: 0,
            files_known: HashSet::new(),
            seen: HashSet::new(),
            late: HashSet::new(),
            unreadable: HashSet::new(),
            names: HashMap::new(),
            said: Vec::new(),
            shared: HashMap::new(),
            full: 0,
            unnamed_gone: 0,
            walking,
        })
    }

    /// Whether process `pid` needs a look (not looked at with an
    /// interpreter found since its exec).
    pub fn known(&self, pid: u32) -> bool {
        self.seen.contains(&pid)
    }

    /// Looks at process `pid`'s mappings (`maps`, its `/proc/PID/maps`)
    /// for an interpreter mtrace reads: its layout goes into the kernel's
    /// table, from which the process's next walk reads its Python frames.
    /// `mm`: its address space when known (0 at the start's scan). A
    /// process without one is looked at again at its next look. The
    /// interpreter's file and its layout from the file's code mapping,
    /// when it is one not seen before (for [`HostPython::add_file`]).
    pub fn look(&mut self, pid: u32, mm: u64, maps: &str) -> Option<(HostFileId, PythonLayout)> {
        if !self.walking || self.known(pid) || !maps.contains("python") {
            return None;
        }
        let mappings = crate::tracee::parse_maps(maps);
        let found = self.look_in(pid, mm, &mappings)?;
        let (code, runtime) = python::files::from_code_mapping(&found, &mappings)?;
        let id = super::walks::file_id(code);
        let layout = PythonLayout {
            runtime,
            ..found.layout
        };
        (!self.files_known.contains(&id)).then_some((id, layout))
    }

    /// Puts file `id`'s interpreter (its layout from its code mapping)
    /// under its tag `tag` in the kernel's table: a process whose direct
    /// caller is in it is known to run it from its first walk on.
    pub fn add_file(&mut self, id: HostFileId, tag: u32, layout: PythonLayout) {
        if !self.files_known.insert(id) {
            return;
        }
        match self.files.insert(tag, layout, 0) {
            Ok(()) => self.raise_epoch(),
            Err(_) => log::debug!(
                "interpreter file {}:{}: no room in the kernel's table",
                id.dev,
                id.ino
            ),
        }
    }

    /// Raises the tracer's part of the interpreter epoch, an entry having
    /// been put in the kernel's tables. Where it cannot be written, the
    /// remembered walks of the program would keep serving a process found
    /// to run an interpreter since without its Python frames: that is
    /// said.
    fn raise_epoch(&mut self) {
        self.epoch += 1;
        if let Err(e) = self
            .next
            .set(tracer_common::HOST_NEXT_PY_EPOCH_TRACER, self.epoch, 0)
        {
            log::warn!("the kernel's interpreter epoch not raised ({e}): stacks remembered before may lack Python frames");
        }
    }

    /// Whether file `id` is in the kernel's table of interpreter files.
    pub fn has_file(&self, id: &HostFileId) -> bool {
        self.files_known.contains(id)
    }

    fn look_in(
        &mut self,
        pid: u32,
        mm: u64,
        mappings: &[crate::tracee::Mapping],
    ) -> Option<Interpreter> {
        let interpreter = match python::detect(pid, mappings) {
            Found::Known(i) => i,
            Found::Unknown(why) => {
                python::say_once(&why);
                self.say(why);
                self.seen.insert(pid);
                return None;
            }
            Found::None => return None,
        };
        let pending = match python::state::settled_in(pid, &interpreter.layout) {
            State::Unreadable(why) => {
                let line = python::state::unreadable_line(&interpreter.name(), &why);
                python::say_once(&line);
                self.say(line);
                self.seen.insert(pid);
                return None;
            }
            State::Readable => None,
            State::NotYet => Some((interpreter.layout, interpreter.name())),
        };
        let names = Names::new(pid, interpreter.minor, pending)?;
        if let Err(e) = self.map.insert(pid, interpreter.layout, 0) {
            log::debug!("pid {pid}: its interpreter's layout not kept: {e}");
            self.full += 1;
            self.seen.insert(pid);
            return None;
        }
        self.raise_epoch();
        self.say(interpreter.describe());
        // (Names learned already under this address space stay: the exec's
        // word can come after the process's first notices.)
        let slot = self.names.entry((pid, mm)).or_insert_with(Names::gone);
        if slot.is_gone() {
            let old = std::mem::replace(slot, names);
            slot.adopt(old);
        }
        self.seen.insert(pid);
        Some(interpreter)
    }

    fn say(&mut self, line: String) {
        if self.said.len() < SAID_KEPT && !self.said.contains(&line) {
            self.said.push(line);
        }
    }

    /// Judges the interpreter state of process `pid` where it was not
    /// yet (it had no thread when first looked at): one that cannot be
    /// read is said once, and read no more.
    pub fn judge(&mut self, pid: u32) {
        self.judge_where(|p| p == pid);
    }

    /// Judges every process's interpreter not judged yet (at a reading).
    pub fn judge_all(&mut self) {
        self.judge_where(|_| true);
    }

    fn judge_where(&mut self, which: impl Fn(u32) -> bool) {
        let mut lines = Vec::new();
        for ((p, _), names) in self.names.iter_mut() {
            if which(*p) {
                lines.extend(names.judge().map(|l| (*p, l.to_string())));
            }
        }
        for (pid, line) in lines {
            python::say_once(&line);
            let _ = self.map.remove(&pid);
            self.unreadable.insert(pid);
            // In place of what was said of the interpreter.
            let who = line.split(": its interpreter state").next().unwrap_or("");
            self.said.retain(|l| !l.starts_with(who));
            self.say(line);
        }
    }

    /// Whether every interpreter found was judged unreadable (then no
    /// Python figures are reported: its frames were never read).
    pub fn none_readable(&self) -> bool {
        !self.names.is_empty() && self.names.keys().all(|(p, _)| self.unreadable.contains(p))
    }

    /// Process `pid` exec'd: its interpreter is looked for again (the
    /// kernel took its layout out). The old program's code objects stay
    /// named under its address space.
    pub fn execd(&mut self, pid: u32) {
        self.seen.remove(&pid);
        self.late.remove(&pid);
        if let Some(names) = self.names.remove(&(pid, 0)) {
            self.unnamed_gone += names.unnamed;
        }
    }

    /// The names of process `pid`'s code objects in address space `mm`.
    fn names_of(&mut self, pid: u32, mm: u64) -> Option<&mut Names> {
        if !self.names.contains_key(&(pid, mm)) {
            let names = self.names.remove(&(pid, 0))?;
            self.names.insert((pid, mm), names);
        }
        self.names.get_mut(&(pid, mm))
    }

    /// Reads the code objects a stack's Python words (`words`) of process
    /// `pid` (address space `mm`) hold, while it lives.
    pub fn learn(&mut self, pid: u32, mm: u64, words: &[u64]) {
        if words.is_empty() {
            return;
        }
        self.names_late(pid, mm);
        let names = self.names.entry((pid, mm)).or_insert_with(Names::gone);
        let shared = self.shared.entry(names.minor).or_default();
        names.learn_with(words, shared);
    }

    /// Makes the names of process `pid`'s code objects in address space
    /// `mm` ready, its interpreter looked for first if it was not (the kernel found
    /// it by its file before the tracer looked: looked at now, while its
    /// code objects live).
    fn names_late(&mut self, pid: u32, mm: u64) {
        if !self.seen.contains(&pid) && self.late.insert(pid) {
            if let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
                let _ = self.look(pid, mm, &text);
            }
        }
        self.names_of(pid, mm);
    }

    /// A notice of a new stack's Python frames (a ring record shorter
    /// than a walk's).
    pub fn notice(&mut self, record: &[u8]) {
        if let Some(snap) = python::snap::parse(record) {
            // A code object's copy, ahead of its stack's notice.
            self.names_late(snap.tgid, snap.mm);
            let key = (snap.tgid, snap.mm);
            let names = self.names.entry(key).or_insert_with(Names::gone);
            let shared = self.shared.entry(snap.minor as u8).or_default();
            names.copied(&snap, shared);
            return;
        }
        if record.len() < std::mem::size_of::<PyNotice>() {
            return;
        }
        // SAFETY: `PyNotice` is plain data, and the record is as long.
        let n: PyNotice = unsafe { std::ptr::read_unaligned(record.as_ptr() as *const PyNotice) };
        let len = (n.n as usize).min(2 * PY_MAX_FRAMES) & !1;
        self.learn(n.tgid, n.mm, &n.words[..len]);
    }

    /// `native` (a stack's frames, symbolized) with its Python frames
    /// (`words`) in place of the eval loop's.
    pub fn splice(
        &mut self,
        pid: u32,
        mm: u64,
        native: Vec<std::sync::Arc<Frame>>,
        words: &[u64],
    ) -> Vec<std::sync::Arc<Frame>> {
        if self.unreadable.contains(&pid) {
            // What was read of it is left out.
            return native;
        }
        // Code objects no notice told of, while the process lives (a
        // process whose interpreter was never looked at, gone before the
        // tracer heard of it, keeps its Python frames: each code object
        // counted unnamed and shown by its address).
        self.learn(pid, mm, words);
        match self.names.get(&(pid, mm)) {
            Some(names) => names.splice(native, words),
            None => native,
        }
    }

    /// Code objects that could not be named, over every process, gone
    /// ones too.
    pub fn unnamed(&self) -> u64 {
        self.unnamed_gone + self.names.values().map(|n| n.unnamed).sum::<u64>()
    }

    /// Forgets processes `gone` (their rows are read out for good; the
    /// kernel took their layouts out at their end).
    pub fn forget(&mut self, gone: &HashSet<u32>) {
        self.seen.retain(|p| !gone.contains(p));
        self.late.retain(|p| !gone.contains(p));
        self.unreadable.retain(|p| !gone.contains(p));
        let mut dropped = 0;
        self.names.retain(|(p, _), n| {
            let keep = !gone.contains(p);
            if !keep {
                dropped += n.unnamed;
            }
            keep
        });
        self.unnamed_gone += dropped;
        for &pid in gone {
            let _ = self.map.remove(&pid);
        }
    }
}
