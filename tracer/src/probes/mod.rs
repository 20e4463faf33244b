//! Loading the BPF programs and attaching them to the target's allocator.
//! Dropping [`Probes`] detaches everything (the kernel also detaches when
//! mtrace dies: the links are file descriptors).

mod inline;
pub mod kernel;
mod load;
pub mod multi;
pub mod pool;
mod sampling;
#[cfg(test)]
mod tests;

pub(crate) use load::bpf_object;
pub use load::{host_ring, load_host};
pub use sampling::Sampling;

use inline::{inline_numbers, inline_probes};
use load::load;
use sampling::{exp_table, geometric_scale, seed_countdowns, weight_table};

use anyhow::{Context, Result};
use aya::Ebpf;
use tracer_common::{
    maps, Config, ProcessConfig, PythonLayout, Role, VmaOffsets, COOKIE_ARGS_SHIFT,
    COOKIE_ROLE_SHIFT, MAX_BODY_RANGES, MAX_FUNCS, SAMPLE_BYTES, SAMPLE_EVERY, SAMPLE_NONE,
    WEIGHT_ONE,
};

use crate::{
    allocators::{AllocatorObject, FuncInfo, ProbeSite},
    render::text::printable,
    tracee::Mapping,
    user_error,
};

/// The cookie of a probe site: the function's index in the run's table,
/// where its arguments are, and its role (`realloc`'s for a
/// `reallocarray` probed past its multiply: `(ptr, n * size)`).
pub(crate) fn cookie(site: &ProbeSite, func: u32) -> u64 {
    let role = if site.multiplied {
        Role::Resize
    } else {
        site.role()
    };
    func as u64 | site.args << COOKIE_ARGS_SHIFT | (role as u64) << COOKIE_ROLE_SHIFT
}

/// Sizes of the kernel maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    /// Distinct (stack, caller, function, thread) keys.
    pub counts: u32,
    /// Distinct stacks.
    pub stacks: u32,
    /// Live mode: event ring buffer, bytes (a power of two).
    pub events: u32,
    /// Unwind rules the kernel holds (distinct return addresses).
    pub unwind_rules: u32,
    /// The ring of walks the tracer finishes, bytes (a power of two).
    pub unwind_ring: u32,
    /// Live mode: frees, and allocations, the kernel keeps aside when a
    /// ring is full (see `LostFree`, `LostAlloc`): each queue holds at
    /// least as many as blocks the tracker follows, so a burst that frees
    /// every followed block at once, or allocates as many, loses none.
    pub kept_aside: u32,
    /// Host scope: processes whose names, runs, incarnations and tree
    /// membership the kernel keeps at once.
    pub processes: u32,
}

/// What to attach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mode {
    pub per_thread: bool,
    /// Live mode: return probes too, every block tracked (and `free`).
    pub live: bool,
    /// Count mode: probe `free` too.
    pub count_frees: bool,
    pub sampling: Option<Sampling>,
    /// Benchmark floor: programs that do nothing, at the same places.
    pub floor: bool,
    /// Most frames a stack keeps above the direct caller (`--max-stack`).
    pub max_frames: u32,
    /// CPython's object and memory allocators probed too
    /// (`--python-objects`).
    pub python_objects: bool,
    /// Every process probed is followed by the tracer with ptrace (launch
    /// mode): a thread that fills the ring of walks waits for the tracer
    /// (see `tracer_common::Config::throttle`).
    pub throttle: bool,
}

pub struct Probes {
    /// Every probe's link; dropping a link takes its probes out. This
    /// field comes first because fields drop in order, so the probes are
    /// out before the programs and the maps they use are dropped.
    links: Vec<multi::Link>,
    /// Its programs, loaded for `links`.
    pub programs: Vec<multi::Program>,
    /// What `links` attach: kept to put the probes back after a pause.
    plan: multi::LinkPlan,
    /// The process probed.
    pid: u32,
    pub ebpf: Ebpf,
    made_for: (Mode, MapSizes),
    /// Every attached probe.
    pub attached: Vec<crate::profile::Probe>,
    /// How many of them are in each object (a C++ program's allocator
    /// is libc's and libstdc++'s), in the order met.
    pub objects: Vec<(String, usize)>,
    /// The run's function table: one row per probe site, indexed by the
    /// probes' cookies.
    pub funcs: Vec<FuncInfo>,
    /// Live mode is on.
    pub live: bool,
    /// `free` is probed.
    pub frees_counted: bool,
    pub sampling: Option<Sampling>,
    /// Most frames a stack keeps above the direct caller.
    pub max_frames: u32,
    /// Set before the last reading of a gone process: the reading takes
    /// the entries it reads out of the maps (no program of the process
    /// can run any more), for the object's next process.
    pub last_read: bool,
    /// What the last reading and the unwinder left empty.
    pub emptied: std::sync::Mutex<pool::Emptied>,
    /// Its object's mappings, kept for the object's next emptying.
    mapped: pool::Mapped,
}

/// Loads the BPF object, calls `before` with it (for what must run before
/// the first probe fires), then attaches every probe.
pub fn attach<T>(
    pid: u32,
    alloc: &AllocatorObject,
    maps: &[Mapping],
    mode: Mode,
    sizes: MapSizes,
    python: PythonLayout,
    before: impl FnOnce(&mut Ebpf) -> Result<T>,
) -> Result<(Probes, T)> {
    let (sample_mode, sample_param) = match mode.sampling {
        None => (SAMPLE_NONE, 0),
        Some(Sampling::Bytes(n)) => (SAMPLE_BYTES, n),
        Some(Sampling::Every(n)) => (SAMPLE_EVERY, n),
    };
    let mut config = Box::new(Config {
        per_thread: mode.per_thread as u32,
        live: mode.live as u32,
        sample_mode,
        max_frames: mode.max_frames.min(tracer_common::MAX_FRAMES as u32),
        sample_param,
        sample_scale: 0,
        exp_table: exp_table(),
        weight_table: weight_table(),
        kernel: kernel::offsets(),
        vma: VmaOffsets::default(),
        host_runs: 0,
        host_scope: tracer_common::SCOPE_ALL,
        throttle: mode.throttle as u32,
        _pad: 0,
    });
    if let Some(Sampling::Every(n)) = mode.sampling {
        // The table's exponential draws are cut off at their tail, so
        // their mean is 0.03% below 1. The scale is divided by that mean,
        // so the gaps between sampled calls average N calls, not 0.03%
        // fewer.
        let table = &config.exp_table;
        let mean =
            table.iter().map(|&e| e as f64).sum::<f64>() / (table.len() as f64 * WEIGHT_ONE as f64);
        config.sample_scale = (geometric_scale(n) / mean * WEIGHT_ONE as f64).round() as u64;
    }

    let load_started = std::time::Instant::now();
    if alloc.sites.len() > MAX_FUNCS as usize {
        return Err(user_error!(
            "{} allocator functions in {}: mtrace probes at most {MAX_FUNCS}",
            alloc.sites.len(),
            alloc.path
        ));
    }
    // Count and sampled modes need one probe per allocating call: `free`
    // only when asked for (or in live mode, which follows every block).
    let wanted = |site: &&ProbeSite| match site.role() {
        _ if site.live_only && !mode.live => false,
        Role::Free => mode.live || mode.count_frees,
        // Returns a size, not a block: nothing for live mode to follow.
        Role::ResizeInPlace => !mode.live,
        _ => true,
    };
    let mut plan = multi::LinkPlan::default();
    let numbers = inline_numbers(alloc.sites.iter().flat_map(|s| &s.inlined));
    let mut places = std::collections::HashSet::new();
    let mut attached = Vec::new();
    let mut objects: Vec<(String, usize)> = Vec::new();
    let mut funcs = Vec::new();
    for (func, site) in alloc.sites.iter().filter(wanted).enumerate() {
        let func = func as u32;
        let role = site.role();
        let offset = site.file_offset + site.probe_offset;
        let program = if mode.floor {
            maps::FLOOR
        } else {
            role.program()
        };
        plan.add(program, &site.open_path, false, offset, cookie(site, func));
        if let (true, Some(ret)) = (mode.live, role.return_program()) {
            let ret = if mode.floor { maps::FLOOR_RET } else { ret };
            plan.add(ret, &site.open_path, true, offset, cookie(site, func));
        }
        // Inlined copies: counted where their guard lets them run; in
        // live mode their blocks are taken where each copy's path meets
        // its call's (a copy without such a place is not probed).
        for copy in &site.inlined {
            let Some((guard, known)) = inline_probes(copy, func, mode.live, &numbers, &mut places)
            else {
                continue;
            };
            let program = if copy.size.frees() {
                maps::RELEASE_INLINE
            } else {
                maps::ALLOC_INLINE
            };
            let floor = |p| if mode.floor { maps::FLOOR } else { p };
            plan.add(
                floor(program),
                &site.open_path,
                false,
                copy.file_offset,
                guard,
            );
            for (offset, cookie) in known {
                plan.add(
                    floor(maps::ALLOC_INLINE_RET),
                    &site.open_path,
                    false,
                    offset,
                    cookie,
                );
            }
        }
        match objects.iter_mut().find(|(p, _)| *p == site.path) {
            Some((_, n)) => *n += 1,
            None => objects.push((site.path.clone(), 1)),
        }
        let name = site.display_name();
        attached.push(crate::profile::Probe {
            function: name.clone(),
            offset: site.probe_offset,
            instruction: site.instruction.clone(),
            emulated: site.emulated,
        });
        funcs.push(FuncInfo { name, role });
    }
    let made_for = (mode, sizes);
    let prepare_spare = || {
        let (config, names) = (config.clone(), plan.programs());
        pool::prepare(made_for, move || {
            let mut loaded = load(config, mode, sizes)?;
            loaded.programs = multi::load(&bpf_object()?, &loaded.ebpf, &names)?;
            Ok(loaded)
        });
    };
    let (mut loaded, how) = match pool::take(made_for) {
        Some(loaded) => {
            // This was the last spare, so the next one is loaded and
            // verified meanwhile: a fork is often followed at once by an
            // exec, which needs another object.
            if pool::spares_wanted() && !pool::any_for(made_for) {
                prepare_spare();
            }
            (loaded, "reused")
        }
        None => {
            if pool::spares_wanted() {
                // The next process's object verifies on another CPU while
                // this one's does.
                prepare_spare();
            }
            (load(config.clone(), mode, sizes)?, "loaded")
        }
    };
    let missing: Vec<&'static str> = plan
        .programs()
        .into_iter()
        .filter(|name| !loaded.programs.iter().any(|p| p.name == *name))
        .collect();
    if !missing.is_empty() {
        let new = multi::load(&bpf_object()?, &loaded.ebpf, &missing)?;
        loaded.programs.extend(new);
    }
    let pool::Loaded {
        mut ebpf,
        programs,
        made_for,
        mapped,
        ..
    } = loaded;
    let bodies = alloc.body_ranges(maps);
    let n = bodies.len().min(MAX_BODY_RANGES);
    let frees = alloc.free_body_ranges(maps);
    let mut process = ProcessConfig {
        stack_start: crate::tracee::start_stack(pid),
        n_bodies: n as u32,
        n_free_bodies: frees.len() as u32,
        python,
        ..Default::default()
    };
    process.bodies[..n].copy_from_slice(&bodies[..n]);
    process.free_bodies[..frees.len()].copy_from_slice(&frees);
    let mut map: aya::maps::Array<_, ProcessConfig> =
        aya::maps::Array::try_from(ebpf.map_mut(maps::PROCESS).context("PROCESS map")?)?;
    map.set(0, process, 0)?;
    if let Some(sampling) = mode.sampling {
        seed_countdowns(&mut ebpf, sampling)?;
    }
    let before = before(&mut ebpf)?;
    let attach_started = std::time::Instant::now();
    let links = plan.attach(&programs, Some(pid))?;
    log::debug!(
        "pid {pid}: BPF object {how} and {} probes attached in {:.1} ms ({:.1} ms attaching)",
        attached.len(),
        load_started.elapsed().as_secs_f64() * 1e3,
        attach_started.elapsed().as_secs_f64() * 1e3
    );
    let frees_counted = funcs.iter().any(|f| !f.role.allocates());
    let mut probes = Probes {
        frees_counted,
        ebpf,
        programs,
        plan,
        pid,
        made_for,
        links,
        objects,
        attached,
        funcs,
        live: mode.live,
        sampling: mode.sampling,
        max_frames: mode.max_frames.min(tracer_common::MAX_FRAMES as u32),
        last_read: false,
        emptied: Default::default(),
        mapped,
    };
    // Every probe is in: counting starts now, for all functions at once.
    probes.set_enabled(true)?;
    Ok((probes, before))
}

impl Probes {
    /// Whether thread `tid` was sent the throttle signal and not yet let
    /// go (see [`Mode::throttle`]); it is let go from here on.
    pub fn take_throttled(&mut self, tid: u32) -> bool {
        let Some(map) = self.ebpf.map_mut(maps::THROTTLED) else {
            return false;
        };
        aya::maps::HashMap::<_, u32, u32>::try_from(map).is_ok_and(|mut m| m.remove(&tid).is_ok())
    }

    /// Takes every probe out, then empties the object for the next
    /// process (its process runs another program now).
    pub fn recycle(self) {
        let (links, loaded) = self.split();
        multi::close_all(links);
        pool::give_back(loaded);
    }

    /// What its object was loaded for.
    pub fn made_for(&self) -> (Mode, MapSizes) {
        self.made_for
    }

    /// `8 probes in /…/libc.so.6`, or with probes in several objects
    /// `16 probes: 8 in /…/libc.so.6, 8 in /…/libstdc++.so.6`.
    pub fn placement(&self) -> String {
        let n = self.attached.len();
        match self.objects.as_slice() {
            [(path, _)] => format!("{n} probes in {}", printable(path)),
            several => format!(
                "{n} probes: {}",
                several
                    .iter()
                    .map(|(path, k)| format!("{k} in {}", printable(path)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    /// Takes every probe out, side by side.
    pub fn take_out(&mut self) {
        multi::close_all(self.take_links());
    }

    /// Puts the probes back after [`Probes::take_links`] (a pause of the
    /// windows policy); the counts went on being kept meanwhile.
    pub fn resume(&mut self) -> Result<()> {
        if self.links.is_empty() {
            self.links = self.plan.attach(&self.programs, Some(self.pid))?;
        }
        Ok(())
    }

    /// Its links, for the caller to close (the probes stay in until then).
    pub fn take_links(&mut self) -> Vec<multi::Link> {
        std::mem::take(&mut self.links)
    }

    /// Its links and its object (which serves another process only once
    /// emptied, and once no program of its process can run any more).
    pub fn split(self) -> (Vec<multi::Link>, pool::Loaded) {
        let Probes {
            links,
            programs,
            ebpf,
            made_for,
            emptied,
            mapped,
            ..
        } = self;
        (
            links,
            pool::Loaded {
                ebpf,
                programs,
                made_for,
                emptied: emptied.into_inner().unwrap_or_else(|e| e.into_inner()),
                mapped,
            },
        )
    }

    /// Starts or stops counting in every program at once (the `ENABLED`
    /// flag they read first).
    pub fn set_enabled(&mut self, on: bool) -> Result<()> {
        let mut flag: aya::maps::Array<_, u32> =
            aya::maps::Array::try_from(self.ebpf.map_mut(maps::ENABLED).context("ENABLED map")?)?;
        flag.set(0, on as u32, 0)?;
        Ok(())
    }
}
