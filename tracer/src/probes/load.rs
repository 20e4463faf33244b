//! Loading the BPF object: one shared loader, the maps sized for a traced
//! process's mode or for the host scope.

use anyhow::{Context, Result};
use aya::{Ebpf, EbpfLoader};
use tracer_common::{maps, Config, SAMPLE_NONE};

use super::{
    kernel, pool,
    sampling::{exp_table, weight_table},
    MapSizes, Mode,
};

/// The BPF object built by build.rs.
pub(super) static BPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/mtrace.bpf.o"));

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

/// The host scope's maps at their smallest, for a traced process's
/// object, whose programs never use them.
const HOST_MAPS_UNUSED: [(&str, u32); 17] = [
    (maps::HOST_COUNTS, 1),
    (maps::HOST_TOTALS, 1),
    (maps::HOST_FUNCS, 1),
    (maps::HOST_BODIES, 1),
    (maps::HOST_NAMES, 1),
    (maps::HOST_RUNS, 1),
    (maps::HOST_EXECS, 4096),
    (maps::HOST_STACKS, 1),
    (maps::HOST_RULES, 1),
    (maps::HOST_VMAS, 64),
    (maps::HOST_FILE_TAGS, 1),
    (maps::HOST_TAG_FILES, 1),
    (maps::HOST_GENS, 1),
    (maps::HOST_SCOPE_PIDS, 1),
    (maps::HOST_SCOPE_CGROUPS, 1),
    (maps::HOST_PYTHON, 1),
    (maps::HOST_PY_FILES, 1),
];

/// The most cgroups that a host scope narrowed to cgroups can name.
pub const SCOPE_CGROUPS: u32 = 64;

/// Loads the BPF object for `mode` and `sizes` (its programs are loaded
/// as processes need them).
pub(super) fn load(config: Box<Config>, mode: Mode, sizes: MapSizes) -> Result<pool::Loaded> {
    // Live mode: one event ring per CPU, up to EVENT_RINGS (CPUs beyond
    // share them); rings no CPU uses, and all in count mode, get a page.
    let cpus = aya::util::nr_cpus().map_or(1, |n| n as u32);
    let mut guard = LOADER.lock().unwrap_or_else(|e| e.into_inner());
    let loader = configured(&mut guard, config);
    for (i, name) in maps::EVENTS.iter().enumerate() {
        let used = mode.live && (i as u32) < cpus;
        loader.map_max_entries(name, if used { sizes.events } else { 4096 });
    }
    // The host scope's maps, unused by a traced process's programs.
    for (name, entries) in HOST_MAPS_UNUSED {
        loader.map_max_entries(name, entries);
    }
    let ebpf = loader
        // PENDING is task storage, which aya cannot read (mtrace never does).
        .allow_unsupported_maps()
        .map_max_entries(maps::COUNTS, sizes.counts)
        .map_max_entries(maps::STACKS, sizes.stacks)
        .map_max_entries(maps::UNWIND_RULES, sizes.unwind_rules)
        .map_max_entries(maps::UNWIND_MISSES, sizes.unwind_ring)
        .map_max_entries(maps::PY_CODES_SENT, PY_CODES_SENT_PROCESS)
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

/// Code objects whose copy a traced process's object remembers having
/// sent (an LRU, preallocated in every object of the pool: one forgotten
/// is only copied again, at a new stack holding it).
const PY_CODES_SENT_PROCESS: u32 = 2048;

/// The same for the host scope's one object, over every Python process.
const PY_CODES_SENT_HOST: u32 = 32768;

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

/// The host scope's ring of walks: a command's tree (`--file-wide --
/// CMD`) starts from no rule, in a burst of new code that every
/// hand-over copies the stack of (a short sqlite3 run: about 20 MB of
/// walks in its 20 ms), so it has four times a process's ring; the host
/// and a cgroup, traced for long, keep the one size.
pub fn host_ring(sizes: &MapSizes, scope: u32) -> u32 {
    match scope {
        tracer_common::SCOPE_TREE => sizes.unwind_ring.saturating_mul(4),
        _ => sizes.unwind_ring,
    }
}

/// Loads the BPF object for the host scope (`--all`): count mode, the
/// direct caller only, `host_counts` keys, each process's runs counted
/// when `runs` (the windows policy); the maps of the per-process programs
/// at their smallest.
pub fn load_host(
    sizes: &MapSizes,
    max_frames: u32,
    runs: bool,
    per_thread: bool,
    scope: u32,
) -> Result<Ebpf> {
    let config = Box::new(Config {
        per_thread: per_thread as u32,
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
        host_scope: scope,
        // A command's tree: every process of it is followed (ptrace).
        throttle: (scope == tracer_common::SCOPE_TREE) as u32,
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
        .map_max_entries(maps::UNWIND_MISSES, host_ring(sizes, scope))
        .map_max_entries(maps::PY_CODES_SENT, PY_CODES_SENT_HOST)
        .map_max_entries(maps::LOST_FREES, 1)
        .map_max_entries(maps::LOST_ALLOCS, 1)
        .map_max_entries(maps::HOST_COUNTS, sizes.counts)
        .map_max_entries(maps::HOST_STACKS, host_stacks(sizes))
        .map_max_entries(maps::HOST_RULES, host_rules(sizes))
        .map_max_entries(maps::HOST_VMAS, HOST_VMAS)
        .map_max_entries(maps::HOST_FILE_TAGS, tracer_common::MAX_HOST_TAGS)
        .map_max_entries(maps::HOST_TAG_FILES, tracer_common::MAX_HOST_TAGS)
        .map_max_entries(maps::HOST_GENS, sizes.processes)
        // The shared loader keeps every size from the previous load, so
        // each map's size is set here, even where it does not change.
        .map_max_entries(maps::HOST_TOTALS, 2 * tracer_common::MAX_HOST_FUNCS)
        .map_max_entries(maps::HOST_FUNCS, tracer_common::MAX_HOST_FUNCS)
        .map_max_entries(maps::HOST_BODIES, tracer_common::MAX_HOST_FILES)
        .map_max_entries(maps::HOST_NAMES, sizes.processes)
        .map_max_entries(maps::HOST_RUNS, sizes.processes)
        .map_max_entries(maps::HOST_SCOPE_PIDS, sizes.processes)
        .map_max_entries(maps::HOST_SCOPE_CGROUPS, SCOPE_CGROUPS)
        .map_max_entries(maps::HOST_EXECS, 1 << 18)
        .load(&bpf_object()?)
        .context("loading the BPF programs")?;
    Ok(ebpf)
}
