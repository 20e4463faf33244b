//! What the live view shows: the rows of the profile so far, their rates
//! over the last second, the history of the allocation rate, and what the
//! user selected.

use std::collections::{HashMap, VecDeque};

use ratatui::widgets::TableState;

use crate::{
    profile::{is_allocation, Profile, StackEntry},
    render::{
        apart::{told_apart, with_offset},
        SortKey,
    },
    watch::Tick,
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
    /// One row per process (when the stacks say their process), each
    /// with its most frequent stack: who allocates.
    pub process_rows: Vec<TopRow>,
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
    /// One row per process rather than per stack.
    pub by_process: bool,
}

impl Default for UiState {
    fn default() -> Self {
        UiState {
            sort: SortKey::Calls,
            by_rate: true,
            table: TableState::default().with_selected(Some(0)),
            expanded: true,
            by_process: false,
        }
    }
}

/// How many seconds of rate the sparkline keeps.
const HISTORY: usize = 600;

impl Model {
    /// An empty view titled `title`; `live` when the trace has live data.
    pub fn new(title: String, live: bool) -> Model {
        Model {
            title,
            live,
            ..Model::default()
        }
    }

    /// Takes in the profile so far, `tick.elapsed` seconds into the trace.
    pub fn update(&mut self, profile: &Profile, tick: &Tick) {
        let dt = (tick.elapsed - self.prev_t).max(1e-3);
        let mut rows = Vec::new();
        let mut now = HashMap::new();
        let stacks: Vec<&StackEntry> = profile.stacks.iter().filter(|s| is_allocation(s)).collect();
        let apart = told_apart(stacks.iter().map(|st| {
            let who = (
                st.process.as_ref().map(|p| p.pid),
                st.thread.as_ref().map(|t| t.tid),
            );
            ((&st.func, who), st.frames.as_slice())
        }));
        for (i, st) in stacks.into_iter().enumerate() {
            let key = row_key(st);
            let (calls0, bytes0) = self.prev.get(&key).copied().unwrap_or((0, 0));
            rows.push(TopRow {
                func: st.func.clone(),
                frames: st
                    .frames
                    .iter()
                    .enumerate()
                    .map(|(d, f)| match apart.contains(&(i, d)) {
                        true => with_offset(f).describe(),
                        false => f.describe(),
                    })
                    .collect(),
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
        let process_rows = self.per_process(&rows, &mut now, dt);
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
        self.process_rows = process_rows;
        self.prev = now;
        self.prev_t = tick.elapsed;
    }

    /// Rows of `stacks` joined by process (`who`), each showing its
    /// most frequent stack; their totals at this tick go in `now`.
    fn per_process(
        &self,
        stacks: &[TopRow],
        now: &mut HashMap<String, (u64, u64)>,
        dt: f64,
    ) -> Vec<TopRow> {
        let mut by: HashMap<&str, (TopRow, u64)> = HashMap::new();
        for r in stacks {
            let Some(who) = r.who.as_deref() else {
                continue;
            };
            let (row, top) = by.entry(who).or_insert_with(|| (TopRow::default(), 0));
            row.calls += r.calls;
            row.bytes += r.bytes;
            if r.calls > *top {
                *top = r.calls;
                row.func = r.func.clone();
                row.frames = r.frames.clone();
                row.who = r.who.clone();
            }
        }
        by.into_values()
            .map(|(mut row, _)| {
                let key = format!("#process {}", row.who.as_deref().unwrap_or(""));
                let (calls0, bytes0) = self.prev.get(&key).copied().unwrap_or((0, 0));
                row.calls_rate = row.calls.saturating_sub(calls0) as f64 / dt;
                row.bytes_rate = row.bytes.saturating_sub(bytes0) as f64 / dt;
                now.insert(key, (row.calls, row.bytes));
                row
            })
            .collect()
    }

    /// The rows shown: per process when the reader asked and the stacks
    /// say their process, else per stack.
    pub fn shown(&self, state: &UiState) -> &[TopRow] {
        if state.by_process && !self.process_rows.is_empty() {
            &self.process_rows
        } else {
            &self.rows
        }
    }

    /// The rows in the order the reader chose.
    pub fn sorted(&self, state: &UiState) -> Vec<&TopRow> {
        let mut rows: Vec<&TopRow> = self.shown(state).iter().collect();
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
