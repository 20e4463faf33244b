//! `mtrace top`: a full-screen live view of a trace under way (ratatui).
//!
//! Every second the session hands it the profile so far; it shows the top
//! stacks by their rate over the last second or by their totals, sorted by
//! calls, bytes or (live mode) live bytes, with the selected stack expanded,
//! the totals, the losses and a sparkline of the allocation rate. `q` (or
//! Ctrl-C) ends the trace, and the usual report follows: nothing is lost by
//! watching.
//!
//! The view is drawn on standard error (which must be a terminal) in the
//! alternate screen; keys are read by a thread of their own, which redraws
//! at once on a key and tells the session when to stop.

use std::{
    collections::{HashMap, VecDeque},
    io::{IsTerminal, Stderr},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::Result;
use ratatui::{
    backend::CrosstermBackend,
    crossterm::{
        event::{self, Event, KeyCode, KeyEventKind, KeyModifiers},
        execute,
        terminal::{self, EnterAlternateScreen, LeaveAlternateScreen},
    },
    layout::{Constraint, Layout},
    style::{Modifier, Style, Stylize},
    text::{Line, Span},
    widgets::{Block, Borders, Cell, Paragraph, Row, Sparkline, Table, TableState, Wrap},
    Frame, Terminal,
};
use tokio::sync::oneshot;

use crate::{
    error::{UserError, EXIT_USAGE},
    profile::{is_allocation, Profile, StackEntry},
    render::{
        text::{bytes, short_count, thousands},
        SortKey,
    },
    watch::{status_line::summary, Tick, Watcher},
};

/// One stack as the view shows it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TopRow {
    /// The allocator function.
    pub func: String,
    /// Innermost first, as `function (file:line)`.
    pub frames: Vec<String>,
    /// Thread or process, when the trace splits by them.
    pub who: Option<String>,
    pub calls: u64,
    pub bytes: u64,
    /// Over the last second.
    pub calls_rate: f64,
    pub bytes_rate: f64,
    /// Live mode: bytes of this stack still allocated.
    pub live_bytes: Option<u64>,
}

/// Everything drawn, apart from the terminal.
#[derive(Debug, Default)]
pub struct Model {
    pub title: String,
    pub live: bool,
    pub tick: Option<TickView>,
    pub rows: Vec<TopRow>,
    /// Allocation calls per second, oldest first.
    pub rates: VecDeque<u64>,
    /// Each row's totals at the previous tick, for the rates.
    prev: HashMap<String, (u64, u64)>,
    prev_t: f64,
}

/// The tick's totals, as shown.
#[derive(Clone, Copy, Debug, Default)]
pub struct TickView {
    pub tick: Tick,
    pub calls_rate: f64,
    pub bytes_rate: f64,
}

/// What the reader chose.
#[derive(Debug)]
pub struct UiState {
    pub sort: SortKey,
    /// Order by the last second's rate (else by totals).
    pub by_rate: bool,
    pub table: TableState,
    pub expanded: bool,
}

impl Default for UiState {
    fn default() -> Self {
        UiState {
            sort: SortKey::Calls,
            by_rate: true,
            table: TableState::default().with_selected(Some(0)),
            expanded: true,
        }
    }
}

/// How many seconds of rate the sparkline keeps.
const HISTORY: usize = 600;

impl Model {
    /// Takes in the profile so far, `tick.elapsed` seconds into the trace.
    pub fn update(&mut self, profile: &Profile, tick: &Tick) {
        let dt = (tick.elapsed - self.prev_t).max(1e-3);
        let mut rows = Vec::new();
        let mut now = HashMap::new();
        for st in profile.stacks.iter().filter(|s| is_allocation(s)) {
            let key = row_key(st);
            let (calls0, bytes0) = self.prev.get(&key).copied().unwrap_or((0, 0));
            rows.push(TopRow {
                func: st.func.clone(),
                frames: st.frames.iter().map(|f| f.describe()).collect(),
                who: st
                    .process
                    .as_ref()
                    .map(|p| format!("{} ({})", p.name, p.pid))
                    .or_else(|| {
                        st.thread
                            .as_ref()
                            .map(|t| format!("{} ({})", t.name, t.tid))
                    }),
                calls: st.counts.calls,
                bytes: st.counts.bytes,
                calls_rate: st.counts.calls.saturating_sub(calls0) as f64 / dt,
                bytes_rate: st.counts.bytes.saturating_sub(bytes0) as f64 / dt,
                live_bytes: st.live.as_ref().map(|l| l.outstanding_bytes),
            });
            now.insert(key, (st.counts.calls, st.counts.bytes));
        }
        let last = self.tick.map(|t| t.tick.running).unwrap_or_default();
        let view = TickView {
            tick: *tick,
            calls_rate: tick.running.calls.saturating_sub(last.calls) as f64 / dt,
            bytes_rate: tick.running.bytes.saturating_sub(last.bytes) as f64 / dt,
        };
        self.rates.push_back(view.calls_rate.round() as u64);
        while self.rates.len() > HISTORY {
            self.rates.pop_front();
        }
        self.tick = Some(view);
        self.rows = rows;
        self.prev = now;
        self.prev_t = tick.elapsed;
    }

    /// The rows in the order the reader chose.
    pub fn sorted(&self, state: &UiState) -> Vec<&TopRow> {
        let mut rows: Vec<&TopRow> = self.rows.iter().collect();
        let key = |r: &TopRow| -> (f64, f64) {
            let (rate, total) = match state.sort {
                SortKey::Calls => (r.calls_rate, r.calls as f64),
                SortKey::Bytes => (r.bytes_rate, r.bytes as f64),
                SortKey::Live => {
                    let live = r.live_bytes.unwrap_or(0) as f64;
                    (live, live)
                }
            };
            if state.by_rate {
                (rate, total)
            } else {
                (total, rate)
            }
        };
        rows.sort_by(|a, b| {
            key(b)
                .partial_cmp(&key(a))
                .unwrap_or(std::cmp::Ordering::Equal)
                .then_with(|| a.frames.cmp(&b.frames))
        });
        rows
    }
}

/// Rows of successive ticks are matched by what they show.
fn row_key(st: &StackEntry) -> String {
    let mut key = st.func.clone();
    for f in &st.frames {
        key.push(';');
        key.push_str(&f.function);
        key.push('@');
        key.push_str(&f.addr.to_string());
    }
    if let Some(t) = &st.thread {
        key += &format!("#t{}", t.tid);
    }
    if let Some(p) = &st.process {
        key += &format!("#p{}", p.pid);
    }
    key
}

/// Draws the whole view.
pub fn draw(frame: &mut Frame, model: &Model, state: &mut UiState) {
    let area = frame.area();
    let expanded = state.expanded && !model.rows.is_empty();
    let [head, spark, table_area, stack_area, help] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(3),
        Constraint::Min(4),
        Constraint::Length(if expanded {
            (area.height / 3).max(4)
        } else {
            0
        }),
        Constraint::Length(1),
    ])
    .areas(area);

    frame.render_widget(Paragraph::new(header(model)), head);
    let rates: Vec<u64> = model.rates.iter().copied().collect();
    let width = spark.width.saturating_sub(2) as usize;
    let shown = &rates[rates.len().saturating_sub(width)..];
    frame.render_widget(
        Sparkline::default()
            .block(Block::default().borders(Borders::TOP).title(format!(
                "calls/s, last {} s (peak {})",
                shown.len(),
                short_count(shown.iter().copied().max().unwrap_or(0) as f64)
            )))
            .data(shown),
        spark,
    );

    let rows = model.sorted(state);
    // A table drawn without rows forgets its selection.
    match state.table.selected() {
        None if !rows.is_empty() => state.table.select(Some(0)),
        Some(sel) if sel >= rows.len() && !rows.is_empty() => {
            state.table.select(Some(rows.len() - 1))
        }
        _ => {}
    }
    let arrow = |k: SortKey, rate: bool| {
        if state.sort == k && state.by_rate == rate {
            " ▼"
        } else {
            ""
        }
    };
    let mut head_cells = vec![
        format!("calls/s{}", arrow(SortKey::Calls, true)),
        format!("bytes/s{}", arrow(SortKey::Bytes, true)),
        format!("calls{}", arrow(SortKey::Calls, false)),
        format!("bytes{}", arrow(SortKey::Bytes, false)),
    ];
    if model.live {
        head_cells.push(format!(
            "live{}",
            if state.sort == SortKey::Live {
                " ▼"
            } else {
                ""
            }
        ));
    }
    head_cells.push("function ← caller ← ...".into());
    let header_row = Row::new(head_cells).style(Style::new().bold());
    let body: Vec<Row> = rows
        .iter()
        .map(|r| {
            let mut cells = vec![
                Cell::from(short_count(r.calls_rate)),
                Cell::from(bytes(r.bytes_rate as u64)),
                Cell::from(thousands(r.calls)),
                Cell::from(bytes(r.bytes)),
            ];
            if model.live {
                cells.push(Cell::from(bytes(r.live_bytes.unwrap_or(0))));
            }
            let mut path = r.func.clone();
            for f in r.frames.iter().take(4) {
                path += " ← ";
                path += short_function(f);
            }
            if let Some(who) = &r.who {
                path = format!("[{who}] {path}");
            }
            cells.push(Cell::from(path));
            Row::new(cells)
        })
        .collect();
    let mut widths = vec![
        Constraint::Length(9),
        Constraint::Length(11),
        Constraint::Length(13),
        Constraint::Length(11),
    ];
    if model.live {
        widths.push(Constraint::Length(11));
    }
    widths.push(Constraint::Min(20));
    let table = Table::new(body, widths)
        .header(header_row)
        .block(Block::default().borders(Borders::TOP).title(format!(
            "{} stacks, by {} {}",
            rows.len(),
            match state.sort {
                SortKey::Calls => "calls",
                SortKey::Bytes => "bytes",
                SortKey::Live => "live bytes",
            },
            if state.by_rate && state.sort != SortKey::Live {
                "in the last second"
            } else {
                "since the start"
            }
        )))
        .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED));
    frame.render_stateful_widget(table, table_area, &mut state.table);

    if expanded {
        if let Some(r) = state.table.selected().and_then(|i| rows.get(i)) {
            let mut lines = vec![Line::from(Span::raw(r.func.clone()).bold())];
            lines.extend(r.frames.iter().map(|f| Line::from(format!("  {f}"))));
            frame.render_widget(
                Paragraph::new(lines)
                    .wrap(Wrap { trim: false })
                    .block(Block::default().borders(Borders::TOP).title("stack")),
                stack_area,
            );
        }
    }
    frame.render_widget(
        Paragraph::new(
            "q quit (then the report)  ↑↓ select  enter stack  c calls  b bytes  l live  t rate/total",
        )
        .dim(),
        help,
    );
}

/// `foo (file.c:12)` -> `foo`.
fn short_function(described: &str) -> &str {
    described.split(" (").next().unwrap_or(described)
}

fn header(model: &Model) -> Vec<Line<'static>> {
    let mut lines = vec![Line::from(Span::raw(model.title.clone()).bold())];
    let Some(t) = model.tick else {
        lines.push(Line::from("waiting for the first second..."));
        return lines;
    };
    let s = summary(&t.tick, t.calls_rate, t.bytes_rate);
    let mut line = vec![Span::raw(s)];
    if t.tick.running.lost > 0 {
        line.push(
            Span::raw(format!("  lost {}", thousands(t.tick.running.lost)))
                .red()
                .bold(),
        );
    } else {
        line.push(Span::raw("  no loss").dim());
    }
    lines.push(Line::from(line));
    lines
}

struct Screen {
    terminal: Terminal<CrosstermBackend<Stderr>>,
    model: Model,
    state: UiState,
}

impl Screen {
    fn redraw(&mut self) {
        let Screen {
            terminal,
            model,
            state,
        } = self;
        if let Err(e) = terminal.draw(|f| draw(f, model, state)) {
            log::debug!("drawing the live view: {e}");
        }
    }
}

/// The live view while it runs: the screen, and the thread reading keys.
pub struct TopView {
    screen: Arc<Mutex<Screen>>,
    done: Arc<AtomicBool>,
    keys: Option<JoinHandle<()>>,
}

impl TopView {
    /// Takes over the terminal (standard error); returns the view and what
    /// tells the session to stop (`q`).
    pub fn start(title: String, live: bool) -> Result<(TopView, oneshot::Receiver<()>)> {
        check_terminal()?;
        terminal::enable_raw_mode()?;
        let mut err = std::io::stderr();
        if let Err(e) = execute!(err, EnterAlternateScreen) {
            let _ = terminal::disable_raw_mode();
            return Err(e.into());
        }
        // (Not `Terminal::clear`: it asks the terminal for the cursor's
        // position on standard output, which may be a file. The alternate
        // screen starts blank.)
        let terminal = Terminal::new(CrosstermBackend::new(std::io::stderr()))?;
        let screen = Arc::new(Mutex::new(Screen {
            terminal,
            model: Model {
                title,
                live,
                ..Model::default()
            },
            state: UiState::default(),
        }));
        screen.lock().unwrap().redraw();
        let done = Arc::new(AtomicBool::new(false));
        let (stop_tx, stop_rx) = oneshot::channel();
        let keys = {
            let (screen, done) = (screen.clone(), done.clone());
            std::thread::Builder::new()
                .name("mtrace-top-keys".into())
                .spawn(move || read_keys(screen, done, stop_tx))?
        };
        Ok((
            TopView {
                screen,
                done,
                keys: Some(keys),
            },
            stop_rx,
        ))
    }
}

/// The view needs a terminal: said before anything is attached.
pub fn check_terminal() -> Result<()> {
    if std::io::stderr().is_terminal() {
        Ok(())
    } else {
        Err(anyhow::Error::new(UserError::with_code(
            "mtrace top needs a terminal on standard error",
            EXIT_USAGE,
        )))
    }
}

fn read_keys(screen: Arc<Mutex<Screen>>, done: Arc<AtomicBool>, stop: oneshot::Sender<()>) {
    let mut stop = Some(stop);
    while !done.load(Ordering::Relaxed) {
        match event::poll(Duration::from_millis(100)) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(_) => break,
        }
        let Ok(ev) = event::read() else { break };
        let mut s = screen.lock().unwrap();
        match ev {
            Event::Key(k) if k.kind != KeyEventKind::Release => {
                let ctrl_c =
                    k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                let live = s.model.live;
                let st = &mut s.state;
                match k.code {
                    _ if ctrl_c => {
                        if let Some(tx) = stop.take() {
                            let _ = tx.send(());
                        }
                    }
                    KeyCode::Char('q') | KeyCode::Esc => {
                        if let Some(tx) = stop.take() {
                            let _ = tx.send(());
                        }
                    }
                    KeyCode::Down | KeyCode::Char('j') => st.table.select_next(),
                    KeyCode::Up | KeyCode::Char('k') => st.table.select_previous(),
                    KeyCode::PageDown => st.table.scroll_down_by(10),
                    KeyCode::PageUp => st.table.scroll_up_by(10),
                    KeyCode::Home => st.table.select_first(),
                    KeyCode::Enter | KeyCode::Char(' ') => st.expanded = !st.expanded,
                    KeyCode::Char('c') => st.sort = SortKey::Calls,
                    KeyCode::Char('b') => st.sort = SortKey::Bytes,
                    KeyCode::Char('l') if live => st.sort = SortKey::Live,
                    KeyCode::Char('t') | KeyCode::Char('r') => st.by_rate = !st.by_rate,
                    _ => {}
                }
                s.redraw();
            }
            Event::Resize(..) => s.redraw(),
            _ => {}
        }
    }
}

impl Watcher for TopView {
    fn tick(&mut self, tick: &Tick, profile: &dyn Fn() -> Result<Profile>) -> Result<()> {
        let profile = profile()?;
        let mut s = self.screen.lock().unwrap();
        s.model.update(&profile, tick);
        s.redraw();
        Ok(())
    }
}

impl Drop for TopView {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(keys) = self.keys.take() {
            let _ = keys.join();
        }
        let mut s = self.screen.lock().unwrap();
        let _ = s.terminal.show_cursor();
        let _ = execute!(std::io::stderr(), LeaveAlternateScreen);
        let _ = terminal::disable_raw_mode();
    }
}

/// Launch mode: the command's standard input, output and error while the
/// view has the terminal (input from /dev/null, output and error to a log
/// file), set on mtrace's own descriptors for the command to inherit, and
/// mtrace's put back once it is started.
pub struct Redirect {
    saved: Vec<(i32, std::os::fd::OwnedFd)>,
    pub log: std::path::PathBuf,
}

impl Redirect {
    pub fn start() -> Result<Redirect> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let (file, log) = tempfile::Builder::new()
            .prefix("mtrace-top-")
            .suffix(".log")
            .tempfile()?
            .keep()?;
        let null = std::fs::File::open("/dev/null")?;
        let mut saved = Vec::new();
        for (fd, to) in [
            (0, null.as_raw_fd()),
            (1, file.as_raw_fd()),
            (2, file.as_raw_fd()),
        ] {
            // SAFETY: plain descriptor calls; the duplicate is owned here.
            let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
            if copy < 0 {
                return Err(std::io::Error::last_os_error().into());
            }
            saved.push((fd, unsafe { OwnedFd::from_raw_fd(copy) }));
            if unsafe { libc::dup2(to, fd) } < 0 {
                return Err(std::io::Error::last_os_error().into());
            }
        }
        Ok(Redirect { saved, log })
    }
}

impl Drop for Redirect {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        for (fd, copy) in &self.saved {
            // SAFETY: puts back a descriptor we duplicated.
            unsafe { libc::dup2(copy.as_raw_fd(), *fd) };
        }
    }
}

#[cfg(test)]
mod tests {
    use ratatui::backend::TestBackend;

    use super::*;
    use crate::{
        collect::Running,
        profile::{Counts, Frame as PFrame},
    };

    fn entry(func: &str, frames: &[&str], calls: u64, bytes: u64) -> StackEntry {
        StackEntry {
            func: func.into(),
            frames: frames
                .iter()
                .enumerate()
                .map(|(i, f)| PFrame {
                    function: f.to_string(),
                    addr: 0x1000 + i as u64,
                    ..PFrame::default()
                })
                .collect(),
            counts: Counts { calls, bytes },
            ..StackEntry::default()
        }
    }

    fn tick(elapsed: f64, calls: u64, bytes: u64) -> Tick {
        Tick {
            elapsed,
            running: Running {
                calls,
                bytes,
                ..Running::default()
            },
            live_bytes: None,
            processes: 1,
        }
    }

    fn screen_text(model: &Model, state: &mut UiState) -> String {
        let area = ratatui::layout::Rect::new(0, 0, 120, 30);
        let mut t = Terminal::new(TestBackend::new(area.width, area.height)).unwrap();
        // Drawn once before any row came, as the view is.
        t.draw(|f| draw(f, &Model::default(), state)).unwrap();
        t.draw(|f| draw(f, model, state)).unwrap();
        let buf = t.backend().buffer().clone();
        let mut out = String::new();
        for y in 0..area.height {
            for x in 0..area.width {
                out.push_str(buf[(x, y)].symbol());
            }
            out.push('\n');
        }
        out
    }

    #[test]
    fn rates_are_per_second_and_order_the_rows() {
        let mut m = Model {
            title: "mtrace top: pid 1 (demo)".into(),
            ..Model::default()
        };
        let mut p = Profile {
            stacks: vec![
                entry("malloc", &["hot_early", "main"], 1000, 1000),
                entry("calloc", &["warm", "main"], 10, 5000),
            ],
            ..Profile::default()
        };
        m.update(&p, &tick(1.0, 1010, 6000));
        p.stacks = vec![
            entry("malloc", &["hot_early", "main"], 1010, 1010),
            entry("calloc", &["warm", "main"], 510, 105_000),
            entry("free", &["main"], 7, 0),
        ];
        m.update(&p, &tick(3.0, 1520, 106_010));
        assert_eq!(m.rows.len(), 2, "frees are not allocations");
        let mut state = UiState::default();
        let by_rate: Vec<&str> = m
            .sorted(&state)
            .iter()
            .map(|r| r.frames[0].as_str())
            .collect();
        assert_eq!(by_rate, ["warm", "hot_early"]);
        assert_eq!(m.sorted(&state)[0].calls_rate, 250.0);
        state.by_rate = false;
        let by_total: Vec<&str> = m
            .sorted(&state)
            .iter()
            .map(|r| r.frames[0].as_str())
            .collect();
        assert_eq!(by_total, ["hot_early", "warm"]);
        let tv = m.tick.unwrap();
        assert_eq!((tv.tick.running.calls, tv.calls_rate), (1520, 255.0));

        let mut state = UiState {
            by_rate: false,
            ..UiState::default()
        };
        let text = screen_text(&m, &mut state);
        assert!(text.contains("\nstack──"), "{text}");
        assert!(text.contains("calls ▼"), "{text}");
        assert!(
            text.lines().any(|l| l.trim_end() == "  hot_early"),
            "the selected stack is shown\n{text}"
        );
        assert!(text.contains("mtrace top: pid 1 (demo)"), "{text}");
        assert!(text.contains("calloc ← warm ← main"), "{text}");
        assert!(text.contains("1,520 calls"), "{text}");
        assert!(text.contains("no loss"), "{text}");
    }
}
