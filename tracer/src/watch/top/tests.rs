//! The live view's model and drawing, on a test terminal.
//!
//! Each drawn screen is a golden file in `../golden/`: `top-NAME.txt` is every
//! cell's symbol, row by row, on a fixed 120 x 30 terminal; where a test
//! is about styles (the selected row reversed, a loss in red), also
//! `top-NAME.styles.txt`, each cell's style as a letter. After an intended
//! change of the view, rewrite them and review the change with `git diff`:
//!
//! ```text
//! MTRACE_BLESS=1 cargo test --release -p tracer --bin mtrace watch::
//! ```

use std::path::Path;

use ratatui::{
    backend::TestBackend,
    buffer::{Buffer, Cell},
    style::Color,
    Terminal,
};

use super::{
    draw::draw,
    model::{Model, UiState},
};
use crate::{
    collect::Running,
    profile::{Counts, Frame as PFrame, LiveStats, Profile, StackEntry},
    watch::Tick,
};

fn entry(func: &str, frames: &[&str], calls: u64, bytes: u64) -> StackEntry {
    StackEntry {
        func: func.into(),
        frames: frames
            .iter()
            .enumerate()
            .map(|(i, f)| {
                std::sync::Arc::new(PFrame {
                    function: f.to_string(),
                    addr: 0x1000 + i as u64,
                    ..PFrame::default()
                })
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

/// The screen after drawing `model`, on a terminal of a fixed size.
fn screen(model: &Model, state: &mut UiState) -> Buffer {
    let mut t = Terminal::new(TestBackend::new(120, 30)).unwrap();
    // Drawn once before any row came, as the view is.
    t.draw(|f| draw(f, &Model::default(), state)).unwrap();
    t.draw(|f| draw(f, model, state)).unwrap();
    t.backend().buffer().clone()
}

/// Every cell's symbol, row by row, without the spaces ending a row.
fn screen_text(buf: &Buffer) -> String {
    let area = buf.area;
    let mut out = String::new();
    for y in area.top()..area.bottom() {
        let row: String = (area.left()..area.right())
            .map(|x| buf[(x, y)].symbol())
            .collect();
        out += row.trim_end();
        out.push('\n');
    }
    out
}

/// Every cell's style as a letter, row by row, after a legend of the
/// letters (in the order they first appear); a cell in the terminal's own
/// colours without modifiers is a space, and the spaces ending a row are
/// left out.
fn screen_styles(buf: &Buffer) -> String {
    let area = buf.area;
    let mut legend: Vec<String> = Vec::new();
    let mut grid = String::new();
    for y in area.top()..area.bottom() {
        let mut row = String::new();
        for x in area.left()..area.right() {
            let style = style_name(&buf[(x, y)]);
            if style.is_empty() {
                row.push(' ');
                continue;
            }
            let i = legend.iter().position(|s| *s == style).unwrap_or_else(|| {
                legend.push(style);
                legend.len() - 1
            });
            row.push(char::from(b'a' + i as u8));
        }
        grid += row.trim_end();
        grid.push('\n');
    }
    let mut out = String::new();
    for (i, s) in legend.iter().enumerate() {
        out += &format!("{} = {s}\n", char::from(b'a' + i as u8));
    }
    out + "\n" + &grid
}

/// `Red on Blue bold reversed`: a cell's colours other than the
/// terminal's own and its modifiers; empty for a plain cell.
fn style_name(cell: &Cell) -> String {
    let mut parts = Vec::new();
    if cell.fg != Color::Reset {
        parts.push(cell.fg.to_string());
    }
    if cell.bg != Color::Reset {
        parts.push(format!("on {}", cell.bg));
    }
    parts.extend(cell.modifier.iter_names().map(|(n, _)| n.to_lowercase()));
    parts.join(" ")
}

/// Compares a screen's text (and, with `styles`, its styles) with the
/// golden files `golden/top-NAME.txt` and `golden/top-NAME.styles.txt`.
#[track_caller]
fn check_screen(name: &str, buf: &Buffer, styles: bool) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/watch/golden");
    tracer_offline::golden::check(&dir, &format!("top-{name}.txt"), &screen_text(buf));
    if styles {
        let name = format!("top-{name}.styles.txt");
        tracer_offline::golden::check(&dir, &name, &screen_styles(buf));
    }
}

#[test]
fn rates_are_per_second_and_order_the_rows() {
    let mut m = Model::new("mtrace top: pid 1 (demo)".into(), false);
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
    let buf = screen(&m, &mut state);
    check_screen("totals", &buf, true);
    // What a reader of the golden file could miss: the arrow marks the
    // column the rows are sorted by, and the stack shown below is the
    // selected (first) row's.
    let text = screen_text(&buf);
    assert!(text.contains("calls ▼"), "{text}");
    assert!(
        text.lines().any(|l| l == "  hot_early"),
        "the selected stack is shown\n{text}"
    );
}

/// Per process (`p`): one row per process with its totals and its most
/// frequent stack, and its rate over the last second.
#[test]
fn rows_per_process_sum_their_stacks() {
    let of = |pid: u32, name: &str, func: &str, frames: &[&str], calls: u64| {
        let mut e = entry(func, frames, calls, calls * 10);
        e.process = Some(crate::profile::ProcessRef {
            pid,
            name: name.into(),
        });
        e
    };
    let profile = |n: u64| Profile {
        stacks: vec![
            of(10, "ls", "malloc", &["xmalloc"], 3 * n),
            of(10, "ls", "calloc", &["main"], n),
            of(20, "bash", "malloc", &["xmalloc"], 5 * n),
        ],
        ..Profile::default()
    };
    let mut model = Model::new("t".into(), false);
    model.update(&profile(1), &tick(1.0, 9, 90));
    model.update(&profile(3), &tick(2.0, 27, 270));
    let mut state = UiState {
        by_process: true,
        ..UiState::default()
    };
    let rows = model.sorted(&state);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].who.as_deref(), Some("bash (20)"));
    assert_eq!((rows[0].calls, rows[0].calls_rate), (15, 10.0));
    assert_eq!(rows[1].who.as_deref(), Some("ls (10)"));
    assert_eq!((rows[1].calls, rows[1].calls_rate), (12, 8.0));
    assert_eq!((rows[1].func.as_str(), rows[1].frames.len()), ("malloc", 1));
    check_screen("per-process", &screen(&model, &mut state), false);
    state.by_process = false;
    assert_eq!(model.sorted(&state).len(), 3);
}

/// Before the first second: the title and a word that the counts come.
#[test]
fn waiting_for_the_first_tick() {
    let model = Model::new("mtrace top: pid 1 (demo)".into(), false);
    check_screen("waiting", &screen(&model, &mut UiState::default()), false);
}

/// Live mode sorted by live bytes, with a loss: the live column, and the
/// loss in red in the header.
#[test]
fn live_bytes_and_a_loss() {
    let live = |e: StackEntry, outstanding_bytes: u64| StackEntry {
        live: Some(LiveStats {
            outstanding_bytes,
            ..LiveStats::default()
        }),
        ..e
    };
    let profile = Profile {
        stacks: vec![
            live(entry("malloc", &["many_small", "main"], 900, 9000), 100),
            live(
                entry("realloc", &["few_large", "main"], 3, 3 << 20),
                2 << 20,
            ),
        ],
        ..Profile::default()
    };
    let mut model = Model::new("mtrace top: pid 1 (demo)".into(), true);
    let mut t = tick(5.0, 903, 9000 + (3 << 20));
    t.running.lost = 12;
    t.live_bytes = Some(100 + (2 << 20));
    model.update(&profile, &t);
    let mut state = UiState {
        sort: crate::render::SortKey::Live,
        ..UiState::default()
    };
    check_screen("live-lost", &screen(&model, &mut state), true);
}
