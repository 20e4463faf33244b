//! The lines that say how good the stacks are (whole, cut short and why,
//! Python frames, perf maps, debug symbols) and how a windows policy's
//! counts came about.

use std::fmt::Write as _;

use crate::profile::{PythonQuality, StackQuality};

use super::{bytes, wrap_list};

/// How a windows policy's counts came about: `windows: probes in 6.3 s
/// of 60.0 s (10.5%, 3 windows; 6.0 s counted), counts scaled x10.00`.
/// "Probes in" is what the processes paid for (switches included), the
/// counted time what the counts are scaled by.
pub fn windows_line(w: &crate::profile::WindowsInfo, duration_secs: f64) -> String {
    let probes_in = if w.trapped_secs > 0.0 {
        w.trapped_secs.min(duration_secs.max(w.probed_secs))
    } else {
        w.probed_secs
    };
    let pct = if duration_secs > 0.0 {
        probes_in * 100.0 / duration_secs
    } else {
        100.0
    };
    let counted = if w.trapped_secs > 0.0 {
        format!("; {:.1} s counted", w.probed_secs)
    } else {
        String::new()
    };
    let scaled = if w.scale == 0.0 {
        "counts are the windows' own".to_string()
    } else if w.scale == 1.0 {
        "counts exact (probes in throughout)".to_string()
    } else {
        format!("counts scaled x{:.2} (estimates)", w.scale)
    };
    format!(
        "windows: probes in {probes_in:.1} s of {:.1} s ({pct:.1}%, {} {}{counted}), {scaled}",
        duration_secs,
        w.windows,
        if w.windows == 1 { "window" } else { "windows" }
    )
}

/// `stacks: 99.95% whole (to the thread's first frame); cut short: no_cfi 12`
/// on one line (for pprof's comment).
pub fn quality_line(q: &StackQuality) -> String {
    let mut line = format!("stacks: {}", whole_text(q));
    if let Some(limit) = limit_text(q) {
        let _ = write!(line, "; {limit}");
    }
    let cut = cut_short(q);
    if !cut.is_empty() {
        let _ = write!(line, "; cut short: {}", cut.join(", "));
    }
    line
}

/// The table's: `stacks: 99.95% whole ...`, then `stacks: cut short: ...`.
pub fn quality_lines(q: &StackQuality) -> String {
    let mut out = format!("stacks: {}\n", whole_text(q));
    if let Some(limit) = limit_text(q) {
        let _ = writeln!(out, "stacks: {limit}");
    }
    let cut = cut_short(q);
    if !cut.is_empty() {
        out.push_str(&wrap_list("stacks: cut short", &cut, ""));
    }
    // Holding loses nothing; whether nothing was lost is the ring's to say.
    let none_lost = if q.truncated.get("copy_lost").is_some_and(|&n| n > 0) {
        ""
    } else {
        " (none lost)"
    };
    if q.held_for_tracer > 0 {
        let (who, often, whose) = threads_times(q.held_for_tracer);
        let _ = writeln!(
            out,
            "stacks: {who} held {often} for mtrace to finish {whose} walks{none_lost}"
        );
    }
    if q.not_held > 0 {
        // Plural, the line leaves out "their" to fit 80 columns.
        let (who, often, _) = threads_times(q.not_held);
        let whose = if q.not_held == 1 { "its " } else { "" };
        let _ = writeln!(
            out,
            "stacks: {who} blocking SIGURG not held {often} ({whose}copies may be lost)"
        );
    }
    let python = q.python.as_ref();
    if let Some(n) = python.map(|p| p.not_known).filter(|&n| n > 0) {
        let _ = writeln!(
            out,
            "python: not read (no interpreter known) in {n} calls running Python code"
        );
    }
    if let Some(p) = python.filter(|p| **p != not_known_only(p)) {
        let walked = p.with_frames
            + p.no_interpreter
            + p.no_thread_state
            + p.no_code_running
            + p.threads_beyond;
        let _ = writeln!(
            out,
            "python: {} of {walked} stacks walked carry Python frames",
            p.with_frames
        );
        let mut without = vec![
            format!("no interpreter yet {}", p.no_interpreter),
            format!("not a Python thread {}", p.no_thread_state),
            format!("no Python code running {}", p.no_code_running),
        ];
        if p.threads_beyond > 0 {
            without.push(format!(
                "thread past the 4096 thread states searched {}",
                p.threads_beyond
            ));
        }
        out.push_str(&wrap_list("python: without", &without, ""));
        let lost = [
            format!("frames cut {}", p.cut),
            format!("unreadable {}", p.unreadable),
            format!("code unnamed {}", p.unnamed),
            format!("notices lost {}", p.notices_lost),
        ];
        out.push_str(&wrap_list("python", &lost, ""));
    }
    if let Some(m) = &q.perf_map {
        let _ = writeln!(
            out,
            "perf map: {} pieces of JIT code named, of {} lines read",
            m.kept, m.lines
        );
        let lost = [
            format!("evicted (oldest, over the ceiling) {}", m.evicted),
            format!("names cut {}", m.names_cut),
            format!("lines not understood {}", m.bad_lines),
            format!("unread {}", bytes(m.unread_bytes)),
            format!("read again {}", m.rereads),
        ];
        out.push_str(&wrap_list("perf map", &lost, ""));
    }
    if let Some(d) = &q.symbols {
        let counts = [
            format!("stripped files {}", d.stripped_files),
            format!("debug info found here {}", d.local),
            format!("fetched {}", d.fetched),
            format!("missing {}", d.not_on_servers + d.not_fetched),
            format!("of those for a failed server {}", d.not_fetched),
        ];
        out.push_str(&wrap_list("symbols", &counts, ""));
    }
    out
}

/// `p` with nothing but its calls whose interpreter was not known.
fn not_known_only(p: &PythonQuality) -> PythonQuality {
    PythonQuality {
        not_known: p.not_known,
        ..PythonQuality::default()
    }
}

/// `99.95% whole (to the thread's first frame)`: never `100.00%` unless
/// every stack is whole.
fn whole_text(q: &StackQuality) -> String {
    let pct = q.whole_pct();
    let shown = if q.whole < q.calls {
        (pct * 100.0).floor() / 100.0
    } else {
        pct
    };
    format!("{shown:.2}% whole (to the thread's first frame)")
}

/// `--max-stack N`: `at most N frames above the caller (--max-stack N)`.
fn limit_text(q: &StackQuality) -> Option<String> {
    Some(match q.frame_limit? {
        0 => "the direct caller only (--max-stack 0)".to_string(),
        n => format!("at most {n} frames above the caller (--max-stack {n})"),
    })
}

/// `no_cfi 12`, ... for every cause with calls.
fn cut_short(q: &StackQuality) -> Vec<String> {
    q.truncated
        .iter()
        .filter(|(_, &n)| n > 0)
        .map(|(why, n)| format!("{why} {n}"))
        .collect()
}

/// `n` times of threads: "a thread" and "once" for 1, else "threads" and
/// "N times"; and the possessive that goes with them.
fn threads_times(n: u64) -> (&'static str, String, &'static str) {
    if n == 1 {
        ("a thread", "once".to_string(), "its")
    } else {
        ("threads", format!("{n} times"), "their")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hold lines, one thread and several, with and without copies
    /// lost.
    #[test]
    fn hold_lines_say_once_or_times() {
        let mut q = StackQuality {
            calls: 1,
            whole: 1,
            held_for_tracer: 1,
            not_held: 1,
            ..StackQuality::default()
        };
        let lines = quality_lines(&q);
        assert!(lines
            .contains("stacks: a thread held once for mtrace to finish its walks (none lost)\n"));
        assert!(lines
            .contains("stacks: a thread blocking SIGURG not held once (its copies may be lost)\n"));
        q.held_for_tracer = 3;
        q.not_held = 4;
        q.truncated.insert("copy_lost".into(), 2);
        let lines = quality_lines(&q);
        assert!(lines.contains("stacks: threads held 3 times for mtrace to finish their walks\n"));
        assert!(lines
            .contains("stacks: threads blocking SIGURG not held 4 times (copies may be lost)\n"));
    }
}
