//! Reading the host scope's maps into a profile: each key's counts summed
//! over the CPUs, its caller symbolized in its file, its process named.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use anyhow::{Context, Result};
use aya::maps::{HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap};
use tracer_common::{
    counter, maps, Comm, HostKey, HostProcess, HostValue, MAX_HOST_FUNCS, PLACE_ANONYMOUS,
    PLACE_FILE, PLACE_UNKNOWN,
};

use super::{files::FileIndex, probes::HostProbes, Processes};
use crate::profile::{
    Counts, Frame, Losses, Meta, ProcessMeta, ProcessRef, Profile, StackEntry, Totals,
};

/// Each key's counts summed over the CPUs, and its return address's place
/// (looked up by the CPU that made the key).
type Row = (HostKey, Counts, HostValue);

fn row(key: HostKey, per_cpu: &[HostValue]) -> Option<Row> {
    let mut c = Counts::default();
    let mut place = HostValue::default();
    for v in per_cpu {
        c.calls += v.calls;
        c.bytes += v.bytes;
        if v.place != PLACE_UNKNOWN {
            place = *v;
        }
    }
    (c.calls > 0).then_some((key, c, place))
}

fn counts_map(probes: &HostProbes) -> Result<PerCpuHashMap<&MapData, HostKey, HostValue>> {
    Ok(PerCpuHashMap::try_from(
        probes
            .ebpf
            .map(maps::HOST_COUNTS)
            .context("HOST_COUNTS map")?,
    )?)
}

/// What the maps hold now, as a profile (`meta` filled in but for the
/// processes, the probes and the allocator line).
pub fn profile(
    probes: &HostProbes,
    index: &mut FileIndex,
    processes: &mut Processes,
    meta: Meta,
) -> Result<Profile> {
    let mut rows = Vec::new();
    for entry in counts_map(probes)?.iter() {
        let (key, per_cpu) = entry?;
        rows.extend(row(key, &per_cpu));
    }
    profile_of(probes, index, processes, meta, rows)
}

/// The rows of `keys` (those of processes gone) as a profile of their
/// rows alone (no totals: the totals' map holds every call).
pub fn gone_profile(
    probes: &HostProbes,
    index: &mut FileIndex,
    processes: &mut Processes,
    keys: &[HostKey],
) -> Result<Profile> {
    let map = counts_map(probes)?;
    let mut rows = Vec::new();
    for k in keys {
        if let Ok(per_cpu) = map.get(k, 0) {
            rows.extend(row(*k, &per_cpu));
        }
    }
    let mut p = profile_of(probes, index, processes, Meta::default(), rows)?;
    p.totals = Totals::default();
    p.losses = Losses::default();
    Ok(p)
}

/// Every key in the counts map.
pub fn counted_keys(probes: &HostProbes) -> Result<Vec<HostKey>> {
    Ok(counts_map(probes)?.keys().filter_map(|k| k.ok()).collect())
}

fn profile_of(
    probes: &HostProbes,
    index: &mut FileIndex,
    processes: &mut Processes,
    mut meta: Meta,
    rows: Vec<Row>,
) -> Result<Profile> {
    let ebpf = &probes.ebpf;
    let names: BpfHashMap<&MapData, HostProcess, Comm> =
        BpfHashMap::try_from(ebpf.map(maps::HOST_NAMES).context("HOST_NAMES map")?)?;
    // Each process (one per exec) that allocated, with its record.
    let mut seen: BTreeMap<HostProcess, ProcessMeta> = BTreeMap::new();
    for (k, _, _) in &rows {
        let p = HostProcess {
            tgid: k.tgid,
            _pad: 0,
            mm: k.mm,
        };
        seen.entry(p).or_insert_with(|| {
            let comm = names.get(&p, 0).map(|c| comm_text(&c)).unwrap_or_default();
            processes.meta(p, &comm)
        });
    }

    // Every caller, symbolized once per (file, offset).
    let mut by_file: HashMap<(u32, u64), Vec<u64>> = HashMap::new();
    for (_, _, v) in &rows {
        if v.place == PLACE_FILE {
            by_file.entry((v.dev, v.ino)).or_default().push(v.offset);
        }
    }
    index.find(by_file.keys().copied());
    let mut frames: HashMap<(u32, u64, u64), Vec<Arc<Frame>>> = HashMap::new();
    for (file, mut offsets) in by_file {
        offsets.sort_unstable();
        offsets.dedup();
        let found = match index.open(file) {
            Some((f, path)) => crate::symbolize::returns_in_file(&f, &path, &offsets),
            None => offsets.iter().map(|&o| vec![unopened(file, o)]).collect(),
        };
        for (o, f) in offsets.iter().zip(found) {
            frames.insert((file.0, file.1, *o), f.into_iter().map(Arc::new).collect());
        }
    }

    let func_name = |f: u32| {
        probes
            .funcs
            .get(f as usize)
            .map_or_else(|| format!("func{f}"), |i| i.name.clone())
    };
    let mut stacks = Vec::with_capacity(rows.len());
    for (k, c, v) in &rows {
        let p = HostProcess {
            tgid: k.tgid,
            _pad: 0,
            mm: k.mm,
        };
        let name = seen.get(&p).map(|m| m.name.clone()).unwrap_or_default();
        let caller = match frames.get(&(v.dev, v.ino, v.offset)) {
            Some(f) if v.place == PLACE_FILE => f.clone(),
            _ => vec![Arc::new(no_file(k.ret, v.place))],
        };
        stacks.push(StackEntry {
            func: func_name(k.func),
            frames: caller,
            truncated: false,
            thread: None,
            process: Some(ProcessRef { pid: k.tgid, name }),
            counts: *c,
            live: None,
            in_use: None,
            object_size: None,
        });
    }

    let totals_map: PerCpuArray<&MapData, u64> =
        PerCpuArray::try_from(ebpf.map(maps::HOST_TOTALS).context("HOST_TOTALS map")?)?;
    let mut totals = Totals::default();
    for (f, info) in probes.funcs.iter().enumerate() {
        let f = f as u32;
        let calls: u64 = totals_map.get(&f, 0)?.iter().sum();
        if calls == 0 {
            continue;
        }
        let bytes: u64 = totals_map.get(&(MAX_HOST_FUNCS + f), 0)?.iter().sum();
        let c = Counts { calls, bytes };
        totals.allocs.add(c);
        totals.per_func.entry(info.name.clone()).or_default().add(c);
    }
    let counters: PerCpuArray<&MapData, u64> =
        PerCpuArray::try_from(ebpf.map(maps::COUNTERS).context("COUNTERS map")?)?;
    let sum = |i: u32| -> Result<u64> {
        let mut s = 0;
        for index in [i, i + counter::N] {
            s += counters.get(&index, 0)?.iter().sum::<u64>();
        }
        Ok(s)
    };
    totals.nested = sum(counter::NESTED)?;
    // Count mode probes no release function here.
    totals.frees_counted = false;
    let losses = Losses {
        map_full: sum(counter::MAP_FULL)?,
        caller_unreadable: sum(counter::CALLER_READ_FAILED)?,
        ..Losses::default()
    };

    meta.processes = seen.into_values().take(Meta::MAX_PROCESS_RECORDS).collect();
    meta.probes = probes.funcs.iter().map(|f| f.probe.clone()).collect();
    Ok(Profile {
        meta,
        stacks,
        totals,
        losses,
        stack_quality: None,
        live: None,
        snapshot: None,
        timeline: None,
        go_heaps: Vec::new(),
        unseen: Vec::new(),
    })
}

/// A caller in a file no process maps any more under a path mtrace could
/// open.
fn unopened(file: (u32, u64), offset: u64) -> Frame {
    Frame {
        function: format!(
            "[file {}:{} inode {} +{offset:#x}]",
            file.0 >> 20,
            file.0 & 0xfffff,
            file.1
        ),
        addr: offset,
        ..Frame::default()
    }
}

/// A caller in no file (a JIT's code), or whose mapping could not be
/// looked up.
fn no_file(ret: u64, place: u32) -> Frame {
    Frame {
        function: if place == PLACE_ANONYMOUS {
            format!("[anonymous code {ret:#x}]")
        } else {
            format!("[caller {ret:#x}, its mapping not looked up]")
        },
        addr: ret,
        ..Frame::default()
    }
}

pub fn comm_text(c: &Comm) -> String {
    let end = c.iter().position(|&b| b == 0).unwrap_or(c.len());
    String::from_utf8_lossy(&c[..end]).into_owned()
}
