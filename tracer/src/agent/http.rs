//! The agent's HTTP endpoints (tiny_http: GET only, nothing that writes).
//!
//! Each request gets a thread of its own, so that a `?seconds=60` profile
//! does not hold up a scrape of `/metrics`; at most [`MAX_IN_FLIGHT`] at
//! once, more are turned away with 503.

use std::{
    net::{SocketAddr, TcpListener},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use tiny_http::{Header, Method, Request, Response};

use super::{metrics, Reading, Shared};
use crate::{profile::Profile, render::pprof};

/// Requests served side by side at most.
const MAX_IN_FLIGHT: usize = 16;

/// Longest `?seconds=` window.
const MAX_SECONDS: u64 = 3600;

/// The listening socket, bound before anything is attached (a port in
/// use is a usage error, not a trace lost), then served.
pub struct Server {
    http: Arc<tiny_http::Server>,
    pub addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    pub fn bind(addr: SocketAddr) -> Result<Server> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| crate::user_error!("cannot listen on {addr}: {e}"))?;
        let addr = listener.local_addr()?;
        let http = tiny_http::Server::from_listener(listener, None)
            .map_err(|e| anyhow::anyhow!("serving on {addr}: {e}"))?;
        Ok(Server {
            http: Arc::new(http),
            addr,
            thread: None,
        })
    }

    /// Answers requests from `shared`'s readings, on a thread, until
    /// [`Server::stop`].
    pub fn serve(&mut self, shared: Arc<Shared>) -> Result<()> {
        let http = self.http.clone();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let thread = std::thread::Builder::new()
            .name("mtrace-agent-http".into())
            .spawn(move || {
                while let Ok(req) = http.recv() {
                    if in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        let _ = req.respond(text(503, "too many requests at once\n"));
                        continue;
                    }
                    let (shared, in_flight) = (shared.clone(), in_flight.clone());
                    let spawned = std::thread::Builder::new()
                        .name("mtrace-agent-req".into())
                        .spawn(move || {
                            answer(req, &shared, started);
                            in_flight.fetch_sub(1, Ordering::SeqCst);
                        });
                    if let Err(e) = spawned {
                        log::warn!("agent: no thread for a request: {e}");
                    }
                }
            })
            .context("starting the agent's HTTP thread")?;
        self.thread = Some(thread);
        Ok(())
    }

    /// Stops accepting; requests under way finish on their own threads.
    pub fn stop(mut self) {
        self.http.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

type Answer = Response<std::io::Cursor<Vec<u8>>>;

fn text(code: u16, body: &str) -> Answer {
    Response::from_string(body)
        .with_status_code(code)
        .with_header(header("Content-Type", "text/plain; charset=utf-8"))
}

fn header(name: &str, value: &str) -> Header {
    Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("a valid header")
}

fn answer(req: Request, shared: &Shared, started: Instant) {
    let response = if !matches!(req.method(), Method::Get | Method::Head) {
        text(
            405,
            "only GET: the agent serves what it counted and changes nothing\n",
        )
        .with_header(header("Allow", "GET, HEAD"))
    } else {
        let url = req.url().to_string();
        let (path, query) = url.split_once('?').unwrap_or((url.as_str(), ""));
        match route(path, query, shared, started) {
            Ok(r) => r,
            Err((code, why)) => text(code, &format!("{why}\n")),
        }
    };
    if let Err(e) = req.respond(response) {
        log::debug!("agent: answering a request: {e}");
    }
}

type Routed = std::result::Result<Answer, (u16, String)>;

const INDEX: &str = "\
mtrace agent
  /debug/pprof/allocs   allocations since the start (Go heap profile); ?seconds=N: during the next N seconds
  /debug/pprof/heap     the same, in-use first (live mode only)
                        ?pid=PID: one process's samples only (every sample has pid and comm labels)
  /metrics              Prometheus text format
  /healthz              200 while tracing
";

fn route(path: &str, query: &str, shared: &Shared, started: Instant) -> Routed {
    let query = Query::parse(query)?;
    match path {
        "/" => Ok(text(200, INDEX)),
        "/healthz" => healthz(shared, started),
        "/metrics" => {
            let reading = shared.fresh().map_err(|e| (503, e))?;
            Ok(Response::from_data(metrics::render(&reading))
                .with_header(header("Content-Type", metrics::CONTENT_TYPE)))
        }
        "/debug/pprof/allocs" => profile(shared, &query, "alloc_space"),
        "/debug/pprof/heap" => profile(shared, &query, "inuse_space"),
        _ => Err((404, format!("no such page: {path} (see /)"))),
    }
}

fn healthz(shared: &Shared, started: Instant) -> Routed {
    let st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
    match &st.gone {
        Some(why) => Err((503, why.clone())),
        None => Ok(text(
            200,
            &format!("ok: tracing for {:.0} s\n", started.elapsed().as_secs_f64()),
        )),
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

fn profile(shared: &Shared, q: &Query, default_type: &str) -> Routed {
    let first = shared.fresh().map_err(|e| (503, e))?;
    let live = first.profile.live.is_some();
    if default_type == "inuse_space" && !live {
        return Err((
            501,
            "in-use memory is not tracked: the agent runs in count mode (start it with --live); /debug/pprof/allocs has the allocations".into(),
        ));
    }
    let profile = match q.seconds {
        None => first.profile.clone(),
        Some(n) => {
            let due = first.at + Duration::from_secs(n);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            let second: Arc<Reading> = shared.fresh().map_err(|e| (503, e))?;
            let mut window = crate::profile::window::between(&first.profile, &second.profile);
            // The window's own start (pprof's time_nanos).
            window.meta.start_time = humantime::format_rfc3339_seconds(first.wall).to_string();
            window
        }
    };
    let mut profile = match q.pid {
        None => profile,
        Some(pid) => only_process(profile, pid)?,
    };
    crate::profile::window::scale_windows(&mut profile);
    let bytes =
        pprof::render_go_heap(&profile, default_type).map_err(|e| (500, format!("{e:#}")))?;
    Ok(Response::from_data(bytes)
        .with_header(header("Content-Type", "application/octet-stream"))
        .with_header(header(
            "Content-Disposition",
            "attachment; filename=\"profile.pb.gz\"",
        )))
}

/// `?pid=`: the stacks of one process of the scope.
fn only_process(mut profile: Profile, pid: u32) -> std::result::Result<Profile, (u16, String)> {
    let known = profile.meta.pid == pid || profile.meta.processes.iter().any(|p| p.pid == pid);
    if !known {
        return Err((404, format!("pid {pid} is not among the processes traced")));
    }
    profile
        .stacks
        .retain(|e| e.process.as_ref().is_some_and(|p| p.pid == pid));
    Ok(profile)
}
