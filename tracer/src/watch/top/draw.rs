//! Drawing the live view: the header, the table of stacks, the selected
//! stack, the sparkline.

use ratatui::{
    layout::{Constraint, Layout},
    style::{Modifier, Style, Stylize},
    text::{Line, Span},
    widgets::{Block, Borders, Cell, Paragraph, Row, Sparkline, Table, Wrap},
    Frame,
};

use crate::{
    render::{
        text::{bytes, short_count, thousands},
        SortKey,
    },
    watch::status_line::summary,
};

use super::model::{Model, UiState};

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
    let per_process = state.by_process && !model.process_rows.is_empty();
    head_cells.push(if per_process {
        "process: its most frequent stack".into()
    } else {
        "function ← caller ← ...".into()
    });
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
            "{} {}, by {} {}",
            rows.len(),
            if per_process { "processes" } else { "stacks" },
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
            "q quit (then the report)  ↑↓ select  enter stack  c calls  b bytes  l live  t rate/total  p per process",
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
