//! The one loop every trace runs, whatever its scope: it owns the signals,
//! the duration, the `q` of the live view, the watchers' ticks, the
//! `--interval` and SIGUSR1 snapshots and the windows policy's switches,
//! and hands every other event to the scope's engine ([`Engine`]): the
//! processes of a trace by pid, command or cgroup ([`super::Session`]), or
//! of the whole host (`crate::host`).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Result;
use tokio::sync::{oneshot, Notify};

use super::{
    end::{End, Signals},
    Schedule, SnapshotTimer,
};
use crate::{
    profile::Profile,
    watch::{Tick, Watcher},
};

/// How often the timeline, the status line and the live view are fed.
const TICK_EVERY: Duration = Duration::from_secs(1);

/// A watcher's redraw costs at most 1/VIEW_SHARE of the time between
/// redraws: one that took long (a busy host's profile is read and
/// symbolized anew each time) is redrawn less often than each second.
const VIEW_SHARE: u32 = 20;

/// What a scope's engine does for the loop. Its own events (processes
/// that start and end, rings to drain, mappings to read again) come from
/// [`Engine::work`] and are answered by [`Engine::handle`].
pub trait Engine {
    /// One of the engine's own events.
    type Work;

    /// The engine's next event. Cancel-safe: the loop drops it when
    /// another event comes first and asks again.
    async fn work(&mut self) -> Self::Work;

    /// Answers `work`; `Some` ends the trace.
    async fn handle(&mut self, work: Self::Work) -> Result<Option<End>>;

    /// The totals so far.
    fn tick(&mut self) -> Tick;

    /// Each second, before the watchers see `tick`.
    fn record(&mut self, _tick: &Tick) {}

    /// The profile so far.
    fn profile(&self) -> Result<Profile>;

    /// A snapshot now (`--interval`, SIGUSR1).
    fn snapshot(&mut self) -> Result<()>;

    /// When the windows policy switches next.
    fn duty_due(&self) -> Option<Instant>;

    /// The windows policy's switch, due now.
    fn switch_duty(&mut self);

    /// A watcher failed: the error ends the trace, unless the engine
    /// says it need not.
    fn watcher_failed(&self, e: anyhow::Error) -> Result<()> {
        Err(e)
    }
}

/// The watchers of a trace, and the receiver of the live view's `q`.
pub type Watchers = (Vec<Box<dyn Watcher>>, Option<oneshot::Receiver<()>>);

/// What the loop listens to besides the engine.
pub struct Controls {
    pub signals: Signals,
    /// The live view's `q`.
    pub stop: Option<oneshot::Receiver<()>>,
    /// A watcher wants the trace now, not at the next second.
    pub wake: Option<Arc<Notify>>,
}

/// Runs `engine` until the trace ends; returns why.
pub async fn drive<E: Engine>(
    engine: &mut E,
    schedule: &Schedule,
    controls: Controls,
    watchers: &mut [Box<dyn Watcher>],
) -> Result<End> {
    let Controls {
        mut signals,
        stop,
        wake,
    } = controls;
    let woken = async || match &wake {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    };
    let at = |due: Option<Instant>| async move {
        match due {
            Some(due) => tokio::time::sleep_until(due.into()).await,
            None => std::future::pending().await,
        }
    };
    let until = at(schedule.duration.map(|d| Instant::now() + d));
    tokio::pin!(until);
    let stop = async {
        match stop {
            Some(rx) => {
                if rx.await.is_err() {
                    std::future::pending::<()>().await
                }
            }
            None => std::future::pending().await,
        }
    };
    tokio::pin!(stop);
    let mut interval = SnapshotTimer::new(schedule.interval);
    let mut second = tokio::time::interval_at(tokio::time::Instant::now() + TICK_EVERY, TICK_EVERY);
    second.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next_view = Instant::now();
    loop {
        let next_switch = engine.duty_due();
        tokio::select! {
            _ = at(next_switch) => engine.switch_duty(),
            _ = &mut stop => return Ok(End::Stopped),
            _ = &mut until => return Ok(End::Duration),
            sig = signals.next() => match sig {
                Some(sig) => return Ok(End::Interrupted(sig)),
                None => engine.snapshot()?,
            },
            _ = interval.due() => engine.snapshot()?,
            _ = woken() => {
                let tick = engine.tick();
                for w in watchers.iter_mut() {
                    if let Err(e) = w.woken(&tick, &|| engine.profile()) {
                        engine.watcher_failed(e)?;
                    }
                }
            }
            _ = second.tick() => {
                let tick = engine.tick();
                engine.record(&tick);
                if Instant::now() < next_view {
                    continue;
                }
                let began = Instant::now();
                for w in watchers.iter_mut() {
                    if let Err(e) = w.tick(&tick, &|| engine.profile()) {
                        engine.watcher_failed(e)?;
                    }
                }
                next_view = began + began.elapsed() * VIEW_SHARE;
            }
            work = engine.work() => {
                if let Some(end) = engine.handle(work).await? {
                    return Ok(end);
                }
            }
        }
    }
}
