//! Collection: the kernel maps into a [`RawProfile`] (addresses, counts,
//! losses), and in live mode the event rings into the [`live_tracker`].

pub mod live_tracker;
pub mod raw;
pub mod timeline;

use std::collections::{BTreeMap, HashMap};

use anyhow::{Context, Result};
use aya::maps::{HashMap as BpfHashMap, MapData, PerCpuArray};
use tracer_common::{
    counter, maps, stop, Comm, CountKey, CountValue, StackFrames, WalkMemo, STACK_NONE, WEIGHT_ONE,
};

use self::raw::{RawProfile, RawStack};
use crate::{
    probes::Probes,
    profile::{Counts, LiveTotals, Losses, PythonQuality, StackQuality},
};

/// Calls whose walk the tracer finished (the BPF walk met a return address
/// without an unwind rule), counted here, by the key the kernel would have
/// used, until the kernel maps are read.
#[derive(Default)]
pub struct UserWalks {
    pub counts: HashMap<CountKey, CountValue>,
    /// Frames above the direct caller and the stop code, by stack key.
    pub stacks: HashMap<u64, (Vec<u64>, u32)>,
}

impl UserWalks {
    /// Counts one call under `key`, whose stack is `frames`.
    pub fn add(&mut self, key: CountKey, frames: Vec<u64>, stop: u32, calls: u64, bytes: u64) {
        let v = self.counts.entry(key).or_default();
        v.calls += calls;
        v.bytes += bytes;
        self.stacks.entry(key.stack).or_insert((frames, stop));
    }
}

/// The name of a stop code in the report.
pub(crate) fn stop_name(code: u32) -> &'static str {
    match code {
        stop::NO_CFI => "no_cfi",
        stop::MAX_FRAMES => "max_frames",
        stop::BAD_FRAME => "bad_frame",
        stop::READ_FAILED => "read_failed",
        stop::COPY_LOST => "copy_lost",
        stop::RULES_FULL => "rules_full",
        stop::GONE => "process_gone",
        _ => "unknown",
    }
}

fn counters(probes: &Probes) -> Result<PerCpuArray<&MapData, u64>> {
    Ok(PerCpuArray::try_from(
        probes.ebpf.map(maps::COUNTERS).context("COUNTERS map")?,
    )?)
}

/// Counter `i` summed over the CPUs: its plain half and its atomic half
/// (see the BPF side).
fn counter_sum(counters: &PerCpuArray<&MapData, u64>, i: u32) -> Result<u64> {
    let mut sum = 0;
    for index in [i, i + counter::N] {
        sum += counters.get(&index, 0)?.iter().sum::<u64>();
    }
    Ok(sum)
}

/// The kernel's counters, summed over the CPUs, read in batches (one
/// lookup per counter, each half and CPU, was most of a short process's
/// reading). The last reading of a gone process also notes which
/// counters are not zero, the only ones its object's emptying zeroes.
fn counter_sums(probes: &Probes) -> Result<Vec<u64>> {
    let map = probes.ebpf.map(maps::COUNTERS).context("COUNTERS map")?;
    let n = counter::N as usize;
    let mut sums = vec![0u64; n];
    let mut nonzero = Vec::new();
    crate::probes::pool::per_cpu_entries(
        crate::probes::pool::map_fd(map)?,
        |index: u32, per_cpu: &[u64]| {
            // Each counter's plain half, then its atomic half.
            if let Some(sum) = sums.get_mut(index as usize % n) {
                if per_cpu.iter().any(|v| *v != 0) {
                    nonzero.push(index);
                }
                *sum += per_cpu.iter().sum::<u64>();
            }
        },
    )
    .context("reading the counters")?;
    if probes.last_read {
        emptied(probes).counters = Some(nonzero);
    }
    Ok(sums)
}

/// What the last reading leaves empty (see [`Probes::last_read`]).
fn emptied(probes: &Probes) -> std::sync::MutexGuard<'_, crate::probes::pool::Emptied> {
    probes.emptied.lock().unwrap_or_else(|e| e.into_inner())
}

/// The kernel's counts by key: the aggregation map plus what remembered
/// walks still hold. The kernel moves an entry's counts into the map while
/// tracing; a read that a move may have torn (the number of moves changed,
/// or an entry was being written) is read again, a few times at most.
fn kernel_counts(probes: &Probes) -> Result<HashMap<CountKey, CountValue>> {
    let ebpf = &probes.ebpf;
    let counts = crate::probes::pool::map_fd(ebpf.map(maps::COUNTS).context("COUNTS map")?)?;
    let memo = crate::probes::pool::map_fd(ebpf.map(maps::MEMO).context("MEMO map")?)?;
    let counters = counters(probes)?;
    // How many times the kernel has moved an entry's counts into the map.
    let flushes = || counter_sum(&counters, counter::MEMO_FLUSHES);
    // The last reading takes the entries out as it reads them, and each
    // pass adds what a move put in since the one before.
    let take = probes.last_read;
    let mut taken: HashMap<CountKey, CountValue> = HashMap::new();
    let mut merged = HashMap::new();
    for _ in 0..8 {
        merged.clear();
        let before = flushes()?;
        let into = if take { &mut taken } else { &mut merged };
        crate::probes::pool::entries(counts, take, |key: CountKey, v: CountValue| {
            let sum: &mut CountValue = into.entry(key).or_default();
            sum.calls += v.calls;
            sum.bytes += v.bytes;
        })
        .context("reading the counts")?;
        if take {
            merged.clone_from(&taken);
        }
        let mut torn = false;
        crate::probes::pool::per_cpu_entries(memo, |_: u32, per_cpu: &[WalkMemo]| {
            for e in per_cpu.iter().filter(|e| e.hits != 0) {
                torn |= e.seq & 1 != 0;
                let key = CountKey {
                    stack: e.key,
                    func: e.func as u32,
                    tid: e.tid as u32,
                    caller: e.caller,
                };
                let sum = merged.entry(key).or_default();
                sum.calls += e.calls;
                sum.bytes += e.bytes;
            }
        })
        .context("reading the remembered walks")?;
        if !torn && flushes()? == before {
            if take {
                emptied(probes).maps.push(maps::COUNTS);
            }
            break;
        }
    }
    Ok(merged)
}

/// Calls from the kernel's count: sampled counts are estimates, in 16.16
/// fixed point.
fn calls_of(probes: &Probes) -> impl Fn(u64) -> u64 {
    let sampled = probes.sampling.is_some();
    move |raw: u64| {
        if sampled {
            (raw + WEIGHT_ONE / 2) / WEIGHT_ONE
        } else {
            raw
        }
    }
}

/// What a process has counted so far, from the counters alone (cheap
/// enough to read every second: the status line, the timeline, the live
/// view).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Running {
    /// Allocating calls and their requested bytes.
    pub calls: u64,
    pub bytes: u64,
    pub frees: u64,
    /// Calls in no stack (the count map was full) and, in live mode,
    /// events the kernel could not send.
    pub lost: u64,
}

impl Running {
    pub fn add(&mut self, other: Running) {
        self.calls += other.calls;
        self.bytes += other.bytes;
        self.frees += other.frees;
        self.lost += other.lost;
    }
}

/// Reads a process's [`Running`] counts.
pub fn running(probes: &Probes) -> Result<Running> {
    let sums = counter_sums(probes)?;
    let calls = calls_of(probes);
    let mut out = Running {
        lost: sums[counter::MAP_FULL as usize] + sums[counter::EVENTS_LOST as usize],
        ..Running::default()
    };
    for (f, info) in probes.funcs.iter().enumerate() {
        let n = calls(sums[counter::CALLS as usize + f]);
        if info.role.allocates() {
            out.calls += n;
            out.bytes += sums[counter::BYTES as usize + f];
        } else {
            out.frees += n;
        }
    }
    Ok(out)
}

pub fn collect(probes: &Probes, walks: &UserWalks) -> Result<RawProfile> {
    let ebpf = &probes.ebpf;
    let sums = counter_sums(probes)?;
    let sampled = probes.sampling.is_some();
    let calls = calls_of(probes);
    let n_funcs = probes.funcs.len();
    let mut per_func: Vec<Counts> = (0..n_funcs)
        .map(|f| Counts {
            calls: calls(sums[counter::CALLS as usize + f]),
            bytes: sums[counter::BYTES as usize + f],
        })
        .collect();
    let losses = Losses {
        map_full: sums[counter::MAP_FULL as usize],
        stack_walk_failed: sums[counter::STACK_WALK_FAILED as usize],
        stack_collisions: sums[counter::STACK_COLLISION as usize],
        stack_map_full: sums[counter::STACK_MAP_FULL as usize],
        caller_unreadable: sums[counter::CALLER_READ_FAILED as usize],
        thread_names_full: sums[counter::THREAD_NAMES_FULL as usize],
        ..Losses::default()
    };

    // The last reading takes every stack out at once (one pass over the
    // map's buckets, which its emptying would make anyway); any other
    // looks up those it needs.
    let stack_map = ebpf.map(maps::STACKS).context("STACKS map")?;
    let (stack_map, taken_stacks) = if probes.last_read {
        let mut all = HashMap::new();
        let fd = crate::probes::pool::map_fd(stack_map)?;
        crate::probes::pool::entries(fd, true, |k: u64, st: StackFrames| {
            all.insert(k, st);
        })
        .context("reading the stacks")?;
        emptied(probes).maps.push(maps::STACKS);
        (None, Some(all))
    } else {
        let map: BpfHashMap<&MapData, u64, StackFrames> = BpfHashMap::try_from(stack_map)?;
        (Some(map), None)
    };
    let mut frames_by_hash: HashMap<u64, Option<(Vec<u64>, u32)>> = HashMap::new();
    let mut stacks = Vec::new();
    let mut raw_stack_calls = Vec::new();
    // The kernel's keys, then the ones only the tracer's walks have.
    let mut merged = kernel_counts(probes)?;
    for (key, v) in &walks.counts {
        let sum = merged.entry(*key).or_default();
        sum.calls += v.calls;
        sum.bytes += v.bytes;
    }
    let mut quality = StackQuality::default();
    for (key, value) in merged {
        raw_stack_calls.push(value.calls);
        let walked = if key.stack == STACK_NONE {
            None
        } else {
            frames_by_hash
                .entry(key.stack)
                .or_insert_with(|| match walks.stacks.get(&key.stack) {
                    Some(w) => Some(w.clone()),
                    None => match (&taken_stacks, &stack_map) {
                        (Some(all), _) => all.get(&key.stack).copied(),
                        (None, Some(map)) => map.get(&key.stack, 0).ok(),
                        (None, None) => None,
                    }
                    .map(|st| {
                        let n = (st.len as usize).min(st.frames.len());
                        (st.frames[..n].to_vec(), st.stop)
                    }),
                })
                .clone()
        };
        let stop = walked.as_ref().map_or(0, |w| w.1);
        let calls = calls(value.calls);
        quality.calls += calls;
        if stop == stop::END {
            quality.whole += calls;
        } else {
            // No stack at all: the walk failed, or its stack found the
            // kernel's stack map full (both counted among the losses).
            let why = match (&walked, key.stack == STACK_NONE) {
                (Some(_), _) => stop_name(stop),
                (None, true) => "stack_walk_failed",
                (None, false) => "stack_map_full",
            };
            *quality.truncated.entry(why.into()).or_default() += calls;
        }
        stacks.push(RawStack {
            func: key.func,
            addrs: assemble_stack(key.caller, walked.as_ref().map(|w| w.0.as_slice())),
            truncated: stop != stop::END,
            tid: (key.tid != 0).then_some(key.tid),
            counts: Counts {
                calls,
                bytes: value.bytes,
            },
            key,
            live: None,
        });
    }
    quality.frame_limit =
        (probes.max_frames < tracer_common::MAX_FRAMES as u32).then_some(probes.max_frames);
    quality.finished_by_tracer =
        sums[counter::UNWIND_MISSES as usize] - sums[counter::UNWIND_MISSES_LOST as usize];
    quality.walked_in_kernel = sums[counter::WALKS as usize];
    quality.held_for_tracer = sums[counter::THROTTLED as usize];
    quality.not_held = sums[counter::NOT_THROTTLED as usize];
    let python = PythonQuality {
        with_frames: sums[counter::PY_WITH_FRAMES as usize],
        no_interpreter: sums[counter::PY_NO_INTERPRETER as usize],
        no_thread_state: sums[counter::PY_NO_THREAD_STATE as usize],
        no_code_running: sums[counter::PY_NO_CODE_RUNNING as usize],
        threads_beyond: sums[counter::PY_THREADS_BEYOND as usize],
        cut: sums[counter::PY_CUT as usize],
        unreadable: sums[counter::PY_READ_FAILED as usize],
        notices_lost: sums[counter::PY_NOTICES_LOST as usize],
        unnamed: 0,
        not_known: 0,
    };
    quality.python = (python != PythonQuality::default()).then_some(python);

    let mut thread_names = BTreeMap::new();
    // Names are kept in per-thread mode only (a key's thread id is 0
    // otherwise).
    let named = probes.made_for().0.per_thread;
    if let Some(map) = ebpf.map(maps::THREAD_NAMES).filter(|_| named) {
        let fd = crate::probes::pool::map_fd(map)?;
        crate::probes::pool::entries(fd, probes.last_read, |tid: u32, comm: Comm| {
            let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
            thread_names.insert(tid, String::from_utf8_lossy(&comm[..end]).into_owned());
        })
        .context("reading the thread names")?;
    }
    if probes.last_read {
        emptied(probes).maps.push(maps::THREAD_NAMES);
    }

    let live = probes.live.then(|| LiveTotals {
        failed: sums[counter::FAILED as usize],
        events_lost: sums[counter::EVENTS_LOST as usize],
        frees_kept: sums[counter::FREES_KEPT as usize],
        frees_lost: sums[counter::FREES_LOST as usize],
        allocs_kept: sums[counter::ALLOCS_KEPT as usize],
        allocs_lost: sums[counter::ALLOCS_LOST as usize],
        pending_full: sums[counter::PENDING_FULL as usize],
        inline_unfinished: sums[counter::INLINE_UNFINISHED as usize],
        ..LiveTotals::default()
    });

    if sampled {
        // Rounded estimates must add up: a function's total is the sum of
        // its stacks' rounded estimates, plus the rounded rest (samples
        // that found the map full).
        let mut in_stacks = vec![(0u64, 0u64); n_funcs];
        for (st, raw_calls) in stacks.iter().zip(&raw_stack_calls) {
            if let Some(slot) = in_stacks.get_mut(st.func as usize) {
                slot.0 += raw_calls;
                slot.1 += st.counts.calls;
            }
        }
        for (f, total) in per_func.iter_mut().enumerate() {
            let raw_total = sums[counter::CALLS as usize + f];
            let (raw_in, rounded_in) = in_stacks[f];
            total.calls = rounded_in + calls(raw_total.saturating_sub(raw_in));
        }
    }

    Ok(RawProfile {
        stacks,
        per_func,
        nested: sums[counter::NESTED as usize],
        losses,
        thread_names,
        live,
        samples: sums[counter::SAMPLES as usize],
        stack_quality: quality,
        frees_counted: probes.frees_counted,
    })
}

/// Builds the stack, innermost first, from the direct caller (read at
/// `[rsp]`) and the frame-pointer walk from `rbp`. When the probed function
/// had already set up its own frame (a probe after `push %rbp; mov
/// %rsp,%rbp`), the walk's first return address is the caller again: it is
/// not repeated.
pub fn assemble_stack(caller: u64, walked: Option<&[u64]>) -> Vec<u64> {
    let mut out = Vec::new();
    if caller != 0 {
        out.push(caller);
    }
    if let Some(frames) = walked {
        let mut rest = frames;
        if caller != 0 && rest.first() == Some(&caller) {
            rest = &rest[1..];
        }
        out.extend(rest.iter().copied().filter(|&a| a != 0));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::assemble_stack;

    #[test]
    fn caller_goes_first() {
        assert_eq!(
            assemble_stack(0x10, Some(&[0x20, 0x30])),
            vec![0x10, 0x20, 0x30]
        );
    }

    #[test]
    fn caller_found_by_the_walk_too_is_not_repeated() {
        assert_eq!(assemble_stack(0x10, Some(&[0x10, 0x20])), vec![0x10, 0x20]);
    }

    #[test]
    fn failed_walk_keeps_the_caller() {
        assert_eq!(assemble_stack(0x10, None), vec![0x10]);
    }
}
