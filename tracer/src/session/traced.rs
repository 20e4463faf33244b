//! One traced process: its probes and maps, the walks its unwinder
//! finishes, its live tracker, its address space; what it does when it
//! exec's another program.

use std::sync::{Arc, Mutex};

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use tracer_common::{maps, LostFree};

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

/// Live mode: the kernel's map of lost frees (see [`LostFree`]).
type LostFrees = aya::maps::Queue<MapData, LostFree>;

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
    /// Live mode: the frees its rings had no room for.
    lost_frees: Option<LostFrees>,
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
        let layout = interpreter.as_ref().map(|i| i.layout).unwrap_or_default();
        let names = interpreter
            .as_ref()
            .and_then(|i| python::Names::new(pid, i.minor));
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
            lost_frees: None,
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
            let map = probes::pool::map_copy(&proc.probes.ebpf, maps::LOST_FREES)?;
            proc.lost_frees = Some(LostFrees::try_from(map)?);
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
        drain(
            &mut self.events,
            self.lost_frees.as_mut(),
            &mut self.tracker,
            &self.unwind,
        );
    }

    /// Its counting ends: every function at once, then the walks and
    /// events under way are taken in.
    pub(super) fn finish(&mut self) -> Result<()> {
        self.probes.set_enabled(false)?;
        self.unwind.walks().finish_all();
        self.drain();
        if let Some(t) = &mut self.tracker {
            t.flush(None);
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

/// Feeds every event waiting in the rings to the tracker, which applies
/// those stamped before the drain began. The rest wait for the next drain;
/// after the last one, they are events of after the trace's end. The walks
/// the tracer finished come first: an allocation event whose stack the
/// tracer unwound names it by an id that only they resolve.
fn drain(
    events: &mut [RingBuf<MapData>],
    lost_frees: Option<&mut LostFrees>,
    tracker: &mut Option<LiveTracker>,
    unwind: &UnwindService,
) {
    let Some(tracker) = tracker.as_mut() else {
        return;
    };
    let started = live_tracker::monotonic_ns();
    for (id, key) in unwind.walks().take_remaps() {
        tracker.remap_stack(id, key);
    }
    for ring in events.iter_mut() {
        while let Some(item) = ring.next() {
            tracker.on_bytes(&item);
        }
    }
    // After the rings: a free kept there was stored before its block
    // could be allocated again, so a later allocation drained above never
    // comes without it.
    if let Some(queue) = lost_frees {
        while let Ok(free) = queue.pop(0) {
            tracker.on_lost_free(free);
        }
    }
    tracker.flush(Some(started));
}
