//! The report's header: the run (`mtrace: pid 1234, 1.23 s`), its
//! command and probes, the processes of a tree or a scope and those not
//! traced, the processes that allocated most, how the run was sampled and
//! the Go heaps read.

use std::fmt::Write;

use crate::profile::Profile;
use crate::render::text::{bytes, count, thousands, windows_line, Paint};
use crate::render::FREE_FUNC;

/// Untraced processes the header names one by one; the rest are counted.
const UNTRACED_SHOWN: usize = 10;

/// Processes shown by [`by_process`].
const BY_PROCESS_SHOWN: usize = 5;

/// Per process (rows split with `--per-process`): the processes that
/// allocated most, by calls, with their executable and cgroup.
fn by_process(profile: &Profile) -> String {
    // By pid and name: a process that exec'd is two programs.
    let mut per: std::collections::HashMap<(u32, &str), (u64, u64)> = Default::default();
    for e in profile.stacks.iter().filter(|e| e.func != FREE_FUNC) {
        if let Some(p) = &e.process {
            let sum = per.entry((p.pid, p.name.as_str())).or_default();
            sum.0 += e.counts.calls;
            sum.1 += e.counts.bytes;
        }
    }
    let mut rows: Vec<(u32, &str, u64, u64)> = per
        .into_iter()
        .map(|((pid, name), (c, b))| (pid, name, c, b))
        .collect();
    rows.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)).then(a.1.cmp(b.1)));
    let mut out = String::new();
    for &(pid, name, calls, b) in rows.iter().take(BY_PROCESS_SHOWN) {
        let meta = {
            let of_pid = || profile.meta.processes.iter().rev().filter(|p| p.pid == pid);
            of_pid()
                .find(|p| p.name == name)
                .or_else(|| of_pid().next())
        };
        let _ = write!(
            out,
            "by process: {} (pid {pid}): {} calls, {}",
            if name.is_empty() {
                meta.map_or("?", |m| m.name.as_str())
            } else {
                name
            },
            thousands(calls),
            bytes(b)
        );
        if let Some(m) = meta {
            if !m.executable.is_empty() {
                let _ = write!(out, ", {}", m.executable);
            }
            if !m.cgroup.is_empty() {
                let _ = write!(out, ", cgroup {}", m.cgroup);
            }
        }
        out.push('\n');
    }
    if rows.len() > BY_PROCESS_SHOWN {
        let _ = writeln!(
            out,
            "by process: {} more processes allocated",
            rows.len() - BY_PROCESS_SHOWN
        );
    }
    out
}

/// `mtrace: pid 1234, 1.23 s` (`the host`, `a cgroup` for those scopes),
/// then `command:`, `probes:`, the processes
/// of a tree and how it was sampled, each on lines of its own.
pub(super) fn header(profile: &Profile, paint: Paint) -> String {
    let meta = &profile.meta;
    // A scope of many processes has no pid of its own.
    let what = match (meta.pid, meta.scope.as_str()) {
        (0, "host") => "the host".to_string(),
        (0, "cgroup") => "a cgroup".to_string(),
        (pid, _) => format!("pid {pid}"),
    };
    let mut out = format!(
        "{} {:.2} s\n",
        paint.strong(&format!("mtrace: {what},")),
        meta.duration_secs
    );
    if !meta.command.is_empty() {
        let _ = writeln!(out, "command: {}", meta.command);
    }
    // The host engine's scope, on lines within the width.
    let scope = match meta.scope.as_str() {
        "" => None,
        "host" => Some("the whole host (--all):".to_string()),
        s => Some(format!(
            "the {} (--file-wide):",
            if s == "tree" {
                "command's process tree"
            } else {
                "cgroup"
            }
        )),
    };
    if let Some(scope) = scope {
        let kernel = match meta.scope.as_str() {
            "host" => "",
            _ => " the scope's processes told from others in the kernel;",
        };
        let text = format!(
            "{scope} file-wide probes in every process that maps an allocator;{kernel} each call under its process and stack"
        );
        let words: Vec<String> = text.split(' ').map(str::to_string).collect();
        out.push_str(&crate::render::text::wrap_words("scope", &words));
    }
    if !meta.allocator_object.is_empty() {
        let _ = write!(out, "probes: {}", meta.allocator_object);
        match (
            meta.allocator_family.as_str(),
            meta.allocator_version.as_str(),
        ) {
            ("", _) => {}
            // The host engine's probes name each file's family; its
            // profile's family is what the scope called.
            (family, _) if !meta.scope.is_empty() => {
                let _ = write!(out, "\nallocators called: {family}");
            }
            (family, "") => {
                let _ = write!(out, " ({family})");
            }
            (family, version) => {
                let _ = write!(out, " ({family} {version})");
            }
        }
        out.push('\n');
        if !meta.allocator_beside.is_empty() {
            let _ = writeln!(out, "probes: also {}", meta.allocator_beside);
        }
        if !meta.python.is_empty() {
            let _ = writeln!(out, "python: {}", meta.python);
        }
    }
    if !meta.processes.is_empty() {
        let traced = meta.processes.iter().filter(|p| p.traced).count();
        let exited = meta
            .processes
            .iter()
            .filter(|p| p.traced && p.exit_code.is_some())
            .count();
        let untraced: Vec<_> = meta.processes.iter().filter(|p| !p.traced).collect();
        // Processes beyond the profile's records were untraced too.
        let not_traced = untraced.len() as u64 + meta.processes_unlisted;
        if !meta.scope.is_empty() {
            // What exited is not followed there: every process is in, and
            // those beyond the records kept were counted all the same.
            let _ = write!(
                out,
                "processes: {} allocated (one per exec)",
                traced as u64 + meta.processes_unlisted
            );
            if meta.processes_unlisted > 0 {
                let _ = write!(
                    out,
                    ", the records of the newest {} kept",
                    meta.processes.len()
                );
            }
            out.push('\n');
        } else {
            let _ = write!(
                out,
                "processes: {traced} traced ({exited} exited during the trace)"
            );
            // Traced for a while, then out of the scope: a process that
            // left the traced cgroup.
            let left = meta
                .processes
                .iter()
                .filter(|p| p.traced && p.exit_code.is_none() && p.not_traced.is_some())
                .count();
            if left > 0 {
                let _ = write!(out, ", {left} let go when they left the cgroup");
            }
            if not_traced > 0 {
                let _ = write!(out, ", {not_traced} not traced");
            }
            out.push('\n');
            for p in untraced.iter().take(UNTRACED_SHOWN) {
                let _ = writeln!(
                    out,
                    "not traced: {} (pid {}): {}",
                    p.name,
                    p.pid,
                    p.not_traced.as_deref().unwrap_or("not traced")
                );
            }
            let rest = not_traced - untraced.len().min(UNTRACED_SHOWN) as u64;
            if rest > 0 {
                let _ = writeln!(
                    out,
                    "not traced: {rest} more ({} listed in the JSON profile)",
                    untraced.len().saturating_sub(UNTRACED_SHOWN)
                );
            }
        }
        out.push_str(&by_process(profile));
    }
    if let Some(s) = &meta.sampling {
        let how = match s.kind.as_str() {
            "bytes" => format!("one sample per {} on average", bytes(s.rate)),
            _ => format!("one call in {}", s.rate),
        };
        let _ = writeln!(out, "sampled: {how}, {}", count(s.samples, "sample"));
        out.push_str("sampled: calls and bytes are unbiased estimates, frees are not counted\n");
    }
    if let Some(w) = &meta.windows {
        out.push_str(&windows_line(w, meta.duration_secs));
        out.push('\n');
    }
    for g in &profile.go_heaps {
        let _ = writeln!(
            out,
            "go heap: pid {} ({}), {}: its runtime's own sampled profile, {}, scaled as Go's pprof scales it; allocated {}, in use as of its last garbage collection{}",
            g.pid,
            g.name,
            g.version,
            if g.rate == 1 {
                "every allocation".to_string()
            } else {
                format!("one sample per {} on average (MemProfileRate, read from it)", bytes(g.rate))
            },
            if g.since == "start" {
                "since it started"
            } else {
                "since mtrace came"
            },
            match g.read_at.as_str() {
                "exit" => " (read at its exit)",
                "last" => " (read last before it ended)",
                _ => "",
            }
        );
    }
    for u in &profile.unseen {
        let _ = writeln!(
            out,
            "not seen: {} (pid {}): {}: {}",
            u.name, u.pid, u.heap, u.why
        );
    }
    out
}
