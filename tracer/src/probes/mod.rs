//! Loading the BPF programs and attaching them to the target's allocator.
//! Dropping [`Probes`] detaches everything (the kernel also detaches when
//! mtrace dies: the links are file descriptors).

pub mod kernel;
pub mod multi;
pub mod pool;

use anyhow::{Context, Result};
use aya::{Ebpf, EbpfLoader};
use std::collections::HashMap;
use tracer_common::{
    maps, Config, ProcessConfig, PythonLayout, Role, VmaOffsets, COOKIE_ARGS_SHIFT,
    COOKIE_INLINE_ID_SHIFT, COOKIE_INLINE_SIZE_SHIFT, COOKIE_ROLE_SHIFT, EXP_TABLE_LEN,
    MAX_BODY_RANGES, MAX_FUNCS, SAMPLE_BYTES, SAMPLE_EVERY, SAMPLE_NONE, WEIGHT_ONE,
    WEIGHT_TABLE_LEN, WEIGHT_TABLE_START,
};

use crate::{
    allocators::{
        inlined::{InlineSite, SizeAt},
        AllocatorObject, FuncInfo, ProbeSite,
    },
    render::text::printable,
    tracee::Mapping,
    user_error,
};

/// The BPF object built by build.rs.
static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/mtrace.bpf.o"));

/// The cookie of a probe site: the function's index in the run's table,
/// where its arguments are, and its role.
pub(crate) fn cookie(site: &ProbeSite, func: u32) -> u64 {
    func as u64 | site.args << COOKIE_ARGS_SHIFT | (site.role() as u64) << COOKIE_ROLE_SHIFT
}

/// The embedded BPF object, or for experiments on the programs the file
/// named by `MTRACE_BPF_OBJECT`.
pub(crate) fn bpf_object() -> Result<std::borrow::Cow<'static, [u8]>> {
    match std::env::var_os("MTRACE_BPF_OBJECT") {
        Some(path) => Ok(std::borrow::Cow::Owned(std::fs::read(&path).with_context(
            || format!("reading MTRACE_BPF_OBJECT={}", path.to_string_lossy()),
        )?)),
        None => Ok(std::borrow::Cow::Borrowed(BPF_OBJECT)),
    }
}

/// One loader for every BPF object mtrace loads: aya's `EbpfLoader::new`
/// parses the kernel's BTF (`/sys/kernel/btf/vmlinux`, several MiB) each
/// time, which was a quarter of mtrace's time in a tree of short
/// programs. Every setting is made again before each load.
struct SharedLoader {
    loader: EbpfLoader<'static>,
    /// The config the loader's global points at: leaked for it, freed
    /// when the next load replaces it.
    config: Option<std::ptr::NonNull<Config>>,
}

// SAFETY: the config pointer is only used under the mutex.
unsafe impl Send for SharedLoader {}

static LOADER: std::sync::Mutex<Option<SharedLoader>> = std::sync::Mutex::new(None);

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
}

/// Count mode, sampled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampling {
    /// On average one sample per N allocated bytes.
    Bytes(u64),
    /// Each call with probability 1/N.
    Every(u64),
}

/// Sampling: every CPU's countdown starts at a draw of the gap it counts
/// down (exponential in bytes, geometric in calls), so the first
/// allocation is no more likely to be sampled than any other.
fn seed_countdowns(ebpf: &mut Ebpf, sampling: Sampling) -> Result<()> {
    use aya::maps::{PerCpuArray, PerCpuValues};
    let n = aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?;
    let mut state = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x9e37_79b9_7f4a_7c15)
        ^ (std::process::id() as u64) << 32
        | 1;
    let draws: Vec<i64> = (0..n)
        .map(|_| {
            // xorshift64*: plenty for spreading start points.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let r = state.wrapping_mul(0x2545_f491_4f6c_dd1d);
            let u = ((r >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            match sampling {
                Sampling::Bytes(rate) => (-u.ln() * rate as f64) as i64 + 1,
                Sampling::Every(n) => (-u.ln() * geometric_scale(n)) as i64 + 1,
            }
        })
        .collect();
    let mut map: PerCpuArray<_, i64> =
        PerCpuArray::try_from(ebpf.map_mut(maps::COUNTDOWN).context("COUNTDOWN map")?)?;
    map.set(0, PerCpuValues::try_from(draws)?, 0)?;
    Ok(())
}

/// One-in-N sampling: with `E` exponential, `floor(scale * E) + 1` is a
/// geometric gap of mean N (each call sampled with probability 1/N, apart
/// from the others) when `scale = -1 / ln(1 - 1/N)`.
fn geometric_scale(n: u64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    -1.0 / (-1.0 / n as f64).ln_1p()
}

/// `-ln((i + 0.5) / len)` in 16.16: exponential intervals by table lookup.
fn exp_table() -> [u32; EXP_TABLE_LEN] {
    let mut t = [0u32; EXP_TABLE_LEN];
    for (i, v) in t.iter_mut().enumerate() {
        let u = (i as f64 + 0.5) / EXP_TABLE_LEN as f64;
        *v = (-u.ln() * WEIGHT_ONE as f64).round() as u32;
    }
    t
}

/// `1 / (1 - exp(-x))` in 16.16 for `x = (WEIGHT_TABLE_START + i + 0.5) / 256`.
fn weight_table() -> [u32; WEIGHT_TABLE_LEN] {
    let mut t = [0u32; WEIGHT_TABLE_LEN];
    for (i, v) in t.iter_mut().enumerate() {
        let x = (WEIGHT_TABLE_START as f64 + i as f64 + 0.5) / 256.0;
        *v = (WEIGHT_ONE as f64 / (1.0 - (-x).exp())).round() as u32;
    }
    t
}

pub struct Probes {
    /// Dropped, they take every probe out; first (fields drop in order).
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

/// The shared loader (made on first use) with `config` as the object's
/// global.
fn configured(shared: &mut Option<SharedLoader>, config: Box<Config>) -> &mut EbpfLoader<'static> {
    let shared = shared.get_or_insert_with(|| SharedLoader {
        loader: EbpfLoader::new(),
        config: None,
    });
    let new_config = std::ptr::NonNull::from(Box::leak(config));
    // SAFETY: the loader holds this reference until a later load replaces
    // it, and it is freed only then (below).
    shared
        .loader
        .override_global(maps::CONFIG, unsafe { new_config.as_ref() }, true);
    if let Some(old) = shared.config.replace(new_config) {
        // SAFETY: leaked by an earlier load, and the override above
        // replaced the loader's one reference to it.
        drop(unsafe { Box::from_raw(old.as_ptr()) });
    }
    &mut shared.loader
}

/// Loads the BPF object for `mode` and `sizes` (its programs are loaded
/// as processes need them).
fn load(config: Box<Config>, mode: Mode, sizes: MapSizes) -> Result<pool::Loaded> {
    // Live mode: one event ring per CPU, up to EVENT_RINGS (CPUs beyond
    // share them); rings no CPU uses, and all in count mode, get a page.
    let cpus = aya::util::nr_cpus().map_or(1, |n| n as u32);
    let mut guard = LOADER.lock().unwrap_or_else(|e| e.into_inner());
    let loader = configured(&mut guard, config);
    for (i, name) in maps::EVENTS.iter().enumerate() {
        let used = mode.live && (i as u32) < cpus;
        loader.map_max_entries(name, if used { sizes.events } else { 4096 });
    }
    let ebpf = loader
        // PENDING is task storage, which aya cannot read (mtrace never does).
        .allow_unsupported_maps()
        .map_max_entries(maps::COUNTS, sizes.counts)
        .map_max_entries(maps::STACKS, sizes.stacks)
        .map_max_entries(maps::UNWIND_RULES, sizes.unwind_rules)
        .map_max_entries(maps::UNWIND_MISSES, sizes.unwind_ring)
        // Room for the frees and the allocations a full ring lets through
        // between two drains (24 and 48 bytes each).
        .map_max_entries(
            maps::LOST_FREES,
            if mode.live { sizes.kept_aside } else { 1 },
        )
        .map_max_entries(
            maps::LOST_ALLOCS,
            if mode.live { sizes.kept_aside } else { 1 },
        )
        // The host scope's maps, unused by a traced process's programs.
        .map_max_entries(maps::HOST_COUNTS, 1)
        .map_max_entries(maps::HOST_TOTALS, 1)
        .map_max_entries(maps::HOST_FUNCS, 1)
        .map_max_entries(maps::HOST_BODIES, 1)
        .map_max_entries(maps::HOST_NAMES, 1)
        .map_max_entries(maps::HOST_RUNS, 1)
        .map_max_entries(maps::HOST_EXECS, 4096)
        .map_max_entries(maps::HOST_STACKS, 1)
        .map_max_entries(maps::HOST_RULES, 1)
        .map_max_entries(maps::HOST_VMAS, 64)
        .map_max_entries(maps::HOST_FILE_TAGS, 1)
        .map_max_entries(maps::HOST_TAG_FILES, 1)
        .map_max_entries(maps::HOST_GENS, 1)
        .load(&bpf_object()?)
        .context("loading the BPF programs")?;
    drop(guard);
    Ok(pool::Loaded {
        ebpf,
        programs: Vec::new(),
        made_for: (mode, sizes),
        emptied: pool::Emptied::default(),
        mapped: pool::Mapped::default(),
    })
}

/// Processes the host scope keeps apart at once (names, runs,
/// incarnations).
const HOST_PROCESSES: u32 = 65536;

/// Mappings the host scope's walks remember (an LRU: a process's mappings
/// are looked up again once forgotten).
const HOST_VMAS: u32 = 65536;

/// Distinct stacks the host scope keeps: every process's, shared where
/// they are the same (a stack is its frames' files and offsets).
fn host_stacks(sizes: &MapSizes) -> u32 {
    sizes.stacks.saturating_mul(2)
}

/// Unwind rules the host scope keeps: by file and offset, for every file
/// on the host.
fn host_rules(sizes: &MapSizes) -> u32 {
    sizes.unwind_rules.max(1 << 18)
}

/// Loads the BPF object for the host scope (`--all`): count mode, the
/// direct caller only, `host_counts` keys, each process's runs counted
/// when `runs` (the windows policy); the maps of the per-process programs
/// at their smallest.
pub fn load_host(sizes: &MapSizes, max_frames: u32, runs: bool) -> Result<Ebpf> {
    let config = Box::new(Config {
        per_thread: 0,
        live: 0,
        sample_mode: SAMPLE_NONE,
        max_frames: max_frames.min(tracer_common::MAX_FRAMES as u32),
        sample_param: 0,
        sample_scale: 0,
        exp_table: exp_table(),
        weight_table: weight_table(),
        kernel: kernel::offsets(),
        vma: kernel::vma_offsets(),
        host_runs: runs as u32,
        _pad: 0,
    });
    let mut guard = LOADER.lock().unwrap_or_else(|e| e.into_inner());
    let loader = configured(&mut guard, config);
    for name in maps::EVENTS {
        loader.map_max_entries(name, 4096);
    }
    let ebpf = loader
        .allow_unsupported_maps()
        .map_max_entries(maps::COUNTS, 1)
        .map_max_entries(maps::STACKS, 1)
        .map_max_entries(maps::UNWIND_RULES, 1)
        .map_max_entries(maps::UNWIND_MISSES, sizes.unwind_ring)
        .map_max_entries(maps::LOST_FREES, 1)
        .map_max_entries(maps::LOST_ALLOCS, 1)
        .map_max_entries(maps::HOST_COUNTS, sizes.counts)
        .map_max_entries(maps::HOST_STACKS, host_stacks(sizes))
        .map_max_entries(maps::HOST_RULES, host_rules(sizes))
        .map_max_entries(maps::HOST_VMAS, HOST_VMAS)
        .map_max_entries(maps::HOST_FILE_TAGS, tracer_common::MAX_HOST_TAGS)
        .map_max_entries(maps::HOST_TAG_FILES, tracer_common::MAX_HOST_TAGS)
        .map_max_entries(maps::HOST_GENS, HOST_PROCESSES)
        // (The shared loader keeps sizes between loads: each is set.)
        .map_max_entries(maps::HOST_TOTALS, 2 * tracer_common::MAX_HOST_FUNCS)
        .map_max_entries(maps::HOST_FUNCS, tracer_common::MAX_HOST_FUNCS)
        .map_max_entries(maps::HOST_BODIES, tracer_common::MAX_HOST_FILES)
        .map_max_entries(maps::HOST_NAMES, HOST_PROCESSES)
        .map_max_entries(maps::HOST_RUNS, HOST_PROCESSES)
        .map_max_entries(maps::HOST_EXECS, 1 << 18)
        .load(&bpf_object()?)
        .context("loading the BPF programs")?;
    Ok(ebpf)
}

/// Live mode: the number of the copies (`COOKIE_INLINE_ID_SHIFT`) that
/// may take their block at each place (by file offset). Copies that share
/// a place share a number, and each place is probed once: one probe where
/// the code of two guarded copies meets takes up the call of either.
fn inline_numbers<'a>(copies: impl Iterator<Item = &'a InlineSite>) -> HashMap<u64, u64> {
    // Union-find over the places, each copy's places joined.
    let mut places: Vec<u64> = Vec::new();
    let mut parent: Vec<usize> = Vec::new();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    for copy in copies {
        let mut first = None;
        for b in &copy.blocks {
            let i = match places.iter().position(|p| *p == b.file_offset) {
                Some(i) => i,
                None => {
                    places.push(b.file_offset);
                    parent.push(parent.len());
                    places.len() - 1
                }
            };
            match first {
                None => first = Some(i),
                Some(f) => {
                    let (a, b) = (root(&mut parent, f), root(&mut parent, i));
                    parent[b] = a;
                }
            }
        }
    }
    let mut numbers: HashMap<usize, u64> = HashMap::new();
    let mut out = HashMap::new();
    for (i, place) in places.iter().enumerate() {
        let r = root(&mut parent, i);
        let next = numbers.len() as u64 + 1;
        let n = *numbers.entry(r).or_insert(next);
        if n <= MAX_INLINE_LIVE {
            out.insert(*place, n << COOKIE_INLINE_ID_SHIFT);
        }
    }
    out
}

/// An inlined copy's probes, for the function `func`: its guard's cookie,
/// and in live mode the places its block is known not probed yet (file
/// offset and cookie each; `numbers` from [`inline_numbers`], `probed`
/// the places probed so far). `None`: not probed (in live mode, a copy
/// whose block's places were not found).
fn inline_probes(
    copy: &InlineSite,
    func: u32,
    live: bool,
    numbers: &HashMap<u64, u64>,
    probed: &mut std::collections::HashSet<u64>,
) -> Option<(u64, Vec<(u64, u64)>)> {
    let guard = func as u64 | copy.cookie_bits();
    if !live || copy.size.frees() {
        return Some((guard, Vec::new()));
    }
    // A copy of realloc leaves its block at several places; live mode
    // sees the static malloc and free it calls instead (see
    // `allocators::inlined`).
    if matches!(copy.size, SizeAt::Resize { .. }) {
        return None;
    }
    let id = *numbers.get(&copy.blocks.first()?.file_offset)?;
    let known = copy
        .blocks
        .iter()
        .filter(|b| probed.insert(b.file_offset))
        .map(|b| {
            let cookie = func as u64
                | b.reg << COOKIE_ARGS_SHIFT
                | b.at_disp << COOKIE_INLINE_SIZE_SHIFT
                | (Role::Size as u64) << COOKIE_ROLE_SHIFT;
            (b.file_offset, cookie | id)
        });
    Some((guard | id, known.collect()))
}

/// Most inlined copies numbered in live mode (the cookie's bits from
/// [`COOKIE_INLINE_ID_SHIFT`]; 0 is no copy).
const MAX_INLINE_LIVE: u64 = (1 << (64 - COOKIE_INLINE_ID_SHIFT)) - 1;

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
        _pad: 0,
    });
    if let Some(Sampling::Every(n)) = mode.sampling {
        // Over the exponential table's mean, which its cut-off tail puts
        // 0.03% below 1: the gaps' mean is then N, not N less 0.03%.
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
            // The last spare taken: the next is verified meanwhile (a
            // fork is often followed at once by an exec, which needs
            // another).
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

#[cfg(test)]
mod tests {
    use super::*;
    use object::{Object, ObjectSymbol};
    use tracer_common::Role;

    /// The contract: every map and program name the tracer uses exists in
    /// the BPF object it embeds.
    #[test]
    fn the_bpf_object_has_every_name_the_tracer_uses() {
        let file = object::File::parse(BPF_OBJECT).expect("the embedded BPF object parses");
        let symbols: Vec<String> = file
            .symbols()
            .filter_map(|s| s.name().ok().map(str::to_string))
            .collect();
        let has = |name: &str| symbols.iter().any(|s| s == name);
        let mut programs = vec![
            maps::FLOOR,
            maps::FLOOR_RET,
            maps::ALLOC_INLINE,
            maps::ALLOC_INLINE_RET,
            maps::RELEASE_INLINE,
        ];
        for role in Role::ALL {
            programs.push(role.program());
            programs.extend(role.return_program());
        }
        for name in programs {
            assert!(has(name), "program {name} missing from the BPF object");
        }
        for name in maps::ALL_MAPS
            .iter()
            .chain(&maps::EVENTS)
            .chain([&maps::CONFIG])
        {
            assert!(has(name), "map {name} missing from the BPF object");
        }
        assert!(file.section_by_name(".maps").is_some());
    }
}
