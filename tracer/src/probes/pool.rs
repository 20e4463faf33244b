//! Loaded BPF objects kept for the processes to come: loading one is the
//! verifier's work on every program (most of what a new process cost),
//! so an object whose process is gone is emptied and serves the next.
//!
//! An object goes back only once its links are closed: closing a link
//! returns after the kernel's grace period, when no program of it runs
//! any more, so nothing of the old process reaches the emptied maps.

use std::{
    os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd},
    sync::Mutex,
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
}

static POOL: Mutex<Vec<Loaded>> = Mutex::new(Vec::new());

/// An emptied object loaded for `made_for`, if one waits.
pub fn take(made_for: (Mode, MapSizes)) -> Option<Loaded> {
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let i = pool.iter().position(|l| l.made_for == made_for)?;
    Some(pool.swap_remove(i))
}

/// Empties `loaded` (its links closed) and keeps it for the next process;
/// dropped instead when it cannot be emptied.
pub fn give_back(loaded: Loaded) {
    match empty(&loaded.ebpf) {
        Ok(()) => POOL.lock().unwrap_or_else(|e| e.into_inner()).push(loaded),
        Err(e) => log::debug!("a BPF object not kept for reuse: {e:#}"),
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
fn empty(ebpf: &Ebpf) -> Result<()> {
    for (name, map) in ebpf.maps() {
        if name.starts_with('.') || name == maps::RULE_CACHE {
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
        let result = match kind {
            Kind::Array => zero_array(fd, value_size, entries),
            Kind::PerCpuArray => {
                let cpus = aya::util::nr_cpus().map_err(|(w, e)| anyhow::anyhow!("{w}: {e}"))?;
                zero_array(fd, value_size.next_multiple_of(8) * cpus, entries)
            }
            Kind::Hash => clear_hash(fd, key_size, value_size),
            Kind::PerCpuHash => {
                let cpus = aya::util::nr_cpus().map_err(|(w, e)| anyhow::anyhow!("{w}: {e}"))?;
                clear_hash(fd, key_size, value_size.next_multiple_of(8) * cpus)
            }
        };
        result.with_context(|| format!("emptying the {name} map"))?;
    }
    Ok(())
}

/// Every entry of an array map to zeros, in one call.
fn zero_array(fd: RawFd, value_size: usize, entries: u32) -> std::io::Result<()> {
    let keys: Vec<u32> = (0..entries).collect();
    let values = vec![0u8; value_size * entries as usize];
    // SAFETY: all-zero is a valid bpf_attr.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the union's batch member.
    let b = unsafe { &mut attr.batch };
    b.map_fd = fd as u32;
    b.keys = keys.as_ptr() as u64;
    b.values = values.as_ptr() as u64;
    b.count = entries;
    sys_bpf(bpf_cmd::BPF_MAP_UPDATE_BATCH, &mut attr).map(drop)
}

/// Every entry of a hash map deleted, a batch at a time (one pass over
/// its buckets: a key-by-key walk starts each step's search over).
fn clear_hash(fd: RawFd, key_size: usize, value_size: usize) -> std::io::Result<()> {
    const BATCH: usize = 256;
    let mut keys = vec![0u8; key_size * BATCH];
    let mut values = vec![0u8; value_size * BATCH];
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
        b.count = BATCH as u32;
        match sys_bpf(bpf_cmd::BPF_MAP_LOOKUP_AND_DELETE_BATCH, &mut attr) {
            Ok(_) => {}
            // The last batch (possibly empty): the map is empty.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            Err(e) => return Err(e),
        }
        first = false;
        token_in = token_out;
    }
}
