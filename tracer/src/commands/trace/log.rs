//! What a trace says about itself: the one `tracing ...` line, and the
//! verbose lines (`-v`) on the verifier's work, the unwind rules, the
//! probes and the programs' load times.

use super::attach::Root;
use crate::{
    cli::config::{Target, TraceConfig},
    probes::multi,
    profile::Probe,
    render::text::printable,
    session::TracedProcess,
    tracee::{self},
};

/// `mtrace: tracing pid 1234 (name): 8 probes in libc.so.6, ...`
pub(super) fn tracing_line(config: &TraceConfig, root: &Root) -> String {
    let pid = root.pid();
    let placement = match root {
        Root::Probed(root) => {
            let mut placed = root.probes.placement();
            if let Some(go) = &root.go {
                placed.push_str(&format!(
                    "; its Go heap ({}) read from its memory",
                    go.version()
                ));
            }
            placed
        }
        Root::Go { go, .. } => format!(
            "no malloc, its Go heap ({}) read from its memory",
            go.version()
        ),
    };
    format!(
        "mtrace: tracing pid {} ({}): {}{}{}",
        pid,
        printable(&tracee::comm(pid)),
        placement,
        match &config.target {
            Target::Command(_) if config.follow => ", and every process it starts",
            Target::Pid(_) if config.children => ", and its children, present and to come",
            Target::Cgroup(_) => ", and every process of its cgroup, present and to come",
            _ => "",
        },
        if config.schedule.duration.is_some() {
            String::new()
        } else {
            ", Ctrl-C to stop".into()
        }
    )
}

/// The verifier's work on each program (`-v`).
pub(super) fn log_verified(programs: &[multi::Program]) {
    for prog in programs {
        if let Ok(info) = prog.info() {
            log::debug!(
                "bpf program {}: {} instructions verified",
                prog.name,
                info.verified_instructions
            );
        }
    }
}

/// The root's unwinder at work (`-v`).
pub(super) fn log_unwind(root: &TracedProcess, config: &TraceConfig) {
    let walks = root.unwind.walks();
    let u = &walks.unwinder.stats;
    log::debug!(
        "unwind: {} walks finished by the tracer, {}; {} rules found the kernel map full; memory: rules {} KiB here; in the kernel, rules map {} KiB ({} of {} entries used), cache {} KiB, ring {} KiB",
        u.walks_finished,
        u.describe(),
        walks.rules_full,
        // A hash-map entry here: key, rule and the table's overhead.
        u.rules * 32 / 1024,
        // The kernel's hash map, preallocated: key, value and ~64 bytes
        // of element each.
        config.sizes.unwind_rules as usize * 80 / 1024,
        u.rules,
        config.sizes.unwind_rules,
        tracer_common::RULE_CACHE_SLOTS as usize * std::mem::size_of::<tracer_common::CachedRule>() / 1024,
        config.sizes.unwind_ring / 1024,
    );
}

pub(super) fn log_probes(probes: &[Probe]) {
    for p in probes {
        log::debug!(
            "probe: {}+{} ({}{})",
            p.function,
            p.offset,
            p.instruction,
            if p.emulated { "" } else { ", single-stepped" }
        );
    }
}
