//! Reading the host scope's maps into a profile: each key's counts, its
//! caller symbolized in its file, its process named.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::Arc,
};

use anyhow::{Context, Result};
use aya::maps::{HashMap as BpfHashMap, MapData, PerCpuArray};
use tracer_common::{
    counter, host_frame_parts, maps, stop, Comm, HostKey, HostName, HostProcess, HostValue,
    StackFrames, MAX_HOST_FUNCS, PLACE_ANONYMOUS, PLACE_FILE,
};

use super::{files::FileIndex, probes::HostProbes, walks::HostWalks, Processes};
use crate::profile::{
    Counts, Frame, HostLosses, Losses, Meta, ProcessMeta, ProcessRef, Profile, PythonQuality,
    StackEntry, StackQuality, Thread, Totals,
};
use crate::python::{runs_eval_loop, split};

/// Each key's counts and its return address's place (looked up by the
/// program that made the key).
type Row = (HostKey, HostValue);

/// A key's counts as [`with_walked`] sums them: its calls whose Python
/// frames were not looked for among them.
type Summed = (HostKey, HostValue, u64);

fn row(key: HostKey, v: HostValue) -> Option<Row> {
    (v.calls > 0).then_some((key, v))
}

fn counts_map(probes: &HostProbes) -> Result<BpfHashMap<&MapData, HostKey, HostValue>> {
    Ok(BpfHashMap::try_from(
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
    walks: &mut HostWalks,
    meta: Meta,
) -> Result<Profile> {
    let mut rows = Vec::new();
    for entry in counts_map(probes)?.iter() {
        let (key, value) = entry?;
        rows.extend(row(key, value));
    }
    let rows = with_walked(rows, walks.rows.iter().map(|(k, v)| (*k, *v)));
    profile_of(probes, index, processes, walks, meta, rows)
}

/// The rows of `keys` (those of processes gone) as a profile of their
/// rows alone (no totals: the totals' map holds every call).
pub fn gone_profile(
    probes: &HostProbes,
    index: &mut FileIndex,
    processes: &mut Processes,
    walks: &mut HostWalks,
    keys: &[HostKey],
    walked: Vec<(HostKey, HostValue)>,
) -> Result<Profile> {
    let map = counts_map(probes)?;
    let mut rows = Vec::new();
    for k in keys {
        if let Ok(value) = map.get(k, 0) {
            rows.extend(row(*k, value));
        }
    }
    let rows = with_walked(rows, walked.into_iter());
    let gone: HashSet<u32> = rows.iter().map(|(k, _, _)| k.tgid).collect();
    let mut p = profile_of(probes, index, processes, walks, Meta::default(), rows)?;
    p.totals = Totals::default();
    p.losses = Losses::default();
    // The kernel's counters and the tracer's running figures are the
    // host's since the start, which the last reading gives once (a part
    // is summed with the others); what the part's own rows say (calls
    // running Python code not read) and the perf maps' figures of the
    // processes gone (forgotten after) are kept here.
    if let Some(q) = p.stack_quality.as_mut() {
        q.finished_by_tracer = 0;
        q.walked_in_kernel = 0;
        q.python = q
            .python
            .take()
            .map(|p| PythonQuality {
                not_known: p.not_known,
                ..PythonQuality::default()
            })
            .filter(|p| p.not_known > 0);
        q.perf_map = walks.jit.quality_of(&gone);
    }
    Ok(p)
}

/// The kernel's rows with the calls the tracer's walks counted added: a
/// key of both is one row, and so are keys that differ only in whether
/// Python frames were looked for (the calls they were not are summed).
fn with_walked(rows: Vec<Row>, walked: impl Iterator<Item = (HostKey, HostValue)>) -> Vec<Summed> {
    let mut at: HashMap<HostKey, usize> = HashMap::with_capacity(rows.len());
    let mut out: Vec<Summed> = Vec::with_capacity(rows.len());
    for (k, v) in rows.into_iter().chain(walked) {
        let unread = if k.python_unread != 0 { v.calls } else { 0 };
        let k = HostKey {
            python_unread: 0,
            ..k
        };
        match at.get(&k) {
            Some(&i) => {
                out[i].1.calls += v.calls;
                out[i].1.bytes += v.bytes;
                out[i].2 += unread;
            }
            None => {
                at.insert(k, out.len());
                out.push((k, v, unread));
            }
        }
    }
    out
}

fn counters(probes: &HostProbes) -> Result<PerCpuArray<&MapData, u64>> {
    Ok(PerCpuArray::try_from(
        probes.ebpf.map(maps::COUNTERS).context("COUNTERS map")?,
    )?)
}

/// Counter `i` summed over the CPUs and both halves (the CPU owner's and
/// the atomic one).
fn counter_sum(counters: &PerCpuArray<&MapData, u64>, i: u32) -> Result<u64> {
    let mut s = 0;
    for index in [i, i + counter::N] {
        s += counters.get(&index, 0)?.iter().sum::<u64>();
    }
    Ok(s)
}

/// Every key in the counts map.
pub fn counted_keys(probes: &HostProbes) -> Result<Vec<HostKey>> {
    Ok(counts_map(probes)?.keys().filter_map(|k| k.ok()).collect())
}

fn profile_of(
    probes: &HostProbes,
    index: &mut FileIndex,
    processes: &mut Processes,
    walks: &mut HostWalks,
    mut meta: Meta,
    rows: Vec<Summed>,
) -> Result<Profile> {
    let ebpf = &probes.ebpf;
    // Interpreters whose state could not be judged before: judged now,
    // before their frames are put in; JIT code's names read to where
    // their maps are.
    walks.python.judge_all();
    walks.jit.catch_up();
    let names: BpfHashMap<&MapData, HostProcess, HostName> =
        BpfHashMap::try_from(ebpf.map(maps::HOST_NAMES).context("HOST_NAMES map")?)?;
    // Each process (one per exec) that allocated, with its record.
    // By process id, so that a parent is usually read before the children
    // it forked (a child that did not exec takes its parent's program).
    let keys: BTreeSet<HostProcess> = rows
        .iter()
        .map(|(k, _, _)| HostProcess {
            tgid: k.tgid,
            _pad: 0,
            mm: k.mm,
        })
        .collect();
    let mut seen: BTreeMap<HostProcess, ProcessMeta> = BTreeMap::new();
    for p in keys {
        let (comm, ppid) = names
            .get(&p, 0)
            .map(|n| (comm_text(&n.comm), n.ppid))
            .unwrap_or_default();
        seen.insert(p, processes.meta(p, &comm, ppid));
    }

    // `--per-thread`: the threads' names, as each was at its first key.
    let mut threads: HashMap<u32, String> = HashMap::new();
    if rows.iter().any(|(k, _, _)| k.tid != 0) {
        let map: BpfHashMap<&MapData, u32, Comm> =
            BpfHashMap::try_from(ebpf.map(maps::THREAD_NAMES).context("THREAD_NAMES map")?)?;
        for (k, _, _) in &rows {
            if k.tid != 0 && !threads.contains_key(&k.tid) {
                let name = map
                    .get(&k.tid, 0)
                    .map(|c| comm_text(&c))
                    .unwrap_or_default();
                threads.insert(k.tid, name);
            }
        }
    }

    // Each row's stack above its caller: the kernel's walk, or the
    // tracer's.
    let stack_map: BpfHashMap<&MapData, u64, StackFrames> =
        BpfHashMap::try_from(ebpf.map(maps::HOST_STACKS).context("HOST_STACKS map")?)?;
    let mut stacks: HashMap<u64, Option<(Vec<u64>, u32)>> = HashMap::new();
    for (k, _, _) in &rows {
        if k.stack == 0 {
            continue;
        }
        stacks
            .entry(k.stack)
            .or_insert_with(|| match walks.stacks.get(&k.stack) {
                Some(w) => Some(w.clone()),
                None => stack_map.get(&k.stack, 0).ok().map(|st| {
                    let n = (st.len as usize).min(st.frames.len());
                    (st.frames[..n].to_vec(), st.stop)
                }),
            });
    }
    // The files the stacks' frames lie in, by tag (a stack's Python
    // frames follow its native ones).
    let mut files_of: HashMap<u32, Option<(u32, u64)>> = HashMap::new();
    for (frames, _) in stacks.values().flatten() {
        for (tag, _) in split(frames).0.iter().filter_map(|f| host_frame_parts(*f)) {
            files_of.entry(tag).or_insert_with(|| walks.file_of(tag));
        }
    }
    let file_of = |tag: u32| -> Option<(u32, u64)> { files_of.get(&tag).copied().flatten() };

    // Every caller and frame, symbolized once per (file, offset).
    let mut by_file: HashMap<(u32, u64), Vec<u64>> = HashMap::new();
    for (_, v, _) in &rows {
        if v.place == PLACE_FILE {
            by_file.entry((v.dev, v.ino)).or_default().push(v.offset);
        }
    }
    for (frames, _) in stacks.values().flatten() {
        for (tag, offset) in split(frames).0.iter().filter_map(|f| host_frame_parts(*f)) {
            if let Some(file) = file_of(tag) {
                by_file.entry(file).or_default().push(offset);
            }
        }
    }
    index.find(by_file.keys().copied());
    let mut frames: HashMap<(u32, u64, u64), Vec<Arc<Frame>>> = HashMap::new();
    for (file, mut offsets) in by_file {
        offsets.sort_unstable();
        offsets.dedup();
        // Named before: from the store.
        offsets.retain(|&o| match index.symbols(&(file.0, file.1, o)) {
            Some(named) => {
                frames.insert((file.0, file.1, o), named.clone());
                false
            }
            None => true,
        });
        if offsets.is_empty() {
            continue;
        }
        let Some((f, path)) = index.open(file) else {
            for &o in &offsets {
                frames.insert((file.0, file.1, o), vec![Arc::new(unopened(file, o))]);
            }
            continue;
        };
        let found = crate::symbolize::returns_in_file(&f, &path, &offsets);
        let (build_id, loads) = (crate::tracee::build_id(&f), loaded_segments(&f));
        for (o, f) in offsets.iter().zip(found) {
            let named: Vec<Arc<Frame>> = f
                .into_iter()
                .map(|mut frame| {
                    locate_in_file(&mut frame, *o, &build_id, &loads);
                    Arc::new(frame)
                })
                .collect();
            index.keep_symbols((file.0, file.1, *o), named.clone());
            frames.insert((file.0, file.1, *o), named);
        }
    }

    let func_name = |f: u32| {
        probes
            .funcs
            .get(f as usize)
            .map_or_else(|| format!("func{f}"), |i| i.name.clone())
    };
    let walking = probes.max_frames != 0;
    let mut quality = StackQuality::default();
    // Calls running Python code whose Python frames the kernel did not read.
    let mut py_not_known = 0;
    let mut out = Vec::with_capacity(rows.len());
    for (k, v, unread) in &rows {
        let c = Counts {
            calls: v.calls,
            bytes: v.bytes,
        };
        let p = HostProcess {
            tgid: k.tgid,
            _pad: 0,
            mm: k.mm,
        };
        let name = seen.get(&p).map(|m| m.name.clone()).unwrap_or_default();
        let jit = |addr: u64| walks.jit.name(k.tgid, addr);
        let mut all = match frames.get(&(v.dev, v.ino, v.offset)) {
            Some(f) if v.place == PLACE_FILE => f.clone(),
            _ => vec![Arc::new(no_file(k.ret, v.place, jit(k.ret)))],
        };
        let walked = stacks.get(&k.stack).and_then(|s| s.as_ref());
        let stop = match walked {
            Some((above, stop)) => {
                let (above, py) = split(above);
                for &f in above {
                    match host_frame_parts(f).map(|(tag, o)| (file_of(tag), o)) {
                        Some((Some(file), o)) => match frames.get(&(file.0, file.1, o)) {
                            Some(named) => all.extend(named.iter().cloned()),
                            None => all.push(Arc::new(unopened(file, o))),
                        },
                        Some((None, o)) => all.push(Arc::new(Frame {
                            function: format!("[unknown file +{o:#x}]"),
                            addr: o,
                            ..Frame::default()
                        })),
                        None => all.push(Arc::new(no_file(f, PLACE_ANONYMOUS, jit(f)))),
                    }
                }
                if !py.is_empty() {
                    all = walks.python.splice(k.tgid, k.mm, all, py);
                } else if runs_eval_loop(&all) {
                    // (Calls whose Python frames were looked for and not
                    // found are in the kernel's categories.)
                    py_not_known += unread;
                }
                Some(*stop)
            }
            // `--max-stack 0`: the direct caller alone, every call cut
            // at the limit (or its caller unread), as by pid.
            None if !walking => Some(if k.ret != 0 {
                stop::MAX_FRAMES
            } else {
                stop::READ_FAILED
            }),
            None => None,
        };
        quality.calls += c.calls;
        match (stop, k.stack) {
            (Some(stop::END), _) => quality.whole += c.calls,
            (Some(why), _) => {
                *quality
                    .truncated
                    .entry(crate::collect::stop_name(why).into())
                    .or_default() += c.calls
            }
            (None, 0) => {
                *quality
                    .truncated
                    .entry("stack_walk_failed".into())
                    .or_default() += c.calls
            }
            (None, _) => {
                *quality
                    .truncated
                    .entry("stack_map_full".into())
                    .or_default() += c.calls
            }
        }
        out.push(StackEntry {
            func: func_name(k.func),
            frames: all,
            truncated: stop != Some(stop::END),
            thread: (k.tid != 0).then(|| Thread {
                tid: k.tid,
                name: threads.get(&k.tid).cloned().unwrap_or_default(),
            }),
            process: Some(ProcessRef { pid: k.tgid, name }),
            counts: c,
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
    let counters = counters(probes)?;
    let sum = |i: u32| counter_sum(&counters, i);
    totals.nested = sum(counter::NESTED)?;
    // Count mode probes no release function here.
    totals.frees_counted = false;
    quality.frame_limit =
        (probes.max_frames < tracer_common::MAX_FRAMES as u32).then_some(probes.max_frames);
    if walking {
        quality.finished_by_tracer = walks.finished;
        quality.walked_in_kernel = sum(counter::WALKS)?;
        quality.held_for_tracer = sum(counter::THROTTLED)?;
        quality.not_held = sum(counter::NOT_THROTTLED)?;
        quality.symbols = crate::symbolize::symbols_quality();
        quality.perf_map = walks.jit.quality();
        let python = PythonQuality {
            with_frames: sum(counter::PY_WITH_FRAMES)?,
            no_interpreter: sum(counter::PY_NO_INTERPRETER)?,
            no_thread_state: sum(counter::PY_NO_THREAD_STATE)?,
            no_code_running: sum(counter::PY_NO_CODE_RUNNING)?,
            threads_beyond: sum(counter::PY_THREADS_BEYOND)?,
            cut: sum(counter::PY_CUT)?,
            unreadable: sum(counter::PY_READ_FAILED)?,
            notices_lost: sum(counter::PY_NOTICES_LOST)?,
            unnamed: walks.python.unnamed(),
            not_known: py_not_known,
        };
        quality.python =
            (python != PythonQuality::default() && !walks.python.none_readable()).then_some(python);
        meta.python = walks.python.said.join("; ");
    }
    let losses = Losses {
        stack_map_full: sum(counter::STACK_MAP_FULL)?,
        stack_walk_failed: sum(counter::STACK_WALK_FAILED)?,
        map_full: sum(counter::MAP_FULL)?,
        caller_unreadable: sum(counter::CALLER_READ_FAILED)?,
        thread_names_full: sum(counter::THREAD_NAMES_FULL)?,
        host: Some(HostLosses {
            exec_events_lost: sum(counter::HOST_EXECS_LOST)?,
            process_names_full: sum(counter::HOST_NAMES_FULL)?,
            process_runs_full: sum(counter::HOST_RUNS_FULL)?,
            tree_full: sum(counter::SCOPE_FULL)?,
            frames_untagged: sum(counter::HOST_NO_TAG)? + walks.untagged,
            processes_unnumbered: sum(counter::HOST_NO_GEN)?,
            python_full: sum(counter::HOST_PYTHON_FULL)? + walks.python.full,
        }),
        ..Losses::default()
    };

    meta.processes = seen.into_values().take(Meta::MAX_PROCESS_RECORDS).collect();
    meta.probes = probes.funcs.iter().map(|f| f.probe.clone()).collect();
    Ok(Profile {
        meta,
        stacks: out,
        totals,
        losses,
        stack_quality: Some(quality),
        live: None,
        snapshot: None,
        timeline: None,
        go_heaps: Vec::new(),
        unseen: Vec::new(),
        tests: Vec::new(),
        groups: Vec::new(),
    })
}

/// The file's loaded segments (`PT_LOAD`): each one's file offset and
/// size in the file.
fn loaded_segments(f: &std::fs::File) -> Vec<(u64, u64)> {
    use object::{Object, ObjectSegment};
    let cache = object::read::ReadCache::new(f);
    let Ok(obj) = object::File::parse(&cache) else {
        return Vec::new();
    };
    obj.segments().map(|s| s.file_range()).collect()
}

/// Where frame `frame`, at return offset `offset` of its file, lies, for
/// a backend that symbolizes by build id (pprof's mappings): the file's
/// build id, and as its mapping the pages of the loaded segment that
/// holds it, put where their file offsets are (no process's addresses
/// are known on the host engine; the frame's address is its offset, so
/// `address - start + offset` is the offset in the file, as in a
/// process's own mapping).
fn locate_in_file(frame: &mut Frame, offset: u64, build_id: &Option<String>, loads: &[(u64, u64)]) {
    frame.file_offset = Some(offset);
    frame.build_id.clone_from(build_id);
    let at = offset.saturating_sub(1);
    if let Some(&(start, size)) = loads.iter().find(|(o, size)| at >= *o && at < o + size) {
        let first = start & !0xfff;
        frame.mapping = Some(crate::profile::FileMapping {
            start: first,
            limit: (start + size + 0xfff) & !0xfff,
            offset: first,
        });
    }
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

/// A caller in no file (a JIT's code: named by its perf map, `jit`), or
/// whose mapping could not be looked up.
fn no_file(ret: u64, place: u32, jit: Option<String>) -> Frame {
    Frame {
        function: match jit {
            Some(name) => name,
            None if place == PLACE_ANONYMOUS => format!("[anonymous code {ret:#x}]"),
            None => format!("[caller {ret:#x}, its mapping not looked up]"),
        },
        addr: ret,
        ..Frame::default()
    }
}

pub fn comm_text(c: &Comm) -> String {
    let end = c.iter().position(|&b| b == 0).unwrap_or(c.len());
    String::from_utf8_lossy(&c[..end]).into_owned()
}
