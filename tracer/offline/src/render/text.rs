//! The pieces of readable text every human-facing output shares (the
//! table, the tree, the HTML page, pprof's comments, the status line and
//! `mtrace top`): sizes in binary units, counts and durations, counted
//! nouns, frames, the stack-quality line, lists broken into lines of at
//! most [`WIDTH`] columns, and colour (ANSI styles from `anstyle`, only
//! when the caller says the output is a terminal that wants them).
//! Renderers take these from here, never from one another.
//!
//! The size format is written here rather than taken from a crate:
//! `bytesize` and `humansize` print `46.9 KiB` too, but neither prints
//! raw bytes below 1 KiB as `512 B` with a space and one decimal above
//! without options, and this is six lines.

use std::{borrow::Cow, fmt::Write as _};

use anstyle::{AnsiColor, Style};

use crate::profile::{Frame, Profile, StackQuality};

/// Characters a terminal acts on rather than shows: C0 and C1 controls
/// and DEL (escape sequences, carriage return, bell) and the bidirectional
/// overrides and isolates, which reorder what follows them.
fn unprintable(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with every character a terminal would act on written as its
/// escape (`\u{1b}`), so that names from the traced process (its name,
/// arguments, thread names, symbols) cannot move the cursor, set the
/// title or hide text.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(unprintable) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unprintable(c) {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Calls `$f` on every name in `$profile` that the traced process chose
/// (command, executable and object paths, process and thread names,
/// function, file and module names), by reference (`ref`) or by mutable
/// reference (`mut`): one list of the fields for reading and rewriting.
macro_rules! each_name {
    (ref $profile:expr, $f:expr) => {
        each_name!(@ $profile, $f, &)
    };
    (mut $profile:expr, $f:expr) => {
        each_name!(@ $profile, $f, &mut)
    };
    (@ $profile:expr, $f:expr, $($r:tt)+) => {{
        let profile = $profile;
        #[allow(unused_mut)]
        let mut f = $f;
        let m = $($r)+ profile.meta;
        f($($r)+ m.command);
        f($($r)+ m.executable);
        f($($r)+ m.allocator_object);
        f($($r)+ m.allocator_beside);
        f($($r)+ m.python);
        for p in $($r)+ m.processes {
            f($($r)+ p.name);
            f($($r)+ p.command);
            f($($r)+ p.executable);
            f($($r)+ p.allocator_object);
        }
        for probe in $($r)+ m.probes {
            f($($r)+ probe.function);
        }
        for st in $($r)+ profile.stacks {
            f($($r)+ st.func);
            if let Some(t) = $($r)+ st.thread {
                f($($r)+ t.name);
            }
            if let Some(r) = $($r)+ st.process {
                f($($r)+ r.name);
            }
            for frame in $($r)+ st.frames {
                f($($r)+ frame.function);
                if let Some(file) = $($r)+ frame.file {
                    f(file);
                }
                if let Some(module) = $($r)+ frame.module {
                    f(module);
                }
            }
        }
    }};
}

/// `profile` with every name that came from the traced process made
/// [`printable`]; borrowed when there was nothing to change. Text
/// renderers take this before they write a line.
pub fn printable_profile(profile: &Profile) -> Cow<'_, Profile> {
    let mut dirty = profile
        .totals
        .per_func
        .keys()
        .any(|k| k.chars().any(unprintable));
    each_name!(ref profile, |name: &String| dirty |=
        name.chars().any(unprintable));
    if !dirty {
        return Cow::Borrowed(profile);
    }
    let mut clean = profile.clone();
    each_name!(mut &mut clean, |name: &mut String| {
        if let Cow::Owned(fixed) = printable(name) {
            *name = fixed;
        }
    });
    clean.totals.per_func = std::mem::take(&mut clean.totals.per_func)
        .into_iter()
        .map(|(k, v)| (printable(&k).into_owned(), v))
        .collect();
    Cow::Owned(clean)
}

/// The width every line of the report keeps to (but for frames and paths,
/// which are never cut).
pub const WIDTH: usize = 80;

/// `512 B`, `1.0 KiB`, `46.9 KiB`, `3.2 MiB`, `1.5 GiB`, ... `8.0 EiB`:
/// raw bytes under 1 KiB, else one decimal of the largest binary unit the
/// size reaches.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `1,234,567`: every digit, in groups of three.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `950`, `98.1k`, `12.3M`, `4.0G`: a count or rate in at most about five
/// characters (one decimal from a thousand up).
pub fn short_count(v: f64) -> String {
    if v < 1e3 {
        format!("{v:.0}")
    } else if v < 1e6 {
        format!("{:.1}k", v / 1e3)
    } else if v < 1e9 {
        format!("{:.1}M", v / 1e6)
    } else {
        format!("{:.1}G", v / 1e9)
    }
}

/// `1 call`, `2 calls`, `0 calls`: `n` and `noun`, plural (with an `s`)
/// unless `n` is 1.
pub fn count(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// `label: a, b, c` broken into as many lines as it takes to keep each
/// within [`WIDTH`], every line starting with `label: ` (a reader, or a
/// parser, joins them); an item longer than a line gets a line of its own.
/// No items give one line, `label: ` followed by `empty`. Every line ends
/// with a newline.
pub fn wrap_list(label: &str, items: &[String], empty: &str) -> String {
    let prefix = format!("{label}: ");
    if items.is_empty() {
        return format!("{prefix}{empty}\n");
    }
    let mut out = String::new();
    let mut line = prefix.clone();
    for (i, item) in items.iter().enumerate() {
        let last = i + 1 == items.len();
        let piece = if last {
            item.clone()
        } else {
            format!("{item},")
        };
        let fresh = line.len() == prefix.len();
        if !fresh && line.len() + 1 + piece.len() > WIDTH {
            out.push_str(line.trim_end());
            out.push('\n');
            line = prefix.clone();
        } else if !fresh {
            line.push(' ');
        }
        line.push_str(&piece);
    }
    out.push_str(&line);
    out.push('\n');
    out
}

/// `1.3us`, `250ms`, `2.50s`.
pub fn duration_ns(ns: u64) -> String {
    let ns_f = ns as f64;
    if ns < 1_000 {
        format!("{ns}ns")
    } else if ns < 1_000_000 {
        format!("{:.1}us", ns_f / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.1}ms", ns_f / 1e6)
    } else {
        format!("{:.2}s", ns_f / 1e9)
    }
}

/// `function (file:line)`, the place faint, ` [inlined]` after an inlined
/// function.
pub fn frame_text(frame: &Frame, paint: Paint) -> String {
    let described = frame.describe();
    // `describe` starts with the function's name, then says where.
    let (name, place) = described.split_at(frame.function.len().min(described.len()));
    // A table line is indented by 4: the name's templates are folded
    // until the line fits 80 columns (the JSON and folded stacks keep
    // the name whole).
    let inlined = if frame.inlined { " [inlined]".len() } else { 0 };
    let room = FRAME_COLUMNS.saturating_sub(place.chars().count() + inlined);
    let name = fold_templates(name, room);
    let mut text = format!("{name}{}", paint.faint(place));
    if frame.inlined {
        text.push_str(&paint.faint(" [inlined]"));
    }
    text
}

/// Columns a frame's text may take in the table (80, less its indent).
const FRAME_COLUMNS: usize = 76;

/// `name` with its parameter lists folded to `(…)`, then the arguments
/// of its innermost templates to `<…>`, innermost first, until it is at
/// most `width` characters or nothing is left to fold: `std::vector<std::pair<int, long>>::_M_realloc_insert`
/// becomes `std::vector<std::pair<…>>::_M_realloc_insert`, then
/// `std::vector<…>::_M_realloc_insert`. Only brackets that pair up are
/// folded (`operator<` and `operator->` are left as they are).
pub fn fold_templates(name: &str, width: usize) -> std::borrow::Cow<'_, str> {
    if name.chars().count() <= width {
        return std::borrow::Cow::Borrowed(name);
    }
    // Parameter lists first (the function is named without them), then
    // templates.
    let mut s: Vec<char> = name.chars().collect();
    for (open_ch, close_ch) in [('(', ')'), ('<', '>')] {
        if s.len() > width {
            fold_pairs(&mut s, width, open_ch, close_ch);
        }
    }
    std::borrow::Cow::Owned(s.into_iter().collect())
}

/// Folds the innermost pairs of `open_ch`/`close_ch` in `s` to `…`, level
/// by level, until `s` is at most `width` long or nothing is left.
fn fold_pairs(s: &mut Vec<char>, width: usize, open_ch: char, close_ch: char) {
    let folded = |s: &[char], (o, c): (usize, usize)| c == o + 2 && s[o + 1] == '…';
    loop {
        // Every pair of brackets ('<' matched by the next unmatched '>').
        let mut stack = Vec::new();
        let mut pairs = Vec::new();
        for (i, &ch) in s.iter().enumerate() {
            if ch == open_ch {
                stack.push(i);
            } else if ch == close_ch {
                if let Some(o) = stack.pop() {
                    pairs.push((o, i));
                }
            }
        }
        // The innermost not yet folded: none unfolded inside them.
        let open: Vec<(usize, usize)> = pairs
            .iter()
            .copied()
            .filter(|&p| !folded(s, p) && p.1 > p.0 + 1)
            .collect();
        let innermost: Vec<(usize, usize)> = open
            .iter()
            .copied()
            .filter(|&(o, c)| !open.iter().any(|&(o2, c2)| o2 > o && c2 < c))
            .collect();
        if innermost.is_empty() {
            break;
        }
        // The last first: the indices of the earlier ones stay put.
        for &(o, c) in innermost.iter().rev() {
            s.splice(o + 1..c, ['…']);
        }
        if s.len() <= width {
            break;
        }
    }
}

/// `stacks: 99.95% whole (to the thread's first frame); cut short: no_cfi 12`
/// on one line (for pprof's comment).
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
    if let Some(p) = &q.python {
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
    out
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

/// Colours, or none: every method returns its text unchanged when off.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Paint {
    pub on: bool,
}

impl Paint {
    pub fn new(on: bool) -> Self {
        Paint { on }
    }

    fn style(self, style: Style, text: &str) -> String {
        if self.on && !text.is_empty() {
            format!("{style}{text}{style:#}")
        } else {
            text.to_string()
        }
    }

    /// Headings and each row's first line.
    pub fn strong(self, text: &str) -> String {
        self.style(Style::new().bold(), text)
    }

    /// Where a frame is (file and line), the allocator function's
    /// neighbours: what the eye may skip.
    pub fn faint(self, text: &str) -> String {
        self.style(Style::new().dimmed(), text)
    }

    /// The allocator function of a row.
    pub fn func(self, text: &str) -> String {
        self.style(Style::new().fg_color(Some(AnsiColor::Cyan.into())), text)
    }

    /// Something lost or a caveat.
    pub fn warn(self, text: &str) -> String {
        self.style(
            Style::new().fg_color(Some(AnsiColor::Yellow.into())).bold(),
            text,
        )
    }

    /// Leaks.
    pub fn alert(self, text: &str) -> String {
        self.style(
            Style::new().fg_color(Some(AnsiColor::Red.into())).bold(),
            text,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_template_names_fold_innermost_first() {
        let name = "std::vector<std::pair<int, long>, std::allocator<std::pair<int, long> > >::_M_realloc_insert<std::pair<int, long> const&>";
        assert_eq!(fold_templates(name, 200), name);
        assert_eq!(
            fold_templates(name, 98),
            "std::vector<std::pair<…>, std::allocator<std::pair<…> > >::_M_realloc_insert<std::pair<…> const&>"
        );
        assert_eq!(
            fold_templates(name, 70),
            "std::vector<std::pair<…>, std::allocator<…> >::_M_realloc_insert<…>"
        );
        assert_eq!(
            fold_templates(name, 10),
            "std::vector<…>::_M_realloc_insert<…>"
        );
        // Operators are not brackets.
        assert_eq!(
            fold_templates("bool operator< <Foo<int> >(Foo<int> const&)", 34),
            "bool operator< <Foo<int> >(…)"
        );
        assert_eq!(
            fold_templates("Node::operator->() const", 5),
            "Node::operator->() const"
        );
    }

    #[test]
    fn names_from_the_target_cannot_drive_the_terminal() {
        assert_eq!(printable("malloc"), Cow::Borrowed("malloc"));
        assert_eq!(
            printable("a\x1b]0;owned\x07b\rc\u{202e}d"),
            "a\\u{1b}]0;owned\\u{7}b\\u{d}c\\u{202e}d"
        );
        let mut p = Profile::default();
        p.meta.command = "./x \x1b[2J".into();
        p.stacks.push(crate::profile::StackEntry {
            func: "malloc".into(),
            frames: vec![Frame {
                function: "f\x1b[31m".into(),
                ..Frame::default()
            }],
            thread: Some(crate::profile::Thread {
                tid: 1,
                name: "t\x07".into(),
            }),
            ..Default::default()
        });
        let clean = printable_profile(&p);
        assert!(matches!(clean, Cow::Owned(_)));
        assert_eq!(clean.meta.command, "./x \\u{1b}[2J");
        assert_eq!(clean.stacks[0].frames[0].function, "f\\u{1b}[31m");
        assert_eq!(clean.stacks[0].thread.as_ref().unwrap().name, "t\\u{7}");
        p.meta.command = "./x".into();
        p.stacks.clear();
        assert!(matches!(printable_profile(&p), Cow::Borrowed(_)));
    }

    #[test]
    fn sizes_in_binary_units() {
        let cases = [
            (0, "0 B"),
            (1, "1 B"),
            (1023, "1023 B"),
            (1024, "1.0 KiB"),
            (1536, "1.5 KiB"),
            (48_000, "46.9 KiB"),
            (16_384, "16.0 KiB"),
            (1 << 20, "1.0 MiB"),
            (3 * (1 << 20) + (1 << 19), "3.5 MiB"),
            ((1 << 30) * 3 / 2, "1.5 GiB"),
            (1 << 63, "8.0 EiB"),
            (u64::MAX, "16.0 EiB"),
        ];
        for (n, want) in cases {
            assert_eq!(bytes(n), want, "{n}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(duration_ns(999), "999ns");
        assert_eq!(duration_ns(1_300), "1.3us");
        assert_eq!(duration_ns(250_000_000), "250.0ms");
        assert_eq!(duration_ns(2_500_000_000), "2.50s");
    }

    #[test]
    fn digits_grouped_and_counts_shortened() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(100), "100");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(short_count(950.0), "950");
        assert_eq!(short_count(98_100.0), "98.1k");
        assert_eq!(short_count(12_300_000.0), "12.3M");
        assert_eq!(short_count(4e9), "4.0G");
    }

    #[test]
    fn singular_and_plural() {
        assert_eq!(count(0, "call"), "0 calls");
        assert_eq!(count(1, "call"), "1 call");
        assert_eq!(count(2, "block"), "2 blocks");
    }

    #[test]
    fn lists_wrap_at_80_columns_with_the_label_repeated() {
        let items: Vec<String> = (0..12).map(|i| format!("item number {i}")).collect();
        let text = wrap_list("lost", &items, "none");
        for line in text.lines() {
            assert!(line.len() <= WIDTH, "{line:?}");
            assert!(line.starts_with("lost: "), "{line:?}");
        }
        let joined = text
            .lines()
            .map(|l| &l["lost: ".len()..])
            .collect::<Vec<_>>()
            .join(" ");
        assert_eq!(joined.split(", ").collect::<Vec<_>>(), items);
        assert_eq!(wrap_list("x", &[], "none"), "x: none\n");
        assert_eq!(wrap_list("x", &["a".into(), "b".into()], ""), "x: a, b\n");
    }

    #[test]
    fn paint_is_plain_when_off() {
        assert_eq!(Paint::new(false).strong("a"), "a");
        assert_eq!(Paint::new(true).strong("a"), "\u{1b}[1ma\u{1b}[0m");
        assert_eq!(Paint::new(true).warn(""), "");
    }
}
