//! The host scope's probes: one BPF object for the run, and for every
//! allocator file a process on the host allocates through, one link that
//! puts the allocating entry points' probes in every process that maps
//! the file (now or later). Each process's allocator is found as for a
//! traced process ([`crate::allocators::find_in_process`]); a file already
//! probed costs nothing more, a site not yet probed in it one more link.

use std::collections::HashMap;

use anyhow::{Context, Result};
use aya::{maps::Array, programs::RawTracePoint, Ebpf};
use tracer_common::{
    maps, BodyRange, HostBodies, HostFunc, MAX_HOST_BODIES, MAX_HOST_FILES, MAX_HOST_FUNCS,
};

use super::files::{key_of_path, mapped_files, FileKey};
use crate::{
    allocators::{find_in_files, find_in_process, AllocatorObject, ProbeSite},
    probes::{self, multi},
    tracee::parse_maps,
};

/// A row of the host's function table: an allocating function in one file.
#[derive(Clone, Debug)]
pub struct HostFuncInfo {
    pub name: String,
    pub probe: crate::profile::Probe,
    /// Its file: a row of [`HostProbes::files`].
    pub file: u32,
}

/// An allocator file with probes in it.
#[derive(Debug)]
pub struct ProbedFile {
    pub key: FileKey,
    pub path: String,
    pub family: &'static str,
    /// A prefixed allocator API in it beside the C library's (`jemalloc
    /// (_rjem_) in PATH`): its calls are not the family's of the scope.
    pub beside: Option<String>,
    bodies: Vec<BodyRange>,
}

/// One link's worth of probes in one file: kept to put them back after a
/// pause (the windows policy), through the file held open (the path a
/// process mapped it by may be gone: `/proc/PID/root/...`).
struct Plan {
    file: std::fs::File,
    offsets: Vec<u64>,
    cookies: Vec<u64>,
}

impl Plan {
    fn attach(&self, program: &multi::Program) -> std::io::Result<multi::Link> {
        use std::os::fd::AsRawFd;
        let path = std::path::PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()));
        program.attach(&path, &self.offsets, &self.cookies, false, None)
    }
}

pub struct HostProbes {
    /// Dropped, they take every probe out of every process; first.
    links: Vec<multi::Link>,
    /// Every link's probes, attached or not (paused).
    plans: Vec<Plan>,
    /// Out for a pause of the windows policy: plans are made, not attached.
    paused: bool,
    program: multi::Program,
    pub ebpf: Ebpf,
    pub funcs: Vec<HostFuncInfo>,
    pub files: Vec<ProbedFile>,
    /// (file, probe's file offset) -> row of `funcs`.
    sites: HashMap<(u32, u64), u32>,
    /// Sites left unprobed: the function table or the files' table was
    /// full.
    pub unprobed: u64,
    /// Most frames a walk keeps above the direct caller (0: no walk).
    pub max_frames: u32,
    /// mtrace's own executable, never probed.
    own: Option<FileKey>,
}

impl HostProbes {
    /// The program every allocator file's probes run.
    pub fn program(&self) -> &multi::Program {
        &self.program
    }

    /// Each function's calls and bytes so far (the kernel's totals, by
    /// row of [`HostProbes::funcs`]); none when the map cannot be read.
    pub fn totals_by_func(&self) -> Vec<(u64, u64)> {
        let Some(Ok(totals)) = self
            .ebpf
            .map(maps::HOST_TOTALS)
            .map(aya::maps::PerCpuArray::<&aya::maps::MapData, u64>::try_from)
        else {
            return Vec::new();
        };
        let sum = |i: u32| totals.get(&i, 0).map_or(0, |v| v.iter().sum::<u64>());
        (0..self.funcs.len() as u32)
            .map(|f| (sum(f), sum(MAX_HOST_FUNCS + f)))
            .collect()
    }

    /// The prefixed allocator APIs beside the C library's whose functions
    /// the scope called (`totals`: [`Self::totals_by_func`]'s), `jemalloc
    /// (_rjem_) in PATH`, joined, as the per-process engine says its
    /// process's.
    pub fn besides_called(&self, totals: &[(u64, u64)]) -> String {
        let mut said: Vec<&str> = Vec::new();
        for (func, &(n, _)) in self.funcs.iter().zip(totals) {
            let beside = self
                .files
                .get(func.file as usize)
                .and_then(|f| f.beside.as_deref());
            if let Some(b) = beside.filter(|b| n > 0 && !said.contains(b)) {
                said.push(b);
            }
        }
        said.join("; ")
    }

    /// The allocator families whose functions the scope called, most
    /// called first, joined (`glibc`, or `jemalloc, glibc` for a program
    /// with jemalloc that also calls libc's), as the per-process engine
    /// names its process's (`totals`: [`Self::totals_by_func`]'s).
    pub fn families_called(&self, totals: &[(u64, u64)]) -> String {
        let mut calls: Vec<(&str, u64)> = Vec::new();
        for (func, &(n, _)) in self.funcs.iter().zip(totals) {
            let family = self.files.get(func.file as usize).map_or("", |f| f.family);
            if n == 0 || family.is_empty() {
                continue;
            }
            match calls.iter_mut().find(|(name, _)| *name == family) {
                Some(c) => c.1 += n,
                None => calls.push((family, n)),
            }
        }
        calls.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        calls
            .iter()
            .map(|(name, _)| *name)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Loads the object (`counts`: keys the aggregation map holds; `runs`:
    /// each process's program runs counted), with the exec tracepoint
    /// attached; no allocator probed yet.
    pub fn load(
        sizes: &probes::MapSizes,
        max_frames: u32,
        runs: bool,
        per_thread: bool,
        scope: u32,
    ) -> Result<HostProbes> {
        let mut ebpf = probes::load_host(sizes, max_frames, runs, per_thread, scope)?;
        let object = probes::bpf_object()?;
        let mut programs = multi::load(&object, &ebpf, &[maps::HOST_ALLOC])?;
        let program = programs.pop().context("the host program")?;
        attach_tracepoint(&mut ebpf, maps::HOST_EXEC, "sched_process_exec")?;
        attach_tracepoint(&mut ebpf, maps::HOST_EXIT, "sched_process_exit")?;
        if scope == tracer_common::SCOPE_TREE {
            attach_tracepoint(&mut ebpf, maps::HOST_FORK, "sched_process_fork")?;
        }
        let mut own: Array<_, u32> = Array::try_from(
            ebpf.map_mut(maps::HOST_SELF)
                .context("BPF map HOST_SELF missing")?,
        )?;
        own.set(0, std::process::id(), 0)?;
        Ok(HostProbes {
            links: Vec::new(),
            plans: Vec::new(),
            paused: false,
            program,
            ebpf,
            funcs: Vec::new(),
            files: Vec::new(),
            sites: HashMap::new(),
            unprobed: 0,
            max_frames: max_frames.min(tracer_common::MAX_FRAMES as u32),
            own: key_of_path(std::path::Path::new("/proc/self/exe")),
        })
    }

    /// A tree scope: puts process `pid` in the tree (its children join it
    /// as they are forked).
    pub fn scope_pid(&mut self, pid: u32) -> Result<()> {
        let mut pids: aya::maps::HashMap<_, u32, u32> = aya::maps::HashMap::try_from(
            self.ebpf
                .map_mut(maps::HOST_SCOPE_PIDS)
                .context("BPF map HOST_SCOPE_PIDS missing")?,
        )?;
        pids.insert(pid, 1, 0)?;
        Ok(())
    }

    /// A tree scope: the processes in the tree, those gone taken out
    /// (each pid's main thread takes it out when it ends, so this is for
    /// a pid whose exit the kernel could not take out).
    pub fn scope_pids(&mut self) -> Result<Vec<u32>> {
        let mut pids: aya::maps::HashMap<_, u32, u32> = aya::maps::HashMap::try_from(
            self.ebpf
                .map_mut(maps::HOST_SCOPE_PIDS)
                .context("BPF map HOST_SCOPE_PIDS missing")?,
        )?;
        let listed: Vec<u32> = pids.keys().filter_map(|k| k.ok()).collect();
        let (alive, gone): (Vec<u32>, Vec<u32>) = listed
            .into_iter()
            .partition(|&p| crate::tracee::cgroup::is_alive(p));
        for p in gone {
            let _ = pids.remove(&p);
        }
        Ok(alive)
    }

    /// A cgroup scope: the cgroup v2 `id` and its descendants are in it
    /// (`level`: below the root, the root's level being 0).
    pub fn scope_cgroup(&mut self, id: u64, level: u32) -> Result<()> {
        if level >= tracer_common::SCOPE_CGROUP_LEVELS {
            anyhow::bail!(
                "the cgroup lies {level} levels deep; mtrace looks {} deep at most",
                tracer_common::SCOPE_CGROUP_LEVELS
            );
        }
        let mut ids: aya::maps::HashMap<_, u64, u32> = aya::maps::HashMap::try_from(
            self.ebpf
                .map_mut(maps::HOST_SCOPE_CGROUPS)
                .context("BPF map HOST_SCOPE_CGROUPS missing")?,
        )?;
        let levels = ids.get(&0, 0).unwrap_or(0) | (1 << level);
        ids.insert(id, 1, 0)?;
        ids.insert(0, levels, 0)?;
        Ok(())
    }

    /// Probes what process `pid` (whose `/proc/PID/maps` reads `maps`)
    /// allocates through and is not probed yet; returns how many sites
    /// went in. A process whose allocator cannot be found adds none.
    pub fn add_process(&mut self, pid: u32, maps: &str) -> Result<usize> {
        let mappings = parse_maps(maps);
        let Ok(Some(alloc)) = find_in_process(pid, &mappings, false) else {
            return Ok(0);
        };
        let keys: HashMap<String, FileKey> = mapped_files(maps).map(|(k, p)| (p, k)).collect();
        self.add(&alloc, &keys)
    }

    /// Probes the allocator of a program that would map `paths` (in this
    /// order), as they are on this host, before any process maps them.
    pub fn add_files(&mut self, paths: &[String]) -> Result<usize> {
        let Some(alloc) = find_in_files(paths.to_vec())? else {
            return Ok(0);
        };
        let keys: HashMap<String, FileKey> = paths
            .iter()
            .filter_map(|p| Some((p.clone(), key_of_path(std::path::Path::new(p))?)))
            .collect();
        self.add(&alloc, &keys)
    }

    /// Probes `alloc`'s sites not probed yet (`keys`: each file's
    /// identity, by the path `alloc` names it by).
    fn add(&mut self, alloc: &AllocatorObject, keys: &HashMap<String, FileKey>) -> Result<usize> {
        let mut by_path: Vec<(String, Vec<&ProbeSite>)> = Vec::new();
        for site in alloc.sites.iter().filter(|s| s.role().allocates()) {
            match by_path.iter_mut().find(|(p, _)| *p == site.path) {
                Some((_, v)) => v.push(site),
                None => by_path.push((site.path.clone(), vec![site])),
            }
        }
        let mut added = 0;
        for (path, sites) in by_path {
            let Some(&key) = keys.get(&path) else {
                continue;
            };
            if Some(key) == self.own {
                // mtrace's own Rust allocator shims: mtrace is not one of
                // the host's processes, and each probe in it is a trap
                // on every allocation it makes.
                continue;
            }
            let family = if path == alloc.path { alloc.family } else { "" };
            let beside = (path != alloc.path && sites.iter().any(|s| s.prefix.is_some()))
                .then(|| alloc.beside.clone())
                .flatten();
            let Some(file) = self.file_index(key, &path, family, beside) else {
                self.unprobed += sites.len() as u64;
                continue;
            };
            // The file's bodies: every probed function of it and the
            // allocator's internals in it.
            let mut bodies: Vec<BodyRange> = sites
                .iter()
                .map(|s| BodyRange {
                    start: s.file_offset,
                    end: s.file_offset + s.size.max(1),
                })
                .chain(
                    alloc
                        .internals
                        .iter()
                        .filter(|i| i.path == path)
                        .map(|i| BodyRange {
                            start: i.file_offset,
                            end: i.file_offset + i.size.max(1),
                        }),
                )
                .collect();
            bodies.extend(self.files[file as usize].bodies.iter().copied());
            self.set_bodies(file, bodies)?;
            // Every site of the file is attached through the same path.
            let open = sites[0].open_path.clone();
            let (mut offsets, mut cookies) = (Vec::new(), Vec::new());
            for site in sites {
                let at = site.file_offset + site.probe_offset;
                if self.sites.contains_key(&(file, at)) {
                    continue;
                }
                let func = self.funcs.len() as u32;
                if func >= MAX_HOST_FUNCS {
                    self.unprobed += 1;
                    continue;
                }
                let mut table: Array<_, HostFunc> = Array::try_from(
                    self.ebpf
                        .map_mut(maps::HOST_FUNCS)
                        .context("BPF map HOST_FUNCS missing")?,
                )?;
                table.set(
                    func,
                    HostFunc {
                        file,
                        _pad: 0,
                        probe_offset: at,
                    },
                    0,
                )?;
                self.sites.insert((file, at), func);
                self.funcs.push(HostFuncInfo {
                    name: site.display_name(),
                    probe: crate::profile::Probe {
                        function: site.display_name(),
                        offset: site.probe_offset,
                        instruction: site.instruction.clone(),
                        emulated: site.emulated,
                    },
                    file,
                });
                offsets.push(at);
                cookies.push(probes::cookie(site, func));
            }
            if offsets.is_empty() {
                continue;
            }
            let plan = Plan {
                file: std::fs::File::open(&open)
                    .with_context(|| format!("opening {}", open.display()))?,
                offsets,
                cookies,
            };
            if !self.paused {
                let link = plan.attach(&self.program).with_context(|| {
                    format!("attaching {} uprobes to {path}", plan.offsets.len())
                })?;
                self.links.push(link);
            }
            added += plan.offsets.len();
            self.plans.push(plan);
        }
        Ok(added)
    }

    /// The index of file `key` in the files' table, added when new
    /// (`None`: the table is full).
    fn file_index(
        &mut self,
        key: FileKey,
        path: &str,
        family: &'static str,
        beside: Option<String>,
    ) -> Option<u32> {
        if let Some(i) = self.files.iter().position(|f| f.key == key) {
            return Some(i as u32);
        }
        if self.files.len() >= MAX_HOST_FILES as usize {
            return None;
        }
        self.files.push(ProbedFile {
            key,
            path: path.to_string(),
            family,
            beside,
            bodies: Vec::new(),
        });
        Some(self.files.len() as u32 - 1)
    }

    /// Sets file `file`'s bodies (sorted, overlaps joined; the first
    /// `MAX_HOST_BODIES`) in the kernel's table, before any probe of it
    /// that needs them goes in.
    fn set_bodies(&mut self, file: u32, mut bodies: Vec<BodyRange>) -> Result<()> {
        bodies.sort_by_key(|b| (b.start, b.end));
        let mut joined: Vec<BodyRange> = Vec::new();
        for b in bodies {
            match joined.last_mut() {
                Some(last) if b.start <= last.end => last.end = last.end.max(b.end),
                _ => joined.push(b),
            }
        }
        joined.truncate(MAX_HOST_BODIES);
        if joined == self.files[file as usize].bodies {
            return Ok(());
        }
        let mut value = HostBodies {
            n: joined.len() as u32,
            ..HostBodies::default()
        };
        value.ranges[..joined.len()].copy_from_slice(&joined);
        let mut table: Array<_, HostBodies> = Array::try_from(
            self.ebpf
                .map_mut(maps::HOST_BODIES)
                .context("BPF map HOST_BODIES missing")?,
        )?;
        table.set(file, value, 0)?;
        self.files[file as usize].bodies = joined;
        Ok(())
    }

    /// Counting on or off, for every process at once.
    pub fn set_enabled(&mut self, on: bool) -> Result<()> {
        let mut flag: Array<_, u32> = Array::try_from(
            self.ebpf
                .map_mut(maps::ENABLED)
                .context("BPF map ENABLED missing")?,
        )?;
        flag.set(0, on as u32, 0)?;
        Ok(())
    }

    /// Takes every probe out of every process (each link's close waits
    /// for the kernel; they overlap).
    pub fn detach(&mut self) {
        multi::close_all(std::mem::take(&mut self.links));
    }

    /// Links in place, or planned during a pause.
    pub fn links(&self) -> usize {
        self.plans.len()
    }

    /// The windows policy's pause: counting stopped, every probe out of
    /// every process; probes of files found during the pause wait for
    /// [`HostProbes::resume`]. Returns when the closing of the links began.
    pub fn pause(&mut self) -> Result<std::time::Instant> {
        self.set_enabled(false)?;
        self.paused = true;
        let closing = std::time::Instant::now();
        self.detach();
        Ok(closing)
    }

    /// After a pause: every probe back in, then counting on.
    pub fn resume(&mut self) -> Result<()> {
        self.paused = false;
        for plan in &self.plans {
            let link = plan
                .attach(&self.program)
                .context("putting the probes back")?;
            self.links.push(link);
        }
        self.set_enabled(true)
    }

    /// Each process's runs of the host program so far, by process id.
    pub fn process_runs(&self) -> std::collections::HashMap<u32, u64> {
        let Some(map) = self.ebpf.map(maps::HOST_RUNS) else {
            return Default::default();
        };
        let Ok(runs) = aya::maps::HashMap::<_, u32, u64>::try_from(map) else {
            return Default::default();
        };
        runs.iter().filter_map(|e| e.ok()).collect()
    }

    /// Forgets the runs of the processes in `gone`.
    pub fn forget_runs(&mut self, gone: &std::collections::HashSet<u32>) {
        let Some(map) = self.ebpf.map_mut(maps::HOST_RUNS) else {
            return;
        };
        let Ok(mut runs) = aya::maps::HashMap::<_, u32, u64>::try_from(map) else {
            return;
        };
        let keys: Vec<u32> = runs
            .keys()
            .filter_map(|k| k.ok())
            .filter(|t| gone.contains(t))
            .collect();
        for t in keys {
            let _ = runs.remove(&t);
        }
    }

    /// The host program's runs and run time so far (the kernel's BPF
    /// run-time stats, when on).
    pub fn program_stats(&self) -> (u64, u64) {
        self.program
            .info()
            .map_or((0, 0), |i| (i.runs, i.run_time_ns))
    }
}

/// Loads `program` and attaches it to the raw tracepoint `tracepoint`: by
/// name, with no tracefs (which a host may not have mounted). The link is
/// the program's: detached when the object is dropped.
fn attach_tracepoint(ebpf: &mut Ebpf, program: &str, tracepoint: &str) -> Result<()> {
    let p: &mut RawTracePoint = ebpf
        .program_mut(program)
        .with_context(|| format!("the program {program}"))?
        .try_into()?;
    // Loaded again when a signal interrupted the verifier (see
    // `multi::interrupted`).
    let mut tries = 1;
    loop {
        match p.load() {
            Err(aya::programs::ProgramError::LoadError { io_error, .. })
                if crate::probes::multi::interrupted(&io_error)
                    && tries < crate::probes::multi::LOAD_TRIES =>
            {
                tries += 1
            }
            done => break done.with_context(|| format!("loading {program}"))?,
        }
    }
    p.attach(tracepoint)
        .with_context(|| format!("attaching to {tracepoint}"))?;
    Ok(())
}
