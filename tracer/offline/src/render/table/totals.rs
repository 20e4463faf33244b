//! The lines under the rows: the totals and the calls per allocation
//! function, the Go heaps' totals, the probes the kernel single-stepped,
//! and the losses with a note on each one that is not zero.

use crate::profile::{Losses, Profile};
use crate::render::text::{bytes, count, wrap_list, Paint};
use crate::render::FREE_FUNC;

/// `go heap: N objects, B allocated, M objects, B in use (estimates)` and
/// what could not be read, over every Go program read.
pub(super) fn go_totals_lines(profile: &Profile) -> String {
    if profile.go_heaps.is_empty() {
        return String::new();
    }
    let mut allocated = crate::profile::Counts::default();
    let mut in_use = crate::profile::Counts::default();
    let (mut buckets, mut unreadable, mut inconsistent, mut cut) = (0, 0, 0, 0);
    for g in &profile.go_heaps {
        allocated.add(g.allocated);
        in_use.add(g.in_use);
        buckets += g.buckets;
        unreadable += g.unreadable;
        inconsistent += g.inconsistent;
        cut += u64::from(g.cut);
    }
    format!(
        "go heap: {} allocated, {}; {} in use, {} (estimates)\ngo heap: {} buckets read; lost: unreadable {unreadable}, caught mid-update {inconsistent}, walks cut {cut}\n",
        count(allocated.calls, "object"),
        bytes(allocated.bytes),
        count(in_use.calls, "object"),
        bytes(in_use.bytes),
        buckets
    )
}

/// The probed functions the kernel cannot emulate the first instruction
/// of (it single-steps them, about 20 µs a call instead of 1), with the
/// calls that paid it; nothing when no call did.
pub(super) fn single_stepped_lines(profile: &Profile) -> String {
    let mut paid: Vec<String> = Vec::new();
    for p in profile.meta.probes.iter().filter(|p| !p.emulated) {
        let calls = profile
            .totals
            .per_func
            .get(&p.function)
            .map_or(0, |c| c.calls);
        let entry = format!("{} {calls}", p.function);
        if calls > 0 && !paid.contains(&entry) {
            paid.push(entry);
        }
    }
    if paid.is_empty() {
        return String::new();
    }
    wrap_list("single-stepped probes (20 us a call, not 1)", &paid, "")
}

/// `total: N allocation calls, B requested, F frees`, then `by function:`
/// the allocation functions with calls, most first.
pub(super) fn totals_lines(profile: &Profile, paint: Paint) -> String {
    let totals = &profile.totals;
    let mut out = format!(
        "{} {} requested, {}\n",
        paint.strong(&format!(
            "total: {},",
            count(totals.allocs.calls, "allocation call")
        )),
        bytes(totals.allocs.bytes),
        if totals.frees_counted {
            count(totals.frees, "free")
        } else {
            "frees not counted".to_string()
        }
    );
    let mut funcs: Vec<(&str, u64)> = totals
        .per_func
        .iter()
        .filter(|(name, counts)| name.as_str() != FREE_FUNC && counts.calls > 0)
        .map(|(name, counts)| (name.as_str(), counts.calls))
        .collect();
    // Most calls first; per_func is sorted by name, which breaks ties.
    funcs.sort_by_key(|&(_, calls)| std::cmp::Reverse(calls));
    if !funcs.is_empty() {
        let list: Vec<String> = funcs
            .iter()
            .map(|(name, calls)| format!("{name} {calls}"))
            .collect();
        out.push_str(&wrap_list("by function", &list, ""));
    }
    out
}

/// Printed in every report, even when nothing was lost; yellow when
/// something was.
pub(super) fn losses_lines(l: &Losses, paint: Paint) -> String {
    let items = [
        ("map full", l.map_full),
        ("stack walk failed", l.stack_walk_failed),
        ("stack collisions", l.stack_collisions),
        ("stack map full", l.stack_map_full),
        ("caller unreadable", l.caller_unreadable),
        ("thread names", l.thread_names_full),
    ]
    .map(|(what, n)| format!("{what} {n}"));
    // Only `mtrace agent --all` can lose stacks of gone processes: said
    // when it did.
    let beyond =
        (l.gone_stacks_beyond > 0).then(|| format!("gone stacks beyond {}", l.gone_stacks_beyond));
    let mut items: Vec<String> = items.into_iter().chain(beyond).collect();
    let mut any = [
        l.map_full,
        l.stack_walk_failed,
        l.stack_collisions,
        l.stack_map_full,
        l.caller_unreadable,
        l.thread_names_full,
        l.gone_stacks_beyond,
    ]
    .iter()
    .any(|&n| n > 0);
    if let Some(h) = &l.host {
        // Calls of processes unnumbered are a cost, not a loss: they do
        // not make the line a warning.
        any |= h
            .named()
            .iter()
            .any(|&(what, n)| n > 0 && what != "processes_unnumbered");
        // One list with the others, so that its lines join into one.
        items.extend(
            h.named()
                .iter()
                .map(|(what, n)| format!("{} {n}", what.replace('_', " "))),
        );
    }
    let text = wrap_list("lost", &items, "");
    if !any {
        return text;
    }
    text.lines()
        .map(|line| {
            let rest = line.strip_prefix("lost:").unwrap_or(line);
            format!("{}{rest}\n", paint.warn("lost:"))
        })
        .collect()
}

/// What the nonzero losses mean and which option helps, one note each
/// (each within 80 columns after `note: `).
pub(super) fn losses_notes(l: &Losses) -> Vec<&'static str> {
    let mut notes = Vec::new();
    if l.map_full > 0 {
        notes.push("map full: calls in the totals, in no stack (raise --count-map-size)");
    }
    if l.stack_walk_failed > 0 {
        notes.push("stack walk failed: counted under the direct caller only");
    }
    if l.stack_collisions > 0 || l.stack_map_full > 0 {
        notes.push("stack map full or collisions: direct caller only (raise --stack-map-size)");
    }
    if l.caller_unreadable > 0 {
        notes.push("caller unreadable: the return address could not be read");
    }
    if l.thread_names_full > 0 {
        notes.push("thread names: name map full, names read from /proc instead");
    }
    if let Some(h) = &l.host {
        let host_notes = [
            (
                h.exec_events_lost,
                "exec events lost: the exec ring was full (see docs/agent.md)",
            ),
            (
                h.process_names_full + h.process_runs_full,
                "process names/runs full: raise --process-table-size",
            ),
            (
                h.tree_full,
                "tree full: children not counted (raise --process-table-size)",
            ),
            (
                h.frames_untagged,
                "frames untagged: files beyond the tag table, kept as addresses",
            ),
        ];
        notes.extend(
            host_notes
                .iter()
                .filter(|(n, _)| *n > 0)
                .map(|(_, note)| *note),
        );
    }
    if l.gone_stacks_beyond > 0 {
        notes.push("gone stacks beyond: gone processes' stacks past those kept, per command");
    }
    notes
}
