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
//! ([`crate::profile::window::between`]).

mod http;
mod metrics;

use std::{
    net::SocketAddr,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use anyhow::Result;

use crate::{
    profile::Profile,
    watch::{Tick, Watcher},
};

pub use http::Server;

/// One reading of the trace: the profile so far and the second's counters.
pub struct Reading {
    pub profile: Profile,
    pub tick: Tick,
    /// When it was made.
    pub at: Instant,
    pub wall: std::time::SystemTime,
}

#[derive(Default)]
struct State {
    /// A reading was asked for since the last one was made.
    wanted: bool,
    latest: Option<Arc<Reading>>,
    /// How many readings were made.
    made: u64,
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

/// Longest a request waits for the session's next reading.
const READING_WAIT: Duration = Duration::from_secs(5);

impl Shared {
    /// A reading made after this call (the session makes one at its next
    /// second), or why there is none.
    pub fn fresh(&self) -> std::result::Result<Arc<Reading>, String> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let since = st.made;
        st.wanted = true;
        self.wake.notify_one();
        let deadline = Instant::now() + READING_WAIT;
        loop {
            if let Some(why) = &st.gone {
                return Err(why.clone());
            }
            if st.made > since {
                if let Some(r) = &st.latest {
                    return Ok(r.clone());
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("the trace made no reading in time".into());
            }
            st = self
                .made
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
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
        if !std::mem::take(&mut self.shared.state.lock().unwrap().wanted) {
            return Ok(());
        }
        // A reading that fails (a map unreadable) is said to the client;
        // the trace goes on.
        let made = profile();
        let mut st = self.shared.state.lock().unwrap();
        match made {
            Ok(profile) => {
                st.latest = Some(Arc::new(Reading {
                    profile,
                    tick: *tick,
                    at: Instant::now(),
                    wall: std::time::SystemTime::now(),
                }));
                st.made += 1;
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
    crate::say!("mtrace agent: {}", describe_listen(server.addr));
    let (agent, wake) = AgentWatcher::start(server)?;
    watchers.push(Box::new(agent));
    Ok(wake)
}

/// `--listen`: what the address lets in, said once at the start.
pub fn describe_listen(addr: SocketAddr) -> String {
    if addr.ip().is_loopback() {
        format!("serving on http://{addr}/ (loopback only)")
    } else {
        format!(
            "serving on http://{addr}/: NOT loopback, any host that reaches this address can read the profiles"
        )
    }
}
