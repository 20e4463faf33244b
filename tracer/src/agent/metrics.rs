//! `/metrics`: the trace's counters in Prometheus' text format (0.0.4).
//!
//! Label sets are bounded by what the scope holds: a process (pid, comm)
//! times an allocator function, a loss by its name; never a stack.

use std::{collections::BTreeMap, fmt::Write as _};

use super::Reading;
use crate::profile::{is_allocation, Counts, Profile, StackEntry};

pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A label value as the format quotes it.
fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", escape(v));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }
}

/// Per process (pid, comm) and allocator function: calls and bytes, each
/// stack's scaled by `factor` as `scale_windows` scales it.
fn per_process(
    stacks: &[StackEntry],
    root: u32,
    factor: f64,
) -> BTreeMap<(u32, String, String), Counts> {
    let scale = |n: u64| {
        if factor == 1.0 {
            n
        } else {
            (n as f64 * factor).round() as u64
        }
    };
    let mut rows: BTreeMap<(u32, String, String), Counts> = BTreeMap::new();
    for e in stacks.iter().filter(|e| is_allocation(e)) {
        let (pid, comm) = match &e.process {
            Some(p) => (p.pid, p.name.clone()),
            None => (root, String::new()),
        };
        rows.entry((pid, comm, e.func.clone()))
            .or_default()
            .add(Counts {
                calls: scale(e.counts.calls),
                bytes: scale(e.counts.bytes),
            });
    }
    rows
}

pub fn render(reading: &Reading) -> Vec<u8> {
    // A windows policy's counts are scaled: the totals on a copy without
    // the stacks (the reading is shared with other requests, and a copy
    // of its stacks is hundreds of megabytes in a large trace), the
    // stacks' as they are summed.
    let mut head = crate::profile::window::without_stacks(&reading.profile);
    crate::profile::window::scale_windows(&mut head);
    let factor = head.meta.windows.as_ref().map_or(1.0, |w| w.scale);
    let p = &head;
    let stacks = &reading.profile.stacks;
    let mut o = Out(String::new());
    o.family(
        "mtrace_up",
        "gauge",
        "1 while the agent traces (the mode, the allocator and the sampling as labels).",
    );
    let sampling = match (&p.meta.sampling, &p.meta.windows) {
        (Some(s), _) => format!("{}:{}", s.kind, s.rate),
        (None, Some(_)) => "windows".to_string(),
        (None, None) => "exact".to_string(),
    };
    o.sample(
        "mtrace_up",
        &[
            ("version", &p.meta.mtrace_version),
            ("mode", &p.meta.mode),
            ("allocator", &p.meta.allocator_family),
            ("sampling", &sampling),
        ],
        1,
    );
    o.family(
        "mtrace_trace_seconds",
        "gauge",
        "How long the agent has traced.",
    );
    o.sample(
        "mtrace_trace_seconds",
        &[],
        format!("{:.3}", p.meta.duration_secs),
    );
    if let Some(w) = &p.meta.windows {
        o.family(
            "mtrace_probed_seconds_total",
            "counter",
            "Windows policy: seconds counted (counts are scaled by mtrace_trace_seconds over this).",
        );
        o.sample(
            "mtrace_probed_seconds_total",
            &[],
            format!("{:.3}", w.probed_secs),
        );
        o.family(
            "mtrace_probes_in_seconds_total",
            "counter",
            "Windows policy: seconds the probes were in the processes, attaches and detaches included (what they paid for).",
        );
        o.sample(
            "mtrace_probes_in_seconds_total",
            &[],
            format!("{:.3}", w.trapped_secs),
        );
        o.family(
            "mtrace_windows_total",
            "counter",
            "Windows policy: windows begun.",
        );
        o.sample("mtrace_windows_total", &[], w.windows);
        o.family(
            "mtrace_window_slowdown_ratio",
            "gauge",
            "Windows policy: the last window's estimated slowdown of the traced processes while probed.",
        );
        o.sample(
            "mtrace_window_slowdown_ratio",
            &[],
            format!("{:.4}", w.last_slowdown),
        );
    }
    o.family(
        "mtrace_processes_traced",
        "gauge",
        "Processes with probes in now.",
    );
    o.sample("mtrace_processes_traced", &[], reading.tick.processes);
    o.family(
        "mtrace_processes_seen_total",
        "counter",
        "Processes the trace has seen start or found in its scope, traced or not.",
    );
    let listed = p.meta.processes.len().max(1) as u64;
    o.sample(
        "mtrace_processes_seen_total",
        &[],
        listed + p.meta.processes_unlisted,
    );
    let rows = per_process(stacks, p.meta.pid, factor);
    for (name, help, of) in [
        (
            "mtrace_allocation_calls_total",
            "Allocation calls counted (estimated when sampled), per process and allocator function.",
            (|c: &Counts| c.calls) as fn(&Counts) -> u64,
        ),
        (
            "mtrace_allocation_bytes_total",
            "Bytes requested by those calls.",
            |c: &Counts| c.bytes,
        ),
    ] {
        o.family(name, "counter", help);
        for ((pid, comm, func), c) in &rows {
            let pid = pid.to_string();
            o.sample(name, &[("pid", &pid), ("comm", comm), ("function", func)], of(c));
        }
    }
    if p.totals.frees_counted {
        o.family(
            "mtrace_frees_total",
            "counter",
            "free calls counted (the whole scope).",
        );
        o.sample("mtrace_frees_total", &[], p.totals.frees);
    }
    if p.live.is_some() {
        let mut live: BTreeMap<(u32, String), (u64, u64)> = BTreeMap::new();
        for e in stacks {
            if let (Some(l), Some(proc)) = (&e.live, &e.process) {
                let row = live.entry((proc.pid, proc.name.clone())).or_default();
                row.0 += l.outstanding;
                row.1 += l.outstanding_bytes;
            }
        }
        for (name, what, of) in [
            (
                "mtrace_live_bytes",
                "bytes",
                (|r: &(u64, u64)| r.1) as fn(&(u64, u64)) -> u64,
            ),
            ("mtrace_live_blocks", "blocks", |r: &(u64, u64)| r.0),
        ] {
            o.family(
                name,
                "gauge",
                &format!("Live mode: {what} allocated and not yet freed, per process, among the blocks followed."),
            );
            for ((pid, comm), row) in &live {
                o.sample(name, &[("pid", &pid.to_string()), ("comm", comm)], of(row));
            }
        }
    }
    o.family(
        "mtrace_lost_total",
        "counter",
        "What the trace could not count or place, by what: every counter that loses data.",
    );
    for (what, n) in losses(p) {
        o.sample("mtrace_lost_total", &[("what", what)], n);
    }
    if let Some(q) = &p.stack_quality {
        o.family(
            "mtrace_stacks_cut_total",
            "counter",
            "Stacks counted whole but cut short, by why.",
        );
        for (why, n) in &q.truncated {
            o.sample("mtrace_stacks_cut_total", &[("why", why)], n);
        }
    }
    let me = own_usage();
    o.family(
        "mtrace_agent_cpu_seconds_total",
        "counter",
        "The agent's own CPU time (user and system).",
    );
    o.sample(
        "mtrace_agent_cpu_seconds_total",
        &[],
        format!("{:.3}", me.cpu_secs),
    );
    o.family(
        "mtrace_agent_resident_bytes",
        "gauge",
        "The agent's resident memory.",
    );
    o.sample("mtrace_agent_resident_bytes", &[], me.rss_bytes);
    o.family(
        "mtrace_agent_open_fds",
        "gauge",
        "File descriptors the agent holds.",
    );
    o.sample("mtrace_agent_open_fds", &[], me.fds);
    o.family(
        "mtrace_agent_reading_seconds",
        "gauge",
        "How long the agent took to make the reading these figures are of.",
    );
    o.sample(
        "mtrace_agent_reading_seconds",
        &[],
        format!("{:.3}", reading.took.as_secs_f64()),
    );
    o.0.into_bytes()
}

/// Every loss counter of the profile, by a stable name.
fn losses(p: &Profile) -> Vec<(&'static str, u64)> {
    let l = &p.losses;
    let mut out = vec![
        ("calls_map_full", l.map_full),
        ("stack_walk_failed", l.stack_walk_failed),
        ("stack_collisions", l.stack_collisions),
        ("stack_map_full", l.stack_map_full),
        ("caller_unreadable", l.caller_unreadable),
        ("thread_names_full", l.thread_names_full),
        ("gone_stacks_beyond", l.gone_stacks_beyond),
    ];
    if let Some(h) = &l.host {
        out.extend(h.named());
    }
    if let Some(live) = &p.live {
        out.extend([
            ("live_events_lost", live.events_lost),
            ("live_frees_lost", live.frees_lost),
            ("live_allocs_lost", live.allocs_lost),
            ("live_untracked", live.untracked),
            ("live_failed", live.failed),
        ]);
    }
    if let Some(py) = p.stack_quality.as_ref().and_then(|q| q.python.as_ref()) {
        out.extend([
            ("python_frames_cut", py.cut),
            ("python_threads_beyond", py.threads_beyond),
            ("python_frames_unreadable", py.unreadable),
            ("python_code_unnamed", py.unnamed),
            ("python_notices_lost", py.notices_lost),
            ("python_calls_not_known", py.not_known),
        ]);
    }
    if let Some(m) = p.stack_quality.as_ref().and_then(|q| q.perf_map.as_ref()) {
        out.extend([
            ("perf_map_names_evicted", m.evicted),
            ("perf_map_names_cut", m.names_cut),
        ]);
    }
    out
}

struct Usage {
    cpu_secs: f64,
    rss_bytes: u64,
    fds: usize,
}

fn own_usage() -> Usage {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid out-parameter.
    let cpu_secs = if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } == 0 {
        let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        s(ru.ru_utime) + s(ru.ru_stime)
    } else {
        0.0
    };
    // statm's second field: resident pages.
    // SAFETY: sysconf has no preconditions.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let rss_bytes = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page);
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    Usage {
        cpu_secs,
        rss_bytes,
        fds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
