//! Loaded BPF objects kept for the processes to come: loading one is the
//! verifier's work on every program (most of what a new process cost),
//! so an object whose process is gone is emptied and serves the next.
//!
//! An object goes back only once its links are closed: closing a link
//! returns after the kernel's grace period, when no program of it runs
//! any more, so nothing of the old process reaches the emptied maps.

use std::{
    os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd},
    sync::{
        atomic::{AtomicBool, Ordering},
        Condvar, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use aya::{
    maps::{Map, MapData, RingBuf},
    Ebpf,
};
use aya_obj::generated::{bpf_attr, bpf_cmd};
use tracer_common::maps;

use super::{
    multi::{self, sys_bpf},
    MapSizes, Mode,
};

/// A loaded object and the programs loaded for it so far.
pub struct Loaded {
    pub ebpf: Ebpf,
    pub programs: Vec<multi::Program>,
    /// What it was loaded for: it serves only the same again.
    pub made_for: (Mode, MapSizes),
    /// What its last process's reading and unwinder left empty.
    pub emptied: Emptied,
    /// Its mappable arrays, mapped once for their emptying.
    pub mapped: Mapped,
}

/// Mappings of an object's mappable arrays, by name: mapping one for each
/// emptying and unmapping it again cost a flush of every CPU's TLB.
#[derive(Default)]
pub struct Mapped(Vec<(String, memmap2::MmapMut)>);

/// What the emptying of an object that comes back may skip, because its
/// process's last reading and its unwinder already left it empty. The
/// maps named in `maps` are skipped whole; this matters because clearing
/// a hash map walks all of its buckets, and an empty map costs as much as
/// a full one. For the `COUNTERS` array, `counters` lists the counters
/// that were not zero at the last reading, and only those are zeroed:
/// every other counter is zero already, and stays zero because no program
/// of a gone process runs any more.
#[derive(Debug, Default)]
pub struct Emptied {
    /// The maps that are already empty, by name.
    pub maps: Vec<&'static str>,
    /// The `COUNTERS` indices that were not zero at the last reading: the
    /// only counters the emptying zeroes. `None` when no last reading
    /// noted them, and then every counter is zeroed.
    pub counters: Option<Vec<u32>>,
}

/// The objects waiting, and those being loaded for the pool (see
/// [`prepare`]), by what they are made for.
struct Pool {
    ready: Vec<Loaded>,
    preparing: Vec<(Mode, MapSizes)>,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    ready: Vec::new(),
    preparing: Vec::new(),
});

/// Signalled when an object being prepared is ready (or failed).
static PREPARED: Condvar = Condvar::new();

/// Whether an object is prepared beside each one loaded for a process:
/// set where processes keep coming (a tree, a cgroup).
static SPARES: AtomicBool = AtomicBool::new(false);

/// Processes keep coming: each time one needs an object none waits for,
/// another is loaded beside it for the next.
pub fn keep_spares() {
    SPARES.store(true, Ordering::Relaxed);
}

/// Whether an object should be prepared beside the one being loaded.
pub fn spares_wanted() -> bool {
    SPARES.load(Ordering::Relaxed)
}

/// Longest wait for an object being prepared (its verification takes a
/// few hundred milliseconds at most; beyond that, one is loaded anew).
const PREPARE_WAIT: Duration = Duration::from_secs(2);

/// An emptied object loaded for `made_for`: one waiting, or one being
/// prepared, once it is ready.
pub fn take(made_for: (Mode, MapSizes)) -> Option<Loaded> {
    let deadline = Instant::now() + PREPARE_WAIT;
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(i) = pool.ready.iter().position(|l| l.made_for == made_for) {
            return Some(pool.ready.swap_remove(i));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if !pool.preparing.contains(&made_for) || left.is_zero() {
            return None;
        }
        pool = PREPARED
            .wait_timeout(pool, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Whether an object made for `made_for` waits in the pool, is being
/// prepared or is on its way back.
pub fn any_for(made_for: (Mode, MapSizes)) -> bool {
    let pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    pool.ready.iter().any(|l| l.made_for == made_for) || pool.preparing.contains(&made_for)
}

/// Loads an object with `load` on a thread of its own, for [`take`].
pub fn prepare(made_for: (Mode, MapSizes), load: impl FnOnce() -> Result<Loaded> + Send + 'static) {
    POOL.lock()
        .unwrap_or_else(|e| e.into_inner())
        .preparing
        .push(made_for);
    std::thread::spawn(move || {
        let loaded = load();
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = pool.preparing.iter().position(|m| *m == made_for) {
            pool.preparing.swap_remove(i);
        }
        match loaded {
            Ok(loaded) => pool.ready.push(loaded),
            Err(e) => log::debug!("a spare BPF object not loaded: {e:#}"),
        }
        PREPARED.notify_all();
    });
}

/// Empties `loaded` (its links closed) and keeps it for the next process;
/// dropped instead when it cannot be emptied.
pub fn give_back(mut loaded: Loaded) {
    let emptied = std::mem::take(&mut loaded.emptied);
    match empty(&loaded.ebpf, &emptied, &mut loaded.mapped) {
        Ok(()) => {
            POOL.lock()
                .unwrap_or_else(|e| e.into_inner())
                .ready
                .push(loaded);
            PREPARED.notify_all();
        }
        Err(e) => log::debug!("a BPF object not kept for reuse: {e:#}"),
    }
}

/// An object on its way back to the pool (emptied on another thread):
/// while it lives, a process needing an object made for the same waits
/// for it in [`take`], as for one being prepared, instead of loading
/// another.
pub struct ComingBack((Mode, MapSizes));

impl ComingBack {
    pub fn new(made_for: (Mode, MapSizes)) -> ComingBack {
        POOL.lock()
            .unwrap_or_else(|e| e.into_inner())
            .preparing
            .push(made_for);
        ComingBack(made_for)
    }
}

impl Drop for ComingBack {
    fn drop(&mut self) {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = pool.preparing.iter().position(|m| *m == self.0) {
            pool.preparing.swap_remove(i);
        }
        drop(pool);
        PREPARED.notify_all();
    }
}

/// The CPUs a per-CPU map holds a value for (the possible ones), read
/// once per run: aya keeps them per thread, and each gone process is let
/// go on a thread of its own.
pub(crate) fn possible_cpus() -> Result<usize> {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if let Some(n) = CPUS.get() {
        return Ok(*n);
    }
    let n = aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?;
    Ok(*CPUS.get_or_init(|| n))
}

/// Calls `f` with every entry of per-CPU map `fd` (a hash map or an
/// array; keys `K`, values `V` on each CPU), read a batch at a time: one
/// pass over a hash map's buckets (a key-by-key walk looks each key up
/// again and starts each step's search over), one call or two for an
/// array.
pub(crate) fn per_cpu_entries<K: Copy, V: Copy>(fd: RawFd, f: impl FnMut(K, &[V])) -> Result<()> {
    each_entry(fd, bpf_cmd::BPF_MAP_LOOKUP_BATCH, Some(possible_cpus()?), f)
}

/// Calls `f` with every entry of hash map `fd` (keys `K`, values `V`),
/// read a batch at a time (one pass over its buckets); `take`: deleted
/// as they are read.
pub(crate) fn entries<K: Copy, V: Copy>(
    fd: RawFd,
    take: bool,
    mut f: impl FnMut(K, V),
) -> Result<()> {
    let cmd = if take {
        bpf_cmd::BPF_MAP_LOOKUP_AND_DELETE_BATCH
    } else {
        bpf_cmd::BPF_MAP_LOOKUP_BATCH
    };
    each_entry(fd, cmd, None, |k, v: &[V]| f(k, v[0]))
}

/// Every entry of map `fd` (batch command `cmd`), its values on each of
/// `cpus` CPUs (a per-CPU map: each value padded to 8 bytes) or its one
/// value (`None`).
fn each_entry<K: Copy, V: Copy>(
    fd: RawFd,
    cmd: bpf_cmd,
    cpus: Option<usize>,
    mut f: impl FnMut(K, &[V]),
) -> Result<()> {
    let key_size = std::mem::size_of::<K>();
    let (copies, value_size) = match cpus {
        Some(n) => (n, std::mem::size_of::<V>().next_multiple_of(8)),
        None => (1, std::mem::size_of::<V>()),
    };
    let stride = value_size * copies;
    let mut values_of: Vec<V> = Vec::with_capacity(copies);
    hash_batches(fd, cmd, key_size, stride, |keys, values, read| {
        for i in 0..read {
            // SAFETY: `K` and `V` are plain `#[repr(C)]` data the map
            // holds, read from their places in the buffers.
            let key =
                unsafe { std::ptr::read_unaligned(keys[i * key_size..].as_ptr().cast::<K>()) };
            values_of.clear();
            for c in 0..copies {
                let at = i * stride + c * value_size;
                // SAFETY: as above.
                values_of
                    .push(unsafe { std::ptr::read_unaligned(values[at..].as_ptr().cast::<V>()) });
            }
            f(key, &values_of);
        }
    })?;
    Ok(())
}

/// One pass over map `fd` with batch command `cmd` (a lookup, or a
/// lookup and delete), 256 entries a call or more where one hash bucket
/// holds more: `f` is given each call's keys and values
/// (`key_size` and `value_size` bytes each) and how many it read.
fn hash_batches(
    fd: RawFd,
    cmd: bpf_cmd,
    key_size: usize,
    value_size: usize,
    mut f: impl FnMut(&[u8], &[u8], usize),
) -> std::io::Result<()> {
    let mut batch = 256usize;
    let mut keys = vec![0u8; key_size * batch];
    let mut values = vec![0u8; value_size * batch];
    let (mut token_in, mut token_out) = (0u64, 0u64);
    let mut first = true;
    loop {
        // SAFETY: all-zero is a valid bpf_attr.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the union's batch member.
        let b = unsafe { &mut attr.batch };
        b.map_fd = fd as u32;
        b.in_batch = if first {
            0
        } else {
            &mut token_in as *mut u64 as u64
        };
        b.out_batch = &mut token_out as *mut u64 as u64;
        b.keys = keys.as_mut_ptr() as u64;
        b.values = values.as_mut_ptr() as u64;
        b.count = batch as u32;
        let last = match sys_bpf(cmd, &mut attr) {
            Ok(_) => false,
            // The last batch (its entries are read too).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            // A bucket holds more entries than the batch (none was read):
            // a larger one.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                batch *= 2;
                keys.resize(key_size * batch, 0);
                values.resize(value_size * batch, 0);
                continue;
            }
            Err(e) => return Err(e),
        };
        // SAFETY: the union's batch member, written back by the kernel.
        let read = unsafe { attr.batch.count } as usize;
        f(&keys, &values, read.min(batch));
        if last {
            return Ok(());
        }
        first = false;
        token_in = token_out;
    }
}

/// Ring handles given back by their readers, by map id: mapping a ring
/// (the kernel inserts its pages one by one) cost more than anything else
/// a new process needed, and a reused object's rings are the same.
static RINGS: Mutex<Vec<(u32, RingBuf<MapData>)>> = Mutex::new(Vec::new());

/// A reader of ring `name` of `ebpf`: the one given back for it, or a new
/// handle. Its reader gives it back with [`ring_back`] when done.
pub fn ring(ebpf: &Ebpf, name: &str) -> Result<RingBuf<MapData>> {
    let id = match ebpf.map(name) {
        Some(Map::RingBuf(d)) => d.info()?.id(),
        _ => anyhow::bail!("{name} ring missing"),
    };
    let mut rings = RINGS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = rings.iter().position(|(r, _)| *r == id) {
        let mut ring = rings.swap_remove(i).1;
        // What a program of the previous process wrote after its last
        // drain (it ran as counting was switched off) is of after its
        // trace's end: the new process's reader starts empty.
        while let Some(item) = ring.next() {
            drop(item);
        }
        return Ok(ring);
    }
    drop(rings);
    Ok(RingBuf::try_from(map_copy(ebpf, name)?)?)
}

/// Keeps a ring's reader, drained, for the next process its object serves.
pub fn ring_back(ring: RingBuf<MapData>) {
    let Ok(id) = ring_id(&ring) else {
        return;
    };
    RINGS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((id, ring));
}

fn ring_id(ring: &RingBuf<MapData>) -> Result<u32> {
    use std::os::fd::AsRawFd;
    // SAFETY: the ring's descriptor, alive for this call.
    let fd = unsafe { BorrowedFd::borrow_raw(ring.as_raw_fd()) };
    let data = MapData::from_fd(fd.try_clone_to_owned()?)?;
    Ok(data.info()?.id())
}

/// Another handle on map `name` of `ebpf`, which keeps its own: the
/// object's maps stay whole for it to be emptied and serve again.
pub fn map_copy(ebpf: &Ebpf, name: &str) -> Result<Map> {
    let map = ebpf
        .map(name)
        .with_context(|| format!("{name} map missing"))?;
    // SAFETY: the descriptor belongs to `map`, alive for this call.
    let fd = unsafe { BorrowedFd::borrow_raw(multi::map_fd(map)?) };
    let copy = MapData::from_fd(fd.try_clone_to_owned()?)
        .with_context(|| format!("a second handle on the {name} map"))?;
    Ok(Map::from_map_data(copy)?)
}

/// Every array and hash map the programs or the tracer write is emptied
/// (the read-only config and data sections, the rings, the queue and the
/// task storage are left: drained, or the process's own), but for the
/// rule cache, whose slots the unwinder that filled them frees.
fn empty(ebpf: &Ebpf, emptied: &Emptied, mapped: &mut Mapped) -> Result<()> {
    for (name, map) in ebpf.maps() {
        if name.starts_with('.') || name == maps::RULE_CACHE || emptied.maps.contains(&name) {
            continue;
        }
        enum Kind {
            Array,
            PerCpuArray,
            Hash,
            PerCpuHash,
        }
        let (kind, data) = match map {
            Map::Array(d) => (Kind::Array, d),
            Map::PerCpuArray(d) => (Kind::PerCpuArray, d),
            Map::HashMap(d) => (Kind::Hash, d),
            Map::PerCpuHashMap(d) => (Kind::PerCpuHash, d),
            _ => continue,
        };
        let info = data.info()?;
        let fd = data.fd().as_fd().as_raw_fd();
        let (key_size, value_size, entries) = (
            info.key_size() as usize,
            info.value_size() as usize,
            info.max_entries(),
        );
        let mappable = info.map_flags() & aya_obj::generated::BPF_F_MMAPABLE != 0;
        let result = match kind {
            Kind::Array if mappable => {
                zero_mapped(mapped, name, data.fd().as_fd(), value_size, entries)
            }
            Kind::Array => zero_array(fd, value_size, &(0..entries).collect::<Vec<_>>()),
            Kind::PerCpuArray => {
                let all: Vec<u32>;
                let keys = match &emptied.counters {
                    Some(nonzero) if name == maps::COUNTERS => nonzero.as_slice(),
                    _ => {
                        all = (0..entries).collect();
                        &all
                    }
                };
                zero_array(fd, value_size.next_multiple_of(8) * possible_cpus()?, keys)
            }
            Kind::Hash => clear_hash(fd, key_size, value_size),
            Kind::PerCpuHash => clear_hash(
                fd,
                key_size,
                value_size.next_multiple_of(8) * possible_cpus()?,
            ),
        };
        result.with_context(|| format!("emptying the {name} map"))?;
    }
    Ok(())
}

/// Every entry of mappable array `name` to zeros, through its mapping
/// (made on first use and kept: a batch update copies and checks each
/// entry on its own).
fn zero_mapped(
    mapped: &mut Mapped,
    name: &str,
    fd: BorrowedFd,
    value_size: usize,
    entries: u32,
) -> std::io::Result<()> {
    let at = match mapped.0.iter().position(|(n, _)| n == name) {
        Some(i) => i,
        None => {
            let len = value_size.next_multiple_of(8) * entries as usize;
            // SAFETY: a shared mapping of the map's values, written as
            // bytes only while the object serves no process (its programs
            // do not run).
            let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&fd)? };
            mapped.0.push((name.to_string(), map));
            mapped.0.len() - 1
        }
    };
    mapped.0[at].1.fill(0);
    Ok(())
}

/// Entries `keys` of an array map to zeros, in one call.
fn zero_array(fd: RawFd, value_size: usize, keys: &[u32]) -> std::io::Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let values = vec![0u8; value_size * keys.len()];
    // SAFETY: all-zero is a valid bpf_attr.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the union's batch member.
    let b = unsafe { &mut attr.batch };
    b.map_fd = fd as u32;
    b.keys = keys.as_ptr() as u64;
    b.values = values.as_ptr() as u64;
    b.count = keys.len() as u32;
    sys_bpf(bpf_cmd::BPF_MAP_UPDATE_BATCH, &mut attr).map(drop)
}

/// The descriptor of `map` (alive as long as it is).
pub(crate) fn map_fd(map: &Map) -> Result<RawFd> {
    multi::map_fd(map)
}

/// How many entries a hash map holds at most.
pub(crate) fn hash_capacity(map: &Map) -> Result<u32> {
    match map {
        Map::HashMap(d) => Ok(d.info()?.max_entries()),
        _ => Err(anyhow::anyhow!("not a hash map")),
    }
}

/// `keys[i]` to `values[i]` in the map `fd`, in one call (`K` and `V` the
/// map's key and value types, `#[repr(C)]`).
pub(crate) fn update_batch<K: Copy, V: Copy>(
    fd: RawFd,
    keys: &[K],
    values: &[V],
) -> std::io::Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    assert_eq!(keys.len(), values.len());
    // SAFETY: all-zero is a valid bpf_attr.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the union's batch member.
    let b = unsafe { &mut attr.batch };
    b.map_fd = fd as u32;
    b.keys = keys.as_ptr() as u64;
    b.values = values.as_ptr() as u64;
    b.count = keys.len() as u32;
    sys_bpf(bpf_cmd::BPF_MAP_UPDATE_BATCH, &mut attr).map(drop)
}

/// `keys` deleted from hash map `fd` in one call; false unless every one
/// was there and went.
pub(crate) fn delete_batch<K: Copy>(fd: RawFd, keys: &[K]) -> bool {
    if keys.is_empty() {
        return true;
    }
    // SAFETY: all-zero is a valid bpf_attr.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the union's batch member.
    let b = unsafe { &mut attr.batch };
    b.map_fd = fd as u32;
    b.keys = keys.as_ptr() as u64;
    b.count = keys.len() as u32;
    // SAFETY: the union's batch member, written back by the kernel.
    sys_bpf(bpf_cmd::BPF_MAP_DELETE_BATCH, &mut attr).is_ok()
        && unsafe { attr.batch.count } as usize == keys.len()
}

/// Every entry of a hash map deleted, a batch at a time (one pass over
/// its buckets: a key-by-key walk starts each step's search over).
fn clear_hash(fd: RawFd, key_size: usize, value_size: usize) -> std::io::Result<()> {
    hash_batches(
        fd,
        bpf_cmd::BPF_MAP_LOOKUP_AND_DELETE_BATCH,
        key_size,
        value_size,
        |_, _, _| {},
    )
}
