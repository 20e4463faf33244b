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
//!
//! This file holds the sizes, counts, durations, lists and colours. Names
//! made printable and cut are in `names.rs`, frames and their folded
//! templates in `frames.rs`, and the stack-quality and windows lines in
//! `quality.rs`; all of them are used from here.

use anstyle::{AnsiColor, Style};

mod frames;
mod names;
mod quality;
#[cfg(test)]
mod tests;

pub use frames::{fold_templates, frame_text, FrameTexts};
pub use names::{cut, map_names, printable, printable_profile, shown, shown_profile, NAME_CHARS};
pub use quality::{quality_line, quality_lines, windows_line};

/// The width every line of the report keeps to (but for frames and paths,
/// which are only cut past [`NAME_CHARS`]).
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
    if items.is_empty() {
        return format!("{label}: {empty}\n");
    }
    let last = items.len() - 1;
    wrap(
        label,
        items.iter().enumerate().map(|(i, item)| match i == last {
            true => item.clone(),
            false => format!("{item},"),
        }),
    )
}

/// `label: w1 w2 ...` broken into lines within [`WIDTH`] as
/// [`wrap_list`] breaks a list, the words joined by spaces alone.
pub fn wrap_words(label: &str, words: &[String]) -> String {
    wrap(label, words.iter().cloned())
}

/// `pieces` joined by spaces on lines within [`WIDTH`], each line starting
/// with `label: ` (a piece longer than a line gets a line of its own).
fn wrap(label: &str, pieces: impl Iterator<Item = String>) -> String {
    let prefix = format!("{label}: ");
    let mut out = String::new();
    let mut line = prefix.clone();
    for piece in pieces {
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
