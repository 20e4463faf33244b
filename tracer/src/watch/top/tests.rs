//! The live view's model and drawing, on a test terminal.

use ratatui::{backend::TestBackend, Terminal};

use super::{
    draw::draw,
    model::{Model, UiState},
};
use crate::{
    collect::Running,
    profile::{Counts, Frame as PFrame, Profile, StackEntry},
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
    let text = screen_text(&model, &mut state);
    assert!(text.contains("2 processes, by calls"), "{text}");
    state.by_process = false;
    assert_eq!(model.sorted(&state).len(), 3);
}
