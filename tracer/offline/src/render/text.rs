//! The pieces of readable text the table and the tree share: sizes in
//! binary units, counted nouns, lists broken into lines of at most
//! [`WIDTH`] columns, and colour (ANSI styles from `anstyle`, only when
//! the caller says the output is a terminal that wants them).
//!
//! The size format is written here rather than taken from a crate:
//! `bytesize` and `humansize` print `46.9 KiB` too, but neither prints
//! raw bytes below 1 KiB as `512 B` with a space and one decimal above
//! without options, and this is six lines.

use anstyle::{AnsiColor, Style};

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
