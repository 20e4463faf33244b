//! One traced process: its probes and maps, the walks its unwinder
//! finishes, its live tracker, its address space; what it does when it
//! exec's another program.

use std::sync::{Arc, Mutex};

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use tracer_common::{maps, LostAlloc, LostFree};

use crate::{
    allocators,
    collect::live_tracker::{self, LiveTracker},
    golang,
    pipeline::{self, Clock},
    probes::{self, MapSizes, Mode, Probes},
    profile::{merge, Meta, Profile},
    python,
    tracee::{self, AddressSpace, Mapping},
    unwind::service::UnwindService,
};

/// Live mode: the kernel's queues of the frees and the allocations whose
/// event found the ring full (see [`LostFree`], [`LostAlloc`]).
struct KeptAside {
    frees: aya::maps::Queue<MapData, LostFree>,
    allocs: aya::maps::Queue<MapData, LostAlloc>,
    /// The most frees, and allocations, one drain took from them (said
    /// with `-v`: how near the queues came to full).
    fullest: (u64, u64),
}

/// What every process's probes and tracker are set up with.
#[derive(Clone, Copy, Debug)]
pub struct ProcSettings {
    pub mode: Mode,
    pub sizes: MapSizes,
    /// Live mode: a block freed sooner than this is a temporary.
    pub temporary_ns: u64,
    /// Live mode: outstanding blocks tracked at once, per process.
    pub live_blocks: usize,
}

/// One traced process: its probes and maps (a BPF object of its own, so
/// that addresses, blocks and unwind rules of different processes never
/// meet), the walks its unwinder finishes, its live tracker, and the
/// record of its address space.
pub struct TracedProcess {
    pub pid: u32,
    pub probes: Probes,
    /// Live mode: folds the kernel's events.
    pub tracker: Option<LiveTracker>,
    /// Live mode: its event rings, one per CPU.
    events: Vec<RingBuf<MapData>>,
    /// Live mode: the frees and allocations its rings had no room for.
    aside: Option<KeptAside>,
    pub space: Arc<Mutex<AddressSpace>>,
    /// Finishes the walks the BPF side hands over.
    pub unwind: UnwindService,
    pub meta: Meta,
    /// The profiles of the programs it ran before its last `exec`, each
    /// symbolized with its own mappings.
    pub before_exec: Vec<Profile>,
    /// Its allocator's object, family and the other objects defining
    /// allocator functions (for the warning when nothing was counted).
    pub shadowed: Vec<String>,
    /// Its command name when probed (read again after it is gone, it
    /// would be lost).
    pub name: String,
    /// A Go program: its runtime's own heap profile, read at each reading.
    pub go: Option<Box<golang::GoProcess>>,
    /// Heaps it keeps that mtrace cannot see (a JVM's, V8's, a Go
    /// program's that cannot be read), one line each.
    pub unseen: Vec<crate::profile::Unseen>,
}

/// What `--python-objects` does not see in an interpreter that copied its
/// object allocator into its callers (`None`: it sees every call).
fn inlined_note(
    alloc: &allocators::AllocatorObject,
    path: &str,
    hidden: bool,
    live: bool,
) -> Option<String> {
    let copies: usize = alloc.sites.iter().map(|s| s.inlined.len()).sum();
    let through = "PYTHONMALLOC=malloc sends every object through malloc";
    if copies == 0 {
        return hidden.then(|| format!(
            "--python-objects: {path} has no _PyObject_Malloc symbol (stripped; an LTO build such as Debian's copies the object allocator into its callers): only calls through its exported PyObject_*/PyMem_* functions are seen; {through}"
        ));
    }
    if live {
        use allocators::inlined::SizeAt;
        let all = || alloc.sites.iter().flat_map(|s| &s.inlined);
        let frees = all().filter(|c| c.size.frees()).count();
        let (unplaced, placed): (Vec<_>, Vec<_>) = all()
            .filter(|c| !c.size.frees() && !matches!(c.size, SizeAt::Resize { .. }))
            .partition(|c| c.blocks.is_empty());
        let (placed, unplaced) = (placed.len(), unplaced.len());
        let mut unseen = Vec::new();
        if unplaced > 0 {
            unseen.push(format!(
                "{unplaced} copies whose block's place was not found"
            ));
        }
        if alloc.inlined_missed > 0 {
            unseen.push(format!(
                "{} whose size or block could not be followed",
                alloc.inlined_missed
            ));
        }
        unseen.push("the new size of a block resized in place".to_string());
        unseen.push("calls through tracemalloc's or the debug hooks".to_string());
        return Some(format!(
            "--python-objects: {path} copies its object allocator into its callers: {placed} copies of malloc and calloc followed to where their block is known, {frees} copies of free probed, resizes seen where pymalloc moves the block (its static _PyObject_Malloc and _PyObject_Free); not seen: {}; {through}",
            unseen.join(", ")
        ));
    }
    let mut unseen = Vec::new();
    if alloc.inlined_missed > 0 {
        unseen.push(format!(
            "{} more whose size could not be followed",
            alloc.inlined_missed
        ));
    }
    if alloc.inlined_resizes > 0 {
        unseen.push(format!(
            "{} copies of PyObject_Realloc (resizes within the object allocator)",
            alloc.inlined_resizes
        ));
    }
    unseen.push("calls through tracemalloc's or the debug hooks".to_string());
    Some(format!(
        "--python-objects: {path} copies its object allocator into its callers: {copies} copies probed at their guards, counted as the function each copies (PyObject_Malloc, PyMem_Calloc, ...; a request over 512 bytes as the malloc it makes); not seen: {}; {through}",
        unseen.join(", ")
    ))
}

impl TracedProcess {
    /// Probes `pid`'s allocator, found in `maps` (`None` when none is
    /// mapped yet). `meta` holds what all processes of the trace share.
    pub fn attach(
        pid: u32,
        maps: &[Mapping],
        settings: &ProcSettings,
        space: Arc<Mutex<AddressSpace>>,
        meta: &Meta,
    ) -> Result<Option<TracedProcess>> {
        let Some(alloc) = allocators::find_in_process(pid, maps, settings.mode.python_objects)?
        else {
            return Ok(None);
        };
        TracedProcess::attach_to(pid, alloc, maps, settings, space, meta).map(Some)
    }

    /// As [`TracedProcess::attach`], to the allocator found already
    /// (`maps` read while the process was stopped, or just before).
    pub fn attach_to(
        pid: u32,
        alloc: allocators::AllocatorObject,
        maps: &[Mapping],
        settings: &ProcSettings,
        space: Arc<Mutex<AddressSpace>>,
        meta: &Meta,
    ) -> Result<TracedProcess> {
        space.lock().unwrap().refresh_with(pid, maps.to_vec());
        let live = settings.mode.live;
        let max_frames = settings.mode.max_frames;
        let (interpreter, python_said) = match python::detect(pid, maps) {
            python::Found::Known(i) => {
                if settings.mode.python_objects {
                    if let Some(note) = inlined_note(&alloc, &i.path, i.allocator_hidden, live) {
                        python::say_once(&note);
                    }
                }
                let said = i.describe();
                (Some(i), said)
            }
            python::Found::Unknown(why) => {
                python::say_once(&why);
                (None, why)
            }
            python::Found::None => (None, String::new()),
        };
        // Python frames only where the stacks are walked.
        let (interpreter, python_said) = match interpreter {
            Some(_) if max_frames == 0 => (None, String::new()),
            other => (other, python_said),
        };
        // An interpreter whose state cannot be read is said to be, once,
        // and not read; one not started yet is judged later, by `Names`.
        let (interpreter, python_said, pending) = match interpreter {
            Some(i) => match python::state::settled_in(pid, &i.layout) {
                python::state::State::Unreadable(why) => {
                    let line = python::state::unreadable_line(&i.name(), &why);
                    python::say_once(&line);
                    (None, line, None)
                }
                python::state::State::Readable => (Some(i), python_said, None),
                python::state::State::NotYet => {
                    let pending = Some((i.layout, i.name()));
                    (Some(i), python_said, pending)
                }
            },
            None => (None, python_said, None),
        };
        let layout = interpreter.as_ref().map(|i| i.layout).unwrap_or_default();
        let names = interpreter
            .as_ref()
            .and_then(|i| python::Names::new(pid, i.minor, pending));
        let (probes, unwind) = probes::attach(
            pid,
            &alloc,
            maps,
            settings.mode,
            settings.sizes,
            layout,
            |ebpf| UnwindService::start(ebpf, pid, space.clone(), live, max_frames, names),
        )?;
        let mut meta = meta.clone();
        meta.pid = pid;
        meta.command = tracee::cmdline(pid);
        meta.executable = tracee::executable(pid);
        meta.allocator_object = alloc.path.clone();
        meta.allocator_family = alloc.family.to_string();
        meta.allocator_version = alloc.version.clone().unwrap_or_default();
        meta.allocator_beside = alloc.beside.clone().unwrap_or_default();
        meta.python = python_said;
        meta.probes = probes.attached.clone();
        let name = tracee::comm(pid);
        let (go, unseen) = go_and_unseen(pid, &name, &meta.executable, maps);
        let mut proc = TracedProcess {
            pid,
            probes,
            tracker: live.then(|| LiveTracker::new(settings.temporary_ns, settings.live_blocks)),
            events: Vec::new(),
            aside: None,
            space,
            unwind,
            meta,
            before_exec: Vec::new(),
            shadowed: alloc.shadowed,
            name,
            go,
            unseen,
        };
        proc.events = proc.take_event_rings()?;
        if proc.tracker.is_some() {
            let queue = |name| probes::pool::map_copy(&proc.probes.ebpf, name);
            proc.aside = Some(KeptAside {
                frees: queue(maps::LOST_FREES)?.try_into()?,
                allocs: queue(maps::LOST_ALLOCS)?.try_into()?,
                fullest: (0, 0),
            });
        }
        Ok(proc)
    }

    /// Everything it ran: the programs before each `exec`, then the
    /// current one (with its Go heap, and what it keeps unseen).
    pub(super) fn profile(&self, clock: &Clock, per_thread: bool) -> Result<Profile> {
        let mut current = self.current_profile(clock, per_thread)?;
        if let Some(go) = &self.go {
            go.add_to(&mut current);
        }
        current.unseen.extend(self.unseen_now());
        if self.before_exec.is_empty() {
            return Ok(current);
        }
        let mut parts = self.before_exec.clone();
        parts.push(current);
        Ok(merge::merge(parts))
    }

    /// The heaps it keeps that mtrace cannot see: its Go heap's line (said
    /// at attach), and its runtime's as its mappings say now (a JVM loads
    /// libjvm.so after the probes are in), or as they said last.
    pub(super) fn unseen_now(&self) -> Vec<crate::profile::Unseen> {
        let (go, runtime): (Vec<_>, Vec<_>) = self
            .unseen
            .iter()
            .cloned()
            .partition(|u| u.heap == "go heap");
        let now = match tracee::read_maps(self.pid) {
            Ok(maps) => golang::unseen::detect(self.pid, &self.name, &self.meta.executable, &maps)
                .into_iter()
                .collect(),
            Err(_) => runtime,
        };
        go.into_iter().chain(now).collect()
    }

    /// The program it runs now (since its last `exec`).
    fn current_profile(&self, clock: &Clock, per_thread: bool) -> Result<Profile> {
        let thread_names = if per_thread {
            tracee::thread_names(self.pid).into_iter().collect()
        } else {
            Default::default()
        };
        pipeline::profile(
            &self.probes,
            &self.unwind,
            self.tracker.as_ref(),
            &self.space,
            &thread_names,
            self.meta.clone(),
            clock,
        )
    }

    /// Feeds the events waiting in its rings to its tracker.
    pub(super) fn drain(&mut self) {
        self.drain_rings(false);
    }

    fn drain_rings(&mut self, last: bool) {
        drain(
            &mut self.events,
            self.aside.as_mut(),
            &mut self.tracker,
            &self.unwind,
            last,
        );
    }

    /// Its counting ends: every function at once, then the walks and
    /// events under way are taken in.
    pub(super) fn finish(&mut self) -> Result<()> {
        self.probes.set_enabled(false)?;
        self.unwind.walks().finish_all();
        self.drain_rings(true);
        if let Some(aside) = &self.aside {
            log::debug!(
                "pid {}: at most {} frees and {} allocations kept aside taken in one drain",
                self.pid,
                aside.fullest.0,
                aside.fullest.1
            );
        }
        if let Some(t) = &mut self.tracker {
            t.finish();
        }
        Ok(())
    }

    /// It exec'd a new program: closes the books of the old one (its
    /// counting stopped), then loads and attaches a new set of probes to
    /// the new program's allocator, with fresh maps, unwind rules and
    /// address space. Returns the old program, with its mappings, for
    /// [`TracedProcess::exec_replaced`] once the new one runs; `None` when
    /// the new program has no allocator mapped yet.
    pub(super) fn on_exec(
        &mut self,
        maps: &[Mapping],
        settings: &ProcSettings,
    ) -> Result<Option<TracedProcess>> {
        let pid = self.pid;
        let Some(alloc) = allocators::find_in_process(pid, maps, settings.mode.python_objects)?
        else {
            return Ok(None);
        };
        // The old program's counts end here, for every function at once.
        self.finish()?;
        // The same record, emptied: by pid the exit hold refreshes it too.
        let old_space = std::mem::take(&mut *self.space.lock().unwrap());
        let space = self.space.clone();
        let new = TracedProcess::attach_to(pid, alloc, maps, settings, space, &self.meta)?;
        let mut old = std::mem::replace(self, new);
        old.space = Arc::new(Mutex::new(old_space));
        Ok(Some(old))
    }

    /// The profile of a program exec replaced ([`TracedProcess::on_exec`]),
    /// read and symbolized with its mappings, kept by the process's new
    /// program; its probes are let go.
    pub(super) fn exec_replaced(
        old: TracedProcess,
        new: Option<&mut TracedProcess>,
        clock: &Clock,
        per_thread: bool,
    ) -> Result<Option<Profile>> {
        let profile = old.profile(clock, per_thread);
        super::detach::let_go(old.release());
        let profile = profile?;
        match new {
            Some(new) => {
                new.before_exec.push(profile);
                Ok(None)
            }
            None => Ok(Some(profile)),
        }
    }

    /// Done with: its unwinder stops and its rings' readers are kept,
    /// before its object serves another process (the probes returned).
    pub(super) fn release(self) -> Probes {
        let TracedProcess {
            probes,
            unwind,
            events,
            ..
        } = self;
        if unwind.stop() {
            probes
                .emptied
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .maps
                .push(maps::UNWIND_RULES);
        }
        events.into_iter().for_each(probes::pool::ring_back);
        probes
    }

    /// Live mode: the event rings, one per CPU.
    fn take_event_rings(&mut self) -> Result<Vec<RingBuf<MapData>>> {
        let mut events = Vec::new();
        if self.tracker.is_some() {
            for name in maps::EVENTS {
                events.push(probes::pool::ring(&self.probes.ebpf, name)?);
            }
        }
        Ok(events)
    }
}

/// `pid`'s Go heap (a Go program's) and the heaps it keeps that cannot be
/// seen.
pub(super) fn go_and_unseen(
    pid: u32,
    name: &str,
    exe: &str,
    maps: &[Mapping],
) -> (Option<Box<golang::GoProcess>>, Vec<crate::profile::Unseen>) {
    let mut unseen: Vec<_> = golang::unseen::detect(pid, name, exe, maps)
        .into_iter()
        .collect();
    let go = match golang::detect(pid, maps) {
        golang::Found::Go(go) => Some(go),
        golang::Found::Unreadable(u) => {
            unseen.push(u);
            None
        }
        golang::Found::None => None,
    };
    (go, unseen)
}

/// Feeds every event waiting in the rings and queues to the tracker, which
/// applies those stamped before the drain began; the rest wait for the
/// next drain. The `last` drain (counting has stopped) takes and applies
/// everything. The walks the tracer finished come first: an allocation
/// event whose stack the tracer unwound names it by an id that only they
/// resolve.
fn drain(
    events: &mut [RingBuf<MapData>],
    aside: Option<&mut KeptAside>,
    tracker: &mut Option<LiveTracker>,
    unwind: &UnwindService,
    last: bool,
) {
    let Some(tracker) = tracker.as_mut() else {
        return;
    };
    let started = live_tracker::monotonic_ns();
    for (id, key) in unwind.walks().take_remaps() {
        tracker.remap_stack(id, key);
    }
    read_rings(events, tracker);
    // A kept free was queued before its block could be allocated again,
    // and a kept allocation before its block could be freed: an event
    // stamped before `started` comes with every kept one it follows, which
    // were queued before it, so ahead of any stamped after `started`.
    // Taking the queues only that far (all of them at the end) keeps a
    // drain from chasing the programs. The rings are read between batches:
    // an event taken from a queue costs a system call, ten times one read
    // from a ring, and a ring left full sends every event to the queues.
    if let Some(aside) = aside {
        let until = (!last).then_some(started);
        let (mut frees, mut allocs) = (Taken::default(), Taken::default());
        while !(frees.done && allocs.done) {
            take_kept(
                &mut aside.frees,
                until,
                &mut frees,
                |f| f.ts,
                |f| tracker.on_lost_free(f),
            );
            take_kept(
                &mut aside.allocs,
                until,
                &mut allocs,
                |a| a.ts,
                |a| tracker.on_lost_alloc(a),
            );
            read_rings(events, tracker);
        }
        aside.fullest = (aside.fullest.0.max(frees.n), aside.fullest.1.max(allocs.n));
    }
    tracker.flush((!last).then_some(started));
}

fn read_rings(events: &mut [RingBuf<MapData>], tracker: &mut LiveTracker) {
    for ring in events.iter_mut() {
        while let Some(item) = ring.next() {
            tracker.on_bytes(&item);
        }
    }
}

/// Entries taken from a queue kept aside during one drain.
#[derive(Default)]
struct Taken {
    n: u64,
    /// The queue was empty, or gave an entry stamped after the drain began.
    done: bool,
}

/// Entries taken from a queue between two reads of the rings.
const KEPT_BATCH: u64 = 4096;

/// Pops up to [`KEPT_BATCH`] entries of `queue` into `take`, until it is
/// empty or, with `until`, up to and including the first entry stamped
/// after it (then `taken` is done).
fn take_kept<T: aya::Pod>(
    queue: &mut aya::maps::Queue<MapData, T>,
    until: Option<u64>,
    taken: &mut Taken,
    ts: impl Fn(&T) -> u64,
    mut take: impl FnMut(T),
) {
    for _ in 0..KEPT_BATCH {
        if taken.done {
            return;
        }
        let Ok(kept) = queue.pop(0) else {
            taken.done = true;
            return;
        };
        taken.done = until.is_some_and(|t| ts(&kept) > t);
        take(kept);
        taken.n += 1;
    }
}
