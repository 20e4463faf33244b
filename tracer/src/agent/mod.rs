//! `mtrace agent`: a trace that runs until it is stopped and serves what
//! it has counted over HTTP, in the formats fleet profilers and
//! Prometheus scrape: Go's heap profiles (`/debug/pprof/allocs`,
//! `/debug/pprof/heap`, [`crate::render::pprof::render_go_heap`]) and
//! Prometheus' text format (`/metrics`, [`metrics`]).
//!
//! The session owns the kernel maps and reads them on its own thread; the
//! server ([`http`]) asks it for a reading and waits for the next second's
//! tick, when the session makes one ([`AgentWatcher`]). A reading is the
//! whole trace so far (every process, those gone included), symbolized;
//! `?seconds=N` is the difference of two readings N seconds apart
//! ([`crate::profile::window::between`]). [`pages`] answers the requests
//! (one profile rendered at a time, shared by the requests that wait for
//! it); [`web`] reads `--web-config` (TLS, basic auth).

mod http;
mod metrics;
mod pages;
mod waiting;
mod web;

use std::{
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use anyhow::Result;

use crate::{
    profile::Profile,
    watch::{Tick, Watcher},
};

pub use http::{Listen, Server};

/// One reading of the trace: the profile so far and the second's counters.
pub struct Reading {
    pub profile: Profile,
    pub tick: Tick,
    /// Its number: readings are numbered from 1 in the order they begin.
    pub number: u64,
    /// When it was made.
    pub at: Instant,
    /// How long it took to make.
    pub took: Duration,
    pub wall: std::time::SystemTime,
}

#[derive(Default)]
struct State {
    /// A reading was asked for since the last one began.
    wanted: bool,
    /// Readings begun.
    begun: u64,
    /// The last reading made, while requests that waited for it have
    /// not all taken it (then dropped: a reading of a large trace is
    /// hundreds of megabytes).
    latest: Option<Arc<Reading>>,
    /// Requests waiting for a reading.
    waiting: usize,
    /// Of those, the ones that have yet to take `latest`.
    takers: usize,
    /// The trace has ended (or the session could not read the maps): why.
    gone: Option<String>,
}

/// What the session and the server share.
#[derive(Default)]
pub struct Shared {
    state: Mutex<State>,
    made: Condvar,
    /// Wakes the session for a reading.
    wake: Arc<tokio::sync::Notify>,
}

/// Longest a request waits for a reading begun after it came: the one
/// under way, then its own (a reading of a trace of 30,000 stacks takes
/// 2-3 s on a loaded machine of 2 CPUs).
const READING_WAIT: Duration = Duration::from_secs(15);

impl Shared {
    /// How many readings have begun: a reading numbered above it begins
    /// after this call.
    pub fn begun(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).begun
    }

    /// A reading begun after this call (the session makes one when woken),
    /// or why there is none.
    pub fn fresh(&self) -> std::result::Result<Arc<Reading>, String> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let since = st.begun;
        st.wanted = true;
        st.waiting += 1;
        self.wake.notify_one();
        let deadline = Instant::now() + READING_WAIT;
        let got = loop {
            if let Some(why) = &st.gone {
                break Err(why.clone());
            }
            if let Some(r) = st.latest.as_ref().filter(|r| r.number > since) {
                let r = r.clone();
                st.takers = st.takers.saturating_sub(1);
                break Ok(r);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break Err("the trace made no reading in time".into());
            }
            st = self
                .made
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        st.waiting -= 1;
        st.takers = st.takers.min(st.waiting);
        if st.takers == 0 {
            st.latest = None;
        }
        got
    }

    fn end(&self, why: String) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.gone.get_or_insert(why);
        self.made.notify_all();
    }
}

/// The session's side: makes a reading at a tick when one was asked for.
pub struct AgentWatcher {
    shared: Arc<Shared>,
    server: Option<Server>,
}

impl AgentWatcher {
    /// Serves `server`'s requests from the session's readings from now on.
    /// Also returns what wakes the session when a request comes.
    pub fn start(mut server: Server) -> Result<(AgentWatcher, Arc<tokio::sync::Notify>)> {
        let shared = Arc::new(Shared::default());
        let wake = shared.wake.clone();
        server.serve(shared.clone())?;
        Ok((
            AgentWatcher {
                shared,
                server: Some(server),
            },
            wake,
        ))
    }
}

impl Watcher for AgentWatcher {
    fn tick(&mut self, tick: &Tick, profile: &dyn Fn() -> Result<Profile>) -> Result<()> {
        self.woken(tick, profile)
    }

    fn woken(&mut self, tick: &Tick, profile: &dyn Fn() -> Result<Profile>) -> Result<()> {
        let number = {
            let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            if !std::mem::take(&mut st.wanted) {
                return Ok(());
            }
            st.begun += 1;
            st.begun
        };
        // A reading that fails (a map unreadable) is said to the client;
        // the trace goes on.
        let began = Instant::now();
        let made = profile();
        let took = began.elapsed();
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        match made {
            Ok(profile) => {
                // Every request waiting now takes it (each waits for one
                // begun after its call, and this one is the newest).
                st.takers = st.waiting;
                st.latest = (st.takers > 0).then(|| {
                    Arc::new(Reading {
                        profile,
                        tick: *tick,
                        number,
                        at: Instant::now(),
                        took,
                        wall: std::time::SystemTime::now(),
                    })
                });
            }
            Err(e) => log::warn!("agent: reading the trace: {e:#}"),
        }
        self.shared.made.notify_all();
        Ok(())
    }

    fn ended(&mut self, why: &str, _tick: &Tick, _profile: &dyn Fn() -> Result<Profile>) {
        self.shared.end(format!("the trace has ended: {why}"));
    }
}

impl Drop for AgentWatcher {
    fn drop(&mut self) {
        self.shared.end("the trace has ended".into());
        if let Some(server) = self.server.take() {
            server.stop();
        }
    }
}

/// Starts serving `server` beside a trace: says where (and what the
/// address lets in), adds its watcher to `watchers`, and returns what
/// wakes the trace when a request wants a reading.
pub fn serve(
    server: Server,
    watchers: &mut Vec<Box<dyn Watcher>>,
) -> Result<Arc<tokio::sync::Notify>> {
    crate::say!("mtrace agent: {}", server.describe());
    let (agent, wake) = AgentWatcher::start(server)?;
    watchers.push(Box::new(agent));
    Ok(wake)
}
