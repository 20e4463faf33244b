//! Unwinding without frame pointers, from the target's own call-frame
//! information.
//!
//! The BPF probe walks the stack frame by frame by looking up each return
//! address in the `UNWIND_RULES` map ([`Rule`], compiled here from
//! `.eh_frame` / `.debug_frame` of the object that maps the address):
//!
//! ```text
//! CFA0 = rsp + 8, ra1 = [rsp], rbp = rbp             (probe at function entry)
//! for each ra: rule = map[ra]
//!     CFA  = (rule.kind == CFA_RSP ? previous CFA : rbp) + rule.cfa_off
//!     ra'  = [CFA - 8]
//!     rbp' = rule.rbp == RBP_AT ? [CFA + rule.rbp_off] : rbp
//! ```
//!
//! A walk that meets an address with no rule yet hands the tracer a copy of
//! the stack from there ([`tracer_common::MissEvent`]); the [`Unwinder`]
//! finishes it with [`unwind_with_fp()`], the same walk in user space, and returns
//! the rules it used so the session can add them to the map. After a short
//! warm-up every walk runs in the kernel.
//!
//! * [`ObjectCfi`] loads one ELF object lazily (headers only; one FDE is
//!   parsed per lookup, through `.eh_frame_hdr`'s binary-search table).
//! * Return addresses are keyed absolute: one target process per run.
//!
//! x86-64 only. Parsing is gimli's; the ELF is read with object.

pub mod jit;
mod object_cfi;
pub mod service;
mod walk;

use std::{
    collections::HashMap,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use tracer_common::{stack_hash_finish, stack_hash_step, stop, MissEvent, STACK_HASH_SEED};

pub use object_cfi::ObjectCfi;
pub use tracer_common::UnwindRule as Rule;
pub use walk::{unwind_with_fp, StackCopy, Stop, FRAME_POINTER};

use crate::tracee::{AddressSpace, FileId, Mapping, Mem};

/// Maps looked up at every frame a walk finished in user space goes
/// through (here and in the host scope's walker): foldhash, not SipHash
/// (a sixth of the host walker's time on cargo), each map with its own
/// random seed, which a target choosing its return addresses does not
/// know.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Says how many stacks were cut short because their copy found the
/// buffer of stack copies full (`copy_lost`), and the option that gives
/// the buffer more room: `ring` is its size in bytes.
pub fn say_copy_lost(quality: Option<&crate::profile::StackQuality>, ring: u32) {
    let Some(n) = quality
        .and_then(|q| q.truncated.get("copy_lost"))
        .filter(|n| **n > 0)
    else {
        return;
    };
    crate::say!(
        "mtrace: {n} stacks cut short: the buffer of stack copies for mtrace to finish was full (copy_lost); --unwind-buffer-size {} gives it twice the room ({} MiB now)",
        u64::from(ring) * 2,
        ring >> 20
    );
}

/// The stop code of a user-space walk (as the BPF walk records it).
pub fn stop_code(stop: Stop) -> u32 {
    match stop {
        Stop::End => stop::END,
        Stop::Unsupported => stop::NO_CFI,
        Stop::OutOfCopy => stop::READ_FAILED,
        Stop::BadRead => stop::BAD_FRAME,
        Stop::MaxFrames => stop::MAX_FRAMES,
    }
}

/// The key of a stack, exactly as the BPF walk computes it: the frames
/// above the direct caller and why the walk stopped.
pub fn stack_key(frames: &[u64], stop: u32) -> u64 {
    let hash = frames
        .iter()
        .fold(STACK_HASH_SEED, |h, &ra| stack_hash_step(h, ra));
    stack_hash_finish(hash, stop)
}

/// A walk the tracer finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    /// Return addresses above the direct caller (as in `StackFrames`).
    pub frames: Vec<u64>,
    /// Why the walk stopped ([`tracer_common::stop`]).
    pub stop: u32,
    /// [`stack_key`] of the two.
    pub key: u64,
}

/// What the unwinder did, for `-v`.
#[derive(Clone, Debug, Default)]
pub struct UnwindStats {
    pub objects: usize,
    pub rules: usize,
    pub walks_finished: u64,
    pub load_time: Duration,
    pub lookup_time: Duration,
    /// The longest a walk waited in the ring before the tracer took it.
    pub max_wait: Duration,
    /// Return addresses in code without call-frame information where the
    /// frame pointer is followed.
    pub frame_pointer_rules: usize,
    /// Bytes of the walks' ring records (their size follows the stack's).
    pub record_bytes: u64,
    /// Walks whose copy had pages that could not be read.
    pub copies_with_holes: u64,
    /// Rules given at the start, learned in other processes of the run.
    pub seeded: usize,
}

impl UnwindStats {
    /// The rules and the walks' records, as `-v`'s `unwind:` line says
    /// them.
    pub fn describe(&self) -> String {
        format!(
            "{} rules from {} objects ({} of them learned in other processes of the run, given at the start; {} where code without call-frame information keeps a frame pointer; loading {:.1} ms, rules {:.1} ms, longest wait in the ring {:.1} ms, records of {:.1} KiB on average, {} with pages that could not be read)",
            self.rules,
            self.objects,
            self.seeded,
            self.frame_pointer_rules,
            self.load_time.as_secs_f64() * 1e3,
            self.lookup_time.as_secs_f64() * 1e3,
            self.max_wait.as_secs_f64() * 1e3,
            self.record_bytes as f64 / 1024.0 / self.walks_finished.max(1) as f64,
            self.copies_with_holes,
        )
    }

    /// Adds another unwinder's figures to these (the longest wait is the
    /// longer of the two).
    pub fn absorb(&mut self, o: &UnwindStats) {
        self.objects += o.objects;
        self.rules += o.rules;
        self.walks_finished += o.walks_finished;
        self.load_time += o.load_time;
        self.lookup_time += o.lookup_time;
        self.max_wait = self.max_wait.max(o.max_wait);
        self.frame_pointer_rules += o.frame_pointer_rules;
        self.record_bytes += o.record_bytes;
        self.copies_with_holes += o.copies_with_holes;
        self.seeded += o.seeded;
    }
}

/// Does `ra` follow a call instruction in the target's code? (What a
/// return address that a frame pointer leads to must be.) The bytes are
/// read from the file the code is mapped from, which outlives a
/// short-lived target, or, for code no file backs (a JIT's), from the
/// target's memory.
fn is_call_site(ra: u64, space: &AddressSpace, pid: u32) -> bool {
    use std::os::unix::fs::FileExt;
    let Some(m) = space.mapping(ra) else {
        return false;
    };
    if !m.perms.contains('x') {
        return false;
    }
    const BEFORE: u64 = 7;
    let mut bytes = [0u8; BEFORE as usize];
    if m.is_anonymous_code() {
        // The call may lie at the very start of the mapping only if the
        // mapping below is code too: keep to this one.
        if ra - m.start < BEFORE {
            return false;
        }
        let read = Mem::open(pid).and_then(|mem| mem.read(ra - BEFORE, &mut bytes));
        if read.is_none() {
            return false;
        }
    } else {
        let Some(file) = space.file(&m.path) else {
            return false;
        };
        let off = m.file_offset(ra);
        if off < BEFORE {
            return false;
        }
        if file.read_exact_at(&mut bytes, off - BEFORE).is_err() {
            return false;
        }
    }
    // A call is 2 to 7 bytes long: one of them must end exactly at `ra`.
    (2..=BEFORE as usize).any(|len| {
        crate::asm::first(&bytes[BEFORE as usize - len..], ra - len as u64)
            .is_some_and(|insn| insn.len() == len && crate::asm::is_call(&insn))
    })
}

/// Rules for the return addresses of one target, from the CFI of the
/// objects it maps (each loaded once, on first need).
pub struct Unwinder {
    pid: u32,
    /// Per mapped path; `None` when the object could not be loaded.
    objects: FastMap<String, Option<Arc<ObjectCfi>>>,
    /// Every rule computed so far, by return address.
    rules: FastMap<u64, Rule>,
    pub stats: UnwindStats,
    /// Most frames a stack keeps above the direct caller (`--max-stack`),
    /// as the BPF walk does.
    pub max_frames: usize,
    /// The identity of each mapped file (for [`learned`]).
    ids: FastMap<String, Option<FileId>>,
    /// Where separate debug files are looked for (the target's
    /// `/usr/lib/debug`, else ours), found at the first object loaded.
    debug_dir: Option<PathBuf>,
    /// Whether the target is a JVM whose compiled code keeps frame
    /// pointers ([`jit`]), found at the first walk through JIT code.
    jit_frame_pointers: Option<bool>,
    /// The walk's Python frames go behind its native ones, in its key
    /// and its frames (false: the caller puts them, as the host scope
    /// does once its frames are file places).
    pub with_python: bool,
}

/// The rules learned in every process of the run, by file and the file
/// offset of the return address: a rule depends on the code alone, so a
/// process of a tree that maps a file another one mapped is given its
/// rules before its first call, instead of handing its first walks
/// through that code to the tracer one by one.
mod learned {
    use std::{collections::HashMap, sync::Mutex};

    use super::Rule;
    use crate::tracee::FileId;

    type Rules = HashMap<FileId, HashMap<u64, Rule>>;

    static LEARNED: Mutex<Option<Rules>> = Mutex::new(None);

    /// Most rules kept (24 bytes each, and the tables' own): past it the
    /// store starts over.
    const MOST: usize = 1 << 18;

    pub(super) fn note(id: FileId, offset: u64, rule: Rule) {
        let mut all = LEARNED.lock().unwrap_or_else(|e| e.into_inner());
        let all = all.get_or_insert_with(HashMap::new);
        if all.values().map(HashMap::len).sum::<usize>() >= MOST {
            all.clear();
        }
        all.entry(id).or_default().insert(offset, rule);
    }

    /// The rules of the file `id` whose offsets are in `range`.
    pub(super) fn of(id: &FileId, range: std::ops::Range<u64>) -> Vec<(u64, Rule)> {
        let all = LEARNED.lock().unwrap_or_else(|e| e.into_inner());
        all.as_ref()
            .and_then(|a| a.get(id))
            .map(|rules| {
                rules
                    .iter()
                    .filter(|(o, _)| range.contains(o))
                    .map(|(o, r)| (*o, *r))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Unwinder {
    pub fn new(pid: u32) -> Self {
        Unwinder {
            pid,
            objects: FastMap::default(),
            rules: FastMap::default(),
            stats: UnwindStats::default(),
            max_frames: tracer_common::MAX_FRAMES,
            ids: FastMap::default(),
            debug_dir: None,
            jit_frame_pointers: None,
            with_python: true,
        }
    }

    /// The rules other processes learned for the code `space` maps (at
    /// most `most`), as this process's (return address, rule); kept here
    /// as computed.
    pub fn seed(&mut self, space: &AddressSpace, most: usize) -> Vec<(u64, Rule)> {
        let mut out = Vec::new();
        let maps: Vec<Mapping> = space.code_mappings().cloned().collect();
        for m in maps {
            let Some(id) = self.file_id(&m.path, space) else {
                continue;
            };
            let range = m.offset..m.offset + (m.end - m.start);
            for (offset, rule) in learned::of(&id, range) {
                if out.len() >= most {
                    break;
                }
                let ra = m.start + (offset - m.offset);
                if self.rules.insert(ra, rule).is_none() {
                    out.push((ra, rule));
                }
            }
        }
        self.stats.rules = self.rules.len();
        self.stats.seeded += out.len();
        out
    }

    /// The return addresses of every rule handed out (to the kernel's map).
    pub fn rule_addresses(&self) -> impl Iterator<Item = u64> + '_ {
        self.rules.keys().copied()
    }

    /// Forgets rules [`seed`](Self::seed) gave that the kernel's map did
    /// not take: they are computed again when a walk needs them.
    pub fn forget(&mut self, ras: &[u64]) {
        for ra in ras {
            self.rules.remove(ra);
        }
        self.stats.rules = self.rules.len();
        self.stats.seeded = self.stats.seeded.saturating_sub(ras.len());
    }

    fn file_id(&mut self, path: &str, space: &AddressSpace) -> Option<FileId> {
        *self
            .ids
            .entry(path.to_string())
            .or_insert_with(|| space.file(path).and_then(FileId::of_file))
    }

    /// Loads the call-frame information of every object the target maps
    /// executable, so that the first walks to finish do not wait for it.
    pub fn preload(&mut self, space: &AddressSpace) {
        let paths: Vec<(String, bool)> = space
            .executable_paths()
            .map(|p| (p.to_string(), self.objects.contains_key(p)))
            .collect();
        for (path, loaded) in paths {
            if !loaded {
                self.load(&path, space);
            }
        }
    }

    fn load(&mut self, path: &str, space: &AddressSpace) {
        let started = Instant::now();
        let pid = self.pid;
        let debug = self.debug_dir.get_or_insert_with(|| {
            // Named by our own path where the target's root is ours: the
            // objects loaded are shared by the key (file, debug directory).
            let root = Path::new("/proc").join(pid.to_string()).join("root");
            let same_root =
                FileId::of(&root).is_some_and(|r| FileId::of(Path::new("/")) == Some(r));
            let debug = root.join("usr/lib/debug");
            if !same_root && debug.is_dir() {
                debug
            } else {
                PathBuf::from("/usr/lib/debug")
            }
        });
        let Some(file) = space.file(path) else {
            // Not opened (yet): looked for again with the next rule.
            return;
        };
        let fd_path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let loaded = FileId::of_file(file).and_then(|id| {
            ObjectCfi::shared(id, &fd_path, debug)
                .inspect_err(|e| {
                    log::debug!("unwind: no call-frame information for {path}: {e:#}");
                })
                .ok()
        });
        self.stats.load_time += started.elapsed();
        self.stats.objects += loaded.is_some() as usize;
        self.objects.insert(path.to_string(), loaded);
    }

    /// The rule for return address `ra` in the target, and whether it is
    /// new (not handed out before).
    pub fn rule_for(&mut self, ra: u64, space: &mut AddressSpace) -> (Rule, bool) {
        if let Some(r) = self.rules.get(&ra) {
            return (*r, false);
        }
        let started = Instant::now();
        let rule = self.compute(ra, space);
        self.stats.lookup_time += started.elapsed();
        if space
            .mapping(ra)
            .is_none_or(|m| m.is_file() && space.file(&m.path).is_none())
        {
            // Not kept: the address space may be known better at the next
            // walk (what is known of a process gone grows walk by walk; a
            // file not opened yet may be).
            return (rule, false);
        }
        self.rules.insert(ra, rule);
        // (Not a rule for code without call-frame information: a walk
        // may follow the frame pointer there, as each process finds.)
        let file = space
            .mapping(ra)
            .filter(|m| m.is_file() && m.perms.contains('x'))
            .filter(|_| rule.kind != Rule::UNSUPPORTED)
            .cloned();
        if let Some(m) = file {
            if let Some(id) = self.file_id(&m.path, space) {
                learned::note(id, m.file_offset(ra), rule);
            }
        }
        self.stats.rules = self.rules.len();
        (rule, true)
    }

    fn compute(&mut self, ra: u64, space: &mut AddressSpace) -> Rule {
        // A library loaded since the last look at the mappings: look again.
        // Also when the address lies in a mapping not executable: the
        // dynamic linker maps a library whole, read-only, before it maps
        // the code over it, and we may have seen the first state only.
        if !space.mapping(ra).is_some_and(|m| m.perms.contains('x')) {
            space.refresh(self.pid);
        }
        let Some(m) = space.mapping(ra).cloned() else {
            // In no mapping of code: not a return address.
            return Rule::not_code();
        };
        if !m.perms.contains('x') {
            return Rule::not_code();
        }
        if m.is_anonymous_code() {
            // A JIT's code has no call-frame information: the walk goes on
            // by the frame pointer where it checks out.
            return Rule::unsupported();
        }
        if !self.objects.contains_key(&m.path) {
            self.load(&m.path, space);
        }
        let Some(Some(obj)) = self.objects.get(&m.path) else {
            return Rule::unsupported();
        };
        match obj.svma_for(m.start, m.offset, ra) {
            Some(svma) => obj.rule_for_ra(svma),
            None => Rule::not_code(),
        }
    }

    /// Finishes a walk the BPF side handed over. `new_rules` receives every
    /// rule computed for the first time, to be added to the kernel's map.
    pub fn finish(
        &mut self,
        ev: &MissEvent,
        space: &mut AddressSpace,
        new_rules: &mut Vec<(u64, Rule)>,
    ) -> Finished {
        self.stats.walks_finished += 1;
        self.stats.max_wait = self.stats.max_wait.max(waited(ev.stack_id));
        let n = (ev.n as usize).min(ev.frames.len());
        let mut frames: Vec<u64> = ev.frames[..n].to_vec();
        // The copy starts at the page of `sp - 8`, `skip` bytes before it.
        let copied = (ev.copied as usize).min(ev.copy.len());
        let skip = (ev.skip as usize).min(copied);
        if ev.holes != 0 {
            self.stats.copies_with_holes += 1;
        }
        let head = (ev.head as usize).clamp(skip, copied);
        let stack = StackCopy {
            bytes: &ev.copy[skip..head],
            holes: ev.holes,
            page_base: ev.sp.wrapping_sub(8).wrapping_sub(skip as u64),
            tail: &ev.copy[head..copied],
            tail_at: ev.tail_at,
        };
        let bp = (ev.bp_ok != 0).then_some(ev.bp);
        let jit_fp = self.jit_frame_pointers(space);
        let space_cell = std::cell::RefCell::new(space);
        let pid = self.pid;
        let (walked, why, by_fp) = unwind_with_fp(
            ev.ra,
            ev.sp.wrapping_sub(8),
            bp,
            stack,
            |ra| {
                let (rule, new) = self.rule_for(ra, &mut space_cell.borrow_mut());
                if new {
                    new_rules.push((ra, rule));
                }
                rule
            },
            |ra| {
                let space = space_cell.borrow();
                is_call_site(ra, &space, pid)
                    || jit_fp && space.mapping(ra).is_some_and(jit::is_jit_code)
            },
        );
        // Code without call-frame information whose frame pointer checked
        // out: the kernel's walk follows it there from now on (the rule of
        // a return address never changes).
        for ra in by_fp {
            self.rules.insert(ra, FRAME_POINTER);
            self.stats.frame_pointer_rules += 1;
            new_rules.retain(|&(r, _)| r != ra);
            new_rules.push((ra, FRAME_POINTER));
        }
        // `walked[0]` is `ev.ra`: the last frame already walked, or the
        // caller itself.
        frames.extend(walked.iter().skip(1));
        let mut stop = stop_code(why);
        // The BPF walk stops when it has its frames and finds one more.
        let limit = self.max_frames.min(tracer_common::MAX_FRAMES);
        if frames.len() > limit {
            frames.truncate(limit);
            stop = stop::MAX_FRAMES;
        }
        let native = stack_key(&frames, stop);
        if !self.with_python {
            return Finished {
                frames,
                stop,
                key: native,
            };
        }
        // The thread's Python frames follow: in the key, all of them; in
        // the frames, as the BPF side puts them.
        let py = &ev.py[..(ev.py_n as usize).min(ev.py.len()) & !1];
        let key = tracer_common::python_stack_key(native, py);
        crate::python::fit(
            &mut frames,
            stop == stop::END,
            py,
            tracer_common::MAX_FRAMES,
        );
        if stop == stop::READ_FAILED {
            log::debug!(
                "unwind: a walk finished here ran out of its stack copy ({copied} bytes from {:#x}, the last {} of them from {:#x}, holes {:#x}) after {} frames, at {:#x}",
                ev.sp.wrapping_sub(8).wrapping_sub(skip as u64),
                copied - head,
                ev.tail_at,
                ev.holes,
                frames.len(),
                frames.last().copied().unwrap_or(ev.ra)
            );
        }
        Finished { frames, stop, key }
    }
}

impl Unwinder {
    /// Whether a frame pointer that leads into JIT code is to be followed
    /// though it follows no call: in a JVM whose compiled code keeps frame
    /// pointers. Decided at the first walk once libjvm.so is mapped (by
    /// then the JVM runs, whatever ran before its `exec`).
    fn jit_frame_pointers(&mut self, space: &AddressSpace) -> bool {
        if let Some(known) = self.jit_frame_pointers {
            return known;
        }
        let maps: Vec<Mapping> = space.code_mappings().cloned().collect();
        let known = jit::hotspot_frame_pointers(self.pid, &maps);
        self.jit_frame_pointers = known;
        known == Some(true)
    }
}

/// How long ago the kernel sent the walk `stack_id` names (its id holds
/// the low 52 bits of the send time, `CLOCK_MONOTONIC` in nanoseconds).
fn waited(stack_id: u64) -> Duration {
    const MASK: u64 = (1 << 52) - 1;
    let sent = (stack_id >> 10) & MASK;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let now = (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64);
    Duration::from_nanos(now.wrapping_sub(sent) & MASK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_keys_are_never_reserved_values() {
        for stop in 1..8 {
            let k = stack_key(&[0x1000, 0x2000], stop);
            assert_eq!(k & 3, 2);
            assert!(!tracer_common::is_miss_stack_id(k));
        }
        assert_ne!(stack_key(&[1], stop::END), stack_key(&[1], stop::NO_CFI));
    }

    /// A mapping known without its file (read from `/proc` as the process
    /// exec'd or exited) gives no rule that is kept or handed out; once the
    /// file is added, the rule is computed from it.
    #[test]
    fn a_mapping_whose_file_is_not_open_gives_no_lasting_rule() {
        let ra = stack_key as *const () as u64 + 1;
        let maps = crate::tracee::read_maps(std::process::id()).unwrap();
        let m = maps.iter().find(|m| m.contains(ra)).unwrap().clone();
        // A process that does not exist: its files cannot be opened.
        let mut space = AddressSpace::new();
        let unopened = Mapping {
            inode: u64::MAX,
            ..m.clone()
        };
        assert!(space.refresh_with(u32::MAX - 1, vec![unopened]));
        assert!(space.mapping(ra).is_some() && space.file(&m.path).is_none());
        let mut unwinder = Unwinder::new(u32::MAX - 1);
        let (rule, new) = unwinder.rule_for(ra, &mut space);
        assert_eq!((rule.kind, new), (Rule::UNSUPPORTED, false));
        space.add_mapped(m.clone(), std::fs::File::open(&m.path).unwrap());
        let (rule, new) = unwinder.rule_for(ra, &mut space);
        assert!(new, "{rule:?}");
        assert_eq!(rule.kind, Rule::CFA_RSP, "{rule:?}");
    }
}
