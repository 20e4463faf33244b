//! The status line: while tracing, when standard error is a terminal, its
//! bottom line shows the elapsed time, the allocation rate, live bytes
//! (live mode) and any loss so far, refreshed every second.
//!
//! A launched command writes to the same terminal, so the line cannot
//! simply be redrawn with `\r`: the command's output would land on it.
//! As apt's progress bar does, the terminal's scrolling region is set to
//! every line but the last; everything else scrolls above it, and the
//! status line is drawn on the last line with the cursor saved and
//! restored around it. The region is reset when tracing ends (and on drop,
//! so an error cannot leave the terminal with it).

use std::io::{IsTerminal, Write};

use super::Tick;
use crate::collect::Running;
use crate::render::text::{bytes, short_count, thousands};

/// The status line, when standard error is a terminal.
pub struct StatusLine {
    rows: u16,
    /// The counts at the previous tick, for the rates.
    last: Running,
    last_t: f64,
    /// Shown so far (for the end to clear).
    active: bool,
}

impl StatusLine {
    /// A status line on standard error, if it is a terminal that can show
    /// one (not `TERM=dumb`, at least 3 lines).
    pub fn new() -> Option<StatusLine> {
        let stderr = std::io::stderr();
        if !stderr.is_terminal() || std::env::var("TERM").is_ok_and(|t| t == "dumb") {
            return None;
        }
        let rows = terminal_rows()?;
        if rows < 3 {
            return None;
        }
        let line = StatusLine {
            rows,
            last: Running::default(),
            last_t: 0.0,
            active: true,
        };
        // Room for the line, then everything but the last row scrolls.
        line.write(&format!(
            "\n\x1b7\x1b[1;{}r\x1b8\x1b[1A",
            rows.saturating_sub(1)
        ));
        Some(line)
    }

    /// Redraws the line for `tick`.
    pub fn show(&mut self, tick: &Tick) {
        // The terminal may have been resized: follow it.
        if let Some(rows) = terminal_rows().filter(|&r| r != self.rows && r >= 3) {
            self.write(&format!("\x1b7\x1b[1;{}r\x1b8", rows - 1));
            self.rows = rows;
        }
        let dt = (tick.elapsed - self.last_t).max(1e-3);
        let text = shown(tick, self.last, dt, terminal_cols().unwrap_or(80));
        self.last = tick.running;
        self.last_t = tick.elapsed;
        self.write(&format!("\x1b7\x1b[{};1H\x1b[2K{text}\x1b8", self.rows));
    }

    /// Takes the line away and gives the terminal its whole height back.
    pub fn end(&mut self) {
        if self.active {
            self.active = false;
            self.write(&format!(
                "\x1b7\x1b[1;{}r\x1b[{};1H\x1b[2K\x1b8",
                self.rows, self.rows
            ));
        }
    }

    fn write(&self, s: &str) {
        // A terminal that cannot be written to has nobody to show it to.
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(s.as_bytes());
        let _ = err.flush();
    }
}

impl Drop for StatusLine {
    fn drop(&mut self) {
        self.end();
    }
}

/// `mtrace 0:00:12  1,234,567 calls  98.1k/s  45.6 MiB  3.2 MiB/s  live 4.5 MiB  LOST 12`
pub fn format_status(tick: &Tick, last: Running, dt: f64) -> String {
    let r = tick.running;
    let mut s = format!(
        "mtrace {}",
        summary(
            tick,
            r.calls.saturating_sub(last.calls) as f64 / dt,
            r.bytes.saturating_sub(last.bytes) as f64 / dt
        )
    );
    if r.lost > 0 {
        s += &format!("  LOST {}", thousands(r.lost));
    }
    s
}

/// `0:00:12  1,234,567 calls  98.1k/s  45.6 MiB  3.2 MiB/s  live 4.5 MiB  2 processes`:
/// the trace so far (the status line, the live view's header).
pub fn summary(tick: &Tick, calls_rate: f64, bytes_rate: f64) -> String {
    let r = tick.running;
    let secs = tick.elapsed as u64;
    let mut s = format!(
        "{}:{:02}:{:02}  {} {}  {}/s  {}  {}/s",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        thousands(r.calls),
        if r.calls == 1 { "call" } else { "calls" },
        short_count(calls_rate),
        bytes(r.bytes),
        bytes(bytes_rate as u64),
    );
    if let Some(live) = tick.live_bytes {
        s += &format!("  live {}", bytes(live));
    }
    if tick.processes > 1 {
        s += &format!("  {} processes", tick.processes);
    }
    s
}

/// The line as shown on a terminal `cols` wide: [`format_status`] cut
/// to leave the last column empty, so that the cursor does not wrap.
fn shown(tick: &Tick, last: Running, dt: f64, cols: u16) -> String {
    let s = format_status(tick, last, dt);
    s.chars()
        .take(usize::from(cols).saturating_sub(1))
        .collect()
}

fn winsize() -> Option<libc::winsize> {
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ fills the struct we pass.
    let rc = unsafe { libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_row > 0).then_some(ws)
}

fn terminal_rows() -> Option<u16> {
    winsize().map(|w| w.ws_row)
}

fn terminal_cols() -> Option<u16> {
    winsize().map(|w| w.ws_col).filter(|&c| c > 0)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// The line through a trace, at ticks a few seconds apart and on
    /// terminals of a fixed width: the golden file
    /// `golden/status-line.txt` (`MTRACE_BLESS=1` rewrites it).
    #[test]
    fn units_and_rates() {
        let tick = |elapsed: f64, calls: u64, bytes: u64| Tick {
            elapsed,
            running: Running {
                calls,
                bytes,
                ..Running::default()
            },
            live_bytes: None,
            processes: 1,
        };
        let first = tick(1.0, 1, 16);
        let mut busy = tick(62.0, 2000, 4096);
        busy.running.lost = 3;
        busy.live_bytes = Some(2048);
        busy.processes = 2;
        let long = tick(3725.0, 12_345_678, 5 << 30);
        let cases = [
            (
                "the first call, 80 columns",
                first,
                Running::default(),
                1.0,
                80,
            ),
            (
                "live, 2 processes and a loss, 120 columns",
                busy,
                first.running,
                2.0,
                120,
            ),
            ("the same, 40 columns", busy, first.running, 2.0, 40),
            ("over an hour, 80 columns", long, busy.running, 1.0, 80),
        ];
        let mut out = String::new();
        for (what, tick, last, dt, cols) in cases {
            out += &format!("{what}:\n{}\n\n", shown(&tick, last, dt, cols));
        }
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/watch/golden");
        tracer_offline::golden::check(&dir, "status-line.txt", &out);
    }
}
