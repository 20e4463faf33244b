//! The host scope, `mtrace --all` and `mtrace top --all`: every process on
//! the host that allocates, at the cost of one BPF object and one link per
//! allocator file. The probes are file-wide (the kernel puts them in every
//! process that maps the file, present and future), so a new process costs
//! mtrace nothing; each call is counted in the kernel under its process,
//! its function and its whole stack. A stack's frames are places in files
//! (a file's tag and an offset), walked by unwind rules kept by file and
//! offset, so that every process that maps a file shares its rules and
//! its stacks; a walk that meets a frame without a rule is finished here
//! (`walks`), which gives the rule for the next. Processes outside any
//! other scope take the trap of every allocating call while it runs (see
//! docs/counting.md).

mod files;
mod go;
mod held;
mod jit;
mod probes;
mod processes;
mod python;
mod read;
mod root;
mod run;
mod walker;
mod walks;
mod windows;

pub use self::run::run;

use std::{
    collections::{HashSet, VecDeque},
    fs,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use aya::maps::{HashMap as BpfHashMap, MapData};
use tracer_common::{maps, Comm, HostExec, HostKey, HostProcess, HostValue, StackFrames};

use self::{
    files::{all_pids, FileIndex},
    probes::HostProbes,
    processes::Processes,
};
use crate::{
    profile::{merge::Merged, Meta, ProcessMeta, Profile},
    render::text::printable,
    say,
    tracee::{self, launch, RunAs},
};

/// What the host engine counts, the kernel's programs telling a process
/// in it from one outside: the allocator files are probed once, file-wide,
/// whatever the scope.
pub enum HostScope {
    /// `--all`: every process.
    All,
    /// `--file-wide -- CMD`: the command's process tree, from the command's
    /// first instruction (a child joins at its fork, in the kernel).
    Tree {
        argv: Vec<String>,
        run_as: Option<RunAs>,
    },
    /// `--file-wide --cgroup PATH`: the processes of the cgroup and of the
    /// cgroups below it, present and to come.
    Cgroup(std::path::PathBuf),
}

impl HostScope {
    /// The programs' name for it (`Config::host_scope`).
    fn kind(&self) -> u32 {
        match self {
            HostScope::All => tracer_common::SCOPE_ALL,
            HostScope::Tree { .. } => tracer_common::SCOPE_TREE,
            HostScope::Cgroup(_) => tracer_common::SCOPE_CGROUP,
        }
    }

    /// The profile's `meta.scope`.
    fn name(&self) -> &'static str {
        match self {
            HostScope::All => "host",
            HostScope::Tree { .. } => "tree",
            HostScope::Cgroup(_) => "cgroup",
        }
    }
}

/// After an exec, when to look at the process's files again: the dynamic
/// linker maps its libraries only once the program runs.
const RECHECKS_MS: [u64; 3] = [5, 50, 500];

/// The host scope under way: its probes, what it knows of files and
/// processes, and the processes whose files it looks at again.
struct Host {
    probes: HostProbes,
    /// The walks the tracer finishes.
    walks: walker::HostWalker,
    index: FileIndex,
    procs: Processes,
    /// The C library the dynamic linker's cache names (beside an
    /// executable that has an allocator of its own).
    libc: Option<String>,
    /// Executables looked at for an allocator of their own, by file.
    classified: HashSet<files::FileKey>,
    /// (when, pid): processes whose files to look at again.
    rechecks: VecDeque<(Instant, u32)>,
    /// Processes whose probes went in after they started.
    late: u64,
    /// A tree followed under ptrace: each exec is held until its
    /// executable is probed ([`held`]), asked for by the thread that
    /// follows it rather than from the kernel's word of the exec.
    held_execs: bool,
    /// The rows of processes gone, read out of the kernel's maps (which
    /// keep the processes alive only), and their records.
    ended: Merged,
    gone: VecDeque<ProcessMeta>,
    /// `mtrace agent --all`: what is kept of gone processes is bounded
    /// (past [`GONE_WITH_PID`] their rows are joined per command, past
    /// [`GONE_STACKS_KEPT`] rows their new stacks are joined per command,
    /// past [`AGENT_RECORDS`] the oldest records are dropped; each
    /// counted). Set by [`Host::bound`].
    bounded: bool,
    gone_with_pid: usize,
    unlisted: u64,
    /// Processes alive that have allocated, at the last look for those
    /// gone (every [`FOLD_EVERY`]).
    allocating: usize,
    stack_prune: StackPrune,
    /// The scope's Go programs: their own heaps.
    go: go::GoHeaps,
    /// A tree scope's root, whose execs are said.
    root: Option<root::RootExecs>,
}

/// `Host::bounded`: gone processes whose rows keep their pid, at most.
const GONE_WITH_PID: usize = 64;

/// `Host::bounded`: records of gone processes kept, at most.
const AGENT_RECORDS: usize = 1024;

/// `Host::bounded`: rows of gone processes kept, at most; past it a gone
/// process's stacks not kept are counted under its command's row of
/// stacks beyond ([`Merged::keep_at_most`]).
const GONE_STACKS_KEPT: usize = 32_768;

/// How often the maps are looked at for processes gone.
const FOLD_EVERY: Duration = Duration::from_secs(5);

/// The kernel's stack map is listed at least this often to take out the
/// stacks of processes gone (more often when it fills).
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// What the pruning of the kernel's stack map knows between looks.
struct StackPrune {
    last: Instant,
    /// The map's capacity.
    capacity: u32,
    /// Stacks the map held after the last look.
    held: usize,
    /// Stacks of processes read for good since the last look.
    left: usize,
    /// Stacks no key referred to at the last look.
    unreferred: HashSet<u64>,
    /// Stacks taken out so far.
    removed: u64,
}

impl Host {
    /// Probes every process on the host now, and the allocator libraries
    /// installed (a program that maps one later is counted from its first
    /// call). `runs`: each process's program runs are counted (the
    /// windows policy).
    fn start(
        sizes: &crate::probes::MapSizes,
        max_frames: u32,
        runs: bool,
        per_thread: bool,
        scope: &HostScope,
    ) -> Result<Host> {
        let probes = HostProbes::load(sizes, max_frames, runs, per_thread, scope.kind())?;
        let walks = walker::HostWalker::start(&probes.ebpf, probes.max_frames)?;
        let capacity = match probes.ebpf.map(maps::HOST_STACKS) {
            Some(aya::maps::Map::HashMap(m)) => m.info().map_or(0, |i| i.max_entries()),
            _ => 0,
        };
        let mut host = Host {
            probes,
            walks,
            index: FileIndex::default(),
            procs: Processes::default(),
            libc: None,
            classified: HashSet::new(),
            rechecks: VecDeque::new(),
            late: 0,
            held_execs: false,
            ended: Merged::default(),
            gone: VecDeque::new(),
            bounded: false,
            gone_with_pid: 0,
            unlisted: 0,
            allocating: 0,
            stack_prune: StackPrune {
                capacity,
                last: Instant::now(),
                held: 0,
                left: 0,
                unreferred: HashSet::new(),
                removed: 0,
            },
            go: go::GoHeaps::default(),
            root: None,
        };
        let me = std::process::id();
        let present = match scope {
            HostScope::All => all_pids(),
            HostScope::Tree { .. } => Vec::new(),
            HostScope::Cgroup(dir) => tracee::cgroup::members_below(dir),
        };
        for pid in present.into_iter().filter(|&p| p != me) {
            let Ok(text) = fs::read_to_string(format!("/proc/{pid}/maps")) else {
                continue;
            };
            if text.is_empty() {
                continue;
            }
            host.index.note(pid, &text);
            host.procs.note(pid, 0, None);
            if let Err(e) = host.probes.add_process(pid, &text) {
                say!("mtrace: pid {pid}: {}", printable(&format!("{e:#}")));
            }
            host.go.look(pid, false);
            host.walks.lock().look_for_python(pid, 0, &text);
            host.go.look_unseen(pid, &text);
        }
        let installed = installed_allocators();
        host.libc = installed.first().and_then(|set| set.first()).cloned();
        for paths in &installed {
            if let Err(e) = host.probes.add_files(paths) {
                log::debug!("probing {paths:?}: {e:#}");
            }
        }
        host.note_probed();
        Ok(host)
    }

    /// Bounds what is kept of gone processes (`mtrace agent --all`).
    fn bound(&mut self) {
        self.bounded = true;
        self.ended.keep_at_most(GONE_STACKS_KEPT);
    }

    /// The probed files are known files (their callers are symbolized
    /// through them).
    fn note_probed(&mut self) {
        for f in &self.probes.files {
            self.index.note_known(f.key, &f.path);
            self.walks.note_path(f.key, &f.path);
        }
    }

    /// `n` probes went in for a process already started (`what`): said,
    /// since its calls before then are not counted.
    fn added_late(&mut self, n: usize, what: String) {
        if n == 0 {
            return;
        }
        self.late += 1;
        self.note_probed();
        say!(
            "mtrace: {n} probes added {}: its calls before then are not counted",
            printable(&what)
        );
    }

    /// A process exec'd: its record, its executable's own allocator (a
    /// static program's, or Rust's shims: probed from the file, which
    /// outlives a process too short to be looked at), and its files
    /// looked at again once the dynamic linker has mapped them.
    fn on_exec(&mut self, e: &HostExec) {
        let end = e.path.iter().position(|&b| b == 0).unwrap_or(e.path.len());
        let path = String::from_utf8_lossy(&e.path[..end]).into_owned();
        self.procs.note(e.tgid, e.mm, Some(&path));
        if let Some(said) = self.root.as_mut().and_then(|r| r.said(e.tgid, &path)) {
            say!("mtrace: {said}");
        }
        self.index.note_file(e.tgid, &path);
        // The Go program it ran before is gone with its memory.
        if let Some(part) = self.go.execd(e.tgid) {
            self.ended.add(part);
        }
        self.look_for_python(e.tgid, e.mm);
        if let Some((key, exe)) = executable_file(e.tgid, &path) {
            if self.held_execs {
                // The process waits at its exec for the thread that
                // follows the tree, which asks for the probes it needs.
                self.walks.note_path(key, &exe);
            } else if let Some(n) = self.probe_executable(key, &exe) {
                self.added_late(n, format!("to {exe} after pid {} started it", e.tgid));
            }
        }
        let now = Instant::now();
        for ms in RECHECKS_MS {
            self.rechecks
                .push_back((now + Duration::from_millis(ms), e.tgid));
        }
    }

    /// Looks at process `pid` (address space `mm`, 0: not known) for an
    /// interpreter whose Python frames to read, now that it exec'd: an
    /// executable with libpython linked in has it mapped already; the
    /// libpython one needs is put in the kernel's table of interpreter
    /// files before the dynamic linker maps it (the process's first walk
    /// from it then knows the process runs it).
    /// Only a program named like an interpreter is looked at here (any
    /// other that runs one, an embedding program, is found when its files
    /// are looked at again): a tree of many short programs pays no read
    /// of their mappings at each exec for it.
    fn look_for_python(&mut self, pid: u32, mm: u64) {
        let exe = tracee::executable(pid);
        let named = crate::python::files::named_like_interpreter(&exe);
        let mut walks = self.walks.lock();
        if mm != 0 {
            walks.python.execd(pid);
        }
        if !named || walks.python.known(pid) {
            return;
        }
        if let Ok(text) = fs::read_to_string(format!("/proc/{pid}/maps")) {
            walks.look_for_python(pid, mm, &text);
        }
        if walks.python.known(pid) {
            return;
        }
        if let Some(lib) = crate::python::files::needed_libpython(pid, &exe) {
            walks.python_file(pid, &lib);
        }
    }

    /// A tree scope: probes the command's executable (an allocator of its
    /// own) and the C library before it runs; root `pid`'s later execs
    /// are said.
    fn probe_command(&mut self, pid: u32, cmd: &str) {
        let Ok((resolved, exe)) = launch::resolve_command(cmd)
            .and_then(|p| Ok((p.to_string_lossy().into_owned(), fs::canonicalize(p)?)))
        else {
            return;
        };
        self.root = Some(root::RootExecs::new(
            pid,
            resolved,
            exe.to_string_lossy().into_owned(),
        ));
        let Some(key) = files::key_of_path(&exe) else {
            return;
        };
        let exe = exe.to_string_lossy().into_owned();
        if self.probe_executable(key, &exe).is_some() {
            self.note_probed();
        }
    }

    /// Probes an executable's allocator of its own, beside the C library
    /// (once per file): the probes added, `None` when looked at before.
    fn probe_executable(&mut self, key: files::FileKey, exe: &str) -> Option<usize> {
        self.walks.note_path(key, exe);
        if !self.classified.insert(key) {
            return None;
        }
        let files: Vec<String> = std::iter::once(exe.to_string())
            .chain(self.libc.clone())
            .collect();
        Some(self.probes.add_files(&files).unwrap_or_else(|e| {
            log::debug!("{exe}: {e:#}");
            0
        }))
    }

    /// The tree's processes held at their exec ([`held`]), each with an
    /// allocator of its own: probed, then let go.
    fn answer_held(&mut self, asks: &std::sync::mpsc::Receiver<held::Ask>) {
        for ask in asks.try_iter() {
            match ask.what {
                held::Held::Probe { key, exe } => {
                    if self.probe_executable(key, &exe).is_some_and(|n| n > 0) {
                        self.note_probed();
                        log::debug!("{exe}: probed at its exec, before its first instruction");
                    }
                }
                held::Held::GoStarted { pid } => {
                    if let Some(part) = self.go.started_at_exec(pid) {
                        self.ended.add(part);
                    }
                }
                held::Held::Exiting { pid } => {
                    self.go.exiting(pid);
                    // Its walks finished while its memory is there to
                    // name their Python code objects from.
                    self.walks.walks().python.judge(pid);
                }
                held::Held::Python { pid } => self.look_for_python(pid, 0),
            }
            let _ = ask.done.send(());
        }
    }

    /// Looks again at the files of the processes due.
    fn recheck(&mut self) {
        let now = Instant::now();
        let mut due = Vec::new();
        self.rechecks.retain(|&(at, pid)| {
            if at <= now {
                due.push(pid);
            }
            at > now
        });
        due.dedup();
        for pid in due {
            if self.held_execs && held::stopped_by_tracer(pid) {
                // Held at its exec, its program not yet run: looked at
                // once it runs.
                self.rechecks
                    .push_back((now + Duration::from_millis(RECHECKS_MS[0]), pid));
                continue;
            }
            let Ok(text) = fs::read_to_string(format!("/proc/{pid}/maps")) else {
                continue;
            };
            self.index.note(pid, &text);
            self.go.look(pid, true);
            self.walks.lock().look_for_python(pid, 0, &text);
            self.go.look_unseen(pid, &text);
            match self.probes.add_process(pid, &text) {
                Ok(n) => self.added_late(
                    n,
                    format!(
                        "for pid {pid} ({}) after it started",
                        printable(&tracee::comm(pid))
                    ),
                ),
                Err(e) => say!("mtrace: pid {pid}: {}", printable(&format!("{e:#}"))),
            }
        }
    }

    /// Moves the rows of processes that are gone out of the kernel's
    /// maps (which then hold the processes alive, and have room for those
    /// to come) into `ended`. A process is gone when `/proc` no longer has
    /// it; its keys are read, then deleted: no call of it can come after.
    /// Its count of program runs goes too.
    fn fold_gone(&mut self) -> Result<()> {
        let exists = |&t: &u32| tracee::cgroup::is_alive(t);
        for part in self.go.fold() {
            self.ended.add(part);
        }
        let ran_gone: HashSet<u32> = self
            .probes
            .process_runs()
            .into_keys()
            .filter(|t| !exists(t))
            .collect();
        self.probes.forget_runs(&ran_gone);
        let mut keys = read::counted_keys(&self.probes)?;
        let mut counted: HashSet<u32> = keys.iter().map(|k| k.tgid).collect();
        // Processes with calls only the tracer's walks counted are
        // counted too.
        let mut walks = self.walks.walks();
        counted.extend(walks.rows.keys().map(|k| k.tgid));
        // Records of processes that never allocated (a static program
        // without an allocator mtrace knows), gone since.
        let idle = self.procs.gone_uncounted(&counted);
        self.procs.forget(&idle);
        let all = counted.len();
        let mut gone = counted;
        gone.retain(|t| !exists(t));
        self.allocating = all - gone.len();
        if gone.is_empty() {
            drop(walks);
            return self.prune_stacks(&keys);
        }
        let (ended_keys, live_keys): (Vec<HostKey>, Vec<HostKey>) =
            keys.into_iter().partition(|k| gone.contains(&k.tgid));
        keys = ended_keys;
        let walked = walks.take_rows_of(&gone);
        let tids: HashSet<u32> = keys
            .iter()
            .chain(walked.iter().map(|(k, _)| k))
            .map(|k| k.tid)
            .filter(|&t| t != 0)
            .collect();
        let mut part = read::gone_profile(
            &self.probes,
            &mut self.index,
            &mut self.procs,
            &mut walks,
            &keys,
            walked,
        )?;
        walks.prune_stacks();
        walks.python.forget(&gone);
        walks.python.forget(&idle);
        walks.jit.forget(&gone);
        drop(walks);
        let ebpf = &mut self.probes.ebpf;
        let mut counts: BpfHashMap<&mut MapData, HostKey, HostValue> =
            BpfHashMap::try_from(ebpf.map_mut(maps::HOST_COUNTS).context("HOST_COUNTS map")?)?;
        for k in &keys {
            let _ = counts.remove(k);
        }
        let mut names: BpfHashMap<&mut MapData, HostProcess, tracer_common::HostName> =
            BpfHashMap::try_from(ebpf.map_mut(maps::HOST_NAMES).context("HOST_NAMES map")?)?;
        let named: Vec<HostProcess> = names
            .keys()
            .filter_map(|k| k.ok())
            .filter(|p| gone.contains(&p.tgid))
            .collect();
        for p in &named {
            let _ = names.remove(p);
        }
        // `--per-thread`: the names of their threads, read with their rows.
        if !tids.is_empty() {
            let mut threads: BpfHashMap<&mut MapData, u32, Comm> = BpfHashMap::try_from(
                ebpf.map_mut(maps::THREAD_NAMES)
                    .context("THREAD_NAMES map")?,
            )?;
            for t in &tids {
                let _ = threads.remove(t);
            }
        }
        self.procs.forget(&gone);
        self.stack_prune.left += keys.iter().map(|k| k.stack).collect::<HashSet<_>>().len();
        self.prune_stacks(&live_keys)?;
        self.gone.extend(std::mem::take(&mut part.meta.processes));
        self.ended.add(part);
        if self.bounded {
            self.gone_with_pid += gone.len();
            if self.gone_with_pid > GONE_WITH_PID {
                self.ended.forget_pids();
                self.gone_with_pid = 0;
            }
            while self.gone.len() > AGENT_RECORDS {
                self.gone.pop_front();
                self.unlisted += 1;
            }
        }
        Ok(())
    }

    /// Takes out of the kernel's stack map the stacks no key of `live`
    /// (every key the counts map holds) refers to: those of processes
    /// read for good. A program stores a new key's stack just before the
    /// key, so a stack is taken out only when no key referred to it at two
    /// looks in a row, [`FOLD_EVERY`] apart: one stored between the keys'
    /// listing and the stacks' is kept. The map is listed when the last
    /// listing found it over a quarter full, or [`PRUNE_EVERY`] after the
    /// last.
    fn prune_stacks(&mut self, live: &[HostKey]) -> Result<()> {
        let prune = &mut self.stack_prune;
        let capacity = prune.capacity;
        let referred: HashSet<u64> = live.iter().map(|k| k.stack).collect();
        // At least this many stacks are in the map: those of the keys,
        // and those left by processes gone since the last look.
        let held = (referred.len() + prune.left).max(prune.held);
        if held * 4 <= capacity as usize && prune.last.elapsed() < PRUNE_EVERY {
            return Ok(());
        }
        prune.last = Instant::now();
        let mut stacks: BpfHashMap<&mut MapData, u64, StackFrames> = BpfHashMap::try_from(
            self.probes
                .ebpf
                .map_mut(maps::HOST_STACKS)
                .context("HOST_STACKS map")?,
        )?;
        let listed: Vec<u64> = stacks.keys().filter_map(|k| k.ok()).collect();
        let unreferred: HashSet<u64> = listed
            .iter()
            .copied()
            .filter(|id| !referred.contains(id))
            .collect();
        let mut removed = 0;
        for id in unreferred.intersection(&prune.unreferred) {
            if stacks.remove(id).is_ok() {
                removed += 1;
            }
        }
        log::debug!(
            "stack map: {removed} stacks of processes gone taken out, {} held",
            listed.len() - removed
        );
        prune.held = listed.len() - removed;
        prune.left = 0;
        prune.removed += removed as u64;
        prune.unreferred = unreferred;
        Ok(())
    }

    /// The profile so far (`meta` without the probes' part): the rows of
    /// processes gone and of those the maps hold.
    fn profile(&mut self, mut meta: Meta) -> Result<Profile> {
        if let Some(root) = &self.root {
            meta.executable = root.program().to_string();
        }
        let totals = self.probes.totals_by_func();
        meta.allocator_family = self.probes.families_called(&totals);
        meta.allocator_beside = self.probes.besides_called(&totals);
        meta.allocator_object = self
            .probes
            .files
            .iter()
            .map(|f| match f.family {
                "" => f.path.clone(),
                family => format!("{} ({family})", f.path),
            })
            .collect::<Vec<_>>()
            .join(", ");
        let mut walks = self.walks.walks();
        let mut live = read::profile(
            &self.probes,
            &mut self.index,
            &mut self.procs,
            &mut walks,
            meta,
        )?;
        drop(walks);
        self.go.add_to(&mut live);
        if self.ended.get().is_none() {
            return Ok(live);
        }
        let alive = live.meta.processes.clone();
        // The rows of processes gone are kept symbolized and joined; a
        // reading copies them and joins the live rows in.
        let mut profile = self.ended.with(live);
        let mut records: Vec<ProcessMeta> = self.gone.iter().cloned().chain(alive).collect();
        let over = records.len().saturating_sub(Meta::MAX_PROCESS_RECORDS);
        records.drain(..over);
        profile.meta.processes = records;
        profile.meta.processes_unlisted = self.unlisted + over as u64;
        Ok(profile)
    }
}

/// The file process `pid` exec'd as `path` (the path exec was given:
/// relative to its working directory, when it is relative), resolved,
/// with its identity.
fn executable_file(pid: u32, path: &str) -> Option<(files::FileKey, String)> {
    let full = if path.starts_with('/') {
        std::path::PathBuf::from(path)
    } else {
        fs::read_link(format!("/proc/{pid}/cwd")).ok()?.join(path)
    };
    let full = fs::canonicalize(full).ok()?;
    Some((
        files::key_of_path(&full)?,
        full.to_string_lossy().into_owned(),
    ))
}

/// The allocator libraries the dynamic linker's cache names (`ldconfig
/// -p`), each as the files a program using it would map: libstdc++ after
/// the C library (it defines `operator new`, not `malloc`), jemalloc,
/// tcmalloc and mimalloc alone. Paths resolved (the probes' files).
fn installed_allocators() -> Vec<Vec<String>> {
    let Ok(out) = std::process::Command::new("ldconfig")
        .arg("-p")
        .stderr(std::process::Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let lib = |name: &str| -> Option<String> {
        text.lines()
            .filter(|l| l.trim_start().starts_with(&format!("{name} ")) && l.contains("x86-64"))
            .find_map(|l| l.split(" => ").nth(1))
            .and_then(|p| fs::canonicalize(p.trim()).ok())
            .map(|p| p.to_string_lossy().into_owned())
    };
    let Some(libc) = lib("libc.so.6") else {
        return Vec::new();
    };
    let mut sets = vec![vec![libc.clone()]];
    if let Some(cxx) = lib("libstdc++.so.6") {
        sets.push(vec![libc.clone(), cxx]);
    }
    for name in [
        "libjemalloc.so.2",
        "libtcmalloc.so.4",
        "libtcmalloc_minimal.so.4",
        "libmimalloc.so.2",
    ] {
        if let Some(p) = lib(name) {
            sets.push(vec![p]);
        }
    }
    sets
}
