//! Kernel maps -> raw profile (addresses) -> profile (symbols): the one
//! path by which a traced program's counts become a profile. The kernel's
//! aggregation and the walks the tracer finished are read
//! ([`collect::collect`]), live mode's tracker adds what it followed
//! ([`add_live`]), and [`symbolize::symbolize`] names every address with
//! the program's own mappings.

use std::{collections::BTreeMap, sync::Mutex, time::Instant};

use anyhow::{Context, Result};

use crate::{
    collect::{
        self,
        live_tracker::{self, LiveTracker},
        raw::RawProfile,
    },
    probes::{Probes, Sampling},
    profile::{Meta, Profile, SamplingInfo},
    symbolize,
    tracee::AddressSpace,
    unwind::service::UnwindService,
};

/// When tracing began, and the age from which a block is a leak suspect.
pub struct Clock {
    pub started: Instant,
    /// CLOCK_MONOTONIC when tracing began.
    pub started_ns: u64,
    /// Live mode: blocks at least this old are leak suspects.
    pub min_age_ns: u64,
}

/// The profile of one program: what its probes counted (with the walks
/// its unwinder finished), what its live tracker followed, symbolized with
/// its address space. `meta` is the program's; its duration and sampling
/// are filled in here.
pub fn profile(
    probes: &Probes,
    unwind: &UnwindService,
    tracker: Option<&LiveTracker>,
    space: &Mutex<AddressSpace>,
    thread_names: &BTreeMap<u32, String>,
    mut meta: Meta,
    clock: &Clock,
) -> Result<Profile> {
    let reading = std::time::Instant::now();
    let mut walks = unwind.walks();
    let mut raw = collect::collect(probes, &walks.counted).context("reading the kernel maps")?;
    let read_ms = reading.elapsed().as_secs_f64() * 1e3;
    // Code objects no notice told of, while the process may still live;
    // unless its interpreter's state turned out unreadable, which is all
    // there is to say of its Python.
    if let Some(names) = walks.python.as_mut() {
        if let Some(line) = names.judge() {
            crate::python::say_once(line);
            meta.python = line.to_string();
            raw.stack_quality.python = None;
        } else {
            for st in &raw.stacks {
                names.learn(crate::python::split(&st.addrs).1);
            }
            let q = raw.stack_quality.python.get_or_insert_default();
            q.unnamed = names.unnamed;
        }
    }
    if let Some(tracker) = tracker {
        add_live(&mut raw, tracker, clock);
    }
    meta.duration_secs = clock.started.elapsed().as_secs_f64();
    meta.sampling = probes.sampling.map(|s| {
        let (kind, rate) = match s {
            Sampling::Bytes(n) => ("bytes", n),
            Sampling::Every(n) => ("every", n),
        };
        SamplingInfo {
            kind: kind.into(),
            rate,
            samples: raw.samples,
        }
    });
    // Locked only once the walks are read: the unwinder's thread takes
    // the walks, then the address space.
    let space = space.lock().unwrap();
    let naming = std::time::Instant::now();
    let profile = symbolize::symbolize(
        &raw,
        &space,
        &probes.funcs,
        thread_names,
        walks.python.as_ref(),
        meta,
    );
    log::debug!(
        "profile: {} stacks read in {read_ms:.1} ms, symbolized in {:.1} ms",
        raw.stacks.len(),
        naming.elapsed().as_secs_f64() * 1e3
    );
    Ok(profile)
}

/// Joins the tracker's per-stack statistics and its table of outstanding
/// blocks to the raw profile.
fn add_live(raw: &mut RawProfile, tracker: &LiveTracker, clock: &Clock) {
    let now = live_tracker::monotonic_ns();
    let outstanding = tracker.outstanding(now, clock.min_age_ns);
    for st in &mut raw.stacks {
        // Every stack gets live data in live mode: zeros for one whose
        // calls all failed.
        st.live = Some(
            tracker
                .stats(&st.key, outstanding.get(&st.key), now)
                .unwrap_or_default(),
        );
    }
    if let Some(t) = &mut raw.live {
        t.peak_bytes = tracker.peak_bytes;
        t.peak_secs = tracker.peak_ts.saturating_sub(clock.started_ns) as f64 / 1e9;
        t.min_age_secs = clock.min_age_ns as f64 / 1e9;
        t.temporary_under_ns = tracker.temporary_ns;
        t.live_map_size = tracker.capacity() as u64;
        for o in outstanding.values() {
            t.outstanding += o.blocks;
            t.outstanding_bytes += o.bytes;
            t.old_outstanding += o.old_blocks;
            t.old_outstanding_bytes += o.old_bytes;
        }
        t.untracked = tracker.untracked;
        t.frees_unknown = tracker.frees_unknown;
        t.stale = tracker.stale;
        for (_, k) in tracker.stacks() {
            t.tracked_allocations += k.allocations;
            t.temporaries += k.temporaries;
        }
    }
}
