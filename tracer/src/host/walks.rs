//! The host scope's walks the kernel could not finish: a walk that met a
//! return address whose file and offset have no rule yet is handed over
//! with a copy of the stack ([`MissEvent`] with its process); the tracer
//! finishes it from the process's mappings and the files' call-frame
//! information, counts the call under its whole stack, and gives the
//! kernel the rules the walk needed, by file and offset, so that the next
//! walk through that code, in this process or any other that maps the
//! file, stays in the kernel. A process gone before its mappings were
//! read is walked in the mappings the kernel's walks met in it.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use anyhow::Result;
use aya::{
    maps::{Array, HashMap as BpfHashMap, MapData, RingBuf},
    Ebpf,
};
use tracer_common::{
    host_anon_rule_key, host_frame, host_frame_parts, maps, python_stack_key, stop, HostFileId,
    HostKey, HostValue, HostVma, HostVmaKey, MissEvent, UnwindRule, HOST_FRAME_IN_FILE,
    HOST_GEN_NONE, MAX_HOST_TAGS, MISS_HEADER_BYTES, PLACE_ANONYMOUS, PLACE_FILE, PLACE_UNRESOLVED,
};

mod gone;

use super::{files::FileIndex, python::HostPython};
use crate::{
    tracee::{AddressSpace, Mapping},
    unwind::{
        service::{read_miss_into, zeroed_miss},
        stack_key, FastMap, ObjectCfi, UnwindStats, Unwinder,
    },
};

/// `bpf_map_update_elem`'s flag: only where the key is not in the map.
const BPF_NOEXIST: u64 = 1;

/// A process whose walks the tracer finishes: its mappings and its rules.
struct Walked {
    space: AddressSpace,
    unwinder: Unwinder,
    used: Instant,
    /// The process was gone when its mappings were to be read: `space`
    /// holds what the kernel's walks met of them.
    gone: bool,
    /// The rule given the kernel for its code in no file: frame pointers
    /// followed (true) once any such frame's checked out; with the key
    /// it went in under, taken out when the process is forgotten.
    anon_fp: Option<bool>,
    anon_key: u64,
}

/// Walks taken from the ring at once.
const BATCH: usize = 256;

/// Processes kept at once (the least recently used give way).
const PROCESSES_KEPT: usize = 256;

/// A process not handed a walk for this long is forgotten.
const IDLE: Duration = Duration::from_secs(30);

/// The walks the tracer finished and what it knows to finish them.
pub struct HostWalks {
    pub(super) ring: Option<RingBuf<MapData>>,
    rules: BpfHashMap<MapData, u64, UnwindRule>,
    file_tags: BpfHashMap<MapData, HostFileId, u32>,
    tag_files: Array<MapData, HostFileId>,
    /// The mappings the kernel's walks met, by process incarnation and
    /// window: what is known of a process's address space once it is gone.
    vmas: BpfHashMap<MapData, HostVmaKey, HostVma>,
    /// Each process's incarnation (gone at its exec and its end).
    gens: BpfHashMap<MapData, u32, u64>,
    /// The threads sent the throttle signal (a command's tree).
    throttled: BpfHashMap<MapData, u32, u32>,
    procs: FastMap<(u32, u64), Walked>,
    /// Each file's tag, as the kernel's table has it.
    tags: FastMap<HostFileId, u32>,
    /// The next tag the tracer gives (from the top of the table down).
    next_tag: u32,
    /// Calls counted under finished walks, with their callers' places.
    pub rows: FastMap<HostKey, HostValue>,
    /// The frames ([`host_frame`]s) and stop of each finished stack.
    pub stacks: FastMap<u64, (Vec<u64>, u32)>,
    /// Walks finished, of them those whose process was gone, and of
    /// those the ones finished whole in the files the kernel's walks had
    /// met.
    pub finished: u64,
    pub gone: u64,
    pub gone_whole: u64,
    /// Rules the kernel's map had no room for.
    pub rules_full: u64,
    /// Frames in a file no tag was left for (kept as addresses).
    pub untagged: u64,
    /// Most frames a stack keeps above the direct caller.
    max_frames: usize,
    /// Files by identity, for rules learned from a file alone (`None`:
    /// it could not be opened or read).
    objects: FastMap<(u32, u64), Option<Arc<ObjectCfi>>>,
    /// Paths of executables as exec'd (the main loop notes them).
    paths: Paths,
    /// Where the files processes map are found.
    index: FileIndex,
    /// Walks of processes gone whose files could not be opened yet (an
    /// executable's path comes with its exec, which the main loop reads),
    /// since when, as the ring's records (the stack copy as long as it
    /// is): taken up again at the next round, finished as they are after
    /// [`DEFER_FOR`] or past [`DEFER_BYTES`].
    pub(super) deferred: std::collections::VecDeque<(Instant, Vec<u8>)>,
    deferred_bytes: usize,
    /// One event's room for every walk, zeroed once (a walk reads no byte
    /// of the copy past what its record copied), and the records' buffers,
    /// kept with their room: a walk's copy is up to 256 KiB, and a buffer
    /// allocated and freed per walk had the allocator give it back to the
    /// kernel each time (a quarter of this thread's time on cargo).
    ev: Option<Box<MissEvent>>,
    spare: Vec<Vec<u8>>,
    /// The processes that run CPython, and their code objects.
    pub python: HostPython,
    /// The processes with JIT code, and their perf maps.
    pub jit: super::jit::HostJit,
    /// What the unwinders of processes forgotten did, and the bytes of
    /// every walk's ring record (`-v`).
    past: UnwindStats,
}

/// How long a walk waits for its process's files to be named.
const DEFER_FOR: Duration = Duration::from_millis(500);

/// The records of walks waiting, in bytes at most.
const DEFER_BYTES: usize = 32 << 20;

/// The records' buffers kept for the next round, in bytes of room at most
/// (the ring's size: one round never holds more at once in steady state).
const SPARE_BYTES: usize = 16 << 20;

/// Paths of files by identity, shared with the main loop.
pub type Paths = Arc<Mutex<HashMap<(u32, u64), PathBuf>>>;

pub(super) fn lock_paths(paths: &Paths) -> MutexGuard<'_, HashMap<(u32, u64), PathBuf>> {
    paths.lock().unwrap_or_else(|e| e.into_inner())
}

impl HostWalks {
    /// Handles on the ring of walks and the maps the walks fill in.
    pub(super) fn new(ebpf: &Ebpf, max_frames: u32, paths: Paths) -> Result<HostWalks> {
        let copy = |name| crate::probes::pool::map_copy(ebpf, name);
        Ok(HostWalks {
            ring: Some(RingBuf::try_from(copy(maps::UNWIND_MISSES)?)?),
            rules: BpfHashMap::try_from(copy(maps::HOST_RULES)?)?,
            file_tags: BpfHashMap::try_from(copy(maps::HOST_FILE_TAGS)?)?,
            tag_files: Array::try_from(copy(maps::HOST_TAG_FILES)?)?,
            vmas: BpfHashMap::try_from(copy(maps::HOST_VMAS)?)?,
            gens: BpfHashMap::try_from(copy(maps::HOST_GENS)?)?,
            throttled: BpfHashMap::try_from(copy(maps::THROTTLED)?)?,
            procs: FastMap::default(),
            tags: FastMap::default(),
            next_tag: MAX_HOST_TAGS - 1,
            rows: FastMap::default(),
            stacks: FastMap::default(),
            finished: 0,
            gone: 0,
            gone_whole: 0,
            rules_full: 0,
            untagged: 0,
            max_frames: max_frames as usize,
            objects: FastMap::default(),
            paths,
            index: FileIndex::default(),
            deferred: Default::default(),
            deferred_bytes: 0,
            ev: None,
            spare: Vec::new(),
            python: HostPython::new(ebpf, max_frames != 0)?,
            jit: Default::default(),
            past: UnwindStats::default(),
        })
    }

    /// The file (device, inode) tagged `tag`, `None` when unknown.
    pub fn file_of(&self, tag: u32) -> Option<(u32, u64)> {
        self.tag_files
            .get(&tag, 0)
            .ok()
            .filter(|id| id.ino != 0)
            .map(|id| (id.dev, id.ino))
    }

    /// Whether thread `tid` was sent the throttle signal and not yet let
    /// go; it is let go from here on.
    pub fn take_throttled(&mut self, tid: u32) -> bool {
        self.throttled.remove(&tid).is_ok()
    }

    /// Finishes every walk waiting in the ring; those of processes gone
    /// whose files are not named yet wait for a later round.
    pub fn finish_all(&mut self) {
        self.finish_round(false);
    }

    /// Finishes every walk waiting in the ring or for its files, as it
    /// can now: the trace's last round (no later one would take them up,
    /// and the kernel counted their calls in its totals).
    pub fn finish_at_end(&mut self) {
        self.finish_round(true);
    }

    fn finish_round(&mut self, end: bool) {
        let Some(mut ring) = self.ring.take() else {
            return;
        };
        let mut new_rules = Vec::new();
        let mut ev = self.ev.take().unwrap_or_else(zeroed_miss);
        let now = Instant::now();
        self.deferred_bytes = 0;
        for (since, record) in std::mem::take(&mut self.deferred) {
            if !read_miss_into(&mut ev, &record) {
                continue;
            }
            let last = end || now.duration_since(since) >= DEFER_FOR;
            if self.finish(&ev, &mut new_rules, last) {
                self.defer(since, record);
            } else {
                self.spare.push(record);
            }
        }
        loop {
            // The ring's records, each as long as its copy.
            let mut batch: Vec<Vec<u8>> = Vec::new();
            while batch.len() < BATCH {
                let Some(item) = ring.next() else {
                    break;
                };
                let mut buf = self.spare.pop().unwrap_or_default();
                buf.clear();
                buf.extend_from_slice(&item);
                batch.push(buf);
            }
            if batch.is_empty() {
                break;
            }
            // The mappings of each process new in the batch, read before
            // any walk of the batch is finished (a short-lived process
            // may be gone by its turn), then the first walk to miss each
            // frame (it gives the rule that spares the next walks through
            // there), then the rest.
            let now = Instant::now();
            let mut firsts = std::collections::HashSet::new();
            let (mut first, mut rest) = (Vec::new(), Vec::new());
            for record in batch {
                if record.len() < MISS_HEADER_BYTES {
                    // A new stack's Python frames, to name.
                    self.python.notice(&record);
                    self.spare.push(record);
                    continue;
                }
                self.past.record_bytes += record.len() as u64;
                if !read_miss_into(&mut ev, &record) {
                    continue;
                }
                // Its Python code objects named first, before the walks
                // ahead of it are finished (a module's code lives only as
                // long as the module's body runs).
                let py = &ev.py[..(ev.py_n as usize).min(ev.py.len()) & !1];
                self.python.learn(ev.tgid as u32, ev.mm, py);
                let key = (ev.tgid as u32, ev.mm);
                if key.0 != 0 && !self.procs.contains_key(&key) {
                    let walked = self.walked(key.0, now);
                    self.procs.insert(key, walked);
                }
                match firsts.insert((ev.tgid, ev.mm, ev.ra)) {
                    true => first.push(record),
                    false => rest.push(record),
                }
            }
            for record in first.into_iter().chain(rest) {
                if !read_miss_into(&mut ev, &record) {
                    continue;
                }
                let last = end || self.deferred_bytes >= DEFER_BYTES;
                if self.finish(&ev, &mut new_rules, last) {
                    self.defer(Instant::now(), record);
                } else {
                    self.spare.push(record);
                }
            }
        }
        // Room for what the ring holds kept, no more.
        let mut kept = 0;
        self.spare.retain(|b| {
            kept += b.capacity();
            kept <= SPARE_BYTES
        });
        self.ev = Some(ev);
        self.ring = Some(ring);
        self.forget_idle();
    }

    /// Keeps a walk's ring record for the next round.
    fn defer(&mut self, since: Instant, record: Vec<u8>) {
        self.deferred_bytes += record.len();
        self.deferred.push_back((since, record));
    }

    /// What the walks of process `tgid` need: its mappings, read now.
    fn walked(&self, tgid: u32, now: Instant) -> Walked {
        let mut space = AddressSpace::new();
        space.refresh(tgid);
        let mut unwinder = Unwinder::new(tgid);
        unwinder.max_frames = self.max_frames;
        // Python frames go in once the native ones are file places.
        unwinder.with_python = false;
        Walked {
            space,
            unwinder,
            used: now,
            gone: false,
            anon_fp: None,
            anon_key: 0,
        }
    }

    /// Finishes walk `ev`; true, not finished, when its process is gone
    /// and a file it maps could not be opened yet, unless this is the
    /// `last` try.
    fn finish(
        &mut self,
        ev: &MissEvent,
        new_rules: &mut Vec<(u64, UnwindRule)>,
        last: bool,
    ) -> bool {
        let tgid = ev.tgid as u32;
        if tgid == 0 {
            return false;
        }
        let now = Instant::now();
        let mut walked = match self.procs.remove(&(tgid, ev.mm)) {
            Some(w) => w,
            None => self.walked(tgid, now),
        };
        walked.used = now;
        // The process runs the program that walked (not one it exec'd
        // since, whose mappings `/proc` would show).
        let same = ev.gen == HOST_GEN_NONE || self.gens.get(&tgid, 0).ok() == Some(ev.gen);
        let alive = !walked.gone
            && same
            && (walked.space.mapping(ev.caller).is_some() || walked.space.refresh(tgid));
        walked.gone = !alive;
        if alive && walked.space.has_jit_code() {
            // Its JIT code's names, read while it lives.
            self.jit.adopt(tgid, walked.space.perf_map());
        }
        let (mapped, unopened) = match alive {
            true => (true, false),
            false => self.add_known_mappings(ev, &mut walked.space),
        };
        if unopened && !last {
            self.procs.insert((tgid, ev.mm), walked);
            return true;
        }
        self.finished += 1;
        if !alive {
            self.gone += 1;
            if !mapped {
                // Gone, with its mappings, and none of them known: the call
                // under its caller, as the kernel placed it, and no more;
                // the rule the walk missed, from its file alone (the next
                // walk through there goes a frame further).
                self.procs.insert((tgid, ev.mm), walked);
                if let Some(rule) = self.rule_in_file(ev.ra_frame) {
                    self.give_rules(&[(ev.ra_frame, rule)]);
                }
                let frames: Vec<u64> = ev.frames[..(ev.n as usize).min(ev.frames.len())].to_vec();
                let caller = self.kernel_caller(ev);
                self.count(ev, frames, stop::GONE, caller);
                return false;
            }
        }
        let space = &mut walked.space;
        new_rules.clear();
        let done = walked.unwinder.finish(ev, space, new_rules);
        // The kernel's frames are file places already, but for those whose
        // mapping it could not look up (kept as addresses, like code in no
        // file); the tracer's are addresses in this process.
        let kernel_n = (ev.n as usize).min(done.frames.len());
        let mut frames = done.frames;
        for (i, f) in frames.iter_mut().enumerate() {
            if i >= kernel_n || *f & HOST_FRAME_IN_FILE == 0 {
                *f = self.place(space, *f).0;
            }
        }
        let mut rules = Vec::new();
        let mut anon_fp = None;
        for (ra, rule) in new_rules.drain(..) {
            let (frame, in_file) = self.place(space, ra);
            if in_file {
                rules.push((frame, rule));
            } else if space.mapping(ra).is_some_and(|m| m.is_anonymous_code()) {
                anon_fp = Some(anon_fp.unwrap_or(false) || rule.kind == UnwindRule::CFA_RBP);
            }
        }
        // The process's code in no file (a JIT's): the kernel follows the
        // frame pointer through it once one checked out here (as a traced
        // process's walk does, rule by rule), else ends its walks there.
        if let Some(fp) = anon_fp.filter(|_| alive && ev.gen != HOST_GEN_NONE) {
            if walked.anon_fp != Some(true) && walked.anon_fp != Some(fp) {
                walked.anon_fp = Some(fp);
                walked.anon_key = host_anon_rule_key(ev.gen);
                let rule = if fp {
                    crate::unwind::FRAME_POINTER
                } else {
                    UnwindRule::unsupported()
                };
                rules.push((host_anon_rule_key(ev.gen), rule));
            }
        }
        // A process gone: a walk that went beyond the files known of it
        // ends there, cut because the process was gone.
        let stop = match done.stop {
            stop::END | stop::MAX_FRAMES => done.stop,
            _ if !alive => stop::GONE,
            other => other,
        };
        if !alive && stop == stop::END {
            self.gone_whole += 1;
        }
        let caller = match space.mapping(ev.caller) {
            Some(_) => caller_value(space, ev.caller),
            None => self.kernel_caller(ev),
        };
        self.procs.insert((tgid, ev.mm), walked);
        self.give_rules(&rules);
        self.count(ev, frames, stop, caller);
        false
    }

    /// Counts the call of `ev` under its stack (`frames` above the
    /// caller, ended by `stop`) and its caller's place.
    /// The thread's Python frames read with the walk follow: in the key,
    /// all of them; in the frames, as the kernel puts them.
    fn count(&mut self, ev: &MissEvent, mut frames: Vec<u64>, stop: u32, caller: HostValue) {
        let py = &ev.py[..(ev.py_n as usize).min(ev.py.len()) & !1];
        let key = HostKey {
            tgid: ev.tgid as u32,
            func: ev.func,
            mm: ev.mm,
            ret: ev.caller,
            stack: python_stack_key(stack_key(&frames, stop), py),
            tid: ev.tid,
            python_unread: ev.python_unread,
        };
        // (Its code objects were named as its record was taken from the
        // ring.)
        if !py.is_empty() {
            crate::python::fit(
                &mut frames,
                stop == stop::END,
                py,
                tracer_common::MAX_FRAMES,
            );
        }
        self.stacks
            .entry(key.stack)
            .or_insert_with(|| (frames, stop));
        let row = self.rows.entry(key).or_insert(caller);
        row.calls += ev.calls;
        row.bytes += ev.bytes;
    }

    /// The direct caller's place of walk `ev` as the kernel found it (`ra`
    /// is the caller where no frame was walked).
    fn kernel_caller(&self, ev: &MissEvent) -> HostValue {
        self.value_of(match ev.n {
            0 => ev.ra_frame,
            _ => ev.caller_frame,
        })
    }

    /// The caller's place from its frame as the kernel found it.
    fn value_of(&self, frame: u64) -> HostValue {
        match host_frame_parts(frame).and_then(|(tag, offset)| Some((self.file_of(tag)?, offset))) {
            Some(((dev, ino), offset)) => HostValue {
                place: PLACE_FILE,
                dev,
                ino,
                offset,
                ..HostValue::default()
            },
            None => HostValue {
                place: PLACE_UNRESOLVED,
                ..HostValue::default()
            },
        }
    }

    /// Return address `ra` of a process mapped as `space` as a host
    /// frame, and whether it lies in a file.
    fn place(&mut self, space: &AddressSpace, ra: u64) -> (u64, bool) {
        let Some(m) = space.mapping(ra).filter(|m| m.is_file()) else {
            return (ra, false);
        };
        let (offset, id) = (m.file_offset(ra), file_id(m));
        match self.tag_of(id) {
            Some(tag) => (host_frame(tag, offset), true),
            None => {
                self.untagged += 1;
                (ra, false)
            }
        }
    }

    /// Looks at process `pid` for an interpreter ([`HostPython::look`];
    /// `maps`: its `/proc/PID/maps`), and puts its file in the kernel's
    /// table of interpreter files; and for JIT code, whose perf map is
    /// read from then on.
    pub fn look_for_python(&mut self, pid: u32, mm: u64, maps: &str) {
        self.jit.look(pid, maps);
        if let Some((id, layout)) = self.python.look(pid, mm, maps) {
            if let Some(tag) = self.tag_of(id) {
                self.python.add_file(id, tag, layout);
            }
        }
    }

    /// Puts the interpreter file `path` holds (as process `pid` sees it)
    /// in the kernel's table of interpreter files, before any process has
    /// mapped it: the process that will is known to run it from its first
    /// walk on.
    pub fn python_file(&mut self, pid: u32, path: &str) {
        let Some((dev, ino)) = super::files::key_of_path(&crate::tracee::path_in_target(pid, path))
        else {
            return;
        };
        let id = HostFileId { dev, _pad: 0, ino };
        if self.python.has_file(&id) {
            return;
        }
        let Some(i) = crate::python::files::in_file(pid, path) else {
            return;
        };
        if let Some(tag) = self.tag_of(id) {
            self.python.add_file(id, tag, i.layout);
        }
    }

    /// The tag of file `id`: the kernel's, else one the tracer
    /// gives it now (`None`: the table is full).
    fn tag_of(&mut self, id: HostFileId) -> Option<u32> {
        if let Some(t) = self.tags.get(&id) {
            return Some(*t);
        }
        if let Ok(t) = self.file_tags.get(&id, 0) {
            self.tags.insert(id, t);
            return Some(t);
        }
        if self.next_tag < MAX_HOST_TAGS / 2 {
            return None;
        }
        let tag = self.next_tag;
        self.next_tag -= 1;
        // The tag's file first: a tag found in the table names its file.
        self.tag_files.set(tag, id, 0).ok()?;
        let tag = match self.file_tags.insert(id, tag, BPF_NOEXIST) {
            Ok(()) => tag,
            Err(_) => self.file_tags.get(&id, 0).ok()?,
        };
        self.tags.insert(id, tag);
        Some(tag)
    }

    /// Gives the kernel rules by file and offset.
    fn give_rules(&mut self, rules: &[(u64, UnwindRule)]) {
        for (frame, rule) in rules {
            if self.rules.insert(frame, rule, 0).is_err() {
                if self.rules_full == 0 {
                    log::warn!("the kernel's map of unwind rules is full: stacks through new code end there from now on (raise --unwind-rules-size)");
                }
                self.rules_full += 1;
            }
        }
    }

    /// What every process's unwinder did so far (`-v`).
    pub fn unwind_stats(&self) -> UnwindStats {
        let mut all = self.past.clone();
        for w in self.procs.values() {
            all.absorb(&w.unwinder.stats);
        }
        all
    }

    /// Forgets processes idle for long, and the least recently used past
    /// [`PROCESSES_KEPT`].
    fn forget_idle(&mut self) {
        let now = Instant::now();
        let mut keys = Vec::new();
        let past = &mut self.past;
        self.procs.retain(|_, w| {
            let keep = now.duration_since(w.used) < IDLE;
            if !keep {
                past.absorb(&w.unwinder.stats);
                if w.anon_key != 0 {
                    keys.push(w.anon_key);
                }
            }
            keep
        });
        while self.procs.len() > PROCESSES_KEPT {
            let Some(oldest) = self
                .procs
                .iter()
                .min_by_key(|(_, w)| w.used)
                .map(|(k, _)| *k)
            else {
                break;
            };
            if let Some(w) = self.procs.remove(&oldest) {
                self.past.absorb(&w.unwinder.stats);
                keys.extend((w.anon_key != 0).then_some(w.anon_key));
            }
        }
        // Its JIT code's rule too (judged again at its next walk there,
        // should it still run).
        for key in keys {
            let _ = self.rules.remove(&key);
        }
    }

    /// Forgets the stacks no row holds any more (those of rows taken out
    /// and read for good).
    pub fn prune_stacks(&mut self) {
        let held: std::collections::HashSet<u64> = self.rows.keys().map(|k| k.stack).collect();
        self.stacks.retain(|k, _| held.contains(k));
    }

    /// Takes the rows of processes `gone` out (they have been read for
    /// good).
    pub fn take_rows_of(
        &mut self,
        gone: &std::collections::HashSet<u32>,
    ) -> Vec<(HostKey, HostValue)> {
        let keys: Vec<HostKey> = self
            .rows
            .keys()
            .filter(|k| gone.contains(&k.tgid))
            .copied()
            .collect();
        keys.into_iter()
            .filter_map(|k| self.rows.remove(&k).map(|v| (k, v)))
            .collect()
    }
}

/// A mapping's file as the kernel names it (`s_dev`: major << 20 | minor).
pub(super) fn file_id(m: &Mapping) -> HostFileId {
    HostFileId {
        dev: (((m.dev >> 32) as u32) << 20) | (m.dev as u32 & 0xfffff),
        _pad: 0,
        ino: m.inode,
    }
}

/// The caller's place, as the kernel would have put it in the row.
fn caller_value(space: &AddressSpace, caller: u64) -> HostValue {
    let mut v = HostValue::default();
    match space.mapping(caller) {
        Some(m) if m.is_file() => {
            let id = file_id(m);
            v.place = PLACE_FILE;
            v.dev = id.dev;
            v.ino = id.ino;
            v.offset = m.file_offset(caller);
        }
        Some(_) => v.place = PLACE_ANONYMOUS,
        None => v.place = PLACE_UNRESOLVED,
    }
    v
}
