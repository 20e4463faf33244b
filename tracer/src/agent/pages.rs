//! What the agent answers, and the capacity each kind of request has.
//!
//! Three kinds, each with its own slots, so that one kind never waits
//! behind another: quick pages (`/metrics`; `/healthz`, `/` and every
//! refusal need no slot), whole profiles, and `?seconds=` windows. A
//! kind whose slots are all taken answers 503 at once. A request that
//! waits (for a reading, a window's end, or its turn to render) gives its
//! slot back as soon as its client closes the connection.
//!
//! Profiles are rendered one at a time, in the order asked (a render of a
//! large trace copies and encodes hundreds of megabytes: side by side,
//! sixteen of them took 4 GB). A render is kept for the requests that
//! come while it is made or waited for it: a request takes the last
//! render of its kind if that render's reading began after the request
//! came, so requests that come together share one render. After each
//! render the memory it freed is given back to the system.

use std::{
    borrow::Cow,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::{Semaphore, TryAcquireError};

use super::{http::Io, metrics, Shared};
use crate::{
    profile::{
        window::{self, without_stacks},
        Profile,
    },
    render::pprof,
};

/// `/metrics` requests answered side by side at most.
const MAX_QUICK: usize = 16;
/// Whole-profile requests waiting or rendering at most.
const MAX_PROFILES: usize = 16;
/// `?seconds=` windows under way at most.
const MAX_WINDOWS: usize = 16;
/// Longest `?seconds=` window.
const MAX_SECONDS: u64 = 3600;
/// Renders kept for the requests that come while they are made.
const KEPT_RENDERS: usize = 8;

/// A response: status, headers beside the length, body (shared: one
/// render answers every request that waited for it).
pub struct Answer {
    pub code: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: Arc<Vec<u8>>,
}

impl Answer {
    fn data(body: Arc<Vec<u8>>) -> Answer {
        Answer {
            code: 200,
            headers: Vec::new(),
            body,
        }
    }

    pub fn with_header(mut self, name: &'static str, value: &str) -> Answer {
        self.headers.push((name, value.to_string()));
        self
    }
}

pub fn text(code: u16, body: &str) -> Answer {
    Answer {
        code,
        headers: Vec::new(),
        body: Arc::new(body.as_bytes().to_vec()),
    }
    .with_header("Content-Type", "text/plain; charset=utf-8")
}

type Routed = std::result::Result<Answer, (u16, String)>;

/// A render kept: its kind, the reading it was made from, the bytes.
struct Rendered {
    kind: &'static str,
    pid: Option<u32>,
    reading: u64,
    body: Arc<Vec<u8>>,
}

pub struct Pages {
    shared: Arc<Shared>,
    started: Instant,
    quick: Semaphore,
    profiles: Semaphore,
    windows: Semaphore,
    /// Held while a profile is rendered: one at a time, first come first
    /// served (tokio's mutex is fair).
    renders: Arc<tokio::sync::Mutex<Vec<Rendered>>>,
}

const INDEX: &str = "\
mtrace agent
  /debug/pprof/allocs   allocations since the start (Go heap profile); ?seconds=N: during the next N seconds
  /debug/pprof/heap     the same, in-use first (live mode only)
                        ?pid=PID: one process's samples only (every sample has pid and comm labels)
  /metrics              Prometheus text format
  /healthz              200 while tracing
";

impl Pages {
    pub fn new(shared: Arc<Shared>) -> Pages {
        Pages {
            shared,
            started: Instant::now(),
            quick: Semaphore::new(MAX_QUICK),
            profiles: Semaphore::new(MAX_PROFILES),
            windows: Semaphore::new(MAX_WINDOWS),
            renders: Arc::new(tokio::sync::Mutex::new(Vec::new())),
        }
    }

    /// The answer to `method target`, or None when the client went away
    /// before it was ready.
    pub async fn answer(&self, method: &str, target: &str, io: &mut dyn Io) -> Option<Answer> {
        if !matches!(method, "GET" | "HEAD") {
            return Some(
                text(
                    405,
                    "only GET: the agent serves what it counted and changes nothing\n",
                )
                .with_header("Allow", "GET, HEAD"),
            );
        }
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let routed = match Query::parse(query) {
            Err(e) => Err(e),
            Ok(query) => match path {
                "/" => Ok(text(200, INDEX)),
                "/healthz" => self.healthz(),
                "/metrics" => self.metrics().await,
                "/debug/pprof/allocs" => self.profile(&query, "alloc_space", io).await?,
                "/debug/pprof/heap" => self.profile(&query, "inuse_space", io).await?,
                _ => Err((404, format!("no such page: {path} (see /)"))),
            },
        };
        Some(routed.unwrap_or_else(|(code, why)| text(code, &format!("{why}\n"))))
    }

    fn healthz(&self) -> Routed {
        let st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        match &st.gone {
            Some(why) => Err((503, why.clone())),
            None => Ok(text(
                200,
                &format!(
                    "ok: tracing for {:.0} s\n",
                    self.started.elapsed().as_secs_f64()
                ),
            )),
        }
    }

    async fn metrics(&self) -> Routed {
        let _slot = slot(&self.quick, "/metrics")?;
        let shared = self.shared.clone();
        let body = blocking(move || read(&shared, |reading| Ok(metrics::render(reading)))).await?;
        Ok(Answer::data(Arc::new(body)).with_header("Content-Type", metrics::CONTENT_TYPE))
    }

    /// A profile, whole or a `?seconds=` window; None when the client
    /// went away.
    async fn profile(&self, q: &Query, kind: &'static str, io: &mut dyn Io) -> Option<Routed> {
        let body = match q.seconds {
            None => {
                let _slot = match slot(&self.profiles, "profile") {
                    Ok(s) => s,
                    Err(e) => return Some(Err(e)),
                };
                let asked = self.shared.begun();
                tokio::select! {
                    r = self.whole(kind, q.pid, asked) => r,
                    () = super::http::gone(io) => return None,
                }
            }
            Some(n) => {
                let _slot = match slot(&self.windows, "?seconds=") {
                    Ok(s) => s,
                    Err(e) => return Some(Err(e)),
                };
                let (shared, pid) = (self.shared.clone(), q.pid);
                // What the window cannot serve is said now, not at its end.
                let first = tokio::select! {
                    r = blocking(move || read(&shared, |r| {
                        servable(&r.profile, kind, pid)?;
                        Ok(First { start: window::Start::of(&r.profile), at: r.at, wall: r.wall })
                    })) => r,
                    () = super::http::gone(io) => return None,
                };
                let first = match first {
                    Ok(f) => f,
                    Err(e) => return Some(Err(e)),
                };
                let due = tokio::time::Instant::from_std(first.at + Duration::from_secs(n));
                tokio::select! {
                    () = tokio::time::sleep_until(due) => {}
                    () = super::http::gone(io) => return None,
                }
                tokio::select! {
                    r = self.window(first, kind, q.pid) => r,
                    () = super::http::gone(io) => return None,
                }
            }
        };
        Some(body.map(|body| {
            Answer::data(body)
                .with_header("Content-Type", "application/octet-stream")
                .with_header(
                    "Content-Disposition",
                    "attachment; filename=\"profile.pb.gz\"",
                )
        }))
    }

    /// The whole profile from a reading begun after reading `asked` had
    /// begun: the last render of its kind if it is one, else a new one.
    async fn whole(
        &self,
        kind: &'static str,
        pid: Option<u32>,
        asked: u64,
    ) -> std::result::Result<Arc<Vec<u8>>, (u16, String)> {
        let mut kept = self.renders.clone().lock_owned().await;
        if let Some(r) = kept
            .iter()
            .find(|r| r.kind == kind && r.pid == pid && r.reading > asked)
        {
            return Ok(r.body.clone());
        }
        let shared = self.shared.clone();
        // On a task of its own, which holds the turn until the render is
        // made, whether the client waits for it or not.
        let made = tokio::spawn(async move {
            let (reading, body) = blocking(move || {
                read(&shared, |reading| {
                    servable(&reading.profile, kind, pid)?;
                    let body = render(Cow::Borrowed(&reading.profile), kind, pid)?;
                    Ok((reading.number, Arc::new(body)))
                })
            })
            .await?;
            kept.retain(|r| !(r.kind == kind && r.pid == pid));
            if kept.len() >= KEPT_RENDERS {
                kept.remove(0);
            }
            kept.push(Rendered {
                kind,
                pid,
                reading,
                body: body.clone(),
            });
            Ok(body)
        });
        made.await.unwrap_or_else(|e| Err((500, e.to_string())))
    }

    /// What was allocated from `first` to a reading begun now, rendered
    /// in its turn.
    async fn window(
        &self,
        first: First,
        kind: &'static str,
        pid: Option<u32>,
    ) -> std::result::Result<Arc<Vec<u8>>, (u16, String)> {
        let turn = self.renders.clone().lock_owned().await;
        let shared = self.shared.clone();
        let made = tokio::spawn(async move {
            let _turn = turn;
            blocking(move || {
                let second = shared.fresh().map_err(|e| (503, e))?;
                // The reading itself when no other request holds it, else
                // a copy.
                let later =
                    Arc::try_unwrap(second).map_or_else(|r| r.profile.clone(), |r| r.profile);
                let mut window = window::since(&first.start, later);
                // The window's own start (pprof's time_nanos).
                window.meta.start_time = humantime::format_rfc3339_seconds(first.wall).to_string();
                let body = render(Cow::Owned(window), kind, pid);
                trim();
                Ok(Arc::new(body?))
            })
            .await
        });
        made.await.unwrap_or_else(|e| Err((500, e.to_string())))
    }
}

/// What a window keeps of its first reading while it waits for its end.
struct First {
    start: window::Start,
    at: Instant,
    wall: std::time::SystemTime,
}

/// A slot of `kind`, or the 503 that says they are all taken.
fn slot<'a>(
    slots: &'a Semaphore,
    what: &str,
) -> std::result::Result<tokio::sync::SemaphorePermit<'a>, (u16, String)> {
    slots.try_acquire().map_err(|e| match e {
        TryAcquireError::NoPermits => (503, format!("too many {what} requests at once")),
        TryAcquireError::Closed => (503, "the agent is stopping".into()),
    })
}

/// `f` of a reading begun now; then the memory freed is given back to the
/// system (glibc keeps what it frees in its arenas, and a reading of a
/// large trace is hundreds of megabytes, freed on whichever thread lets
/// go of it last).
fn read<T>(
    shared: &Shared,
    f: impl FnOnce(&super::Reading) -> std::result::Result<T, (u16, String)>,
) -> std::result::Result<T, (u16, String)> {
    let reading = shared.fresh().map_err(|e| (503, e))?;
    let made = f(&reading);
    drop(reading);
    trim();
    made
}

/// `f` on a blocking thread (a reading is waited for, a render is CPU).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::result::Result<T, (u16, String)> + Send + 'static,
) -> std::result::Result<T, (u16, String)> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err((500, e.to_string())))
}

/// Whether `profile` can give what the request asks: in-use memory needs
/// live mode (or a Go program's own heap, which has in-use figures in
/// count mode too), `?pid=` a process of the scope.
fn servable(
    profile: &Profile,
    kind: &str,
    pid: Option<u32>,
) -> std::result::Result<(), (u16, String)> {
    if kind == "inuse_space" && profile.live.is_none() && profile.go_heaps.is_empty() {
        return Err((
            501,
            "in-use memory is not tracked: the agent runs in count mode (start it with --live); /debug/pprof/allocs has the allocations".into(),
        ));
    }
    if let Some(pid) = pid {
        let known = profile.meta.pid == pid
            || profile.meta.processes.iter().any(|p| p.pid == pid)
            || profile.go_heaps.iter().any(|g| g.pid == pid);
        if !known {
            return Err((404, format!("pid {pid} is not among the processes traced")));
        }
    }
    Ok(())
}

/// `profile` as Go's heap profile: one process's stacks with `pid`, the
/// windows policy's counts scaled. Copied only where it must change.
fn render(
    profile: Cow<'_, Profile>,
    kind: &str,
    pid: Option<u32>,
) -> std::result::Result<Vec<u8>, (u16, String)> {
    let mut profile = match (profile, pid) {
        (p, None) => p,
        (p, Some(pid)) => {
            let mut one = without_stacks(&p);
            one.stacks = p
                .stacks
                .iter()
                .filter(|e| e.process.as_ref().is_some_and(|p| p.pid == pid))
                .cloned()
                .collect();
            Cow::Owned(one)
        }
    };
    if profile.meta.windows.is_some() {
        window::scale_windows(profile.to_mut());
    }
    pprof::render_go_heap(&profile, kind).map_err(|e| (500, format!("{e:#}")))
}

/// Gives the memory freed back to the system.
fn trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// What a profile's query asks for.
#[derive(Default)]
struct Query {
    seconds: Option<u64>,
    pid: Option<u32>,
}

impl Query {
    /// Go's parameters that do not apply here (`gc`, `debug`) are let be.
    fn parse(query: &str) -> std::result::Result<Query, (u16, String)> {
        let mut q = Query::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let bad = || (400, format!("bad {k}={v}"));
            match k {
                "seconds" => {
                    let n: u64 = v.parse().map_err(|_| bad())?;
                    if n == 0 || n > MAX_SECONDS {
                        return Err((400, format!("seconds={v}: from 1 to {MAX_SECONDS}")));
                    }
                    q.seconds = Some(n);
                }
                "pid" => q.pid = Some(v.parse().map_err(|_| bad())?),
                _ => {}
            }
        }
        Ok(q)
    }
}
