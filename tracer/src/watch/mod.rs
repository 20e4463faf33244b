//! What shows a trace while it runs: the status line at the bottom of the
//! terminal ([`status_line`]) and `mtrace top`, the full-screen live view
//! ([`top`]). The session hands every watcher a [`Tick`] each second.

pub mod status_line;
pub mod top;

use anyhow::Result;

pub use status_line::StatusLine;

use crate::{collect::Running, profile::Profile};

/// What one tick shows.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tick {
    pub elapsed: f64,
    pub running: Running,
    /// Live mode: bytes allocated and not yet freed, as traced.
    pub live_bytes: Option<u64>,
    /// Processes traced now (shown when more than one).
    pub processes: usize,
}

/// Shown every second while tracing: the status line, the live view.
pub trait Watcher {
    /// `profile` makes the profile so far, for a watcher that shows stacks.
    fn tick(&mut self, tick: &Tick, profile: &dyn Fn() -> Result<Profile>) -> Result<()>;

    /// Between ticks, a watcher that asked ([`crate::session::Inputs`]'s
    /// `wake`) is handed the trace now.
    fn woken(&mut self, _tick: &Tick, _profile: &dyn Fn() -> Result<Profile>) -> Result<()> {
        Ok(())
    }

    /// The target is gone and tracing has ended (`why`): a watcher that
    /// has the screen shows the last state until the reader is done.
    fn ended(&mut self, _why: &str, _tick: &Tick, _profile: &dyn Fn() -> Result<Profile>) {}
}

impl Watcher for StatusLine {
    fn tick(&mut self, tick: &Tick, _profile: &dyn Fn() -> Result<Profile>) -> Result<()> {
        self.show(tick);
        Ok(())
    }
}
